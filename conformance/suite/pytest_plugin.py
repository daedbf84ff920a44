"""The conformance suite's pytest plugin: which backends, devices and dtypes run, and the header.

    pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite                     from any directory
    pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite --backends torch,jax (or ROSETTA_BACKENDS)
    pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite --devices cpu       (or ROSETTA_DEVICES)
    pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite --hypothesis-profile thorough
    pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite.test_sharded --mesh data=2,model=2

`rosetta conformance` passes `-p conformance.suite.pytest_plugin` itself, and so does this repository's
pyproject.toml (`addopts`); `conformance/suite/conftest.py` loads it for a run that reaches the suite
without either. Options must exist before pytest parses the command line, which a conftest
inside the package cannot guarantee (pytest reads it early only when `conformance` is a path
under the current directory): hence an explicit plugin.

It is deliberately not a `pytest11` entry point, which would load it into every pytest run of
every project installed next to it: `--backends`/`--devices` would be taken there and the `ci`
hypothesis profile would become that project's default.

A backend that is asked for but not installed, and a device that is deselected or absent,
appear as skipped tests with the reason: never silently absent.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
from pathlib import Path

# Tiny models: a second intra-op thread only adds synchronisation, and on a loaded 2-core machine
# it made a torch forward pass up to 100x slower (4 ms -> 0.5 s, measured). Set before any
# framework is imported; a user's own setting wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.params import PARAM_DTYPE_NAMES
from conformance.suite import run_report
from conformance.suite.adapter_targets import adapter_report, with_adapter_skips
from conformance.suite.profiles import load_default_profile  # registers the profiles before hypothesis reads --hypothesis-profile

# Every dtype a parameter may have; each target runs those its backend supports.
DTYPES = PARAM_DTYPE_NAMES
ORACLE_TARGET = ("numpy", "cpu", "float64")  # what every target is compared with
SUITE = Path(__file__).resolve().parent  # the properties are the test_*.py files beside this one


def pytest_addoption(parser):
    group = parser.getgroup("rosetta conformance")
    group.addoption("--backends", default=None, help="comma-separated backends to test (numpy,torch,jax)")
    group.addoption("--devices", default=None, help="comma-separated device kinds to test (cpu,cuda,gpu)")
    group.addoption("--mesh", default=None, help="the (data, model) mesh of the sharded property, data=D,model=M "
                    "(default: 2x2 per backend under ci, issue 46's three meshes under the other profiles)")


def pytest_configure(config):
    config.addinivalue_line("markers", "dtypes(*names): run the property only at these dtypes")
    config.addinivalue_line("markers", "devices(*kinds): run the property only on these device kinds (cuda, gpu)")
    # pytest-xdist registers it too; without xdist (a user's `rosetta conformance`) the suite's
    # group mark must not warn as unknown.
    config.addinivalue_line("markers", "xdist_group(name): pytest-xdist --dist loadgroup runs a group on one worker")
    config.addinivalue_line("markers", "ci_compiling_dtypes(*names): under the ci profile, a compiling backend "
                            "runs the property only at these dtypes (compile cost)")
    load_default_profile(config)
    from conformance.suite import runner

    runner.PROGRESS = full_size_progress(config)
    try:
        if config.getoption("--backends", None):
            os.environ["ROSETTA_BACKENDS"] = config.getoption("--backends")
            for name in backends.requested_backends():
                if backends.is_adapter(name):  # its probe build: a failing factory is a usage error, not INTERNALERROR
                    backends.adapter_of(name).offers()
        if config.getoption("--devices", None):
            os.environ["ROSETTA_DEVICES"] = config.getoption("--devices")
        backends.requested_devices()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    if config.getoption("--mesh", None):
        from conformance.check.scale.sharded import parse_mesh
        from conformance.core.errors import InputError

        try:
            parse_mesh(config.getoption("--mesh"))
        except InputError as exc:
            raise pytest.UsageError(str(exc)) from None


def full_size_progress(config):
    """A `runner.PROGRESS` callback: under a full-size profile (`scale`), one line per model run,
    with the time since the session started, written past pytest's output capture."""
    import time

    from conformance.suite.profiles import full_size

    started = time.perf_counter()

    def report(target, case, seconds):
        if not full_size() or case.config.d_model < 512:
            return
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            return
        elapsed = int(time.perf_counter() - started)
        c = case.config
        kind = "seeded" if case.trained is None else ("offset" if case.trained.offset else
                                                      "outliers" if case.trained.outliers else "sharp")
        line = (f"[scale {elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}] {target.label:<20} "
                f"d_model {c.d_model}, {c.n_encoder_layers}+{c.n_decoder_layers} layers, vocab {c.tgt_vocab_size}, "
                f"src {case.src_ids.shape[1]} tgt {case.tgt_ids.shape[1]}, {kind}: {seconds:.1f} s")
        if capture is None:
            reporter.write_line(line)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    return report


