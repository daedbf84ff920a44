"""`rosetta check` within a memory budget: the plan, the one-at-a-time path and chunked compare.

The one-at-a-time path (the oracle's tensors written to disk and read back one by one) must give
the report the all-at-once path gives, to the last digit, on a few-MB checkpoint; the planner must
pick all at once exactly when its estimated peak fits the budget; and compare() must give the same
result in chunks as on the whole tensor. Nothing here is timed: the peak is measured by hand on a
300 MB checkpoint (docs/check.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from breaks import BREAKS, broken_copy
from thorough import thorough_only
from conformance import ModelConfig, checkpoint, init_params
from conformance.check import backends, compare as compare_module
from conformance.check.compare import compare
from conformance.check.defaults import default_model
from conformance.check.plan import (
    ALL_AT_ONCE,
    ONE_AT_A_TIME,
    OracleTensors,
    available_memory,
    estimate,
    parse_bytes,
    plan_check,
    tensor_shapes,
)
from conformance.check.report import default_targets, fixed_batch, run_check
from conformance.check.tolerances import Tolerance
from conformance.cli import main
from conformance.core.errors import InputError
from conformance.core.output import forward_order, tensors_of
from conformance.core.params import OUTPUT_BLOCK

# A few-MB checkpoint (vocab 3000, d_model 64: 0.8 M parameters, 3 MB in float32) with padded
# target queries and a -inf fill, so that the fixed batch has NaN rows to compare as well.
CONFIG = ModelConfig(
    src_vocab_size=3000, tgt_vocab_size=3000, d_model=64, n_heads=4, d_ff=96, n_encoder_layers=2,
    n_decoder_layers=2, max_len=16, mask_fill=float("-inf"), tgt_pad_mask="queries",
)


def plan_for(mode: str):
    return dataclasses.replace(plan_check(estimate(CONFIG, {}, [], 3, 16, 16), [], budget=2**40), mode=mode)


def comparable(report) -> dict:
    """The report as JSON without the wall times, which differ between any two runs."""
    data = report.to_json()
    for target in data["targets"]:
        target.pop("seconds")
    return data


def test_one_at_a_time_gives_the_report_all_at_once_gives(tmp_path):
    path = tmp_path / "small.safetensors"
    checkpoint.save(path, CONFIG, {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=1).items()})
    assert 2e6 < path.stat().st_size < 5e6
    config, params = checkpoint.load(path)
    targets, skipped = default_targets(["numpy", "torch", "jax"], ["float32"])
    name = "mask fill changed"  # a failing column, with NaN mismatches
    backend, edits, patches = BREAKS[name]
    broken = broken_copy(name, backend, edits, patches)
    targets.append(backends.Target(broken, "cpu", "float64"))
    try:
        src, tgt = fixed_batch(config, length=12)
        impl_jax = pytest.importorskip("impl_jax")
        reports, live = {}, {}
        for mode in (ALL_AT_ONCE, ONE_AT_A_TIME):
            reports[mode] = run_check(config, params, str(path), targets, skipped, src, tgt, plan_for(mode))
            live[mode] = impl_jax.compile_stats()["cached"]
    finally:
        backends.unregister_backend(broken)
    together, one_by_one = reports[ALL_AT_ONCE], reports[ONE_AT_A_TIME]
    assert not together.passed and together.first_failure()[1] == f"{broken}/cpu/float64"
    assert any(cell.comparison.nan_mismatches for cell in together.cells.values() if cell.comparison)
    assert one_by_one.to_text() == together.to_text()
    assert comparable(one_by_one) == comparable(together)
    # When memory is short, JAX's executables (and the buffers they hold) go with its model.
    assert live[ONE_AT_A_TIME] == 0 < live[ALL_AT_ONCE]


def test_one_at_a_time_holds_the_oracle_on_disk_and_removes_it(tmp_path):
    value = np.arange(12.0).reshape(3, 4)
    with OracleTensors(ONE_AT_A_TIME) as held:
        held.put("logits", value)
        spilled = held._held["logits"]
        assert isinstance(spilled, Path) and spilled.exists()
        assert np.array_equal(held["logits"], value) and held["logits"] is not value
        # A row is read alone from the file, in pieces, with the tensor's own dtype.
        for row in range(value.shape[0]):
            pieces = list(held.row_pieces("logits", row, size=3))  # 4 elements a row: pieces of 3 and 1
            assert [p.size for p in pieces] == [3, 1] and all(p.dtype == value.dtype for p in pieces)
            assert np.array_equal(np.concatenate(pieces), value[row])
        with pytest.raises(RuntimeError, match="cannot read row 3"):
            next(held.row_pieces("logits", value.shape[0]))
        with spilled.open("r+b") as f:  # a file cut short: refused, not compared in part
            f.truncate(spilled.stat().st_size - 8)
        with pytest.raises(RuntimeError, match="ended inside row 2"):
            list(held.row_pieces("logits", 2, size=3))
    assert not spilled.parent.exists()
    with OracleTensors(ALL_AT_ONCE) as held:
        held.put("logits", value)
        assert held["logits"] is value
        assert np.array_equal(np.concatenate(list(held.row_pieces("logits", 1, size=3))), value[1])
    with pytest.raises(ValueError, match="unknown memory plan mode"):
        OracleTensors("sometimes")


def test_the_estimate_knows_every_tensor_shape_a_model_returns():
    src, tgt = fixed_batch(CONFIG, length=10)
    src = src[:, :9]  # a source and a target of different lengths
    import impl_numpy

    got = tensors_of(impl_numpy.Model(CONFIG, init_params(CONFIG, seed=0))(src, tgt))
    assert tensor_shapes(CONFIG, 3, 9, 10) == {name: value.shape for name, value in got.items()}


def largest_cast_at_use(config: ModelConfig, params) -> int:
    """Elements of the largest array the NumPy model casts in one forward pass of float32
    parameters in float64: what a model really widens at once, for the estimate to count."""
    import impl_numpy
    from impl_numpy import model as numpy_model

    sizes = []
    original = numpy_model.cast
    numpy_model.cast = lambda w, dtype: sizes.append(w.size) or original(w, dtype)
    try:
        impl_numpy.Model(config, params, "float64", param_dtype="float32")(*fixed_batch(config))
    finally:
        numpy_model.cast = original
    return max(sizes)


def test_the_estimate_counts_what_a_model_widens_at_once():
    """Embeddings are cast by the looked-up rows and the output projection OUTPUT_BLOCK columns at
    a time, so at a real vocabulary the largest widened piece is one block, not the (D, V) weight."""
    big = dataclasses.replace(CONFIG, src_vocab_size=3 * OUTPUT_BLOCK, tgt_vocab_size=3 * OUTPUT_BLOCK)
    for config in (CONFIG, big):
        params = {k: v.astype(np.float32) for k, v in init_params(config, seed=0).items()}
        needed = estimate(config, params, ["float64"], 3, 16, 16)
        assert needed.widened["float64"] == 8 * largest_cast_at_use(config, params)
    assert needed.widened["float64"] == 8 * big.d_model * OUTPUT_BLOCK < 8 * big.d_model * big.tgt_vocab_size


def test_the_plan_holds_the_oracle_only_when_that_fits_the_budget():
    params = {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=0).items()}
    needed = estimate(CONFIG, params, ["float32", "float64"], 3, 16, 16)
    peaks = {mode: needed.peak(mode, ["float32", "float64"]) for mode in (ALL_AT_ONCE, ONE_AT_A_TIME)}
    # Holding the oracle's tensors costs exactly their float64 size on top of the one-at-a-time peak.
    assert peaks[ALL_AT_ONCE] - peaks[ONE_AT_A_TIME] == needed.outputs["float64"] > 0
    assert needed.source_params == sum(v.nbytes for v in params.values())
    # A float64 model of float32 parameters keeps them in float32 and widens one at a time at use.
    assert needed.model_params["float64"] == needed.model_params["float32"]
    assert needed.widened == {"float32": 0, "float64": 8 * largest_cast_at_use(CONFIG, params)}
    wide = estimate(CONFIG, {k: v.astype(np.float64) for k, v in params.items()}, ["float32", "float64"], 3, 16, 16)
    assert wide.model_params["float64"] == 2 * wide.model_params["float32"] and wide.widened == {"float32": 0, "float64": 0}
    roomy = plan_check(needed, ["float32", "float64"], budget=peaks[ALL_AT_ONCE])
    tight = plan_check(needed, ["float32", "float64"], budget=peaks[ALL_AT_ONCE] - 1)
    assert (roomy.mode, tight.mode) == (ALL_AT_ONCE, ONE_AT_A_TIME)
    assert "exceeds the budget" not in tight.describe()
    hopeless = plan_check(needed, ["float32", "float64"], budget=peaks[ONE_AT_A_TIME] - 1)
    assert hopeless.mode == ONE_AT_A_TIME and "exceeds the budget even one at a time" in hopeless.describe()


def test_the_estimate_counts_one_call_s_larger_half_and_the_parameters_as_read_where_they_are_held():
    params = {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=0).items()}
    shapes = tensor_shapes(CONFIG, 3, 16, 16)
    decoder = sum(int(np.prod(shape)) for name, shape in shapes.items() if not name.startswith("encoder"))
    held = estimate(CONFIG, params, ["float32"], 3, 16, 16)
    reread = estimate(CONFIG, params, ["float32"], 3, 16, 16, reread=True)
    # JAX's compiled decoder returns one row's tensors (and logits) together; NumPy and torch hold
    # at most the logits and their sum with the bias: the larger of the two.
    logits = int(np.prod(shapes["logits"]))
    assert held.call_held == {d: max(2 * logits, decoder // 3) * size for d, size in (("float32", 4), ("float64", 8))}
    # Held for the whole run, the parameters as read count once on top of every step; read again
    # per model, only while a model is built.
    steps = max(held.step("float32"), held.step("float64"))
    assert held.peak(ONE_AT_A_TIME, ["float32"]) == held.source_params + steps
    assert reread.peak(ONE_AT_A_TIME, ["float32"]) == max(reread.step("float32"), reread.step("float64"))
    assert reread.step("float64") == max(reread.source_params + 2 * reread.model_params["float64"],
                                         held.step("float64"))
    assert reread.peak(ONE_AT_A_TIME, ["float32"]) < held.peak(ONE_AT_A_TIME, ["float32"])


def test_the_cli_plans_for_a_checkpoint_read_again_per_model(tmp_path, capsys):
    path = tmp_path / "small.safetensors"
    checkpoint.save(path, CONFIG, {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=0).items()})
    config, params = checkpoint.load(path)
    src, tgt = fixed_batch(config)
    expected = estimate(config, params, ["float32"], *src.shape, tgt.shape[1], reread=True)
    main(["check", str(path), "--backends", "numpy", "--dtypes", "float32", "--max-memory", "1T"])
    stated = capsys.readouterr().err
    assert f"{expected.peak(ONE_AT_A_TIME, ['float32']) / 1e6:.1f} MB one at a time" in stated, stated


def test_the_default_budget_is_the_kernels_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  1000 kB\nMemAvailable:    2048 kB\n")
    assert available_memory(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\n")
    assert available_memory(meminfo) is None
    assert available_memory(tmp_path / "absent") is None


@pytest.mark.parametrize("text, expected", [("900M", 900 * 2**20), ("2G", 2 * 2**30), ("1.5g", 3 * 2**29),
                                            ("4096", 4096), ("64KiB", 64 * 1024), ("1GB", 2**30)])
def test_memory_sizes_are_read_with_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "12X", "G", "-1G", "0", "nan", "inf"])
def test_a_bad_memory_size_is_an_input_error(text):
    with pytest.raises(InputError, match="--max-memory"):
        parse_bytes(text)


def test_the_command_refuses_a_bad_length_or_memory_size(capsys):
    longest = default_model()[0].max_len
    assert main(["check", "--length", str(longest + 1)]) == 2
    assert f"length: must be between 1 and the config's max_len {longest}, got {longest + 1}" in capsys.readouterr().err
    assert main(["check", "--max-memory", "lots"]) == 2
    assert "--max-memory: expected a size" in capsys.readouterr().err


def test_the_command_says_which_plan_ran_and_reports_the_same(tmp_path, capsys):
    out = {}
    for budget in ("64G", "1K"):
        assert main(["check", "--backends", "numpy", "--max-memory", budget, "--length", "10",
                     "--json", str(tmp_path / f"{budget}.json")]) == 0
        captured = capsys.readouterr()
        text = "\n".join(line for line in captured.out.splitlines() if not line.startswith("wrote "))  # names the file
        out[budget] = text, json.loads((tmp_path / f"{budget}.json").read_text())
        for target in out[budget][1]["targets"]:
            target.pop("seconds")
        mode = ALL_AT_ONCE if budget == "64G" else ONE_AT_A_TIME
        assert f"memory plan: {mode};" in captured.err
    assert out["64G"] == out["1K"]


def random_comparison(rng: np.random.Generator, max_dim: int):
    """(actual, expected, tol): a random tensor of up to three axes of 1..`max_dim`, close but not
    equal, with NaN and infinities on either side, in three cases of ten rounded so that several
    elements tie for the largest error, and a random tolerance."""
    shape = tuple(rng.integers(1, max_dim + 1, size=rng.integers(1, 4)))
    expected = rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3)
    actual = expected + rng.standard_normal(shape) * 10.0 ** rng.integers(-8, 0)
    for array in (actual, expected):
        for special in (np.nan, np.inf, -np.inf):
            array[rng.random(shape) < 0.05] = special
    if rng.random() < 0.3:
        actual, expected = np.round(actual, 1), np.round(expected, 1)
    tol = Tolerance(atol=float(10.0 ** rng.integers(-6, -1)), rtol=float(rng.choice([0.0, 1e-3])))
    return actual, expected, tol


def test_compare_in_chunks_is_compare_on_the_whole_tensor(monkeypatch):
    rng = np.random.default_rng(7)
    for _ in range(200):
        actual, expected, tol = random_comparison(rng, max_dim=5)  # ties across chunk boundaries too
        with np.errstate(all="ignore"):
            monkeypatch.setattr(compare_module, "CHUNK", 1 << 20)
            whole = compare(actual.astype(np.float32), expected, tol)
            monkeypatch.setattr(compare_module, "CHUNK", 7)
            chunked = compare(actual.astype(np.float32), expected, tol)
        assert repr(chunked) == repr(whole)


def test_compare_row_by_row_is_compare_on_the_whole_tensor(monkeypatch):
    """`Pieces`: a tensor compared one batch row at a time, as JAX targets are, gives compare()'s
    result on the whole tensor: the maxima, the first violation, the NaN mismatches, the values."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        actual, expected, tol = random_comparison(rng, max_dim=4)  # ties across rows too
        monkeypatch.setattr(compare_module, "CHUNK", int(rng.choice([5, 1 << 20])))
        with np.errstate(all="ignore"):
            whole = compare(actual.astype(np.float32), expected, tol)
            rows = compare_module.Pieces(expected.shape, compare_module.tensor_scale(expected), tol)
            for row in range(expected.shape[0]):
                rows.add(actual.astype(np.float32)[row], expected[row])
            assert repr(rows.result()) == repr(whole)


