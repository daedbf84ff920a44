"""Issue 45, from a read-only review of `rosetta generate`'s walk-4 fixes: the search's NaN error
has its own type (`NaNLogitsError`), so that only it is diagnosed as an overflow and a source row
of padding keeps its own message; its message names a -inf fill only for a model that has one;
the overflow diagnosis keeps no tensor, reads each once, never replaces the search's error with
its own, and keeps the search's step and row; a status line waits for a half-written line;
train_toy's `--out=PATH` counts as given; every torch kind of backend fits its threads."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.check import backends
from conformance.cli import generate, main
from conformance.core import checkpoint
from conformance.core.generation.search import search
from conformance.core.errors import InputError, NaNLogitsError
from test_length_limit import overflowing_checkpoint, runnable

OVERFLOW_WARNINGS = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                               "ignore:invalid value encountered:RuntimeWarning")


# -- item 2: only the search's NaN error is diagnosed ------------------------------------------


def test_a_padding_only_row_keeps_its_own_message(tmp_path, capsys):
    """With a -inf fill, a forward pass on a row of padding is NaN; the search refuses that row
    first ("all padding"), and the CLI must not swap that for an overflow diagnosis."""
    config = preset("llmhub", src_vocab_size=16, tgt_vocab_size=16, d_model=16, n_heads=2, d_ff=32,
                    n_encoder_layers=1, n_decoder_layers=1, max_len=16)
    assert np.isinf(config.mask_fill) and config.pad_id == 0
    path = tmp_path / "inf.safetensors"
    checkpoint.save(path, config, init_params(config, seed=0, dtype=np.float32))
    assert main(["generate", str(path), "--src", "5,6,7;0,0,0", "--bos", "1", "--eos", "2",
                 "--backend", "numpy"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and "row 1 is all padding" in error[0], error
    assert "NaN" not in error[0], error[0]


@OVERFLOW_WARNINGS
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_the_searchs_nan_error_has_its_own_type_in_every_backend(backend, tmp_path):
    if not runnable(backend):
        pytest.skip(f"{backend} is not installed")
    config, params = checkpoint.load(overflowing_checkpoint(tmp_path))
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, params)
    with pytest.raises(NaNLogitsError) as info:
        model.generate(np.array([[5, 6, 7, 8]]))
    assert isinstance(info.value, InputError) and info.value.argument == "src_ids"
    assert (info.value.step, info.value.row) == (0, 0)


# -- item 3: the -inf cause is named only where the fill is -inf ---------------------------------


@OVERFLOW_WARNINGS
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_a_finite_fill_blames_an_overflow_not_a_masked_row(backend, tmp_path):
    if not runnable(backend):
        pytest.skip(f"{backend} is not installed")
    config, params = checkpoint.load(overflowing_checkpoint(tmp_path))
    model = backends.build(backends.Target(backend, "cpu", "float32"), config, params)
    with pytest.raises(NaNLogitsError) as info:
        model.generate(np.array([[5, 6, 7, 8]]))
    message = str(info.value)
    assert "mask_fill=-inf" not in message and "every key masked" not in message, message
    assert "overflowed" in message and "rosetta check" in message and "first non-finite tensor" in message, message
    reference = backends.build(backends.Target("numpy", "cpu", "float32"), config, params)
    assert message == str(pytest.raises(NaNLogitsError, reference.generate, np.array([[5, 6, 7, 8]])).value)


def nan_step(tokens, parents):
    logits = np.zeros((len(tokens), 5))
    logits[1] = np.nan
    return logits


def test_the_search_names_the_cause_its_fill_allows():
    with pytest.raises(NaNLogitsError, match="every key masked with mask_fill=-inf") as info:
        search(nan_step, 2, 4, 1, 2, 0, mask_fill=float("-inf"))
    assert (info.value.step, info.value.row) == (0, 1)
    with pytest.raises(NaNLogitsError, match="overflowed") as info:
        search(nan_step, 2, 4, 1, 2, 0, mask_fill=-1e9)
    assert "mask_fill=-inf" not in str(info.value)
    with pytest.raises(NaNLogitsError) as info:  # no model: no cause guessed
        search(nan_step, 2, 4, 1, 2, 0)
    assert "mask_fill" not in str(info.value) and "NaN logits at step 0, row 1" in str(info.value)


# -- item 4: the overflow diagnosis ----------------------------------------------------------------


@OVERFLOW_WARNINGS
def test_the_overflow_message_keeps_the_searchs_step_and_row(tmp_path, capsys):
    path = overflowing_checkpoint(tmp_path)
    assert main(["generate", str(path), "--src", "5,6,7,8", "--backend", "numpy"]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error) == 1 and "NaN logits at step 0, row 0" in error[0], error
    assert "first non-finite tensor is encoder.0.self" in error[0], error[0]


SMALL = preset("hf-marian", src_vocab_size=16, tgt_vocab_size=16, d_model=16, n_heads=2, d_ff=32,
               n_encoder_layers=1, n_decoder_layers=1, max_len=16, pad_id=15)
NAN = NaNLogitsError(3, 1, "the decoder produced NaN logits at step 3, row 1")


def test_a_diagnosis_that_cannot_run_leaves_the_searchs_error():
    def broken(src, tgt, sink=None):
        raise RuntimeError("the diagnostic pass failed for a reason of its own")

    assert generate.overflow_error(broken, SMALL, np.array([[5, 6]]), 15, "m.safetensors", NAN) is None


def test_the_diagnosis_keeps_no_tensor_and_reads_each_once(monkeypatch):
    """A forward pass of many finite tensors, then a non-finite one: while it runs, no host copy
    of an earlier tensor is held, and each is tested for finiteness once (not all again on
    every callback)."""
    from conformance.check import compare
    from conformance.core.output import forward_order

    names = forward_order(SMALL)
    copies: list = []

    def to_numpy(tensor):
        copy = np.array(tensor, dtype=np.float64)
        copies.append(weakref.ref(copy))
        return copy

    tested = []
    isfinite = np.isfinite

    def counting_isfinite(*args, **kwargs):
        tested.append(1)
        return isfinite(*args, **kwargs)

    held = []

    def model(src, tgt, sink=None):
        for name in names[:-1]:
            sink(name, np.ones((1, 4, 8)))
        held.append(sum(ref() is not None for ref in copies))
        sink(names[-1], np.full((1, 4, 8), np.inf))

    monkeypatch.setattr(compare, "to_numpy", to_numpy)
    monkeypatch.setattr(np, "isfinite", counting_isfinite)
    found = generate.overflow_error(model, SMALL, np.array([[5, 6]]), 15, "m.safetensors", NAN)
    assert found is not None and f"first non-finite tensor is {names[-1]}" in str(found), found
    assert f"the tensor before it, {names[-2]}, being finite (largest |value| 1)" in str(found), found
    assert held == [0], held  # the copies of the finite tensors were dropped as they were read
    assert len(tested) <= len(names) + 2, len(tested)


# -- item 6: the status line and another writer's line -------------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_status_redraw_waits_for_a_half_written_line(monkeypatch):
    from conformance.cli.progress import Status

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Status("rosetta x") as status:
        status("first")
        sys.stderr.write("a notice")  # print's text; its newline comes in a second write
        status("second")  # another thread's redraw in between
        sys.stderr.write("\n")
        assert terminal.getvalue().endswith("rosetta x: second (0 s)"), terminal.getvalue()
    assert "a notice\n" in terminal.getvalue(), repr(terminal.getvalue())


def test_writing_nothing_leaves_the_status_shown(monkeypatch):
    from conformance.cli.progress import Status

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Status("rosetta x") as status:
        status("working")
        sys.stderr.write("")
        assert terminal.getvalue().endswith("rosetta x: working (0 s)"), repr(terminal.getvalue())


# -- item 7: train_toy's --out=PATH ------------------------------------------------------------------


def test_train_toy_writes_an_out_given_with_an_equals_sign(tmp_path, capsys):
    script = Path(__file__).resolve().parents[2] / "examples" / "train_toy.py"
    spec = importlib.util.spec_from_file_location("train_toy_review", script)
    train_toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_toy)
    out = tmp_path / "toy.safetensors"
    assert train_toy.main(["--backend", "numpy", "--steps", "1", "--batch", "4", f"--out={out}"]) == 0
    assert out.is_file() and f"wrote {out}" in capsys.readouterr().out


# -- item 8: threads for every torch kind of backend --------------------------------------------------


class Fitted(Exception):
    """Raised by the stand-in for fit_torch_threads: the command got that far."""


def test_check_on_torch_compiled_fits_its_threads_too(monkeypatch):
    """`rosetta check --backends torch-compiled` fits torch's threads as `--backends torch` does
    (generate and attention offer numpy, torch and jax only; they test the backend's kind too)."""
    if not runnable("torch-compiled"):
        pytest.skip("torch is not installed")
    from conformance.cli import threads

    def fit(config):
        raise Fitted

    monkeypatch.setattr(threads, "fit_torch_threads", fit)
    with pytest.raises(Fitted):
        main(["check", "--backends", "torch-compiled", "--dtypes", "float32"])