def in_suite(path) -> bool:
    return Path(str(path)).resolve().parent == SUITE


def header_lines() -> list[str]:
    from hypothesis import settings

    lines = [f"rosetta conformance: hypothesis profile {settings._current_profile!r}"]
    for name, reason in backends.availability().items():
        if reason:
            lines.append(f"  {name}: SKIPPED ({reason})")
            continue
        skipped = {d: backends.device_skip_reason(name, d) for d in backends.device_kinds(name)}
        running = [d for d, why in skipped.items() if why is None]
        not_running = "".join(f"; {d} skipped ({why})" for d, why in skipped.items() if why)
        with backends.full_precision(name):
            precision = backends.precision_settings(name)
        settings_text = ", ".join(f"{k}={v}" for k, v in precision.items()) or "n/a"
        lines.append(f"  {name}: {backends.version(name)}; devices {running}{not_running}; "
                     f"precision during runs: {settings_text}")
        if backends.kind(name) == "jax" and "gpu" in running:
            lines.append(f"  jax/gpu runs: {jax_gpu_determinism()}")
    return lines


def pytest_report_collectionfinish(config, items):
    """The header, once the suite's properties are collected: a run of other tests in the same
    session (this repository's own) does not pay for importing every framework to print it."""
    if config.get_verbosity() < 0 or config.getoption("no_header", False):
        return []
    if not any(in_suite(item.path) for item in items):
        return []
    return header_lines()


def all_targets(dtypes=DTYPES, ci_compiling_dtypes=None, devices=None) -> list:
    """Every (backend, device, dtype) as a pytest param, with a skip mark and reason if it cannot run.
    `ci_compiling_dtypes`: under the `ci` profile, the dtypes a compiling backend runs (all if None).
    `devices`: only these device kinds (a GPU-only property: `cuda`), present or not."""
    from hypothesis import settings

    available = backends.availability()
    bounded = ci_compiling_dtypes is not None and settings._current_profile == "ci"
    params = []
    for name in backends.requested_backends():
        supported = dtypes if available[name] else backends.dtypes(name)
        for device in backends.device_kinds(name):
            if devices is not None and device not in devices:
                continue
            reason = available[name] and f"{name}: {available[name]}"
            reason = reason or backends.device_skip_reason(name, device)
            for dtype in dtypes:
                if dtype not in supported or (name, device, dtype) == ORACLE_TARGET:
                    continue  # a dtype the backend cannot run, or the oracle compared with itself
                target = Target(name, device, dtype)
                skip = reason  # this dtype's own: a ci bound on one dtype must not skip the next
                if not skip and bounded and backends.compiles(name) and dtype not in ci_compiling_dtypes:
                    skip = (f"{target.label}: under ci a compiling backend runs this property at "
                            f"{', '.join(ci_compiling_dtypes)} (compile cost; bfloat16 traces float16's code); "
                            "test_forward and the thorough profile run every dtype")
                marks = [pytest.mark.skip(reason=skip)] if skip else []
                params.append(pytest.param(target, id=target.label, marks=marks))
    return params


