"""The sharded property (conformance/suite/test_sharded.py) and `rosetta check --mesh`
(conformance/check/scale/mesh.py) find the planted sharded bugs of issue 46 (`breaks.SHARDED_BREAKS`)
and name the first tensor, parameter or rank that diverges.

One child process of 4 gloo ranks (`conformance.check.scale.sharded`, the module fixture `broken`) runs
the same job under "tp", "fsdp" and "dp" on a 2x2 mesh with every break planted; each break shows
under its own plan only. The clean runs of every plan are the suite property itself (`ci`: JAX and
torch 2x2). The comparison's own checks (the Adam step rows, a missing tensor), `rosetta check
--mesh`'s verdicts and the child's timeout run without ranks: records built from the oracle.
"""

from __future__ import annotations

import os
import pickle
import time

import numpy as np
import pytest
from breaks import SHARDED_BREAKS

from conformance.check.scale import mesh as mesh_check
from conformance.check.scale import sharded
from conformance.check.scale.sharded import Job, ShardedTarget, compared, first_divergence, oracle, oracle_step, parse_mesh
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.params import init_params, param_shapes
from conformance.suite import test_sharded
from conformance.suite.test_sharded import assert_sharded_equal, sharded_configs

pytestmark = pytest.mark.xdist_group("sharded-property")  # one worker: its fixture's child is paid once

MESH = (2, 2)
PLANS = ("tp", "fsdp", "dp")  # where the breaks show
ALL_BREAKS = ",".join(SHARDED_BREAKS)


def _job() -> Job:
    config = ModelConfig(d_model=16, n_heads=4, d_ff=32, src_vocab_size=32, tgt_vocab_size=32, n_encoder_layers=1,
                         n_decoder_layers=1, max_len=16)
    rng = np.random.default_rng(0)
    src, tgt, labels = (rng.integers(1, 32, (4, n)) for n in (6, 5, 5))
    src[1, -2:] = config.pad_id  # padding, and data ranks that count different numbers of tokens
    labels[2, -3:] = config.pad_id
    return Job(config, init_params(config, seed=0), src, tgt, labels, 0.1)


JOB = _job()


@pytest.fixture(scope="module")
def expected() -> dict:
    return oracle(JOB)


@pytest.fixture(scope="module")
def right(expected) -> dict:
    """The record a correct sharded run gives: the oracle's own tensors and its Adam step."""
    return {"forward": dict(expected["forward"]), "loss": expected["loss"], "grads": dict(expected["grads"]),
            "stepped": oracle_step(JOB, expected["grads"])}


@pytest.fixture(scope="module")
def broken() -> dict:
    """Every break planted in every rank: each shows under its own plan only (the tp one needs a
    split "model", the fsdp and dp ones check the plan), and each leaves its own signature: the tp
    one diverges in the forward pass, the fsdp one only in the gradients, the dp one only on rank 1."""
    return sharded.sharded_runs("torch", "cpu", MESH, [JOB], PLANS, _plant=("breaks", "plant_sharded", ALL_BREAKS))[0]


@pytest.mark.parametrize("name", sorted(SHARDED_BREAKS))
def test_the_property_names_the_first_divergence_of_each_break(broken, name, expected):
    plan = SHARDED_BREAKS[name][-1]
    with pytest.raises(AssertionError) as caught:
        assert_sharded_equal(broken[plan], JOB, ShardedTarget("torch", "cpu", MESH, plan))
    message = str(caught.value)
    assert "replay: python -c" in message, message
    if plan == "tp":
        # The attention maps of the first self-attention come before its output in forward order:
        # 2 x H heads of width K / 2 gathered from the two "model" ranks instead of H.
        assert "first in tensor encoder.0.self ('encoder.0.self')" in message, message
        assert "shape (4, 8, 6, 6) differs from the oracle's (4, 4, 6, 6)" in message, message
    elif plan == "fsdp":
        # The forward and the reported loss are right; the first gradient compared (the output's, in
        # backward order) is half the oracle's.
        last = list(param_shapes(JOB.config))[-1]
        assert f"first in the gradient of {last} ('grad:{last}')" in message, message
    else:
        # Rank 0's record alone equals the oracle: only the ranks' comparison with each other shows it.
        first = list(param_shapes(JOB.config))[0]
        assert "first in the ranks' gathered copies" in message and f"rank 1's step:{first} differs" in message, message
        alone = {key: value for key, value in broken[plan].items() if key != "ranks"}
        assert first_divergence(compared(alone, JOB, "cpu", expected)) is None


def test_the_oracle_s_own_record_passes(right, expected):
    rows = compared(right, JOB, "cpu", expected)
    assert first_divergence(rows) is None
    assert sum(row.name.startswith("step:") for row in rows) == len(param_shapes(JOB.config))


