"""`rosetta check [CHECKPOINT]`: every installed backend against the float64 NumPy oracle.

`--backends numpy,ctranslate2` adds CTranslate2 (`conformance.check.ctranslate2.target`): the
checkpoint converted by CTranslate2's own converter, its score_batch log p per position and its
translate_batch ids against the oracle, per compute type, in a section of its own after the
tensor table (it exposes no intermediate tensors). `--backends ctranslate2` runs that section alone."""

from __future__ import annotations

import argparse
import contextlib
import json
import os

HELP = "Run every installed backend on a fixed batch and report, tensor by tensor, its error against the float64 NumPy oracle."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", nargs="?", help="a rosetta checkpoint (default: the built-in default model)")
    parser.add_argument("--backends", help="comma-separated subset of numpy,torch,jax (default: every installed one; "
                                           "or $ROSETTA_BACKENDS); ctranslate2 adds CTranslate2's section (score_batch "
                                           "log p and translate_batch ids per compute type; docs/deployment.md)")
    parser.add_argument("--devices", help="comma-separated subset of cpu,cuda,gpu (default: every device present; or $ROSETTA_DEVICES)")
    parser.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes to run (default: float32,float64)")
    parser.add_argument("--src", metavar="FILE.npy|IDS",
                        help="the source to check on instead of the built-in batch: ids ('1,2,3;4,5,0' or a .npy "
                             "file), or for a features source (Whisper) a .npy float array (B, n_mels, frames)")
    parser.add_argument("--tgt", metavar="IDS", help="the decoder input ids for --src (default: the built-in "
                        "batch's target rows, as many as --src has)")
    parser.add_argument("--length", type=int, metavar="N",
                        help="source and target length of the fixed batch (default: 7 and 6 tokens)")
    parser.add_argument("--max-memory", metavar="SIZE",
                        help="memory the check's parameters and tensors may use, on top of the loaded frameworks, "
                             "e.g. 900M or 2G (default: the kernel's MemAvailable); "
                             "when holding the oracle's tensors would exceed it, they are compared one at a time")
    parser.add_argument("--stream", action="store_true",
                        help="run the oracle and every backend one layer at a time, each layer's weights read from the "
                             "checkpoint's memory map just before it runs: memory that does not grow with depth "
                             "(docs/scale.md)")
    parser.add_argument("--feed", choices=("oracle", "own"), default=None,
                        help="with --stream, what each layer of a backend is given: the oracle's input from the layer "
                             "below (oracle, the default: errors do not compound) or the backend's own (own: the "
                             "unstreamed report, bit for bit)")
    parser.add_argument("--mesh", metavar="data=D,model=M",
                        help="check the checkpoint (default: the built-in default model) sharded on this (data, "
                             "model) mesh: every plan of impl_jax.shard and impl_torch.parallelize against the oracle, "
                             "a line per plan (forced host devices or gloo processes on the CPU; docs/sharding.md); "
                             "exit 1 when a plan asked for was refused")
    parser.add_argument("--plans", metavar="PLAN,...",
                        help="with --mesh, the plans to check, comma-separated: dp, fsdp, tp, fsdp+tp (default: all)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw each backend's error per tensor against the oracle")


CTRANSLATE2 = "ctranslate2"  # a target of its own section: `ctranslate2_check`, not a backend of the tensor table


def run(args: argparse.Namespace) -> int:
    args.backends, args.ctranslate2 = split_ctranslate2(args.backends)
    with memory_minimising_xla_schedule(args.backends):
        return _run(args)


def split_ctranslate2(option: str | None) -> tuple[str | None, bool]:
    """(--backends without ctranslate2, whether it was named): "" when ctranslate2 was the only
    name (no tensor table), None when --backends and $ROSETTA_BACKENDS name nothing (every backend)."""
    text = option or os.environ.get("ROSETTA_BACKENDS", "")
    names = [n.strip() for n in text.split(",") if n.strip()]
    if CTRANSLATE2 not in names:
        return option, False
    return ",".join(n for n in names if n != CTRANSLATE2), True