def sharded_targets(mesh: str | None) -> list:
    """The sharded property's params: torch and jax (those asked for), each device kind, each
    mesh (`mesh`, "data=D,model=M", else `sharded.default_meshes` for the profile) and each plan,
    with a skip mark where the backend or device cannot run, or (under `ci` without `mesh`) the
    plan is not among `sharded.CI_PLANS`. A mesh of more devices than a GPU
    machine has fails in the child, naming both counts."""
    from hypothesis import settings

    from conformance.check.scale.sharded import CI_PLANS, PLANS, ShardedTarget, default_meshes, parse_mesh

    bounded = settings._current_profile == "ci" and not mesh
    available = backends.availability()
    params = []
    for name in backends.requested_backends():
        if name not in ("torch", "jax"):
            continue
        for device in backends.device_kinds(name):
            reason = available[name] and f"{name}: {available[name]}"
            reason = reason or backends.device_skip_reason(name, device)
            meshes = (parse_mesh(mesh),) if mesh else default_meshes(name, device, settings._current_profile)
            for shape in meshes:
                for plan in PLANS:
                    target = ShardedTarget(name, device, shape, plan)
                    skip = reason
                    if not skip and bounded and plan not in CI_PLANS[name]:
                        skip = (f"{target.label}: under ci without --mesh, {name} runs {', '.join(CI_PLANS[name])} "
                                "only (compile cost); --mesh and the thorough profile run every plan")
                    params.append(pytest.param(target, id=target.label,
                                               marks=[pytest.mark.skip(reason=skip)] if skip else []))
    return params


def target_pairs(dtypes=("float32", "float64")) -> list:
    """Pairs of runnable targets that should agree with each other: same dtype, different backend
    or device (e.g. torch/cpu vs jax/cpu, torch/cuda vs torch/cpu)."""
    flat = [p for p in all_targets(dtypes)]
    params = []
    for a, b in itertools.combinations(flat, 2):
        ta, tb = a.values[0], b.values[0]
        if ta.dtype != tb.dtype or (ta.backend, ta.device) == (tb.backend, tb.device):
            continue
        marks = list(a.marks) + list(b.marks)
        params.append(pytest.param((ta, tb), id=f"{ta.label}~{tb.label}", marks=marks[:1]))
    return params


def pytest_generate_tests(metafunc):
    if not in_suite(metafunc.definition.path):
        return  # another test's own `target` argument is none of our business
    marker = metafunc.definition.get_closest_marker("dtypes")
    dtypes = tuple(marker.args) if marker else DTYPES
    bounded = metafunc.definition.get_closest_marker("ci_compiling_dtypes")
    only = metafunc.definition.get_closest_marker("devices")
    name = metafunc.definition.originalname
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", with_adapter_skips(
            all_targets(dtypes, tuple(bounded.args) if bounded else None, tuple(only.args) if only else None), name))
    if "target_pair" in metafunc.fixturenames:
        metafunc.parametrize("target_pair", with_adapter_skips(target_pairs(dtypes), name))
    if "sharded_target" in metafunc.fixturenames:
        metafunc.parametrize("sharded_target", sharded_targets(metafunc.config.getoption("--mesh", None)))


COVERAGE_FILE = "test_coverage.py"  # checks what the properties ran: collected last


# Drawn examples per property a compiling backend runs under `ci`, after the covering examples
# (which hold every switch value on their own): each drawn example is a new (config, shape), so a
# new compile per program, and under `ci` the drawn ones cost 40 of a JAX target's 45 compiles.
CI_COMPILING_EXAMPLES = 3
SUITE_GROUP = "rosetta-conformance-suite"  # pytest-xdist (--dist loadgroup): the suite on one worker


