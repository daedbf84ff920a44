"""The sharded property (conformance/suite/test_sharded.py) and `rosetta check --mesh`
(conformance/check/mesh.py) find the two planted sharded bugs of issue 46 (`breaks.SHARDED_BREAKS`)
and name the first tensor or parameter that diverges; on the clean backend the same runs pass.

Each run is a child process of 4 gloo ranks (`conformance.check.sharded`), one per module fixture:
the clean and the broken ranks run the same job under "tp" and "fsdp" on a 2x2 mesh. The clean
JAX and torch runs of every plan are the suite property itself (`ci`: 2x2 per backend).
"""

from __future__ import annotations

import numpy as np
import pytest
from breaks import SHARDED_BREAKS

from conformance.check.sharded import Job, ShardedTarget, parse_mesh, sharded_runs
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.params import init_params, param_shapes
from conformance.suite.test_sharded import assert_sharded_equal

pytestmark = pytest.mark.xdist_group("sharded-property")  # one worker: its fixtures' spawns are paid once

MESH = (2, 2)
PLANS = ("tp", "fsdp")  # where the two breaks show
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
def clean() -> dict:
    return sharded_runs("torch", "cpu", MESH, [JOB], PLANS)[0]


@pytest.fixture(scope="module")
def broken() -> dict:
    """Both breaks planted in every rank: each shows under its own plan only (the tp one needs a
    split "model", the fsdp one is planted under fsdp), and each leaves its own signature: the tp
    one diverges in the forward pass, the fsdp one only in the gradients."""
    return sharded_runs("torch", "cpu", MESH, [JOB], PLANS, plant=("breaks", "plant_sharded", ALL_BREAKS))[0]


@pytest.mark.parametrize("plan", PLANS)
def test_the_property_passes_on_the_clean_backend(clean, plan):
    assert_sharded_equal(clean[plan], JOB, ShardedTarget("torch", "cpu", MESH, plan))


@pytest.mark.parametrize("name", sorted(SHARDED_BREAKS))
def test_the_property_names_the_first_divergence_of_each_break(broken, name):
    plan = SHARDED_BREAKS[name][-1]
    with pytest.raises(AssertionError) as caught:
        assert_sharded_equal(broken[plan], JOB, ShardedTarget("torch", "cpu", MESH, plan))
    message = str(caught.value)
    if plan == "tp":
        # The attention maps of the first self-attention come before its output in forward order:
        # 2 x H heads of width K / 2 gathered from the two "model" ranks instead of H.
        assert "first in tensor encoder.0.self ('encoder.0.self')" in message, message
        assert "shape (4, 8, 6, 6) differs from the oracle's (4, 4, 6, 6)" in message, message
    else:
        # The forward and the reported loss are right; the first gradient compared (the output's, in
        # backward order) is half the oracle's.
        last = list(param_shapes(JOB.config))[-1]
        assert f"first in the gradient of {last} ('grad:{last}')" in message, message


def test_rosetta_check_mesh_reports_the_break_and_fails():
    from conformance.check.mesh import run_mesh_check

    lines: list[str] = []
    status = run_mesh_check("data=2,model=1", "cpu", "torch", plans=("fsdp",),
                            plant=("breaks", "plant_sharded", "fsdp divides the loss by the data ranks as well"),
                            out=lines.append)
    text = "\n".join(lines)
    assert status == 1, text
    assert "torch/cpu fsdp" in text and "FAILED: first diverges in the gradient of" in text, text


@pytest.mark.parametrize("text, sizes", [("data=2,model=2", (2, 2)), ("model=4", (1, 4)), ("data=8", (8, 1)),
                                         (" data = 4 , model=2", (4, 2))])
def test_a_mesh_is_parsed(text, sizes):
    assert parse_mesh(text) == sizes


@pytest.mark.parametrize("text", ["2x2", "data=0,model=2", "data=2,batch=2", "data=2,data=2", "data=-1", ""])
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


@pytest.mark.parametrize("extra, named", [(["some.safetensors"], "CHECKPOINT"), (["--stream"], "--stream"),
                                          (["--json", "r.json"], "--json")])
def test_rosetta_check_mesh_refuses_what_it_does_not_do(extra, named, capsys):
    from conformance.cli import main

    assert main(["check", "--mesh", "data=2,model=1", *extra]) == 2
    err = capsys.readouterr().err
    assert "--mesh" in err and named in err, err


def test_rosetta_check_mesh_parses_the_mesh_before_running_anything(capsys):
    from conformance.cli import main

    assert main(["check", "--mesh", "2x2"]) == 2
    assert "data=D,model=M" in capsys.readouterr().err