def batch_of(args: argparse.Namespace, config):
    """The batch a check runs on: --src (and --tgt) when given, else the built-in one (`fixed_batch`:
    three padded rows of ids, or of log-mel features for a features source)."""
    import numpy as np

    from conformance.check.report import fixed_batch
    from conformance.cli.common import parse_ids, parse_source
    from conformance.core.errors import InputError

    if args.tgt and not args.src:
        raise InputError("--tgt", "is the decoder input for --src: give --src too")
    if not args.src:
        return fixed_batch(config, length=args.length)
    if args.length:
        raise InputError("--length", "sets the built-in batch's length; --src gives its own")
    src = parse_source(config, args.src)
    if config.source == "features":  # its shape against the model, said for the flag that gave it
        from conformance.core.inputs import host_features

        host_features("--src", src, config)
    if args.tgt:
        return src, parse_ids(args.tgt, "--tgt")
    built_in = fixed_batch(config)[1]  # (3, T) target rows, taken in turn for each source row
    return src, built_in[np.arange(len(src)) % len(built_in)]


def _run(args: argparse.Namespace) -> int:
    import sys

    from conformance.core import checkpoint
    from conformance.check.defaults import default_model
    from conformance.check.plan import parse_bytes, plan_batch
    from conformance.check.report import run_check
    from conformance.cli.common import check_output
    from conformance.cli.progress import Status
    from conformance.core.errors import InputError

    if args.ctranslate2 and (args.mesh or args.stream):
        flag = "--mesh" if args.mesh else "--stream"
        raise InputError("--backends", f"{CTRANSLATE2} is checked whole, from the checkpoint in memory, in a section "
                                       f"of its own: leave out {flag}, or {CTRANSLATE2}")
    if args.ctranslate2 and not args.backends and args.plot:
        raise InputError("--plot", f"draws the tensor table, and {CTRANSLATE2} exposes no tensors: name a backend "
                                   "beside it (--backends numpy,ctranslate2) or leave out --plot")
    if args.plans and not args.mesh:
        raise InputError("--plans", "chooses the plans of a sharded check: give --mesh too")
    if args.mesh:
        return _run_mesh(args)
    # Every output is checked before the (long) run, and written only if all of them can be.
    # (--json and --plot cannot name the same file: their suffixes differ.)
    outputs = {}
    if args.json:
        outputs["--json"] = check_output(args.json, "--json", (".json",))
    if args.plot:
        outputs["--plot"] = check_output(args.plot, "--plot", (".png",))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        raise InputError("--dtypes", f"unknown dtype {unknown[0]!r}; expected some of {', '.join(DTYPES)}" if unknown
                         else "names no dtype; expected some of " + ", ".join(DTYPES))
    budget = parse_bytes(args.max_memory) if args.max_memory else None
    if args.feed and not args.stream:
        raise InputError("--feed", "chooses what a streamed check feeds each layer: give --stream too")
    if args.stream and args.max_memory:
        raise InputError("--max-memory", "plans how an unstreamed check holds the oracle's tensors; --stream holds one "
                                         "layer's at a time: give one of them")
    if args.stream:
        return _run_streamed(args, outputs, dtypes)
    # The checkpoint before the backends: finding their devices imports the frameworks (seconds),
    # and a file that is no checkpoint is said at once.
    if args.checkpoint:
        config, params = checkpoint.load(args.checkpoint)
        source = args.checkpoint
    else:
        config, params, source = default_model()
    # Whether CTranslate2 can hold this model, before the long run: if not, it is skipped with the
    # reason, as any target that cannot run here, and the rest runs.
    ctranslate2_devices = _ctranslate2_ready(config, params, args.devices) if args.ctranslate2 else None
    src_ids, tgt_ids = batch_of(args, config)
    report = None
    if not args.ctranslate2 or args.backends:
        targets, skipped = _targets(args, dtypes, config)
        plan = plan_batch(config, params, [t.dtype for t in targets], src_ids, tgt_ids, budget,
                          reread=bool(args.checkpoint))
        print(plan.describe(), file=sys.stderr)  # stderr: the report itself is the same on either path
        if args.checkpoint:  # read again for each model, rather than held beside a float64 model's copy
            del params
            params = checkpoint_reader(args.checkpoint, config)
        with Status("rosetta check") as status:
            report = run_check(config, params, source, targets, skipped, src_ids, tgt_ids, plan, progress=status)
        if args.ctranslate2 and CTRANSLATE2 in ctranslate2_devices[1]:
            report.skipped[CTRANSLATE2] = ctranslate2_devices[1].pop(CTRANSLATE2)
        if not args.ctranslate2:
            return _finish(args, outputs, report)
    sections = _ctranslate2_sections(config, params() if callable(params) else params, src_ids, tgt_ids,
                                     *ctranslate2_devices)
    return _finish(args, outputs, WithCTranslate2(report, sections, config, source))


