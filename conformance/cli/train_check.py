"""`rosetta train-check [CHECKPOINT] --steps N`: N training steps in every backend, compared step
by step with the float64 NumPy run (docs/training.md)."""

from __future__ import annotations

import argparse
import io
import sys

HELP = ("Train every installed backend for N steps (the paper's Adam) from the same weights on the same batches; "
        "per step print the loss and the largest parameter difference against the float64 NumPy run, and name "
        "the first parameter whose gradient leaves tolerance, in backward order.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="a rosetta checkpoint (default: the built-in default model)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    parser.add_argument("--backends", help="comma-separated subset of numpy,torch,jax (default: every installed one; or $ROSETTA_BACKENDS)")
    parser.add_argument("--devices", help="comma-separated subset of cpu,cuda,gpu (default: every device present; or $ROSETTA_DEVICES)")
    parser.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes to train in (default: float32,float64)")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="ε of the loss (default: the paper's 0.1)")
    parser.add_argument("--warmup", type=int, default=4000, help="warmup steps of the paper's schedule (default: 4000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the divergence from the reference against the step")


def check_arguments(args: argparse.Namespace) -> None:
    """Every argument that can be checked without the frameworks, before they are imported (seconds)."""
    from conformance.core.errors import InputError
    from conformance.core.inputs import check_label_smoothing
    from conformance.core.training import PAPER_BETAS, PAPER_EPS, check_adam

    if args.steps < 1:
        raise InputError("--steps", f"must be at least 1, got {args.steps}")
    for flag, check in (("--label-smoothing", lambda: check_label_smoothing(args.label_smoothing)),
                        ("--warmup", lambda: check_adam(1, args.warmup, PAPER_BETAS, PAPER_EPS))):
        try:
            check()
        except InputError as exc:
            raise InputError(flag, exc.problem) from None


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    from conformance.cli.common import check_output, write_outputs

    # Every output is checked before the (long) run, and written only if all of them can be,
    # each atomically: a run stopped by Ctrl-C or an error leaves no partial report.
    outputs = {}
    if args.json:
        outputs["--json"] = check_output(args.json, "--json", (".json",))
    if args.plot:
        outputs["--plot"] = check_output(args.plot, "--plot", (".png",))
    from conformance.check import backends
    from conformance.check.defaults import default_model
    from conformance.check.report import default_targets
    from conformance.check.training import plot_train_check, run_train_check, training_batches
    from conformance.cli.progress import Status
    from conformance.core import checkpoint

    if args.checkpoint:
        config, params = checkpoint.load(args.checkpoint)
        source = args.checkpoint
    else:
        config, params, source = default_model()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    try:
        names = backends.requested_backends(args.backends)
        targets, skipped = default_targets(names, dtypes, devices=args.devices)
    except ValueError as exc:  # an unknown backend or device name
        print(f"rosetta train-check: error: {exc}", file=sys.stderr)
        return 2
    batches = training_batches(config, args.steps, seed=args.seed)
    try:
        with Status("rosetta train-check") as status:
            report = run_train_check(config, params, source, targets, args.steps, skipped=skipped, batches=batches,
                                     label_smoothing=args.label_smoothing, warmup=args.warmup, progress=status)
    except NotImplementedError as exc:
        print(f"rosetta train-check: error: no float64 reference: {exc}", file=sys.stderr)
        return 2
    print(report.to_text())
    files = {}
    if args.json:
        files["--json"] = (outputs["--json"], report.dumps().encode())
    if args.plot:
        picture = io.BytesIO()
        width, height = plot_train_check(report, picture)
        files["--plot"] = (outputs["--plot"], picture.getvalue())
    write_outputs(files)
    if args.plot:
        print(f"wrote {args.plot} ({width}x{height} px)")
    return 0 if report.passed else 1
