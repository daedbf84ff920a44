"""NaN logits in `generate` (issue 45): the search's NaN error has its own type
(`NaNLogitsError`), so that only it is diagnosed as an overflow and a source row of padding keeps
its own message; its message names a -inf fill only for a model that has one; `rosetta generate`
names the first non-finite tensor of an overflow, not --src and a -inf fill the config does not
have; the overflow diagnosis keeps no tensor, reads each once, never replaces the search's error
with its own, and keeps the search's step and row."""

from __future__ import annotations

import json
import weakref

import numpy as np
import pytest

from conformance import init_params, preset
from conformance.check import backends
from conformance.cli import generate, main
from conformance.core import checkpoint
from conformance.core.generation.search import search
from conformance.core.errors import InputError, NaNLogitsError

OVERFLOW_WARNINGS = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",
                                               "ignore:invalid value encountered:RuntimeWarning")


def runnable(backend: str) -> bool:
    return not backends.availability([backend])[backend]


# -- an overflow is named where it happens ---------------------------------------------------------

OVERFLOW_SCALE = 1e20  # a Marian embedding times this: q.k overflows float32 in the first attention


def overflowing_checkpoint(tmp_path):
    """A model with a finite mask fill whose embeddings are finite but make q.k overflow float32."""
    config = preset("hf-marian", src_vocab_size=16, tgt_vocab_size=16, d_model=16, n_heads=2, d_ff=32,
                     n_encoder_layers=1, n_decoder_layers=1, max_len=16, pad_id=15,
                     notes={"generation": json.dumps({"decoder_start_token_id": 15, "eos_token_id": 0})})
    assert np.isfinite(config.mask_fill)
    params = init_params(config, seed=0, dtype=np.float32)
    params["encoder.embedding.weight"] = params["encoder.embedding.weight"] * np.float32(OVERFLOW_SCALE)
    assert np.isfinite(params["encoder.embedding.weight"]).all()
    path = tmp_path / "overflow.safetensors"
    checkpoint.save(path, config, params)
    return path


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["numpy", "torch", "jax"])
def test_an_overflow_names_the_first_non_finite_tensor(backend, tmp_path, capsys):
    if not runnable(backend):
        pytest.skip(f"{backend} is not installed")
    path = overflowing_checkpoint(tmp_path)
    assert main(["generate", str(path), "--src", "5,6,7,8", "--backend", backend]) == 2
    err = capsys.readouterr().err
    error = [line for line in err.splitlines() if "error:" in line]
    assert len(error) == 1 and "Traceback" not in err, err
    # As `rosetta check` reads a report: in forward order, where the attention weights come
    # before the sublayer's output; q.k overflows in the first layer's self-attention.
    assert "first non-finite tensor is encoder.0.self (attention weights" in error[0], error[0]
    assert "encoder.embeddings, being finite" in error[0] and "overflowed float32" in error[0], error[0]
    assert "mask_fill=-inf" not in error[0] and "--src:" not in error[0], error[0]
    assert str(path) in error[0], error[0]


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