@thorough_only("JAX compiles a program per row shape (79 s loaded); test_one_at_a_time_gives_the_report_all_at_once_gives "
               "runs the row-by-row plan in CI")
def test_jax_targets_run_row_by_row_with_the_report_the_batch_gives(tmp_path, monkeypatch):
    """One row per call gives JAX's tensors the same bits as the batch, so the report is the same
    (CONFIG's -inf fill and padded queries give NaN rows to compare too)."""
    from conformance.check import report as report_module

    targets = [backends.Target("jax", "cpu", dtype) for dtype in ("float32", "float64")]
    params = {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=0).items()}
    src, tgt = fixed_batch(CONFIG, length=16)
    reports = {}
    for rows in (("jax",), ()):
        monkeypatch.setattr(report_module, "ROW_BY_ROW", rows)
        reports[rows] = comparable(run_check(CONFIG, params, "x", targets, src_ids=src, tgt_ids=tgt,
                                             plan=plan_for(ONE_AT_A_TIME)))
    assert reports[("jax",)] == reports[()]
    # The float64 target was built from a widened copy: the caller's parameters are untouched.
    assert params.keys() == init_params(CONFIG, seed=0).keys() and all(v.dtype == np.float32 for v in params.values())
    cells = [t["results"][target.label] for t in reports[()]["tensors"] for target in targets]
    assert len(cells) == 2 * len(forward_order(CONFIG)) and all("max_abs" in cell for cell in cells)


