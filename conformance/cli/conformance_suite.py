"""`rosetta conformance [--profile ci|thorough|scale] [--mesh data=D,model=M]`: run the cross-backend property suite.

`--mesh` runs the sharded property alone (conformance/suite/test_sharded.py) on that mesh: every
plan of impl_jax.shard (forced host devices on the CPU) and impl_torch.parallelize (spawned gloo
ranks on the CPU, NCCL on CUDA) against the oracle. Without it the whole suite runs, the sharded
property on the profile's meshes (one per backend under `ci`).

Exit status: pytest's (0 every property passed, 1 a property failed), and 1 also when nothing was
checked: every property skipped on every target asked for (a device absent or deselected). Under
pytest-xdist (`-- -n N`) too: what each item reports reaches the controller
(`pytest_plugin.report_to_controller`), and the suite runs on one worker (`--dist loadgroup`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

HELP = "Run the conformance suite (pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite) against every installed backend."
PROFILES = ["ci", "thorough", "scale"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="ci", choices=PROFILES,
                        help="hypothesis profile: ci (bounded, derandomized), thorough (thousands of examples) "
                             "or scale (full-size models: d_model 512-1024, 6+6 layers, vocab 32000, lengths "
                             "128-1024; prints an estimate of its time first)")
    parser.add_argument("--backends", help="comma-separated subset of numpy,torch,jax; torch-compiled "
                        "(impl_torch under torch.compile) runs only when named; your own model through an adapter: "
                        "MODULE:FACTORY (my_adapter.py:build, my_pkg.adapter:build) or an installed "
                        "rosetta.backends entry point's name (docs/own-backend.md)")
    parser.add_argument("--devices", help="comma-separated subset of cpu,cuda,gpu")
    parser.add_argument("--mesh", metavar="data=D,model=M",
                        help="run only the sharded property (sharded equals unsharded, every plan) on this "
                             "(data, model) mesh; a CPU run needs D x M forced host devices or gloo ranks, a GPU run "
                             "D x M GPUs")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="further arguments passed to pytest (after --)")


def run(args: argparse.Namespace) -> int:
    import pytest

    from conformance.check import backends
    from conformance.core.errors import InputError

    # Refused here, in one line, rather than by pytest as a usage error (exit 4) after collection.
    # An adapter's model is built once here too (what it offers): a factory that fails, or switches
    # no config can have, are one line, not pytest's INTERNALERROR from the header.
    for option, parse in (("--backends", backends.requested_backends), ("--devices", backends.requested_devices)):
        value = getattr(args, option[2:])
        if value is not None:
            try:
                names = parse(value)
                for name in names if option == "--backends" else ():
                    if backends.is_adapter(name):
                        backends.adapter_of(name).offers()
            except ValueError as exc:
                raise InputError(option, str(exc)) from None

    argv = suite_argv(args)
    extra = [a for a in args.pytest_args if a != "--"]
    if xdist_workers(extra) and not any(a == "--dist" or a.startswith("--dist=") or a.startswith("-d") for a in extra):
        # The suite's items form one xdist group: its coverage check reads what the properties ran
        # in their worker's process. Spread over workers (--dist load) that check would fail.
        extra += ["--dist", "loadgroup"]
    with tempfile.TemporaryDirectory(prefix="rosetta-hypothesis-") as scratch, hypothesis_storage(scratch):
        return int(pytest.main(argv + extra))


def suite_argv(args: argparse.Namespace) -> list[str]:
    """pytest's arguments for `args` (before any the user passes after --); an InputError for a
    --mesh that is not data=D,model=M."""
    from conformance.check.scale.sharded import parse_mesh

    # The plugin is named explicitly so that its options, profiles and header exist from any
    # working directory (a conftest inside the package is read too late outside the repository).
    suite = "conformance.suite"
    mesh = []
    if getattr(args, "mesh", None):
        data, model = parse_mesh(args.mesh)
        suite, mesh = "conformance.suite.test_sharded", ["--mesh", f"data={data},model={model}"]
    argv = ["-p", "conformance.suite.pytest_plugin", "--pyargs", suite, "--hypothesis-profile", args.profile,
            "-p", "no:cacheprovider", *mesh]
    if args.backends:
        argv += ["--backends", args.backends]
    if args.devices:
        argv += ["--devices", args.devices]
    return argv


def xdist_workers(argv: list[str]) -> bool:
    """Whether pytest's arguments ask pytest-xdist for workers (`-n N`, `-nN`, `--numprocesses`)."""
    return any(a == "-n" or (a.startswith("-n") and a[2:3].isalnum()) or a.startswith("--numprocesses")
               for a in argv)


@contextlib.contextmanager
def hypothesis_storage(directory: str):
    """Hypothesis' cache (`.hypothesis/`: the constants it collects, its example database) in
    `directory` for one run, instead of the user's working directory, unless they chose a place
    ($HYPOTHESIS_STORAGE_DIRECTORY). A failure prints its reproduction blob (every profile has
    print_blob), so nothing a user needs is lost with it."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    # Read when hypothesis first stores something; where it is imported already (rosetta called
    # in-process), set there too. Not imported here: pytest must import it first, to rewrite it.
    configuration = sys.modules.get("hypothesis.configuration")
    os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = directory
    if configuration is not None:
        configuration.set_hypothesis_home_dir(directory)
    try:
        yield
    finally:
        del os.environ["HYPOTHESIS_STORAGE_DIRECTORY"]
        if "hypothesis.configuration" in sys.modules:  # read again from the environment on the next use
            sys.modules["hypothesis.configuration"].set_hypothesis_home_dir(None)