def _ctranslate2_ready(config, params, devices_option: str | None) -> tuple[list[str], dict[str, str]]:
    """(the devices CTranslate2 runs on, {device: why not}). When CTranslate2 is not installed or
    cannot hold this model (no family of its loaders expresses it, `representable`, no end token):
    no device, and {"ctranslate2": why}, a target skipped with its reason as any other."""
    from conformance.check import backends
    from conformance.check.ctranslate2 import target as ctranslate2_check
    from conformance.check.ctranslate2 import model as ctranslate2_model
    from conformance.core.errors import ConfigError, InputError

    try:
        wanted = backends.requested_devices(devices_option)
    except ValueError as exc:
        raise InputError("--devices", str(exc)) from None
    try:
        ctranslate2_model.require()
        ctranslate2_check.representable(config, params, ctranslate2_check.family_of(config, params))
        ctranslate2_check.generation_ids(config)  # an end token, without which CTranslate2 cannot stop
    except (ConfigError, InputError) as exc:
        return [], {CTRANSLATE2: str(exc)}
    run, skipped = [], {}
    if wanted is None or "cpu" in wanted:
        run.append("cpu")
    if wanted is None or {"cuda", "gpu"} & set(wanted):
        if ctranslate2_model.default_device() == "cuda":
            run.append("cuda")
        else:
            skipped["cuda"] = "no CUDA device: ctranslate2.get_cuda_device_count() is 0"
    return run, skipped


def _ctranslate2_sections(config, params, src_ids, tgt_ids, devices: list[str], skipped: dict[str, str]) -> list:
    """One `ctranslate2_check.check` report per device, on one conversion; a device not run as its reason."""
    import tempfile
    from pathlib import Path

    from conformance.check.ctranslate2 import target as ctranslate2_check
    from conformance.cli.progress import Status

    sections: list = []
    with tempfile.TemporaryDirectory(prefix="rosetta-check-ct2-") as scratch, Status("rosetta check") as status:
        folder = Path(scratch) / "model"
        for device in devices:
            sections.append(ctranslate2_check.check(config, params, src_ids, tgt_ids, model_dir=folder, device=device,
                                                    progress=status))
    return sections + [f"{CTRANSLATE2}/{device}: not run: {why}" if device != CTRANSLATE2 else
                       f"{CTRANSLATE2:<24} skipped: {why}" for device, why in skipped.items()]


