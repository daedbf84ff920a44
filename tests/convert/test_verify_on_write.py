"""`rosetta convert` checks what it wrote before it is renamed into place (issue 53), with the
runtime that will read it: our loader for a rosetta checkpoint, transformers for a Hugging Face
folder (and for the folder an import reads), torch DCP and Orbax for the sharded directories, a
read back through the layout for a tutorial's state dict.

A planted fault in each writer (one tensor perturbed, one config field dropped) exits 1, names the
first divergence, and leaves nothing at the destination, nor any temporary. `--no-verify` writes
and says that it did not check. A runtime that is not installed: written, and said. Ctrl-C during
the check or the trial forward pass leaves nothing, and the rerun needs no --force (issue 56 item 6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.cli import main
from conformance.convert import export_state_dict
from conformance.core import checkpoint

torch = pytest.importorskip("torch", reason="the writers and runtimes checked here are PyTorch's")

ROOT = Path(__file__).resolve().parents[2]
PERTURBED = "encoder.layers.0.ffn.linear1.weight"
SIZES = dict(src_vocab_size=19, tgt_vocab_size=19, d_model=8, n_heads=2, d_ff=12, n_encoder_layers=1,
             n_decoder_layers=1, max_len=10)


def run(capsys, *argv):
    status = main([str(a) for a in argv])
    out = capsys.readouterr()
    return status, out.out, out.err


def left(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def perturbed(params: dict, key: str) -> dict:
    out = dict(params)
    out[key] = np.asarray(params[key]) + np.asarray(0.05, dtype=np.asarray(params[key]).dtype)
    return out


@pytest.fixture
def bart(tmp_path):
    """A rosetta checkpoint of a tiny BART (ReLU, which BART's config.json carries) with its generation note."""
    pytest.importorskip("transformers", reason="the Hugging Face folders are checked by transformers itself")
    config = preset("hf-bart", **SIZES, activation="relu", pad_id=1,
                    notes={"generation": json.dumps({"decoder_start_token_id": 2, "eos_token_id": 2,
                                                     "pad_token_id": 1})})
    path = tmp_path / "bart.safetensors"
    checkpoint.save(path, config, init_params(config, seed=2, dtype=np.float32))
    return path


@pytest.fixture
def tutorial(tmp_path):
    """A torch-nn-transformer rosetta checkpoint and the same model as the tutorial's state dict."""
    config = preset("torch-nn-transformer", **SIZES, pad_id=1)
    params = init_params(config, seed=3, dtype=np.float32)
    checkpoint.save(tmp_path / "model.safetensors", config, params)
    checkpoint.write_tensors(tmp_path / "foreign.safetensors",
                             export_state_dict(config, params, "torch-nn-transformer"), {})
    return tmp_path


TUTORIAL_SETS = ["--set", "n_heads=2", "--set", "norm_placement=post", "--set", "pad_id=1"]


# -- Hugging Face folders: transformers itself ----------------------------------------------------


def test_hf_bart_export_is_checked_by_transformers(bart, capsys):
    status, printed, err = run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")
    assert status == 0, err
    assert "verified: transformers" in printed and "BartForConditionalGeneration.from_pretrained" in printed
    assert "every parameter and switch read back as the checkpoint's" in printed, printed


def test_a_planted_hf_bart_tensor_fault_exits_1_naming_the_parameter(bart, capsys, monkeypatch):
    from conformance.convert import hf_folder

    write = hf_folder.write_folder
    monkeypatch.setattr(hf_folder, "write_folder", lambda folder, config, state, layout: write(
        folder, config, perturbed(state, "model.encoder.layers.0.fc1.weight"), layout))
    status, printed, err = run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")
    assert status == 1 and printed == "", err
    assert "not written" in err and f"parameter {PERTURBED} differs" in err, err
    assert left(bart.parent) == ["bart.safetensors"]


def test_a_planted_hf_bart_config_fault_exits_1_naming_the_switch(bart, capsys, monkeypatch):
    """config.json without activation_function: transformers takes BartConfig's GELU."""
    from conformance.convert import hf_folder

    folder_files = hf_folder.folder_files

    def dropped(config, layout):
        hf, generation, warnings = folder_files(config, layout)
        hf.pop("activation_function")
        return hf, generation, warnings

    monkeypatch.setattr(hf_folder, "folder_files", dropped)
    status, printed, err = run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")
    assert status == 1, err
    assert "activation='gelu' where the checkpoint has 'relu'" in err, err
    assert left(bart.parent) == ["bart.safetensors"]


@pytest.mark.parametrize("where, key, said", [
    ("generation_config.json", "eos_token_id",
     "its generation settings (generation_config) say eos_token_id=5 where the checkpoint's note has 2"),
    ("config.json", "decoder_start_token_id", "config.json says decoder_start_token_id=5 where the checkpoint's note has 2"),
], ids=["generation_config", "config.json"])
def test_a_planted_generation_setting_exits_1_naming_it(bart, capsys, monkeypatch, where, key, said):
    """A folder whose logits are right but whose generate would start (or stop) on another token:
    transformers' generate reads generation_config.json, CTranslate2's converter and pipelines
    read config.json's special ids; both are held to the checkpoint's generation note."""
    from conformance.convert import hf_folder

    folder_files = hf_folder.folder_files

    def planted(config, layout):
        hf, generation, warnings = folder_files(config, layout)
        (generation if where == "generation_config.json" else hf)[key] = 5
        return hf, generation, warnings

    monkeypatch.setattr(hf_folder, "folder_files", planted)
    status, printed, err = run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")
    assert status == 1 and printed == "", err
    assert "not written" in err and said in err, err
    assert left(bart.parent) == ["bart.safetensors"]


def test_where_transformers_computes_otherwise_the_first_tensor_is_named(bart, capsys, monkeypatch):
    """A transformers whose ReLU is another function (planted in its ACT2FN table): the folder's
    weights and config read back as the checkpoint's, the logits part, and the layout's [taps]
    find the first tensor where they do, with the switch acting there."""
    from transformers import activations

    monkeypatch.setitem(activations.ACT2FN, "relu", activations.ACT2CLS["gelu"])
    status, printed, err = run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")
    assert status == 1, err
    assert "the logits leave the float32 tolerance" in err, err
    assert "first diverging tensor through the layout's taps: encoder.0.ffn" in err and "activation" in err, err
    assert left(bart.parent) == ["bart.safetensors"]


def test_what_transformers_warns_while_it_checks_is_said_in_the_verdict_not_raw(tmp_path, capfd):
    """A Whisper folder written with no generation note: transformers fills config.json's absent
    special ids with WhisperConfig's defaults (50256, out of this vocabulary) and its logger warns
    so while from_pretrained loads it. That is said once, in the verdict's line, not printed in
    transformers' own voice on stderr (capfd: its handler writes to the stderr it was made with)."""
    from transformers.utils import logging as hf_logging

    hf_logging.warning_once.cache_clear()  # another test in this process may have had it said
    config = preset("hf-whisper", **{**SIZES, "d_ff": 32}, pad_id=3, max_source_len=8, n_mels=8)
    checkpoint.save(tmp_path / "w.safetensors", config, init_params(config, seed=1, dtype=np.float32))
    status = main(["convert", str(tmp_path / "w.safetensors"), str(tmp_path / "folder"), "--to", "hf-whisper"])
    printed, err = capfd.readouterr()
    assert status == 0, err
    assert "[transformers]" not in err and "must be `None` or an integer" not in err, err
    assert "verified: transformers" in printed, printed
    assert "transformers warned on loading or running it: Model config: bos_token_id must be `None`" in printed, printed


@pytest.mark.parametrize("family, out", [("hf-t5", "folder"), ("hf-whisper", "out.safetensors")])
def test_a_size_spelled_as_its_default_reads_back_as_the_same_model(tmp_path, capsys, family, out):
    """T5's d_head 0 (d_model / n_heads) reads back from config.json's d_kv as 4; Whisper's
    max_source_len 0 (max_len) as the encoder table's 16 rows. One model spelled two ways is not
    a divergence."""
    pytest.importorskip("transformers", reason="the written models are checked by transformers itself")
    sizes = dict(SIZES, d_model=16, n_heads=4, d_ff=16, max_len=16)
    if family == "hf-whisper":
        sizes.update(src_vocab_size=19, n_mels=8)
    config = preset(family, **sizes)
    assert config.d_head == 0 and config.max_source_len == 0
    path = tmp_path / "model.safetensors"
    checkpoint.save(path, config, init_params(config, seed=1, dtype=np.float32))
    status, printed, err = run(capsys, "convert", path, tmp_path / out, "--to", family)
    assert status == 0, err
    assert "verified: transformers" in printed, printed


def test_an_import_of_a_folder_runs_the_folder_in_transformers(bart, capsys, monkeypatch):
    """A fault planted in the folder reader (one tensor read wrong) writes a checkpoint that is
    consistent with itself; transformers running the source folder is what catches it."""
    from conformance.convert import hf_folder

    assert run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")[0] == 0
    out = bart.parent / "back.safetensors"
    status, printed, err = run(capsys, "convert", bart.parent / "folder", out)
    assert status == 0, err
    assert "verified: transformers" in printed and "the source folder" in printed, printed
    out.unlink()
    read = hf_folder.read_weights
    monkeypatch.setattr(hf_folder, "read_weights", lambda folder: perturbed(read(folder), "model.encoder.layers.0.fc1.weight"))
    status, printed, err = run(capsys, "convert", bart.parent / "folder", out)
    assert status == 1 and "the source folder" in err and f"parameter {PERTURBED} differs" in err, err
    assert left(bart.parent) == ["bart.safetensors", "folder"]


def test_a_runtime_that_is_not_installed_is_said_and_the_output_written(bart, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` finds uninstalled
    out = bart.parent / "folder"
    status, printed, err = run(capsys, "convert", bart, out, "--to", "hf-bart")
    assert status == 0 and (out / "model.safetensors").is_file(), err
    assert "not verified: the written folder was not loaded: transformers with torch is not installed" in printed
    assert f"warning: {out}: not verified: the written folder was not loaded: transformers with" in err, err


def test_a_source_whose_runtime_is_missing_is_said_on_stdout_and_stderr(bart, capsys, monkeypatch):
    """The written checkpoint is checked by our loader, but the source folder's own system is not
    installed: the output lands, and that the source was not run is said on both streams."""
    assert run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")[0] == 0
    monkeypatch.setitem(sys.modules, "transformers", None)
    out = bart.parent / "back.safetensors"
    status, printed, err = run(capsys, "convert", bart.parent / "folder", out)
    assert status == 0 and out.is_file(), err
    assert "verified: checkpoint.load" in printed, printed
    assert "not verified: the source folder was not loaded: transformers with torch is not installed" in printed
    assert f"warning: {out}: not verified: the source folder was not loaded: transformers with torch" in err, err


def test_a_source_whose_runtime_raises_fails_the_check(bart, capsys, monkeypatch):
    """transformers installed, and raising while it runs the source folder: the one check that
    could catch a config.json read wrong did not vouch for it, so nothing is written (exit 1)."""
    from conformance.formats import hf_runtime

    assert run(capsys, "convert", bart, bart.parent / "folder", "--to", "hf-bart")[0] == 0

    def raising(*args, **kwargs):
        raise RuntimeError("planted: the forward pass broke")

    monkeypatch.setattr(hf_runtime, "call", raising)
    out = bart.parent / "back.safetensors"
    status, printed, err = run(capsys, "convert", bart.parent / "folder", out)
    assert status == 1 and printed == "", err
    assert "not written: the source's own system, running folder: it raised RuntimeError: planted" in err, err
    assert left(bart.parent) == ["bart.safetensors", "folder"]


def test_a_runtime_whose_copy_would_not_fit_is_not_run_and_says_so(bart, capsys, monkeypatch):
    from conformance.formats import verify

    monkeypatch.setattr(verify, "fits_in_memory", lambda *args, **kwargs: (False, "about 9 TiB needed, 1 GiB available"))
    out = bart.parent / "folder"
    status, printed, err = run(capsys, "convert", bart, out, "--to", "hf-bart")
    assert status == 0 and (out / "model.safetensors").is_file(), err
    assert "not verified: the written folder was not loaded: its copy of the model would not fit" in printed, printed
    assert "9 TiB" in printed and f"warning: {out}: not verified: the written folder was not loaded" in err, err


# -- a rosetta checkpoint in: our loader, bit for bit ----------------------------------------------


def test_a_planted_checkpoint_writer_fault_exits_1_naming_the_parameter(tutorial, capsys, monkeypatch):
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda path, config, params: save(path, config, perturbed(params, PERTURBED)))
    out = tutorial / "out.safetensors"
    status, printed, err = run(capsys, "convert", tutorial / "foreign.safetensors", out, *TUTORIAL_SETS)
    assert status == 1 and printed == "", err
    assert f"checkpoint.load: parameter {PERTURBED} differs in" in err, err
    assert left(tutorial) == ["foreign.safetensors", "model.safetensors"]


def test_a_dropped_config_field_is_named(tutorial, capsys, monkeypatch):
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda path, config, params: save(path, config.replace(mask_fill=-1e4),
                                                                                params))
    status, _, err = run(capsys, "convert", tutorial / "model.safetensors", tutorial / "copy.safetensors")
    assert status == 1 and "the config says mask_fill=-10000.0 where the checkpoint has" in err, err
    assert left(tutorial) == ["foreign.safetensors", "model.safetensors"]


def test_a_file_its_loader_refuses_fails_the_check(tutorial, capsys, monkeypatch):
    """Bytes damaged after the digest was taken: checkpoint.load refuses the file, and that refusal
    is the failed check (exit 1, nothing left), not an error about the input (exit 2)."""
    save = checkpoint.save

    def damaged(path, config, params):
        save(path, config, params)
        data = bytearray(Path(path).read_bytes())
        data[-3] ^= 0xFF
        Path(path).write_bytes(bytes(data))

    monkeypatch.setattr(checkpoint, "save", damaged)
    status, _, err = run(capsys, "convert", tutorial / "foreign.safetensors", tutorial / "out.safetensors",
                         *TUTORIAL_SETS)
    assert status == 1 and "could not be read back" in err and "sha256 digest does not match" in err, err
    assert left(tutorial) == ["foreign.safetensors", "model.safetensors"]


def test_the_check_of_a_model_too_large_for_memory_reads_one_parameter_at_a_time(tutorial, capsys, monkeypatch):
    from conformance.formats import verify

    monkeypatch.setattr(verify, "fits_in_memory", lambda *args, **kwargs: (False, "about 9 TiB needed, 1 GiB available"))
    out = tutorial / "out.safetensors"
    status, printed, err = run(capsys, "convert", tutorial / "foreign.safetensors", out, *TUTORIAL_SETS)
    assert status == 0 and "read back one parameter at a time" in printed and "9 TiB" in printed, err
    out.unlink()
    save = checkpoint.save
    monkeypatch.setattr(checkpoint, "save", lambda path, config, params: save(path, config, perturbed(params, PERTURBED)))
    status, _, err = run(capsys, "convert", tutorial / "foreign.safetensors", out, *TUTORIAL_SETS)
    assert status == 1 and f"parameter {PERTURBED} differs" in err and not out.exists(), err


def test_no_verify_writes_and_says_so(tutorial, capsys):
    out = tutorial / "out.safetensors"
    status, printed, err = run(capsys, "convert", tutorial / "foreign.safetensors", out, *TUTORIAL_SETS, "--no-verify")
    assert status == 0 and out.is_file(), err
    assert "not verified: --no-verify skipped the check of what was written" in printed
    assert "verified:" not in printed.replace("not verified:", "")
    assert f"warning: {out}: not verified: --no-verify skipped the check" in err, err


def test_a_bare_state_dict_says_its_system_was_not_run(tutorial, capsys):
    status, printed, err = run(capsys, "convert", tutorial / "foreign.safetensors", tutorial / "out.safetensors",
                               *TUTORIAL_SETS)
    assert status == 0 and "verified: checkpoint.load" in printed, err
    assert "not verified: the system that saved foreign.safetensors was not run" in printed, printed
    assert "not verified: the system that saved foreign.safetensors was not run" in err, err


# -- a tutorial's state dict out: read back through its layout -------------------------------------


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_planted_state_dict_writer_fault_is_found_reading_it_back(tutorial, capsys, monkeypatch, suffix):
    from conformance.formats import state_dict

    out = tutorial / f"tutorial{suffix}"
    status, printed, err = run(capsys, "convert", tutorial / "model.safetensors", out, "--to", "torch-nn-transformer")
    assert status == 0 and "verified: read back through layout torch-nn-transformer" in printed, err
    assert "the torch-nn-transformer system itself was not run" in printed
    out.unlink()
    key = "transformer.encoder.layers.0.linear1.weight"
    write_torch, write_tensors = state_dict.write_torch, checkpoint.write_tensors
    monkeypatch.setattr(state_dict, "write_torch", lambda dst, state: write_torch(dst, perturbed(state, key)))
    monkeypatch.setattr(checkpoint, "write_tensors", lambda path, tensors, metadata: write_tensors(
        path, perturbed(tensors, key), metadata))
    status, _, err = run(capsys, "convert", tutorial / "model.safetensors", out, "--to", "torch-nn-transformer")
    assert status == 1 and f"parameter {PERTURBED} differs" in err, err
    assert left(tutorial) == ["foreign.safetensors", "model.safetensors"]


# -- sharded directories: torch DCP and Orbax themselves -------------------------------------------


@pytest.mark.parametrize("kind", ["dcp", "orbax"])
def test_a_planted_sharded_writer_fault_is_found_by_the_loader_that_reads_it(tutorial, capsys, monkeypatch, kind):
    from conformance.convert import sharded

    if kind == "orbax":
        pytest.importorskip("orbax.checkpoint")
    runtime = {"dcp": "impl_torch.load_distributed", "orbax": "impl_jax.load_sharded"}[kind]
    status, printed, err = run(capsys, "convert", tutorial / "model.safetensors", tutorial / kind, "--to", kind)
    assert status == 0 and f"verified: {runtime}" in printed, err
    back = tutorial / f"{kind}.safetensors"
    status, printed, err = run(capsys, "convert", tutorial / kind, back)
    assert status == 0 and "bit for bit as the source's, read again and cast apart from the conversion" in printed, err
    write = {"dcp": sharded.write_dcp, "orbax": sharded.write_orbax}[kind]
    monkeypatch.setattr(sharded, f"write_{kind}", lambda dst, config, params: write(dst, config,
                                                                                     perturbed(params, PERTURBED)))
    status, printed, err = run(capsys, "convert", tutorial / "model.safetensors", tutorial / "planted", "--to", kind)
    assert status == 1 and f"{runtime}" in err and f"parameter {PERTURBED} differs" in err, err
    assert not (tutorial / "planted").exists() and not [p for p in tutorial.iterdir() if p.name.startswith(".")]


def planted_cast(monkeypatch):
    """convert.engine.cast scaling one parameter by 1.5: the conversion's cast, wrong."""
    from conformance.convert import engine

    cast = engine.cast

    def wrong(value, dtype, key):
        out = cast(value, dtype, key)
        return out * np.asarray(1.5, out.dtype) if key == PERTURBED else out

    monkeypatch.setattr(engine, "cast", wrong)


@pytest.mark.parametrize("kind", ["dcp", "orbax"])
@pytest.mark.parametrize("fault", ["reader", "cast"])
def test_a_sharded_import_is_held_to_the_directory_read_again(tutorial, capsys, monkeypatch, kind, fault):
    """The import writes what its reader read and its cast cast: checked against those alone, a
    fault in either would agree with itself. The directory read again by its own library and cast
    by NumPy is what finds it."""
    from conformance.convert import sharded

    if kind == "orbax":
        pytest.importorskip("orbax.checkpoint")
    assert run(capsys, "convert", tutorial / "model.safetensors", tutorial / kind, "--to", kind)[0] == 0
    flags = []
    if fault == "reader":
        source = sharded.DcpSource if kind == "dcp" else sharded.OrbaxSource
        read = source.read
        monkeypatch.setattr(source, "read", lambda self, name: read(self, name) + np.float32(0.5) if name == PERTURBED
                            else read(self, name))
    else:
        planted_cast(monkeypatch)
        flags = ["--dtype", "float64"]
    back = tutorial / "back.safetensors"
    status, printed, err = run(capsys, "convert", tutorial / kind, back, *flags)
    assert status == 1, err
    assert f"checkpoint.load: against the source, read again: parameter {PERTURBED} differs" in err, err
    assert not back.exists() and not [p for p in tutorial.iterdir() if p.name.startswith(".")]


def test_a_re_save_with_a_cast_is_held_to_the_source_file_cast_apart(tutorial, capsys, monkeypatch):
    out = tutorial / "half.safetensors"
    status, printed, err = run(capsys, "convert", tutorial / "model.safetensors", out, "--dtype", "float16")
    assert status == 0 and "as the source's, read again and cast apart from the conversion" in printed, err
    out.unlink()
    planted_cast(monkeypatch)
    status, printed, err = run(capsys, "convert", tutorial / "model.safetensors", out, "--dtype", "float16")
    assert status == 1 and f"against the source, read again: parameter {PERTURBED} differs" in err, err
    assert left(tutorial) == ["foreign.safetensors", "model.safetensors"]


# -- Ctrl-C: nothing left, and the rerun needs no --force (issue 56 item 6) ------------------------

CHILD = textwrap.dedent("""
    import importlib, os, signal, sys, time

    owner = importlib.import_module(sys.argv[1])
    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(60)
        raise AssertionError("SIGINT was not delivered")

    setattr(owner, sys.argv[2], interrupted)
    from conformance.cli import console_main

    sys.exit(console_main(sys.argv[3:]))
""")


def interrupted(cwd: Path, module: str, attribute: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", CHILD, module, attribute, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("at", ["trial_run", "verify_whole"], ids=["trial", "check"])
def test_ctrl_c_during_the_trial_or_the_check_leaves_nothing(tutorial, capsys, at):
    (tutorial / "old.safetensors").write_bytes(b"the previous checkpoint")
    before = {p.name: p.read_bytes() for p in tutorial.iterdir()}
    for out, force in (("out.safetensors", []), ("old.safetensors", ["--force"])):
        result = interrupted(tutorial, "conformance.formats.rosetta", at, "convert", "foreign.safetensors", out,
                             *TUTORIAL_SETS, *force)
        assert result.returncode == 130, result.stderr
        assert result.stderr.strip().splitlines()[-1] == "rosetta convert: interrupted", result.stderr
        assert {p.name: p.read_bytes() for p in tutorial.iterdir()} == before, "an interrupted run left something"
    status, _, err = run(capsys, "convert", tutorial / "foreign.safetensors", tutorial / "out.safetensors",
                         *TUTORIAL_SETS)
    assert status == 0, err  # no --force: nothing was left to replace