def test_the_memory_minimising_xla_schedule_gives_the_same_report(tmp_path):
    """`rosetta check` asks XLA:CPU for its memory-minimising schedule (read when JAX starts, so
    each run is its own process); a schedule only orders operations, so JAX's report is the same,
    bit for bit, as with a user's own setting of the flag, which the command keeps."""
    import os
    import subprocess
    import sys

    from conformance.cli.check import XLA_SCHEDULE_FLAG

    path = tmp_path / "small.safetensors"
    checkpoint.save(path, CONFIG, {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=2).items()})
    reports = {}
    ours = os.environ.get("XLA_FLAGS", "")  # the test run's compile settings (tests/conftest.py), in both runs
    for schedule in ("false", "true"):
        env = dict(os.environ, XLA_FLAGS=f"{ours} {XLA_SCHEDULE_FLAG}={schedule}".strip())
        if schedule == "false":
            env["XLA_FLAGS"] = ours  # the command's own choice
        out = tmp_path / f"{schedule}.json"
        run = subprocess.run([sys.executable, "-m", "conformance.cli", "check", str(path), "--backends", "jax",
                              "--dtypes", "float32,float64", "--json", str(out)],
                             env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        reports[schedule] = json.loads(out.read_text())
        for target in reports[schedule]["targets"]:
            target.pop("seconds")
    assert reports["false"] == reports["true"] and reports["false"]["passed"]


def test_the_xla_schedule_is_set_for_jax_only_and_put_back(monkeypatch):
    from conformance.cli.check import XLA_SCHEDULE_FLAG, memory_minimising_xla_schedule

    ours = f"{XLA_SCHEDULE_FLAG}=false"
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("ROSETTA_BACKENDS", raising=False)
    with memory_minimising_xla_schedule(None):  # every backend, JAX included
        assert os.environ["XLA_FLAGS"] == ours
    assert "XLA_FLAGS" not in os.environ
    with memory_minimising_xla_schedule("numpy,torch"):
        assert "XLA_FLAGS" not in os.environ
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    with memory_minimising_xla_schedule("jax"):
        assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {ours}"
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.setenv("XLA_FLAGS", f"{XLA_SCHEDULE_FLAG}=true")  # the user's own choice stays
    with memory_minimising_xla_schedule("jax"):
        assert os.environ["XLA_FLAGS"] == f"{XLA_SCHEDULE_FLAG}=true"


def test_each_model_stores_what_its_backend_can_and_a_half_precision_checkpoint_is_checked():
    """float64 and float32 models keep a narrower checkpoint's values where the widening is exact
    and the backend can hold them; NumPy holds no float16, so the oracle of a float16 checkpoint
    stores its widened values, and the check runs."""
    from conformance.check.plan import stored_dtype

    assert stored_dtype("float32", "float64") == "float32"
    assert stored_dtype("float64", "float32") == "float32"  # narrowing: stored as computed
    assert stored_dtype("float16", "float64") == "float64"  # not every backend stores float16
    assert stored_dtype("float16", "float32", ("float32", "float16")) == "float16"
    assert stored_dtype(None, "float64") == "float64"
    params = {k: v.astype(np.float16) for k, v in init_params(CONFIG, seed=3).items()}
    targets, skipped = default_targets(["numpy", "torch"], ["float32", "float64"])
    src, tgt = fixed_batch(CONFIG, length=8)
    report = run_check(CONFIG, params, "float16 parameters", targets, skipped, src, tgt, plan_for(ONE_AT_A_TIME))
    assert report.checked and not report.errors, report.errors
    assert report.passed, report.to_text()


def test_freed_memory_is_handed_back_only_where_the_check_is_large(monkeypatch):
    """A full collection and malloc_trim between models cost about a second in a process that has
    imported torch and JAX; a check whose estimated peak is below RELEASE_ABOVE skips them, a
    larger one and any one-at-a-time plan make them."""
    from conformance.check import plan as plan_module

    collected = []
    monkeypatch.setattr(plan_module.gc, "collect", lambda *a: collected.append(1) or 0)
    small = plan_module.Plan(mode=plan_module.ALL_AT_ONCE, budget=None, budget_source="unknown",
                             peaks={plan_module.ALL_AT_ONCE: 10 * 2**20, plan_module.ONE_AT_A_TIME: 5 * 2**20})
    plan_module.releaser(small)()
    assert collected == []
    large = dataclasses.replace(small, peaks={plan_module.ALL_AT_ONCE: plan_module.RELEASE_ABOVE,
                                              plan_module.ONE_AT_A_TIME: 2**20})
    plan_module.releaser(large)()
    short = dataclasses.replace(small, mode=plan_module.ONE_AT_A_TIME)
    plan_module.releaser(short)()
    assert collected == [1, 1]