@pytest.mark.parametrize("which", [0, -1])
def test_a_wrong_adam_step_fails_on_its_step_row(right, expected, which):
    name = list(param_shapes(JOB.config))[which]
    stepped = dict(right["stepped"])
    stepped[name] = stepped[name].copy()
    stepped[name].flat[0] += 1e-9  # far below the step itself (lr ~ 2e-3), far above the table
    first = first_divergence(compared({**right, "stepped": stepped}, JOB, "cpu", expected))
    assert first is not None and first.name == f"step:{name}", first


@pytest.mark.parametrize("part, name", [("forward", "logits"), ("grads", "decoder.layers.0.ffn.linear1.bias"),
                                        ("stepped", "encoder.layers.0.self_attn.q_proj.weight")])
def test_a_tensor_the_run_did_not_return_fails(right, expected, part, name):
    record = {**right, part: {k: v for k, v in right[part].items() if k != name}}
    assert name in right[part]
    failing = [row for row in compared(record, JOB, "cpu", expected) if not row.comparison.passed]
    assert failing and "not returned" in failing[0].comparison.describe(), failing
    assert failing[0].name.endswith(name), failing


def test_ranks_that_disagree_are_named():
    one = [{"dp": {"forward": {"logits": np.zeros(3)}, "loss": np.float64(1.0), "grads": {"w": np.ones(2)},
                   "stepped": {"w": np.ones(2)}}}]
    other = [{"dp": {**one[0]["dp"], "grads": {"w": np.array([1.0, 2.0])}}}]
    assert "ranks" not in sharded.agreed([one, one])[0]["dp"]
    named = sharded.agreed([one, one, other])[0]["dp"]["ranks"]
    assert named == "rank 2's grad:w differs from rank 0's (max |difference| 1)", named


def _check_mesh(monkeypatch, spec: str, records: dict, **kwargs) -> tuple[int, str]:
    """`run_mesh_check` on `records` as if the child had returned them (nor is torch imported here)."""
    from conformance.check import backends

    monkeypatch.setattr(backends, "availability", lambda names: {name: None for name in names})
    monkeypatch.setattr(mesh_check, "default_job", lambda data: JOB)
    monkeypatch.setattr(mesh_check, "sharded_runs", lambda *args, **kw: [records])
    lines: list[str] = []
    status = mesh_check.run_mesh_check(spec, "cpu", "torch", out=lines.append, **kwargs)
    return status, "\n".join(lines)


def test_rosetta_check_mesh_reports_the_break_and_fails(monkeypatch, broken):
    status, text = _check_mesh(monkeypatch, "data=2,model=2", {"fsdp": broken["fsdp"]}, plans=("fsdp",))
    assert status == 1, text
    assert "torch/cpu fsdp" in text and "FAILED: first diverges in the gradient of" in text, text


def test_rosetta_check_mesh_counts_refusals_and_fails_when_nothing_split_was_checked(monkeypatch, right):
    records = {"dp": right, "fsdp": right, "tp": {"refused": "no"}, "fsdp+tp": {"refused": "no"}}
    status, text = _check_mesh(monkeypatch, "data=1,model=2", records)
    assert status == 1 and "2 refused (not checked)" in text and "nothing split was checked" in text, text
    status, text = _check_mesh(monkeypatch, "data=2,model=1", records)  # refused plans asked for: exit 1
    assert status == 1 and "2 of 2 plan runs equal the oracle; 2 refused (not checked)" in text, text


