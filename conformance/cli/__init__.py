"""The `rosetta` command line. Each command lives in `conformance/cli/<name>.py` and
provides `HELP`, `add_arguments(parser)` and `run(args) -> int` (the exit status). Commands
import PyTorch and JAX lazily, so `rosetta --help` works with only NumPy installed.

May import every other part of `conformance` (the core, the check tools, the converters, the
suite by name); nothing imports the CLI."""

from __future__ import annotations

import argparse
import importlib
import sys

from conformance.core.errors import CheckpointError, ConfigError, InputError

# command name -> module under conformance.cli
COMMANDS = {
    "check": "check",
    "conformance": "conformance_suite",
    "generate": "generate",
    "attention": "attention",
    "convert": "convert",
    "layouts": "layouts",
    "inspect": "inspect",
    "run": "run",
    "train-check": "train_check",
    "compare": "compare",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rosetta",
        description="One Transformer in NumPy, PyTorch and Flax: check, convert and inspect checkpoints.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(f"conformance.cli.{module_name}")
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(command)
        command.set_defaults(_run=module.run)
    return parser


# The exit status of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run one command and return its exit status. Ctrl-C raises `KeyboardInterrupt` here as
    anywhere in Python, so a loop that calls `main([...])` stops; the `rosetta` command
    (`console_main`) turns it into one line and exit 130."""
    from conformance.convert.errors import AmbiguousLayoutError, LayoutError, NoMatchingLayoutError, TensorError

    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (CheckpointError, ConfigError, InputError, LayoutError, NoMatchingLayoutError, AmbiguousLayoutError,
            TensorError) as exc:
        print(f"rosetta {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `rosetta inspect x | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
    except OSError as exc:  # a file the commands did not foresee (a full disk, a vanished folder)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"rosetta {args.command}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2


def console_main(argv: list[str] | None = None) -> int:
    """The `rosetta` command and `python -m conformance.cli`: `main`, with Ctrl-C said in one line
    and exit status 130 (128 + SIGINT, what a shell reports), not a traceback into the model's code.

    Every file write is atomic and removes its temporary file on the way out (this exception
    included), so a stopped command leaves each output as it was (docs/errors.md)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        words = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")]
        command = words[0] if words and words[0] in COMMANDS else None  # rosetta has no option of its own
        print(f"rosetta{f' {command}' if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED
