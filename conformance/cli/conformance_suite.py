"""`rosetta conformance [--profile ci|thorough|scale]`: run the cross-backend property suite."""

from __future__ import annotations

import argparse

HELP = "Run the conformance suite (pytest -p conformance.suite.pytest_plugin --pyargs conformance.suite) against every installed backend."
PROFILES = ["ci", "thorough", "scale"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="ci", choices=PROFILES,
                        help="hypothesis profile: ci (bounded, derandomized), thorough (thousands of examples) "
                             "or scale (full-size models: d_model 512-1024, 6+6 layers, vocab 32000, lengths "
                             "128-1024; prints an estimate of its time first)")
    parser.add_argument("--backends", help="comma-separated subset of numpy,torch,jax")
    parser.add_argument("--devices", help="comma-separated subset of cpu,cuda,gpu")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="further arguments passed to pytest (after --)")


def run(args: argparse.Namespace) -> int:
    import pytest

    from conformance.check import backends
    from conformance.core.errors import InputError

    # Refused here, in one line, rather than by pytest as a usage error (exit 4) after collection.
    for option, parse in (("--backends", backends.requested_backends), ("--devices", backends.requested_devices)):
        value = getattr(args, option[2:])
        if value is not None:
            try:
                parse(value)
            except ValueError as exc:
                raise InputError(option, str(exc)) from None

    # The plugin is named explicitly so that its options, profiles and header exist from any
    # working directory (a conftest inside the package is read too late outside the repository).
    argv = ["-p", "conformance.suite.pytest_plugin", "--pyargs", "conformance.suite", "--hypothesis-profile", args.profile,
            "-p", "no:cacheprovider"]
    if args.backends:
        argv += ["--backends", args.backends]
    if args.devices:
        argv += ["--devices", args.devices]
    extra = [a for a in args.pytest_args if a != "--"]
    return int(pytest.main(argv + extra))
