"""CTranslate2 as a target: `rosetta check --backends numpy,ctranslate2`, and `conformance.compare` /
`rosetta compare CT2_DIR WEIGHTS` on a user's own CTranslate2 model, run in CTranslate2 itself.

The user's model is made the way a user makes it: a tiny seeded Marian (`ctranslate2_check.example_model`)
written as a Hugging Face folder with a tokenizer whose tokens are words ("</s>", "<unk>", "▁w02", ...,
"<pad>"), converted by CTranslate2's TransformersConverter (`ct2-transformers-converter`), so its
vocabulary holds the tokenizer's tokens and ids go through it. A planted bug (one decoder weight
perturbed before the conversion) is found against the unperturbed weights. Every batch is padded.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

# One worker under `--dist loadgroup`: the module's conversions are paid once, not per worker.
pytestmark = pytest.mark.xdist_group("ctranslate2")

pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed: "
                    "pip install 'rosetta-transformer[ctranslate2]'")
pytest.importorskip("torch", reason="CTranslate2's converter loads the Hugging Face folder with transformers' "
                    "torch model")
pytest.importorskip("transformers", reason="CTranslate2's converter loads the folder with transformers")
pytest.importorskip("tokenizers", reason="the user's folder carries a tokenizer, as ct2-transformers-converter expects")

import ctranslate2  # noqa: E402

import conformance  # noqa: E402
from conformance.check import ctranslate2_check  # noqa: E402
from conformance.check.ctranslate2_compare import Directory, compare_ctranslate2  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import ConfigError, InputError  # noqa: E402

MAX_LEN = 16
PLANTED = "decoder.layers.1.ffn.linear2.weight"  # the weight perturbed before the planted conversion


def _tokenizer_vocab(config) -> dict[str, int]:
    """Marian's special tokens where the example model has its ids, words elsewhere."""
    pad, _, eos = ctranslate2_check.EXAMPLE_IDS["hf-marian"]
    vocab = {"</s>": eos, "<unk>": 1, "<pad>": pad}
    vocab.update({f"\u2581w{i:02d}": i for i in range(config.tgt_vocab_size) if i not in vocab.values()})
    return vocab


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """(checkpoint, Hugging Face folder with a tokenizer, its ct2-transformers-converter output, config, params)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("ct2-user")
    config, params = ctranslate2_check.example_model(seed=0)
    path = root / "marian.safetensors"
    checkpoint.save(path, config, params)
    folder = root / "opus-mt-tiny"
    assert main(["convert", str(path), str(folder), "--to", "hf-marian"]) == 0
    words = Tokenizer(models.WordLevel(_tokenizer_vocab(config), unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(str(folder))
    converted = root / "opus-mt-tiny-ct2"
    ctranslate2.converters.TransformersConverter(str(folder)).convert(str(converted))
    return path, folder, converted, config, params


@pytest.fixture(scope="module")
def planted(user):
    """A CTranslate2 model converted from the weights with PLANTED perturbed (`rosetta convert --to ctranslate2`)."""
    path, _, _, config, params = user
    broken = {key: value.copy() for key, value in params.items()}
    broken[PLANTED] = broken[PLANTED] + np.float32(0.05) * np.sign(broken[PLANTED])
    folder = path.parent / "planted-ct2"
    ctranslate2_check.convert(config, broken, folder)
    return folder


@pytest.fixture(scope="module")
def batch(user):
    config = user[3]
    src, tgt = fixed_batch(config)
    assert np.any(src == config.pad_id) and np.any(tgt == config.pad_id)  # padded rows
    return src, tgt


def test_the_users_vocabulary_holds_the_tokenizers_tokens(user):
    _, _, converted, config, _ = user
    directory = Directory.read(converted)
    # Marian's loader dropped the <pad> row and starts the decoder from a zero embedding.
    assert directory.target.tokens == sorted(_tokenizer_vocab(config), key=_tokenizer_vocab(config).get)[:-1]
    assert directory.zero_start and directory.weight_dtypes == ("float32",)
    assert directory.target.unnamed == []


def test_compare_maps_ids_through_the_users_vocabulary(user, batch):
    path, folder, converted, config, _ = user
    report = conformance.compare(str(converted), None, *batch, weights=str(folder),
                                 compute_types=("float32", "int8"), max_len=MAX_LEN)
    float32, int8 = report.rows
    assert report.passed, report.table()
    assert float32.held == tolerance("float32", "cpu") and float32.agreement == {1: 1.0, 4: 1.0}, report.table()
    assert 0 < float32.max_error <= tolerance("float32", "cpu").atol, report.table()
    assert int8.held is None and int8.passed is None and int8.max_error > float32.max_error
    assert report.banned == (config.pad_id,)  # the row Marian's loader dropped is banned from our search


def test_compare_takes_a_translator_with_its_directory(user, batch):
    _, folder, converted, _, _ = user
    translator = ctranslate2.Translator(str(converted), compute_type="float32")
    report = compare_ctranslate2(translator, None, *batch, weights=str(folder), model_dir=converted, max_len=MAX_LEN)
    assert [row.compute_type for row in report.rows] == ["float32"] and report.passed, report.table()
    with pytest.raises(InputError, match="model_dir="):
        compare_ctranslate2(translator, None, *batch, weights=str(folder))
    with pytest.raises(InputError, match="backends"):
        conformance.compare(str(converted), None, *batch, weights=str(folder), backends="numpy")


def test_rosetta_compare_cli(user, tmp_path, capsys):
    _, folder, converted, _, _ = user
    out = tmp_path / "report.json"
    assert main(["compare", str(converted), str(folder), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ctranslate2: ok" in text and "| float32 |" in text and "| int8 |" in text
    saved = json.loads(out.read_text())
    assert saved["passed"] and saved["compute_types"][0]["compute_type"] == "float32"
    assert main(["compare", str(converted), str(folder), "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot: does not apply to a CTranslate2 model" in capsys.readouterr().err
    assert main(["compare", str(converted)]) == 2
    assert "converted from" in capsys.readouterr().err


def test_a_planted_bug_is_found(user, planted, batch, capsys):
    """The model converted from perturbed weights, against the unperturbed ones: the float32 row fails."""
    path, _, _, config, params = user
    report = ctranslate2_check.check(config, params, *batch, compute_types=("float32",), max_len=MAX_LEN,
                                     model_dir=planted)
    row = report.rows[0]
    assert not report.passed and row.passed is False
    assert row.max_error > row.limit, report.table()
    assert row.verdict().startswith("FAIL: log p beyond") and "from position 0" in row.verdict()
    assert main(["compare", str(planted), str(path)]) == 1
    assert "| float32 |" in (text := capsys.readouterr().out) and "FAIL: log p beyond" in text
    assert "ctranslate2: FAIL" in text


def test_rosetta_check_fails_on_a_converter_that_writes_one_layer_wrong(user, planted, monkeypatch, capsys):
    """`rosetta check --backends ctranslate2` with the conversion planted: its exit status is 1."""
    path = user[0]

    def planted_convert(config, params, dst, quantization="float32", layout=None):
        shutil.copytree(planted, dst)
        return dst

    monkeypatch.setattr(ctranslate2_check, "convert", planted_convert)
    assert main(["check", str(path), "--backends", "ctranslate2"]) == 1
    text = capsys.readouterr().out
    assert "FAIL: log p beyond" in text and "ctranslate2: FAIL" in text
    assert "numpy/cpu" not in text  # ctranslate2 alone: no tensor table


def test_a_pad_row_that_is_not_zero_is_explained(user, batch, tmp_path):
    """Marian's CTranslate2 decoder starts from a zero embedding, transformers' from the pad id's row."""
    path, _, converted, config, params = user
    moved = {key: value.copy() for key, value in params.items()}
    moved["encoder.embedding.weight"][config.pad_id] = 0.5  # shared: the decoder's start row
    weights = tmp_path / "moved.safetensors"
    checkpoint.save(weights, config, moved)
    report = compare_ctranslate2(str(converted), None, *batch, weights=str(path), compute_types=("float32",),
                                 max_len=MAX_LEN)
    assert report.passed and not report.notes, report.table()
    report = compare_ctranslate2(str(converted), None, *batch, weights=str(weights), compute_types=("float32",),
                                 max_len=MAX_LEN)
    assert not report.passed and report.rows[0].position_error[0] > report.rows[0].limit, report.table()
    assert any("zero embedding" in note and f"row {config.pad_id}" in note for note in report.notes), report.table()


