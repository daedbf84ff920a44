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
from conformance.check.ctranslate2 import target as ctranslate2_check  # noqa: E402
from conformance.check.ctranslate2.compare import compare_ctranslate2  # noqa: E402
from conformance.check.ctranslate2.model import Directory, Vocabulary  # noqa: E402
from conformance.check.ctranslate2.report import ComputeTypeResult, CTranslate2Report, agreement  # noqa: E402
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

    def planted_convert(config, params, dst, quantization="float32", layout=None, **_):
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
    # the built-in default: no CTranslate2 family holds it, so CTranslate2 is skipped with why
    assert main(["check", "--backends", "numpy,ctranslate2", "--dtypes", "float32"]) == 0
    assert "skipped: ModelConfig: CTranslate2's loaders represent Marian, T5, BART" in capsys.readouterr().out
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
    """config.json's add_source_bos/eos: CTranslate2 puts bos_token before each source and </s> after it;
    the oracle's source has them too, in the same places."""
    _, folder, converted, _, _ = user
    added = _copy(converted, tmp_path, "added")
    settings = json.loads((added / "config.json").read_text())
    (added / "config.json").write_text(json.dumps({**settings, "add_source_bos": True, "bos_token": "\u2581w07",
                                                   "add_source_eos": True}))
    report = compare_ctranslate2(str(added), None, *batch, weights=str(folder), compute_types=("float32",),
                                 beams=(1,), max_len=MAX_LEN)
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

    config = preset("hf-mbart", qkv_bias=False)  # mBART without q/k/v biases: no family's
    with pytest.raises(ConfigError, match="CTranslate2's loaders represent Marian, T5, BART"):
        ctranslate2_check.check(config, init_params(config, seed=0), np.array([[3]]), np.array([[4]]))


def _with_note(config, **fields):
    note = {**json.loads(config.notes["generation"]), **fields}
    return config.replace(notes={**config.notes, "generation": json.dumps(note)})


def test_the_generation_note_is_given_to_both_searches(user, batch):
    """A note's no_repeat_ngram_size, min_length and bad_words_ids (as opus-mt and bart-large-cnn folders
    carry) go to CTranslate2 as its own options and to ours explicitly; what cannot be aligned is said."""
    _, _, converted, config, params = user
    noted = _with_note(config, no_repeat_ngram_size=1, min_length=8, forced_eos_token_id=0,
                       bad_words_ids=[[4], [9, 3]], repetition_penalty=1.2)
    report = ctranslate2_check.check(noted, params, *batch, compute_types=("float32",), max_len=MAX_LEN,
                                     model_dir=converted)
    row, table = report.rows[0], report.table()
    assert report.passed and row.agreement[1] == 1.0 and row.unheld == (4,), table
    assert "no_repeat_ngram_size 1 (the note's) to both" in table
    assert "min_decoding_length=7, ours min_new_tokens=7 (the note's min_length 8, less the start)" in table
    assert "2 word(s) as CTranslate2's suppress_sequences" in table
    assert "not aligned, run by neither: forced_eos_token_id 0" in table and "repetition_penalty 1.2" in table
    assert "beam ids measured, not held" in table and "(not held)" in table
    with pytest.raises(ConfigError, match="not JSON"):
        ctranslate2_check.check(config.replace(notes={**config.notes, "generation": "{"}), params, *batch,
                                model_dir=converted)


@pytest.fixture(scope="module")
def heavy_pad(user):
    """The user's model with the pad (the row Marian's loader drops) holding real probability mass
    (example_model's -30 bias hides a log-softmax over the full vocabulary), converted."""
    path, _, _, config, params = user
    heavy = {key: value.copy() for key, value in params.items()}
    heavy["final_logits_bias"][config.pad_id] = 2.0  # the largest logit at many steps
    folder = path.parent / "heavy-pad-ct2"
    ctranslate2_check.convert(config, heavy, folder)
    return config, heavy, folder


def test_a_pad_with_probability_mass_is_left_out_of_the_oracles_softmax_and_banned(heavy_pad, batch):
    """Greedy only: a ban leaves beam scores that differ (see ctranslate2_compare.aligned_search)."""
    config, heavy, folder = heavy_pad
    report = ctranslate2_check.check(config, heavy, *batch, compute_types=("float32",), beams=(1,),
                                     max_len=MAX_LEN, model_dir=folder)
    assert report.pad_mass > 0.1 and report.banned == (config.pad_id,), report.table()
    assert report.passed, report.table()


def test_ids_that_part_fail_a_row_whose_log_p_agrees():
    held = tolerance("float32", "cpu")
    row = ComputeTypeResult("float32", np.zeros(3), {1: 1.0, 4: 0.75}, {1: None, 4: 2}, held=held)
    assert row.passed is False and row.verdict() == "FAIL: beam 4 ids part at step 2"
    assert ComputeTypeResult("float32", np.zeros(3), {1: 1.0, 4: 0.75}, {1: None, 4: 2}, held=held,
                             unheld=(4,)).passed is True
    assert CTranslate2Report([row], 0.0, "ctranslate2 test", 8).passed is False


def test_the_end_token_is_a_step_of_the_ids():
    assert agreement([[1, 2]], [[1, 2]]) == (1.0, None)
    assert agreement([[1, 2]], [[1, 2, 3]]) == (0.75, 2)  # steps: 1, 2, the end against 3, the end
    assert agreement([[5, 1, 2]], [[5]]) == (0.5, 1)