def target_group(item) -> tuple:
    """The (device, dtype) a suite item runs at: the suite runs group after group, so that a
    compiling backend's executables of one dtype are reused by every property before the next
    dtype's are compiled (property by property, the four dtypes' executables outgrew JAX's bound of
    live executables, which dropped them all and compiled them again for the next property)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    target = params.get("target")
    pair = params.get("target_pair")
    if isinstance(pair, tuple):
        target = pair[-1]
    if not isinstance(target, Target):
        return ("",)
    return (target.device, target.dtype)


def pytest_collection_modifyitems(session, config, items):
    """The suite's properties grouped by (device, dtype), each group in file order, and the
    coverage check (`test_coverage.py`) after every property, whatever the order of the files.
    Under pytest-xdist the suite's items form one group (`--dist loadgroup` runs them on one
    worker), since the coverage check reads what the properties ran in its own process."""
    suite = [item for item in items if in_suite(item.path)]
    last = [item for item in suite if item.path.name == COVERAGE_FILE]
    groups: dict[tuple, list] = {}
    for item in suite:
        if item not in last:
            groups.setdefault(target_group(item), []).append(item)
    ordered = [item for group in groups.values() for item in group] + last
    for item in ordered:
        item.add_marker(pytest.mark.xdist_group(SUITE_GROUP))
    position = iter(ordered)
    items[:] = [next(position) if in_suite(item.path) else item for item in items]


@pytest.fixture(autouse=True)
def _one_dtype_of_executables_at_a_time(request):
    """When the suite moves to another (device, dtype), the executables a compiling backend kept
    for the last one are released: no property of the new group reuses them, and they would fill
    the bound of live executables in the middle of the new group."""
    item = request.node
    if in_suite(item.path):
        group = target_group(item)
        if _LAST_GROUP and _LAST_GROUP[0] != group:
            backends.release_compiled()
        _LAST_GROUP[:] = [group]
    yield


_LAST_GROUP: list = []


def drawn_examples(item) -> int | None:
    """How many examples hypothesis draws for this item under `ci` when its backend compiles
    (`CI_COMPILING_EXAMPLES`), or None: the property's own setting."""
    from hypothesis import settings

    params = getattr(getattr(item, "callspec", None), "params", {})
    targets = [params.get("target")] if "target" in params else list(params.get("target_pair") or ())
    if settings._current_profile != "ci" or not any(isinstance(t, Target) and backends.compiles(t.backend)
                                                   for t in targets):
        return None
    return CI_COMPILING_EXAMPLES


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """While a property runs, `covering.RECORDER` notes the switch values of every case it runs.
    Under `ci`, a compiling backend's item draws at most `CI_COMPILING_EXAMPLES` examples after the
    covering ones (hypothesis reads a test's settings when it is called: set for this item, then put back)."""
    from conformance.suite.covering import RECORDER

    if not in_suite(item.path) or item.path.name == COVERAGE_FILE:
        return (yield)
    RECORDER.property, RECORDER.item = item.originalname, item.nodeid
    seconds_before = dict(_runner_timings())
    test, bound = item.obj, drawn_examples(item)
    chosen = getattr(test, "_hypothesis_internal_use_settings", None)
    if bound is not None and chosen is not None and chosen.max_examples > bound:
        from hypothesis import settings

        test._hypothesis_internal_use_settings = settings(chosen, max_examples=bound)  # this item only
    # A property that may check nothing on a run (an SDPA kernel that refuses every example) says
    # so by a skip after its examples: its module's `watch_examples` wraps the run.
    watch = getattr(item.module, "watch_examples", None)
    acknowledged_before = dict(_acknowledged())
    counted = run_report.ExampleCounter(test)  # how many examples ran, and how many were rejected
    found: list[str] = []
    try:
        names = () if watch is None else inspect.signature(watch).parameters
        arguments = {name: item.funcargs[name] for name in names if name in item.funcargs}
        watching = watch(**arguments) if watch is not None and len(arguments) == len(names) else contextlib.nullcontext()
        with watching, counted:
            try:
                return (yield)
            except BaseException as error:  # an adapter's acknowledged differences are not failures
                from conformance.suite.differences import settle

                rest, found[:] = settle(error, target_of(item) or "", item.originalname)
                if rest is None:
                    return None
                if rest is error:
                    raise
                raise rest from None
    finally:
        RECORDER.property = RECORDER.item = None
        if chosen is not None:
            test._hypothesis_internal_use_settings = chosen
        report_to_controller(item, seconds_before, counted.counts, acknowledged_before, found)