def test_a_child_past_its_timeout_is_killed_with_its_group(monkeypatch, tmp_path):
    pid_file = tmp_path / "pid"
    # 10 s: the child must start Python and reach the plant before it (seconds on a loaded machine).
    monkeypatch.setattr(sharded, "TIMEOUT_S", 10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out after 10 s"):  # not subprocess.TimeoutExpired
        sharded.sharded_runs("jax", "cpu", (1, 1), [JOB], ("dp",),
                             _plant=("os", "system", f"sleep 60 & echo $! > {pid_file}; wait"))
    assert time.monotonic() - start < 60
    pid = int(pid_file.read_text())  # the child's own child, started in its session
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {pid} outlived the timed-out child")


@pytest.mark.parametrize("args, argument", [(("torch", "gpu", MESH), "device"), (("jax", "cuda", MESH), "device"),
                                            (("numpy", "cpu", MESH), "backend")])
def test_sharded_runs_refuse_a_device_or_backend_they_do_not_shard_on(args, argument):
    with pytest.raises(InputError) as caught:
        sharded.sharded_runs(*args, [JOB])
    assert caught.value.argument == argument and repr(args[0 if argument == "backend" else 1]) in str(caught.value)


@pytest.mark.parametrize("plans", [("zero3",), ("dp", "tp ")])
def test_sharded_runs_refuse_an_unknown_plan(plans):
    with pytest.raises(InputError) as caught:
        sharded.sharded_runs("torch", "cpu", MESH, [JOB], plans)
    assert caught.value.argument == "plans" and "dp, fsdp, tp, fsdp+tp" in str(caught.value)


def test_a_failed_child_is_not_started_again_for_each_plan(monkeypatch):
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("the child failed")

    monkeypatch.setattr(test_sharded, "_RUNS", {})
    monkeypatch.setattr(test_sharded, "drawn_jobs", lambda *args, **kwargs: [JOB])
    monkeypatch.setattr(test_sharded, "sharded_runs", failing)
    for plan in ("dp", "tp"):
        with pytest.raises(RuntimeError, match="the child failed"):
            test_sharded.runs_of(ShardedTarget("torch", "cpu", MESH, plan), bounded=False)
    assert len(calls) == 1


def test_a_failure_prints_the_case_and_how_to_replay_it(right, expected):
    name = "encoder.layers.0.ffn.linear1.bias"
    stepped = {**right["stepped"], name: right["stepped"][name] + 1e-6}
    job = Job(**{**JOB.__dict__, "source": "training case seed 7, scale 1.0"})
    with pytest.raises(AssertionError) as caught:
        assert_sharded_equal({**right, "stepped": stepped}, job, ShardedTarget("torch", "cpu", MESH, "fsdp"))
    message = str(caught.value)
    assert "training case seed 7" in message and job.config.to_json() in message, message
    path = message.split("pickle.load(open('")[1].split("'")[0]
    replayed = pickle.loads(open(path, "rb").read())
    os.unlink(path)
    assert replayed.config == job.config and np.array_equal(replayed.src_ids, job.src_ids), message
    assert "sharded_runs('torch', 'cpu', (2, 2), [" in message and "('fsdp',)" in message, message


def test_relative_position_bias_is_drawn_only_where_data_divides_its_buckets():
    from hypothesis import HealthCheck, given, settings

    seen = []

    @settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(config=sharded_configs(3, 1))
    def check(config):
        if config.position == "relative":
            seen.append(config.relative_buckets)
        assert config.position != "relative" or config.relative_buckets % 3 == 0, config.summary()

    check()
    assert not seen or all(n % 3 == 0 for n in seen)


@pytest.mark.parametrize("text, sizes", [("data=2,model=2", (2, 2)), ("model=4", (1, 4)), ("data=8", (8, 1)),
                                         (" data = 4 , model=2", (4, 2))])
def test_a_mesh_is_parsed(text, sizes):
    assert parse_mesh(text) == sizes


@pytest.mark.parametrize("text", ["2x2", "data=0,model=2", "data=2,batch=2", "data=2,data=2", "data=-1", "", "data=\u00b2",
                                  "model=\u0663"])
def test_a_bad_mesh_is_a_typed_error(text):
    with pytest.raises(InputError) as caught:
        parse_mesh(text)
    assert caught.value.argument == "--mesh" and "data=D,model=M" in str(caught.value) and repr(text) in str(caught.value)


def _conformance_args(*argv):
    import argparse

    from conformance.cli import conformance_suite

    parser = argparse.ArgumentParser()
    conformance_suite.add_arguments(parser)
    return conformance_suite, parser.parse_args(list(argv))


def test_rosetta_conformance_mesh_runs_the_sharded_property_on_that_mesh():
    cli, args = _conformance_args("--mesh", "model=2,data=2", "--backends", "torch")
    argv = cli.suite_argv(args)
    assert argv[argv.index("--pyargs") + 1] == "conformance.suite.test_sharded"
    assert argv[argv.index("--mesh") + 1] == "data=2,model=2"
    cli, args = _conformance_args()
    assert cli.suite_argv(args)[cli.suite_argv(args).index("--pyargs") + 1] == "conformance.suite"
    assert "--mesh" not in cli.suite_argv(args)


def test_rosetta_conformance_refuses_a_bad_mesh():
    cli, args = _conformance_args("--mesh", "2x2")
    with pytest.raises(InputError) as caught:
        cli.run(args)
    assert caught.value.argument == "--mesh"


@pytest.mark.parametrize("extra, named", [(["--stream"], "--stream"),
                                          (["--json", "r.json"], "--json"), (["--feed", "own"], "--feed"),
                                          (["--dtypes", "float32"], "--dtypes")])
def test_rosetta_check_mesh_refuses_what_it_does_not_do(extra, named, capsys):
    from conformance.cli import main

    assert main(["check", "--mesh", "data=2,model=1", *extra]) == 2
    err = capsys.readouterr().err
    assert "--mesh" in err and named in err, err


def test_rosetta_check_mesh_parses_the_mesh_before_running_anything(capsys):
    from conformance.cli import main

    assert main(["check", "--mesh", "2x2"]) == 2
    assert "data=D,model=M" in capsys.readouterr().err