def test_rosetta_check_with_ctranslate2(user, tmp_path, capsys):
    path = user[0]
    out = tmp_path / "check.json"
    assert main(["check", str(path), "--backends", "numpy,ctranslate2", "--dtypes", "float32",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "numpy/cpu/float32" in text  # the tensor table, as without ctranslate2
    assert "ctranslate2: converted from the checkpoint through hf-marian" in text and "ctranslate2: ok" in text
    # Every compute type has a row: run, or not run with CTranslate2's reason.
    assert ("| bfloat16 | not run: " in text) == ("bfloat16" not in ctranslate2.get_supported_compute_types("cpu"))
    saved = json.loads(out.read_text())
    assert saved["passed"] and saved["targets"][0]["label"] == "numpy/cpu/float32"
    ran = [section for section in saved["ctranslate2"] if "compute_types" in section]
    assert ran and ran[0]["compute_types"][0] == {**ran[0]["compute_types"][0], "compute_type": "float32",
                                                   "held": True, "passed": True}


def test_rosetta_check_refusals(capsys):
    assert main(["check", "--backends", "numpy,ctranslate2"]) == 2  # the built-in default: no CTranslate2 family
    assert "CTranslate2's loaders represent Marian, T5 and BART" in capsys.readouterr().err
    assert main(["check", "--backends", "ctranslate2", "--stream"]) == 2
    assert "leave out --stream" in capsys.readouterr().err
    assert main(["check", "--backends", "ctranslate2", "--plot", "table.png"]) == 2
    assert "ctranslate2 exposes no tensors" in capsys.readouterr().err
    assert main(["conformance", "--backends", "numpy,ctranslate2"]) == 2
    assert "CTranslate2 exposes no intermediate tensors" in capsys.readouterr().err


def _copy(directory, tmp_path, name: str):
    copy = tmp_path / name
    shutil.copytree(directory, copy)
    return copy


def test_vocabularies_that_cannot_be_mapped_are_refused(user, batch, tmp_path):
    _, folder, converted, config, _ = user
    short = _copy(converted, tmp_path, "short")
    tokens = json.loads((short / "shared_vocabulary.json").read_text())
    (short / "shared_vocabulary.json").write_text(json.dumps(tokens[:-1]))
    with pytest.raises(InputError, match="holds 30 tokens, the weights' target vocabulary 32 rows"):
        compare_ctranslate2(str(short), None, *batch, weights=str(folder), max_len=MAX_LEN)
    # A token that names two rows reads as the first: a batch that needs the second is refused.
    twice = _copy(converted, tmp_path, "twice")
    (twice / "shared_vocabulary.json").write_text(json.dumps(tokens[:30] + [tokens[5]]))
    src, tgt = batch
    with pytest.raises(InputError, match=r"id 30's token '\\u2581w05'|id 30's token '\u2581w05'"):
        compare_ctranslate2(str(twice), None, np.where(src == 5, 30, src), tgt, weights=str(folder),
                            compute_types=("float32",), beams=(1,), max_len=MAX_LEN)
    report = compare_ctranslate2(str(twice), None, np.where(src == 30, 2, src), np.where(tgt == 30, 2, tgt),
                                 weights=str(folder), compute_types=("float32",), beams=(1,), max_len=MAX_LEN)
    assert any("1 rows of" in note and "earlier row's token" in note for note in report.notes), report.table()
    with pytest.raises(InputError, match="not a CTranslate2 model directory"):
        Directory.read(folder)
    cut = _copy(converted, tmp_path, "cut")
    (cut / "model.bin").write_bytes((cut / "model.bin").read_bytes()[:40])
    with pytest.raises(InputError, match="ends inside its header"):
        Directory.read(cut)


def test_a_source_token_ctranslate2_adds_is_given_to_the_oracle_too(user, batch, tmp_path):
    """config.json's add_source_eos: CTranslate2 appends </s> to each source; the oracle's source has it too."""
    _, folder, converted, _, _ = user
    eos = _copy(converted, tmp_path, "eos")
    settings = json.loads((eos / "config.json").read_text())
    (eos / "config.json").write_text(json.dumps({**settings, "add_source_eos": True}))
    report = compare_ctranslate2(str(eos), None, *batch, weights=str(folder), compute_types=("float32",),
                                 max_len=MAX_LEN)
    assert report.passed, report.table()


def test_quantized_weights_are_measured_not_held(user, batch, tmp_path, capsys):
    path, _, _, config, params = user
    folder = tmp_path / "int8"
    ctranslate2_check.convert(config, params, folder, quantization="int8")
    assert Directory.read(folder).weight_dtypes == ("int8",)
    report = compare_ctranslate2(str(folder), None, *batch, weights=str(path), compute_types=("float32", "int8"),
                                 beams=(1,), max_len=MAX_LEN)
    assert all(row.held is None for row in report.rows) and not report.checked and not report.passed
    assert any("weights stored as int8" in note for note in report.notes)


def test_the_check_refuses_a_model_without_a_family():
    from conformance import init_params
    from conformance.core.presets import preset

    config = preset("hf-mbart")
    with pytest.raises(ConfigError, match="CTranslate2's loaders represent Marian, T5 and BART"):
        ctranslate2_check.check(config, init_params(config, seed=0), np.array([[3]]), np.array([[4]]))