def _runner_timings() -> dict[str, float]:
    import sys

    runner = sys.modules.get("conformance.suite.runner")  # imported only once a property ran
    return runner.TIMINGS if runner is not None else {}


def _acknowledged() -> dict:
    import sys

    differences = sys.modules.get("conformance.suite.differences")
    return differences.ACKNOWLEDGED if differences is not None else {}


def report_to_controller(item, seconds_before: dict[str, float], counts: dict[str, int] | None = None,
                         acknowledged_before: dict | None = None, found: list[str] = ()) -> None:
    """What an item's run learnt, on its call report (`user_properties`), which pytest-xdist sends
    from the worker that ran it to the controller that prints the summary: the seconds per target,
    the examples it ran and rejected, and for an adapter's target the tensors its model never
    returned, the differences it acknowledged (with their examples) and the first-diverging
    tensors of the differences it did not."""
    seconds = {label: total - seconds_before.get(label, 0.0) for label, total in _runner_timings().items()}
    item.user_properties.append((SECONDS_KEY, {k: v for k, v in seconds.items() if v > 0}))
    label = target_of(item)
    if counts is not None and label:
        item.user_properties.append((EXAMPLES_KEY, (item.originalname, label, dict(counts))))
    target = getattr(getattr(item, "callspec", None), "params", {}).get("target")
    if label and isinstance(target, Target) and backends.is_adapter(target.backend):
        missing = backends.adapter_of(target.backend).not_exposed.get(label, set())
        item.user_properties.append((NOT_EXPOSED_KEY, (label, sorted(missing))))
        new = {key: dict(entry) for key, entry in _acknowledged().items() if entry != (acknowledged_before or {}).get(key)}
        if new:
            item.user_properties.append((ACKNOWLEDGED_KEY, list(new.items())))
        if found:
            item.user_properties.append((FOUND_KEY, (label, item.originalname, list(found))))


def pytest_runtest_logreport(report):
    """Counts, skip reasons, seconds and unexposed tensors per target, read from what each item
    carries on its reports (`user_properties`): in the process that ran it, and under pytest-xdist
    on the controller, where the summary is printed and the exit status decided."""
    from conformance.suite.covering import RECORDER

    if report.when == "call" and report.passed:
        RECORDER.passed.add(report.nodeid)
    carried = dict(getattr(report, "user_properties", ()) or ())
    prop, label = carried.get(PROPERTY_KEY), carried.get(TARGET_KEY)
    if prop and (report.when == "call" or report.outcome != "passed"):
        RAN.append(report.nodeid)
        if report.skipped:
            SKIPPED_BECAUSE.setdefault(label or prop, set()).add(skip_reason(report))
    if label and (report.when == "call" or report.outcome != "passed"):  # one count per item
        counts = OUTCOMES.setdefault(label, {})
        counts[report.outcome] = counts.get(report.outcome, 0) + 1
    if report.when == "call":
        for name, seconds in (carried.get(SECONDS_KEY) or {}).items():
            SECONDS[name] = SECONDS.get(name, 0.0) + seconds
        if NOT_EXPOSED_KEY in carried:
            target_label, missing = carried[NOT_EXPOSED_KEY]
            NOT_EXPOSED.setdefault(target_label, set()).update(missing)
        if EXAMPLES_KEY in carried and not report.skipped:  # a skipped item ran no example it counts
            name, target_label, counts = carried[EXAMPLES_KEY]
            EXAMPLES[name, target_label] = counts
        for key, entry in carried.get(ACKNOWLEDGED_KEY, ()):
            ACKNOWLEDGED[tuple(key)] = entry
        if FOUND_KEY in carried:
            target_label, name, tensors = carried[FOUND_KEY]
            FOUND.setdefault((target_label, name), []).extend(tensors)


def skip_reason(report) -> str:
    """The reason of a skipped report, without pytest's "Skipped: " prefix."""
    text = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return text.removeprefix("Skipped: ")


def nothing_checked() -> bool:
    """Whether this process ran properties and none of them checked a target: every one was
    skipped (a device deselected or absent, a backend missing). A run with no property at all
    (another project's tests, `--collect-only`) is not such a run."""
    return bool(RAN) and not any(counts.get("passed") or counts.get("failed") for counts in OUTCOMES.values())


