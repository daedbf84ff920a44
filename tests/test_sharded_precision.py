"""FSDP2 mixed precision against the float64 oracle (issue 46, docs/tolerances.md "Sharded mixed
precision"): `impl_torch.parallelize(..., "fsdp", mp_policy=MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32))` on 2 gloo ranks is within the table's bfloat16 row on the
logits, the loss, every gathered gradient and one Adam step, and adds no error of its own beyond
the unsharded model with the same split (`Model(config, params, torch.bfloat16,
param_dtype=torch.float32)`). A planted precision bug, the gradients reduced in bfloat16 and
averaged over the ranks instead of summed, fails that check, naming the gradient.

The runs are benchmarks/sharded_precision.py's (`run_torch_fsdp`, `run_torch_unsharded`), on its
smallest model, in one subprocess (this file run as a script: the gloo ranks are forked from a
process that has not imported JAX); it writes the errors as JSON for the tests below.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("torch-parallel")

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SIZE = (16, 1)  # d_model, layers a side: benchmarks/sharded_precision.py's smallest
# What sharding may add to the unsharded bf16/f32 model's error: each gradient's partial sums are
# rounded to bfloat16 on every rank before the float32 reduction, one rounding more than the
# unsharded backward's (at most doubling the error), plus the float32 row for the reduction itself.
ADDED_FACTOR = 2.0


def _errors(record: dict, job, expected: dict) -> dict:
    """{"logits", "loss", "grad:NAME", "step:NAME": the table's measure against the oracle}."""
    from conformance.check.sharded import max_error, oracle_step

    found = {"logits": max_error(record["logits"], expected["forward"]["logits"]),
             "loss": max_error(record["loss"], expected["loss"])}
    found.update({f"grad:{name}": max_error(record["grads"][name], g) for name, g in expected["grads"].items()})
    stepped = oracle_step(job, record["grads"])
    found.update({f"step:{name}": max_error(record["stepped"][name], w) for name, w in stepped.items()})
    return found


def main(out_path: str) -> None:
    sys.path[:0] = [str(ROOT), str(BENCH)]
    import sharded_precision as bench

    from conformance.check.sharded import oracle

    job = bench.job_of(*SIZE)
    expected = oracle(job)
    found = {"params": len(expected["grads"])}
    for reduction in bench.REDUCTIONS:
        record = bench.run_torch_fsdp([job], reduction)[0]
        found[reduction] = {"errors": _errors(record, job, expected), "logits dtype": record["logits dtype"],
                            "grad dtypes": record["grad dtypes"]}
    found["unsharded"] = {"errors": _errors(bench.run_torch_unsharded(job, mixed=True), job, expected)}
    Path(out_path).write_text(json.dumps(found))


# -- The tests ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "runs.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        run = subprocess.run([sys.executable, __file__, str(out)], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0 and out.exists(), (f"the FSDP2 runs failed (exit {run.returncode}):\n"
                                                      f"{run.stderr[-6000:]}")
        return json.loads(out.read_text())


def precision_failures(errors: dict, unsharded: dict) -> list[str]:
    """What a bf16/f32 FSDP2 run gets wrong, worst first: a tensor beyond the table's bfloat16 row
    against the oracle, or a kind of tensor (logits, loss, gradients, stepped parameters) whose
    worst error exceeds what sharding may add to the unsharded bf16/f32 model's."""
    from conformance.check.tolerances import tolerance

    row, reduction = tolerance("bfloat16", "cpu").atol, tolerance("float32", "cpu").atol
    failures = [(e, f"{name}: {e:.3g} against the oracle, beyond the bfloat16 row {row:g}")
                for name, e in errors.items() if not e <= row]
    for kind in ("logits", "loss", "grad:", "step:"):
        names = [name for name in errors if name == kind or (kind.endswith(":") and name.startswith(kind))]
        worst = max(names, key=errors.get)
        bound = ADDED_FACTOR * max(unsharded[name] for name in names) + reduction
        if not errors[worst] <= bound:
            failures.append((errors[worst], f"{worst}: {errors[worst]:.3g} against the oracle, beyond {bound:.3g} ("
                             f"{ADDED_FACTOR:g}x the unsharded bf16/f32 model's worst + {reduction:g})"))
    return [message for _, message in sorted(failures, reverse=True)]


def test_fsdp_bf16_params_f32_reduce_is_within_the_bfloat16_row(runs):
    run = runs["reduce"]
    # The policy really computed in bfloat16 and reduced into float32 gradients (else this proves nothing).
    assert run["logits dtype"] == "torch.bfloat16" and run["grad dtypes"] == ["torch.float32"], run
    # Every parameter's gradient and step was compared.
    assert sum(name.startswith("grad:") for name in run["errors"]) == runs["params"]
    assert sum(name.startswith("step:") for name in run["errors"]) == runs["params"]
    failures = precision_failures(run["errors"], runs["unsharded"]["errors"])
    assert not failures, "FSDP2 bf16/f32 against the float64 oracle:\n" + "\n".join(failures)


def test_a_bfloat16_reduction_averaged_instead_of_summed_is_caught(runs):
    failures = precision_failures(runs["bf16-averaged"]["errors"], runs["unsharded"]["errors"])
    assert failures and failures[0].startswith("grad:"), failures


if __name__ == "__main__":
    main(sys.argv[1])
