"""`rosetta convert --to ctranslate2` for the families beyond Marian, T5 v1.0 and BART, run in
CTranslate2 itself, and its check of what it writes (issue 53).

T5 v1.1, Flan-T5 and mT5 start as transformers writes them (tiny random models, every weight
perturbed, the lm_head apart from the shared embedding, `save_pretrained`), converted to a rosetta
checkpoint with no --set, then to CTranslate2. CTranslate2 4.8.5's T5 loader scales the head by
d_model**-0.5 when `config.tie_word_embeddings` is true, which transformers 5's T5Config always sets
(the real setting is `scale_decoder_outputs`): with the loader's config left as transformers loads
it (the export before the fix, planted back), the check of what was written fails, exit status 1,
nothing left. With the fix, CTranslate2's log p is the float64 oracle's within the float32 rule and
its greedy and beam-4 ids are ours. mBART, Pegasus and M2M100/NLLB (tiny seeded checkpoints of the
families' presets) convert and pass the same check. Every batch is `fixed_batch`'s padded rows.
"""

from __future__ import annotations

import dataclasses
import re
import json
from pathlib import Path

import numpy as np
import pytest

# One worker under `--dist loadgroup`: the module's conversions are paid once, not per worker.
pytestmark = pytest.mark.xdist_group("ctranslate2")

pytest.importorskip("ctranslate2", reason="the [ctranslate2] extra is not installed")
torch = pytest.importorskip("torch", reason="CTranslate2's converter loads the folder with transformers' torch model")
transformers = pytest.importorskip("transformers", reason="the models are built by transformers")

from conformance.check.ctranslate2 import target as ctranslate2_check  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.core import checkpoint  # noqa: E402
from conformance.core.errors import ConfigError, VerificationError  # noqa: E402
from systems import randomize_  # noqa: E402