def nothing_checked_lines() -> list[str]:
    """Why nothing was checked: what was asked for, and each target (or property without one) with
    the reasons its items were skipped."""
    asked = (f"asked for: backends {','.join(backends.requested_backends())}; "
             f"devices {','.join(backends.requested_devices() or ['every present one'])}")
    lines = ["nothing was checked: every property was skipped on every target asked for, so this run "
             "proves nothing (exit 1, as `rosetta check` when nothing was checked)", asked]
    for name, reasons in sorted(SKIPPED_BECAUSE.items()):
        why = "; ".join(sorted(reasons))[:400]
        # A property with no target among those asked for is named itself (pytest's empty parameter set).
        lines.append(f"  {name}: {why}" if "/" in name else f"  {name}: no target asked for can run it ({why})")
    return lines


def pytest_sessionfinish(session, exitstatus):
    """A run that checked no target fails (exit 1): a CI job on a runner whose GPU is missing, or
    asked for devices its backends do not have, must not go green on skips alone."""
    if exitstatus == pytest.ExitCode.OK and nothing_checked():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_finish(session):
    """Under a full-size profile (`scale`), an estimate of the run's time before it starts. Here,
    after collection, and not in `rosetta conformance` before pytest starts: importing the
    properties before the profile is loaded ran them with hypothesis' defaults (100 examples)."""
    from conformance.suite.profiles import full_size

    if not full_size() or not any(in_suite(item.path) for item in session.items):
        return
    from conformance.suite.estimate import scale_estimate

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    line = scale_estimate()
    if reporter is not None:
        reporter.write_line(line)
    else:
        print(line, flush=True)