class WithCTranslate2:
    """The tensor report (None when ctranslate2 was the only name) with CTranslate2's sections after
    it: one text, one JSON (the tensor report's, its "passed" the whole command's, and a
    "ctranslate2" list), and one verdict: every part passed."""

    def __init__(self, report, sections: list, config, source: str):
        self.report, self.sections, self.config, self.source = report, sections, config, source
        self.measured = [s for s in sections if not isinstance(s, str)]

    @property
    def skipped(self) -> bool:
        """CTranslate2 could not run here and is listed among the tensor table's skipped targets."""
        return CTRANSLATE2 in getattr(self.report, "skipped", {})

    @property
    def passed(self) -> bool:
        """Every part that ran agrees, and something ran: the tensor table, or a CTranslate2 section
        (CTranslate2 skipped beside a table that ran is a skipped target, as any other)."""
        return ((self.report is None or self.report.passed) and (bool(self.measured) or self.skipped)
                and all(s.passed for s in self.measured))

    def to_text(self) -> str:
        head = (self.report.to_text() if self.report is not None
                else f"rosetta check: {self.source}\nconfig: {self.config.summary()}")
        parts = [head, *(s if isinstance(s, str) else s.to_text() for s in self.sections)]
        if not self.measured and not self.skipped:
            parts.append(f"{CTRANSLATE2}: nothing checked")
        return "\n\n".join(parts)

    def to_json(self) -> dict:
        base = self.report.to_json() if self.report is not None else {
            "source": self.source, "config": json.loads(self.config.to_json()), "checked": bool(self.measured)}
        return {**base, "passed": self.passed,
                CTRANSLATE2: [{"not_run": s} if isinstance(s, str) else s.to_json() for s in self.sections]}


def _run_mesh(args: argparse.Namespace) -> int:
    """`--mesh`: conformance.check.scale.mesh, the checkpoint (or the default model) sharded on that mesh,
    every plan asked for, one line per plan."""
    from conformance.check.scale.mesh import run_mesh_check
    from conformance.core.errors import InputError
    from conformance.core.sharding import PLANS

    clashing = [flag for flag, given in (("--stream", args.stream),
                                         ("--length", args.length), ("--max-memory", args.max_memory),
                                         ("--json", args.json), ("--plot", args.plot), ("--feed", args.feed),
                                         ("--dtypes", args.dtypes != "float32,float64")) if given]
    if clashing:
        raise InputError("--mesh", f"runs a sharded check in float64 and prints a line per plan; leave out "
                                   f"{', '.join(clashing)}")
    plans = tuple(p.strip() for p in args.plans.split(",") if p.strip()) if args.plans else PLANS
    return run_mesh_check(args.mesh, args.devices, args.backends, checkpoint=args.checkpoint, plans=plans)


def _run_streamed(args: argparse.Namespace, outputs: dict, dtypes: list[str]) -> int:
    """`--stream`: conformance.check.scale.stream, a layer at a time; the same report and exit status."""
    import sys

    from conformance.check import backends
    from conformance.check.defaults import default_model
    from conformance.check.scale.stream import Weights, refuse_unstreamable, run_streamed

    try:  # a backend that cannot run a layer at a time, before the checkpoint is hashed
        refuse_unstreamable(backends.requested_backends(args.backends))
    except ValueError:  # an unknown name: said by _targets, as without --stream
        pass
    if args.checkpoint:  # the header and digest checked with bounded memory; no tensor read yet
        weights = Weights.open(args.checkpoint)
        config, source = weights.config, args.checkpoint
    else:
        config, params, source = default_model()
        weights = Weights.held(config, params)
    targets, skipped = _targets(args, dtypes, config)
    src_ids, tgt_ids = batch_of(args, config)

    def progress(message: str) -> None:  # a line per stage, kept: a deep model's check takes a while
        print(f"rosetta check --stream: {message}", file=sys.stderr, flush=True)

    report = run_streamed(config, weights, source, targets, skipped, src_ids, tgt_ids, feed=args.feed or "oracle",
                          progress=progress)
    return _finish(args, outputs, report)


def _targets(args: argparse.Namespace, dtypes: list[str], config):
    """The targets asked for (--backends, --devices, --dtypes) and what is skipped, with why."""
    from conformance.check import backends
    from conformance.check.report import default_targets
    from conformance.core.errors import InputError

    try:
        names = backends.requested_backends(args.backends)
        targets, skipped = default_targets(names, dtypes, devices=args.devices)
    except ValueError as exc:  # an unknown backend or device name
        raise InputError("--backends" if "backend" in str(exc) else "--devices", str(exc)) from None
    backends.refuse_adapters(names, "--backends")  # before the models: an adapter runs under `rosetta conformance`
    if any(backends.kind(t.backend) == "torch" and t.device == "cpu" for t in targets):
        from conformance.cli.threads import fit_torch_threads

        fit_torch_threads(config)  # one thread for a tiny model, unless OMP_NUM_THREADS says otherwise
    return targets, skipped