def test_the_end_tokens_log_p_is_compared(user, batch, tmp_path):
    """CTranslate2 made to end at another token: score_batch appends it, so log p parts at each row's end
    position (and nowhere else)."""
    _, _, converted, _, _ = user
    ends = _copy(converted, tmp_path, "ends")
    settings = json.loads((ends / "config.json").read_text())
    (ends / "config.json").write_text(json.dumps({**settings, "eos_token": "\u2581w05"}))
    src, tgt = batch
    report = compare_ctranslate2(str(ends), None, src, tgt, weights=str(user[0]), compute_types=("float32",),
                                 beams=(1,), max_len=MAX_LEN)
    row = report.rows[0]
    ends_at = sorted({int((r != 31).sum()) for r in tgt})  # each row's end-token position
    beyond = np.flatnonzero(row.position_error > row.limit).tolist()
    assert beyond == ends_at and "log p beyond" in row.verdict(), report.table()
    assert any("CTranslate2 ends at id 5" in note for note in report.notes)


def test_a_repeated_token_compares_our_later_row_as_ctranslate2_reads_it(user, batch, tmp_path):
    """T5's converter repeats tokens: an output of the later row reads back as the first; ours is compared so."""
    _, folder, converted, _, _ = user
    src, tgt = batch
    assert 6 not in src and 6 not in tgt  # greedy writes 6 on this batch (rows 2); the batch needs none
    twice = _copy(converted, tmp_path, "twice6")
    tokens = json.loads((twice / "shared_vocabulary.json").read_text())
    tokens[6] = tokens[2]
    (twice / "shared_vocabulary.json").write_text(json.dumps(tokens))
    report = compare_ctranslate2(str(twice), None, src, tgt, weights=str(folder), compute_types=("float32",),
                                 beams=(1,), max_len=MAX_LEN)
    assert report.passed and report.rows[0].agreement == {1: 1.0}, report.table()
    assert any("1 rows of" in note and "(from 6)" in note for note in report.notes), report.table()


def test_rosetta_check_with_nothing_measured_fails(user, capsys):
    """--devices cuda on a machine where CTranslate2 sees none: nothing was checked, exit 1."""
    if ctranslate2.get_cuda_device_count():
        pytest.skip("CTranslate2 sees a CUDA device here")
    assert main(["check", str(user[0]), "--backends", "ctranslate2", "--devices", "cuda"]) == 1
    text = capsys.readouterr().out
    assert "ctranslate2/cuda: not run: no CUDA device" in text and "ctranslate2: nothing checked" in text


def test_a_failing_tensor_table_fails_the_check_beside_a_passing_section():
    from types import SimpleNamespace

    from conformance.cli.check import WithCTranslate2

    held = tolerance("float32", "cpu")
    section = CTranslate2Report([ComputeTypeResult("float32", np.zeros(3), {1: 1.0}, {1: None}, held=held)], 0.0,
                                "ctranslate2 test", 8)
    assert section.passed
    config = ctranslate2_check.example_model()[0]
    assert WithCTranslate2(SimpleNamespace(passed=True), [section], config, "x").passed
    assert not WithCTranslate2(SimpleNamespace(passed=False), [section], config, "x").passed
    assert not WithCTranslate2(None, ["ctranslate2/cuda: not run: no CUDA device"], config, "x").passed


def test_a_line_vocabulary_splits_on_newlines_only(tmp_path):
    path = tmp_path / "shared_vocabulary.txt"
    path.write_text("a\x1cb\nc\u2028d\n</s>\n", encoding="utf-8")
    assert Vocabulary.read(path).tokens == ["a\x1cb", "c\u2028d", "</s>"]


def test_bad_arguments_are_refused_by_name(user, batch):
    from conformance.check.weights import oracle_weights

    path, folder, converted, config, _ = user
    src, tgt = batch
    oracle = oracle_weights(str(path), None, None, {})
    common = dict(oracle=oracle, compute_types=("float32",), beams=(1,), max_len=MAX_LEN)
    cases = [({"compute_type": "int8"}, "compute_type", "is no keyword"), ({"beam": 4}, "beam", "is no keyword"),
             ({"beams": ()}, "beams", "one or more beam sizes"), ({"max_len": 0}, "max_len", r"\[1, "),
             ({"device": "gpu"}, "device", "CTranslate2's device names"),
             ({"compute_types": ("int4",)}, "compute_types", "expected some of"),
             ({"model_dir": converted}, "model_dir", "leave model_dir= out"),
             ({"d_model": 64}, "d_model", "read already")]
    for given, field, message in cases:
        with pytest.raises(InputError, match=message) as caught:
            compare_ctranslate2(str(converted), None, src, tgt, **{**common, **given})
        assert caught.value.argument == field, given
    for bad, message in ((src[0], "must be a"), (src.astype(float), "must be a")):
        with pytest.raises(InputError, match=message):
            compare_ctranslate2(str(converted), None, bad, tgt, **common)
    with pytest.raises(InputError, match="states its own config"):
        compare_ctranslate2(str(converted), None, src, tgt, weights=str(path), d_model=64)
    translator = ctranslate2.Translator(str(converted), compute_type="float32")
    for given in ({"compute_types": ("int8",)}, {"device": "cuda"}):
        with pytest.raises(InputError, match="the Translator runs in"):
            compare_ctranslate2(translator, None, src, tgt, oracle=oracle, model_dir=converted, **given)