def target_of(item) -> str | None:
    """The target label of a suite item ("a~b" for a pair), or None for an item without one."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    # A property with no target among those asked for (the SDPA kernels under --backends numpy) is
    # parametrized with pytest's NOTSET marker and skipped: it has no target to report under.
    if isinstance(params.get("target"), Target):
        return params["target"].label
    if isinstance(params.get("target_pair"), tuple):
        return "~".join(t.label for t in params["target_pair"])
    if params.get("sharded_target") is not None and hasattr(params["sharded_target"], "label"):
        return params["sharded_target"].label
    return None


# What a suite item carries on its reports (`user_properties`, which pytest-xdist sends from the
# worker to the controller): its property, its target, and after its call the seconds per target
# and an adapter's unexposed tensors.
PROPERTY_KEY, TARGET_KEY = "rosetta_property", "rosetta_target"
SECONDS_KEY, NOT_EXPOSED_KEY = "rosetta_seconds", "rosetta_not_exposed"
EXAMPLES_KEY, ACKNOWLEDGED_KEY, FOUND_KEY = "rosetta_examples", "rosetta_acknowledged", "rosetta_found"

# target label -> {"passed": n, "failed": n, "skipped": n}, from the suite's items as they report.
OUTCOMES: dict[str, dict[str, int]] = {}
# The property items that reported, and the reasons of those skipped, by target label (or
# property, for one without targets).
RAN: list[str] = []
SKIPPED_BECAUSE: dict[str, set[str]] = {}
SECONDS: dict[str, float] = {}  # target label -> seconds of model build, compile and run
NOT_EXPOSED: dict[str, set[str]] = {}  # an adapter's target label -> tensors its model never returned
EXAMPLES: dict[tuple[str, str], dict[str, int]] = {}  # (property, target label) -> {"run": n, "rejected": n}
ACKNOWLEDGED: dict[tuple, dict] = {}  # (target label, property, index) -> an adapter's acknowledged difference
FOUND: dict[tuple[str, str], list[str]] = {}  # (adapter target label, property) -> first-diverging tensors


def pytest_itemcollected(item):
    if in_suite(item.path) and item.path.name != COVERAGE_FILE:
        item.user_properties.append((PROPERTY_KEY, item.originalname))
        if target_of(item):
            item.user_properties.append((TARGET_KEY, target_of(item)))


def results_table(timings: dict[str, float]) -> list[str]:
    """One table per device, a row per target: properties passed, failed and skipped, and the
    target's seconds; pairs of targets in a table of their own. The oracle (numpy/cpu/float64),
    which every target is compared with and no property runs as a target, has its row too: its
    seconds, no counts."""
    by_device: dict[str, list[str]] = {}
    oracle = "/".join(ORACLE_TARGET)
    for label in sorted(set(OUTCOMES) | ({oracle} & set(timings))):
        counts = OUTCOMES.get(label, {})
        device = "pairs" if "~" in label else label.rsplit("/", 2)[1]  # an adapter's path may hold a "/"
        row = (f"  {label + ' (the oracle)':<40} {'-':>6} {'-':>6} {'-':>7}" if label == oracle and label not in OUTCOMES
               else f"  {label:<40} {counts.get('passed', 0):6} {counts.get('failed', 0):6} {counts.get('skipped', 0):7}")
        by_device.setdefault(device, []).append(row + (f" {timings[label]:9.1f} s" if label in timings else ""))
    lines = []
    for device, rows in by_device.items():
        lines += [f"  {'target (' + device + ')':<40} {'passed':>6} {'failed':>6} {'skipped':>7} {'time':>11}", *rows]
    return lines


def jax_gpu_determinism() -> str:
    """Whether JAX GPU runs are deterministic: XLA's GPU kernels (scatter, reductions by atomics)
    may add in another order on every run unless `--xla_gpu_deterministic_ops=true` is in
    $XLA_FLAGS; test_determinism.py checks bitwise repeats either way."""
    flags = os.environ.get("XLA_FLAGS", "")
    on = "--xla_gpu_deterministic_ops=true" in flags
    return ("deterministic (XLA_FLAGS has --xla_gpu_deterministic_ops=true)" if on else
            "not forced deterministic (XLA_FLAGS lacks --xla_gpu_deterministic_ops=true): atomics may reorder sums "
            "between runs; test_determinism.py reports whether they did")


def pytest_terminal_summary(terminalreporter):
    if nothing_checked():
        terminalreporter.section("rosetta conformance: nothing was checked", red=True, bold=True)
        for line in nothing_checked_lines():
            terminalreporter.write_line(line)
    if not SECONDS:  # no property ran a model
        return
    if OUTCOMES:
        terminalreporter.section("rosetta conformance: results per target")
        for line in results_table(SECONDS):
            terminalreporter.write_line(line)
    if "gpu" in (backends.requested_devices() or ["gpu"]) and any("jax/gpu" in label for label in OUTCOMES):
        terminalreporter.write_line(f"  jax/gpu: {jax_gpu_determinism()}")
    if EXAMPLES:
        terminalreporter.section("rosetta conformance: examples per property and target (ran / rejected)")
        for line in run_report.examples_table(EXAMPLES):
            terminalreporter.write_line(line)
    adapter_lines = adapter_report(SKIPPED_BECAUSE, NOT_EXPOSED)
    if adapter_lines:
        terminalreporter.section("rosetta conformance: what the adapters do not offer (not counted as passed)")
        for line in adapter_lines:
            terminalreporter.write_line(line)
    if ACKNOWLEDGED:
        from conformance.suite.differences import acknowledged_lines

        terminalreporter.section("rosetta conformance: acknowledged differences (not failures), each with its "
                                 "smallest example")
        for line in acknowledged_lines(ACKNOWLEDGED):
            terminalreporter.write_line(line)
    if FOUND:
        terminalreporter.section("rosetta conformance: differences found on adapter targets (first-diverging tensors)")
        for (label, name), tensors in sorted(FOUND.items()):
            terminalreporter.write_line(f"  {label} {name}: {', '.join(dict.fromkeys(tensors))}")
    terminalreporter.section("rosetta conformance: time per target (model build, compile and run)")
    for label, seconds in sorted(SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  {label:<28} {seconds:7.1f} s")
    for line in backends.compile_report():  # this process's compiles: none on an xdist controller
        terminalreporter.write_line(f"  {line}")