def _finish(args: argparse.Namespace, outputs: dict, report) -> int:
    """Print the report, write --json and --plot, and return the exit status."""
    import io

    from conformance.cli.common import write_outputs

    print(report.to_text())
    files = {}
    if args.json:
        files["--json"] = (outputs["--json"], (json.dumps(report.to_json(), indent=2) + "\n").encode())
    if args.plot:
        from conformance.check.plots import plot_check

        picture = io.BytesIO()
        width, height = plot_check(report.report if isinstance(report, WithCTranslate2) else report, picture)
        files["--plot"] = (outputs["--plot"], picture.getvalue())
    write_outputs(files)
    if args.json:
        print(f"wrote {outputs['--json']} (the report as JSON)")
    if args.plot:
        print(f"wrote {outputs['--plot']} ({width}x{height} px)")
    return 0 if report.passed else 1  # 1 also when nothing was checked


DTYPES = ("float64", "float32", "float16", "bfloat16")


def checkpoint_reader(path: str, config):
    """A function that reads the checkpoint's parameters again (digest and values checked on
    every read, as by `checkpoint.load`), refusing a file whose config changed since the first."""
    from conformance.core import checkpoint
    from conformance.core.errors import CheckpointError

    def read():
        again, params = checkpoint.load(path)
        if again != config:
            raise CheckpointError(path, "changed while it was being checked: its config is not the one first read")
        return params

    return read


XLA_SCHEDULE_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"
# The jaxlib this was measured with; XLA aborts the process on a flag it does not know, so an
# older one is left with its default schedule.
XLA_SCHEDULE_JAXLIB = (0, 10)


@contextlib.contextmanager
def memory_minimising_xla_schedule(backend_option: str | None):
    """Have XLA:CPU order each program for memory rather than concurrency, for one check.

    With its default schedule XLA converts every stored parameter of a model stored narrower than it
    computes at the start of the program: a float64 model of a float32 checkpoint (how the check
    runs float64 targets) then holds all of the decoder's widened weights at once, 134 MB of
    temporaries for the base model at length 512, against 19 MB with this schedule (212 against
    88 MB before the output projection was widened a block at a time; 115 against 17 MB for the
    encoder; XLA's `memory_analysis()`). A schedule only orders operations: the report
    is the same, bit for bit (tests/scale/test_memory_budget.py), and the time too (docs/check.md).

    Set in XLA_FLAGS, which XLA reads once, when JAX starts its CPU client (jit's
    `compiler_options` accepts the option but does not change the schedule: measured), so it acts
    only where JAX has not started yet, as in a `rosetta check` process; XLA_FLAGS is put back
    afterwards. Only when JAX is among the backends asked for, only with a jaxlib this was tested
    on, and never over a user's own setting of the flag."""
    saved = os.environ.get("XLA_FLAGS")
    tokens = (saved or "").split()
    from conformance.check.backends import requested_backends

    try:
        wanted = "jax" in requested_backends(backend_option)
    except ValueError:  # an unknown name: the check refuses it, by name, once it starts
        wanted = False
    if wanted and _jaxlib_at_least(XLA_SCHEDULE_JAXLIB) and not any(t.startswith(XLA_SCHEDULE_FLAG) for t in tokens):
        os.environ["XLA_FLAGS"] = " ".join(tokens + [f"{XLA_SCHEDULE_FLAG}=false"])
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = saved


def _jaxlib_at_least(version: tuple[int, ...]) -> bool:
    from importlib import metadata

    try:
        installed = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return False
    parts = []
    for part in installed.split(".")[:len(version)]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= version
