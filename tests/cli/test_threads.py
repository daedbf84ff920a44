"""Threads for a tiny torch model (conformance/cli/threads.py, issue 45): `rosetta generate` and every
torch kind of backend in `rosetta check` run a small model on one intra-op thread (a second one
only adds synchronisation), unless the user chose a count; a large model keeps torch's default."""

from __future__ import annotations

import pytest

from conformance import preset
from conformance.check import backends
from conformance.cli import main


def runnable(backend: str) -> bool:
    return not backends.availability([backend])[backend]


@pytest.fixture
def torch_threads():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def test_a_tiny_model_runs_on_one_thread_unless_the_user_chose(torch_threads, monkeypatch):
    from conformance.cli import threads

    torch = torch_threads
    config, _, _ = __import__("conformance.check.defaults", fromlist=["default_model"]).default_model()
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    assert threads.fit_torch_threads(config) == 1 and torch.get_num_threads() == 1
    # The user's own count (an environment variable) is left as it is.
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.fit_torch_threads(config) is None and torch.get_num_threads() == 2
    # A model past the threshold keeps torch's default.
    monkeypatch.delenv("OMP_NUM_THREADS")
    big = preset("paper", d_model=512, d_ff=2048, n_heads=8, n_encoder_layers=6, n_decoder_layers=6,
                 src_vocab_size=8000, tgt_vocab_size=8000)
    assert threads.parameter_count(big) > threads.SMALL_MODEL_PARAMETERS
    assert threads.fit_torch_threads(big) is None and torch.get_num_threads() == 2


def test_rosetta_generate_on_torch_uses_one_thread_for_the_toy_model(torch_threads, monkeypatch, capsys):
    from conformance.cli import threads

    torch = torch_threads
    for name in threads.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torch.set_num_threads(2)
    assert main(["generate", "--src", "3 1 4", "--backend", "torch"]) == 0
    assert capsys.readouterr().out.strip() == "4 1 3"
    assert torch.get_num_threads() == 1


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