SIZES = dict(vocab_size=48, d_model=16, num_layers=2, num_decoder_layers=2, relative_attention_num_buckets=8,
             relative_attention_max_distance=20, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
# name -> (config class, model class, what differs from SIZES). Flan-T5 is T5 v1.1's architecture
# (gated GELU, an lm_head of its own, no scaling); here with heads narrower than d_model / H.
DEFAULT = Path(__file__).resolve().parents[2] / "conformance" / "check" / "data" / "default.safetensors"
T5_FAMILIES = {
    "t5-v1_1": ("T5Config", "T5ForConditionalGeneration", dict(num_heads=4, d_kv=4, d_ff=32)),
    "flan-t5": ("T5Config", "T5ForConditionalGeneration", dict(num_heads=3, d_kv=8, d_ff=24)),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration", dict(num_heads=4, d_kv=4, d_ff=32)),
}


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture(scope="module", params=sorted(T5_FAMILIES))
def t5_checkpoint(request, tmp_path_factory):
    """(name, a rosetta checkpoint converted with no --set from transformers' save_pretrained folder)."""
    name = request.param
    config_class, model_class, extra = T5_FAMILIES[name]
    config = getattr(transformers, config_class)(**SIZES, **extra, feed_forward_proj="gated-gelu",
                                                 tie_word_embeddings=False)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    # An lm_head of its own (transformers 5 ties it on construction), as v1.1, Flan-T5 and mT5 load.
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    model = randomize_(model, seed=3)
    root = tmp_path_factory.mktemp(name)
    model.save_pretrained(root / "folder")
    path = root / "model.safetensors"
    assert main(["convert", str(root / "folder"), str(path)]) == 0
    converted, _ = checkpoint.load(path)
    assert (converted.tie_output, converted.scale_logits, converted.ffn_glu) == (False, False, True)
    return name, path


def unfixed(monkeypatch):
    """The T5 family as it was before the fix: the loader reads the config transformers loads."""
    monkeypatch.setattr(ctranslate2_check, "FAMILIES", tuple(
        dataclasses.replace(family, loaded_config=()) if family.layout == "hf-t5" else family
        for family in ctranslate2_check.FAMILIES))


def test_t5_v1_1_flan_t5_and_mt5_before_the_fix_exit_1_with_nothing_written(t5_checkpoint, capsys, monkeypatch):
    name, path = t5_checkpoint
    unfixed(monkeypatch)
    out = path.parent / "unfixed-ct2"
    status, printed, err = run(capsys, "convert", path, out, "--to", "ctranslate2")
    assert status == 1, (name, printed, err)
    assert f"{out}: not written" in err and "log p beyond" in err and "from position 0" in err, err
    assert "scale_logits" in err  # the switches acting where CTranslate2's numbers first part
    assert not out.exists() and sorted(p.name for p in path.parent.iterdir()) == ["folder", "model.safetensors"]
    # The public writer checks as well: the same fault, the same refusal, nothing left.
    config, params = checkpoint.load(path)
    with pytest.raises(VerificationError, match="log p beyond"):
        ctranslate2_check.convert(config, params, out)
    assert not out.exists()


def test_t5_v1_1_flan_t5_and_mt5_after_the_fix_pass_log_p_and_beam_4_ids(t5_checkpoint, capsys):
    name, path = t5_checkpoint
    out = path.parent / "ct2"
    status, printed, err = run(capsys, "convert", path, out, "--to", "ctranslate2")
    assert status == 0, (name, err)
    assert "verified: ctranslate2" in printed and "greedy ids equal" in printed, printed
    config, params = checkpoint.load(path)
    src, tgt = fixed_batch(config)
    assert (src == config.pad_id).any() and (tgt == config.pad_id).any()
    report = ctranslate2_check.check(config, params, src, tgt, compute_types=("float32",), max_len=16, model_dir=out)
    row = report.rows[0]
    assert row.agreement == {1: 1.0, 4: 1.0} and not row.unheld, f"{name}\n{report.table()}"
    assert 0 < row.max_error <= tolerance("float32", "cpu").atol * row.scale, f"{name}\n{report.table()}"


@pytest.mark.parametrize("layout", ["hf-mbart", "hf-pegasus", "hf-m2m100"])
def test_mbart_pegasus_and_m2m100_convert_and_pass_their_check(layout, tmp_path, capsys):
    config, params = ctranslate2_check.example_model(seed=1, layout=layout)
    path = tmp_path / "model.safetensors"
    checkpoint.save(path, config, params)
    status, printed, err = run(capsys, "convert", path, tmp_path / "ct2", "--to", "ctranslate2")
    assert status == 0, err
    assert f"through a Hugging Face {layout} folder" in printed, printed
    assert "verified: ctranslate2" in printed and "greedy ids equal" in printed, printed
    assert ctranslate2_check.family_of(config, params).layout == layout


@pytest.mark.parametrize("layout, change, words", [
    ("hf-mbart", dict(start=1), "starts the decoder from the end token (2)"),
    ("hf-pegasus", dict(start=1), "starts the decoder from the pad token (0)"),
    ("hf-m2m100", dict(pad=3), "pad_id must be 1"),
])
def test_what_a_new_familys_loader_cannot_hold_is_refused_by_the_switch(layout, change, words, tmp_path):
    """mBART's loader starts from the end token, Pegasus's from the pad token, and M2M100's
    positions are transformers' only for pad id 1: anything else is refused before anything is written."""
    from conformance.core.params import init_params
    from conformance.core.presets import preset

    pad, start, eos = ctranslate2_check.EXAMPLE_IDS[layout]
    pad, start = change.get("pad", pad), change.get("start", start)
    config = preset(layout, src_vocab_size=32, tgt_vocab_size=32, pad_id=pad, **(
        {"position_offset": pad + 1} if layout == "hf-m2m100" else {}),
        notes={"generation": json.dumps({"decoder_start_token_id": start, "eos_token_id": eos})})
    params = init_params(config, seed=0, dtype=np.float32)
    with pytest.raises(ConfigError, match=re.escape(words)):
        ctranslate2_check.convert(config, params, tmp_path / "ct2")
    assert list(tmp_path.iterdir()) == []


def test_a_refusal_gives_advice_that_can_be_followed(tmp_path, capsys):
    """Issue 56 item 7: the refusal used to end in `--set ffn_bias=true ...`, which `--to
    ctranslate2` refuses ("nothing to set"). It names each family's reason and no --set."""
    status, _, err = run(capsys, "convert", DEFAULT, tmp_path / "ct2",
                         "--to", "ctranslate2")
    assert status == 2 and "no family CTranslate2 converts expresses this model" in err, err
    assert "--set" not in err and "if your copy of that system" not in err, err
    assert "a switch cannot be set at this export" in err and "hf-m2m100:" in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_planted_writer_fault_exits_1_with_nothing_written(tmp_path, capsys, monkeypatch):
    """One weight perturbed on its way to CTranslate2's converter: the check names the log p
    position where the written model first parts from the oracle, and nothing is left."""
    config, params = ctranslate2_check.example_model(seed=0)
    path = tmp_path / "marian.safetensors"
    checkpoint.save(path, config, params)
    write = ctranslate2_check.write

    def planted(ctranslate2, config, params, out, quantization, family):
        broken = dict(params)
        key = "decoder.layers.1.ffn.linear2.weight"
        broken[key] = np.asarray(params[key]) + np.float32(0.05) * np.sign(params[key])
        return write(ctranslate2, config, broken, out, quantization, family)

    monkeypatch.setattr(ctranslate2_check, "write", planted)
    status, printed, err = run(capsys, "convert", path, tmp_path / "ct2", "--to", "ctranslate2")
    assert status == 1 and printed == "", err
    assert "not written" in err and "log p beyond" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marian.safetensors"]
    # --no-verify writes what it was asked to, and says it was not checked.
    status, printed, err = run(capsys, "convert", path, tmp_path / "ct2", "--to", "ctranslate2", "--no-verify")
    assert status == 0 and "not verified: --no-verify" in printed and (tmp_path / "ct2" / "model.bin").is_file()


def test_a_converter_that_refuses_is_a_typed_error_naming_it_not_a_traceback(tmp_path, capsys, monkeypatch):
    """CTranslate2's converter raising (planted: the ValueError its loaders raise for a
    configuration they have no conversion for) is a CheckpointError that names the converter, the
    family's folder and its message; the exit is 2 with nothing written, nor a scratch folder."""
    import ctranslate2

    config, params = ctranslate2_check.example_model(seed=0)
    path = tmp_path / "marian.safetensors"
    checkpoint.save(path, config, params)

    def refuses(self, *args, **kwargs):
        raise ValueError("No conversion is registered for the model configuration PlantedConfig")

    monkeypatch.setattr(ctranslate2.converters.TransformersConverter, "load_model", refuses)
    status, printed, err = run(capsys, "convert", path, tmp_path / "ct2", "--to", "ctranslate2")
    assert status == 2 and printed == "", err
    assert "TransformersConverter could not convert the hf-marian folder" in err, err
    assert "ValueError: No conversion is registered for the model configuration PlantedConfig" in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["marian.safetensors"]


def test_quantized_weights_are_measured_and_said_not_held(tmp_path, capsys):
    config, params = ctranslate2_check.example_model(seed=0)
    path = tmp_path / "marian.safetensors"
    checkpoint.save(path, config, params)
    status, printed, err = run(capsys, "convert", path, tmp_path / "int8", "--to", "ctranslate2",
                               "--quantization", "int8")
    assert status == 0, err
    assert "not verified: weights stored as int8" in printed and "measured, not held" in printed, printed
    assert "largest |log p error|" in printed
