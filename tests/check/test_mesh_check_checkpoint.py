"""`rosetta check CHECKPOINT --mesh data=D,model=M`: a given checkpoint sharded, every plan asked for.

The sharded child is replaced by records built from the oracle (what a correct run returns), so
that what is checked here is the command: which model the job holds, which plans it asks for, and
the exit status, 1 when a plan asked for was refused (asked for and not checked) as for a check that
checked nothing. The sharded runs themselves are the suite's property (tests/scale/test_sharded_property.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance import checkpoint, init_params, preset
from conformance.check import backends
from conformance.check.scale import mesh as mesh_check
from conformance.check.scale.sharded import oracle, oracle_step
from conformance.cli import main

# A vocabulary of 16, which a "model" of 2 divides: JAX's tp splits the embedding's vocabulary axis.
CONFIG = preset("default", src_vocab_size=16, tgt_vocab_size=16, n_encoder_layers=1, n_decoder_layers=1)


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "v16.safetensors"
    checkpoint.save(path, CONFIG, init_params(CONFIG, seed=1))
    return path


def fake_child(monkeypatch, refused=()):
    """The sharded child replaced by the oracle's own record for each plan (a plan in `refused`
    refused as the backend would); returns the jobs it was handed."""
    handed = []

    def runs(backend, device, mesh, jobs, plans, **kwargs):
        handed.extend(jobs)
        expected = oracle(jobs[0])
        right = {"forward": expected["forward"], "loss": expected["loss"], "grads": expected["grads"],
                 "stepped": oracle_step(jobs[0], expected["grads"])}
        return [{plan: {"refused": "the mesh cannot place it"} if plan in refused else right for plan in plans}]

    monkeypatch.setattr(backends, "availability", lambda names: {name: None for name in names})
    monkeypatch.setattr(mesh_check, "sharded_runs", runs)
    return handed


def test_the_given_checkpoint_is_what_runs_sharded(saved, monkeypatch, capsys):
    handed = fake_child(monkeypatch)
    status = main(["check", str(saved), "--mesh", "data=2,model=2", "--backends", "torch", "--devices", "cpu"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert handed and handed[0].config == CONFIG, handed
    stored = checkpoint.load(saved)[1]
    assert all(np.array_equal(handed[0].params[k], stored[k]) for k in stored)
    assert handed[0].src_ids.shape[0] % 2 == 0  # rows repeated to a multiple of "data"
    assert f"rosetta check --mesh data=2,model=2: {saved}, {CONFIG.summary()}" in out
    assert "4 of 4 plan runs equal the oracle" in out


def test_a_plan_asked_for_and_refused_fails_the_check(saved, monkeypatch, capsys):
    fake_child(monkeypatch, refused=("tp", "fsdp+tp"))
    status = main(["check", str(saved), "--mesh", "data=2,model=2", "--backends", "torch", "--devices", "cpu"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "2 of 2 plan runs equal the oracle; 2 refused (not checked)" in out
    assert "2 plan runs asked for could not run on data=2,model=2" in out and "(exit 1)" in out
    # Asked only for the plans that run: every plan asked for ran.
    status = main(["check", str(saved), "--mesh", "data=2,model=2", "--backends", "torch", "--devices", "cpu",
                   "--plans", "dp,fsdp"])
    out = capsys.readouterr().out
    assert status == 0 and "2 of 2 plan runs equal the oracle" in out and "refused" not in out, out


@pytest.mark.parametrize("argv, named", [(["--mesh", "data=2", "--plans", "dp,zero3"], "'zero3'"),
                                         (["--plans", "dp"], "give --mesh too")])
def test_plans_are_checked_by_name(argv, named, capsys):
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert "--plans" in err and named in err, err
