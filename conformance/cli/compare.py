"""`rosetta compare MODULE:FACTORY WEIGHTS --layout NAME`: your own model beside ours, tensor by
tensor (`conformance.compare`, docs/porting.md). This imports and runs your Python code.

`rosetta compare GRAPHS [WEIGHTS] [--layout NAME]`: your ONNX export (a folder of rosetta's or
optimum-onnx's graphs, or one .onnx graph of a whole transformers model) beside the oracle run on the weights it was exported from
(`conformance.check.onnx.compare`, docs/deployment.md); a folder that holds config.json and the
weights too (a Hugging Face folder) needs no WEIGHTS.

`rosetta compare CT2_DIR WEIGHTS [--layout NAME]`: your CTranslate2 model directory beside the
oracle run on the weights it was converted from: score_batch log p per position and
translate_batch ids, per compute type (`conformance.check.ctranslate2.compare`, docs/deployment.md)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np

HELP = ("Run your own model (imported from MODULE:FACTORY: this imports and runs your Python code) with WEIGHTS, and "
        "our backends on the same weights converted through --layout, and print the rosetta check table with your "
        "model as a column: the first tensor where yours leaves tolerance, and the switches acting there. Exit 0 when "
        "all agree, 1 at a divergence, 2 on an error.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("factory", metavar="MODULE:FACTORY|GRAPHS",
                        help="a Python file (my_model.py) or importable module, and a function in it that returns your "
                             "model: a torch.nn.Module, or a flax.linen Module (WEIGHTS are then its variables). "
                             "Imported and called: it runs your code. Or a folder of ONNX graphs (rosetta convert "
                             "--to onnx, or optimum-onnx's encoder_model.onnx + decoder_model_merged.onnx), or one "
                             ".onnx graph of a whole model (your torch.onnx.export), run in ONNX Runtime; or a CTranslate2 model directory (model.bin, config.json, vocabulary), "
                             "run in CTranslate2 in each compute type")
    parser.add_argument("weights", metavar="WEIGHTS", nargs="?",
                        help="your weights: a PyTorch file (.pt/.pth/.bin), .safetensors, .npz, a Flax .msgpack or "
                             "an Orbax directory; loaded into the model strictly. With GRAPHS (or a CTranslate2 "
                             "directory): the checkpoint they were exported from (a rosetta checkpoint, a Hugging Face "
                             "folder, or a file with --layout); default GRAPHS itself when it is a Hugging Face folder")
    parser.add_argument("--layout", metavar="NAME|FILE",
                        help="the built-in layout (rosetta layouts) or a layout TOML file that maps your keys; its "
                             "[taps] say where your model computes each tensor (with GRAPHS: values of the graphs, "
                             "added as outputs). Required with MODULE:FACTORY")
    parser.add_argument("--run", metavar="FUNCTION",
                        help="a function in MODULE, run(model, src_ids, tgt_ids) -> logits, that calls your model "
                             "(default: a transformers model as its layout's [hf.call] says, with the source's padding mask; any "
                             "other model(src_ids, tgt_ids), with no mask)")
    parser.add_argument("--src", metavar="IDS", help="source ids, '1,2,3;4,5,0' or a .npy file (default: three rows "
                                                    "with padding, as rosetta check)")
    parser.add_argument("--tgt", metavar="IDS", help="target ids, the same forms (default: as --src)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a ModelConfig field for the conversion (n_heads, a switch the layout requires); repeatable")
    parser.add_argument("--key", help="a nested state dict or parameter subtree in WEIGHTS (as rosetta convert)")
    parser.add_argument("--backends", help="our backends beside it, comma-separated (default: every installed one; "
                                           "'none': your model against the oracle alone)")
    parser.add_argument("--dtype", default="float32", help="the dtype our backends run in (default: float32)")
    parser.add_argument("--grads", action="store_true", help="also compare the loss and every gradient with your "
                                                            "model's own autograd (labels: the next target token; the "
                                                            "targets themselves for a shift-right layout)")
    parser.add_argument("--inputs", metavar="NAME=WHAT,...",
                        help="with one .onnx graph of a whole model: what each graph input is given, WHAT one of "
                             "src_ids, tgt_ids, src_mask, tgt_mask (default: the layout's [hf.call], by name, else in "
                             "its order)")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw the errors per tensor")


class UserCodeError(Exception):
    """The user's module, factory or weights: one line for the command's error."""


def _import(spec: str):
    module_text, sep, name = spec.rpartition(":")
    if not sep or not module_text or not name:
        raise UserCodeError(f"{spec!r}: expected MODULE:FACTORY (my_model.py:build or package.module:build)")
    path = Path(module_text)
    try:
        if module_text.endswith(".py") or path.exists():
            if not path.is_file():
                raise UserCodeError(f"{module_text}: no such Python file")
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loaded)
            sys.path.insert(0, str(path.resolve().parent))  # its own imports of files beside it
            try:
                loaded.loader.exec_module(module)
            finally:
                sys.path.remove(str(path.resolve().parent))
        else:
            module = importlib.import_module(module_text)
    except UserCodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module failing to import is one line, not our traceback
        raise UserCodeError(f"importing {module_text} failed: {type(exc).__name__}: {exc}") from None
    return module, name


def _attribute(module, name: str, what: str):
    value = getattr(module, name, None)
    if value is None or not callable(value):
        found = "no attribute" if value is None else f"{type(value).__name__}, not a function"
        raise UserCodeError(f"{module.__name__}:{name}: {found} ({what})")
    return value


def _torch_load(model, state: dict[str, np.ndarray], weights: str, layout) -> None:
    import torch

    from conformance.convert.planner import tied_copies

    own = model.state_dict()
    # A folder written by save_pretrained keeps a tied tensor once (model.shared.weight, not
    # lm_head.weight): filled from the layout's ties, as from_pretrained ties them on loading.
    filled = tied_copies(layout, own, state)
    if filled:
        state = {**state, **{key: state[source] for key, source in filled.items()}}
        print(f"{weights}: {', '.join(sorted(filled))} filled from the tensor{'s' if len(set(filled.values())) > 1 else ''} "
              f"{', '.join(sorted(set(filled.values())))} (tied in layout {layout.name}: a tied tensor is stored once)")
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        parts = [f"{len(missing)} missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})" if missing else "",
                 f"{len(unexpected)} unexpected ({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''})"
                 if unexpected else ""]
        raise UserCodeError(f"{weights} does not fit the model: {'; '.join(p for p in parts if p)}")
    for key, value in own.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise UserCodeError(f"{weights} does not fit the model: {key} is {tuple(state[key].shape)} in the file, "
                                f"{tuple(value.shape)} in the model")
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)).to(own[k].dtype) for k, v in state.items()},
                          strict=True)


def _nested(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _linen_bind(module, state: dict[str, np.ndarray], weights: str):
    import jax
    import jax.numpy as jnp

    tree = _nested(state)
    variables = tree if "params" in tree else {"params": tree}
    sample = {k: np.zeros((1, 2), np.int32) for k in ("src", "tgt")}
    try:
        expected = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.asarray(sample["src"]),
                                                      jnp.asarray(sample["tgt"])))
    except Exception:  # noqa: BLE001 - a model whose init we cannot guess: bind as given, let the run tell
        return module.bind(variables)
    have = {".".join(str(getattr(p, "key", p)) for p in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(variables)}
    want = {".".join(str(getattr(p, "key", p)) for p in path): leaf.shape
            for path, leaf in jax.tree_util.tree_leaves_with_path(dict(expected))}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise UserCodeError(f"{weights} does not fit the model: {len(missing)} missing "
                            f"({', '.join(missing[:3])}), {len(unexpected)} unexpected ({', '.join(unexpected[:3])})")
    for key, shape in want.items():
        if tuple(have[key]) != tuple(shape):
            raise UserCodeError(f"{weights} does not fit the model: {key} is {tuple(have[key])} in the file, "
                                f"{tuple(shape)} in the model")
    return module.bind(variables)


def _default_labels(tgt: np.ndarray, pad_id: int, shifted: bool) -> np.ndarray:
    """The labels of --grads: the targets themselves for a model that embeds shift_right(targets)
    (`decoder_input = "shift-right"`), else the next target token (padding not counted)."""
    if shifted:
        return tgt.copy()
    nxt = np.roll(tgt, -1, axis=1)
    nxt[:, -1] = pad_id
    return np.where(tgt == pad_id, pad_id, nxt)


def run(args: argparse.Namespace) -> int:
    from conformance.check.foreign import taps
    from conformance.check.report import fixed_batch
    from conformance.check.foreign.side_by_side import compare, convert_yours
    from conformance.cli.common import parse_ids
    from conformance.cli.convert import parse_sets
    from conformance.cli.progress import Status
    from conformance.convert import load_layout, read_state_dict
    from conformance.core.errors import InputError

    from conformance.check.ctranslate2.model import is_ctranslate2
    from conformance.check.onnx.compare import is_onnx

    if args.inputs and not is_onnx(args.factory):
        raise InputError("--inputs", "maps the inputs of one .onnx graph of a whole model: give that graph")
    if is_ctranslate2(args.factory):
        return run_ctranslate2(args)
    if is_onnx(args.factory) or Path(args.factory).is_dir():  # a folder is no MODULE:FACTORY: graphs, or an error
        return run_onnx(args)
    if ":" not in args.factory:  # no MODULE:FACTORY, no model found there: a path that is not there
        raise InputError("MODULE:FACTORY|GRAPHS", f"{args.factory}: no such file or directory (expected a CTranslate2 "
                         "model directory, ONNX graphs, or MODULE:FACTORY naming your Python code)")
    if args.weights is None or args.layout is None:
        raise InputError("--layout" if args.weights else "WEIGHTS", "MODULE:FACTORY needs WEIGHTS and --layout "
                         "(only a folder of ONNX graphs may go without)")
    layout = load_layout(args.layout)
    overrides = parse_sets(args.sets)
    json_path, plot_path = _outputs_checked(args)
    with Status("rosetta compare") as status:
        status(f"reading {args.weights}")
        state = read_state_dict(args.weights, args.key)
        try:
            model, user_run = _user_model(args, state, status, layout)
        except UserCodeError as exc:
            failure = exc
        else:
            failure = None
            status(f"converting your weights through layout {layout.name}")
            config = convert_yours(model, layout, taps.foreign_state(model), overrides)[0].config
            src, tgt = (parse_ids(args.src, "--src"), parse_ids(args.tgt, "--tgt")) if args.src else fixed_batch(config)
            backends = [] if (args.backends or "").strip() == "none" else args.backends
            shifted = layout.tap_options["decoder_input"] == "shift-right"
            report = compare(model, layout, src, tgt, run=user_run, dtype=args.dtype, backends=backends,
                             grads=args.grads, labels=_default_labels(tgt, config.pad_id, shifted) if args.grads else None,
                             progress=status, **overrides)
    if failure is not None:
        print(f"rosetta compare: error: {failure}", file=sys.stderr)
        return 2
    return finish(report, json_path, plot_path)


def finish(report, json_path, plot_path) -> int:
    """Print the report, write its JSON and picture, and the exit status (0 ok, 1 a divergence, 2 an error)."""
    print(report.to_text())
    if json_path:
        import json

        json_path.write_text(json.dumps(report.to_json(), indent=2, default=float))
    if plot_path:
        width, height = report.plot(str(plot_path))
        print(f"wrote {plot_path} ({width}x{height} px)")
    if report.diverges:  # whatever else failed: the models differ, and the report says where
        return 1
    # An error of the user's code, forward or backward, with its own frames (exit 2).
    if report.could_not_run:
        print(f"rosetta compare: error: your model could not run: {report.errors[report.yours.label]}"
              + (f"\n{report.failure}" if report.failure else ""), file=sys.stderr)
        return 2
    if report.backward_error:
        print(f"rosetta compare: error: your model's backward pass failed: {report.backward_error}"
              + (f"\n{report.backward_traceback}" if report.backward_traceback else ""), file=sys.stderr)
        return 2
    return 0 if report.ok else 1


def _user_model(args: argparse.Namespace, state: dict[str, np.ndarray], status, layout):
    """(the user's model with WEIGHTS loaded, its --run function or None); UserCodeError when the
    module, the factory or the weights fail (a factory that raises: with its own frames)."""
    from conformance.check.foreign import taps
    from conformance.check.foreign.user_code import user_traceback

    status(f"importing {args.factory.rpartition(':')[0]}")
    module, name = _import(args.factory)
    factory = _attribute(module, name, "the factory that returns your model")
    user_run = _attribute(module, args.run, "--run") if args.run else None
    status(f"building your model ({args.factory}())")
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - the user's factory failing: one line, then its own frames
        frames = user_traceback(exc)
        raise UserCodeError(f"{args.factory}() raised {type(exc).__name__}: {exc}" + (f"\n{frames}" if frames else "")) from None
    try:
        # The factory's linen module is unbound: WEIGHTS are its variables.
        kind = "linen" if taps.is_linen(model) else taps.framework(model)
    except TypeError as exc:
        raise UserCodeError(f"{args.factory}() returned {type(model).__name__}: {exc}") from None
    status(f"loading {args.weights} into your model")
    if kind == "torch":
        _torch_load(model.eval(), state, args.weights, layout)
    elif kind == "linen":
        module = model[0] if isinstance(model, tuple) else model
        if getattr(module, "scope", None) is not None:  # bound already: WEIGHTS replace its variables
            module = module.unbind()[0]
        model = _linen_bind(module, state, args.weights)
    else:
        raise UserCodeError(f"{args.factory}() returned an nnx.Module: its weights are its own; call "
                            "conformance.compare(model, ...) from Python")
    return model, user_run


def run_onnx(args: argparse.Namespace) -> int:
    """`rosetta compare GRAPHS [WEIGHTS]`: the graphs in ONNX Runtime beside the oracle."""
    from conformance.check.onnx import single
    from conformance.check.onnx.compare import compare_onnx, load_graphs
    from conformance.check.onnx.single import OneGraph
    from conformance.check.weights import oracle_weights
    from conformance.check.report import window_batch
    from conformance.cli.common import parse_ids
    from conformance.cli.convert import parse_sets
    from conformance.cli.progress import Status
    from conformance.core.errors import InputError

    if args.run or args.grads or args.key:
        flag = "--run" if args.run else "--grads" if args.grads else "--key"
        raise InputError(flag, "does not apply to ONNX graphs (compare runs them by their input names; they have no "
                               "backward pass)")
    overrides = parse_sets(args.sets)
    json_path, plot_path = _outputs_checked(args)
    with Status("rosetta compare") as status:
        # Read once, here: a folder without graphs is one line before the weights are read, and the
        # weights' config gives the default batch; compare_onnx takes both as read.
        graphs = load_graphs(args.factory)
        oracle = oracle_weights(args.weights, args.factory, args.layout, overrides)
        inputs = parse_inputs(args.inputs) if args.inputs else None
        if args.src:
            src, tgt = parse_source_arg(oracle[0], args.src), parse_ids(args.tgt, "--tgt")
        elif isinstance(graphs, OneGraph):  # a graph exported for fixed shapes gets its padded batch at them
            src, tgt = single.default_batch(graphs, oracle[0], oracle[2], inputs)
        else:
            src, tgt = window_batch(oracle[0])  # a features source: a whole window, as optimum's graphs take
        backends = [] if (args.backends or "").strip() == "none" else args.backends
        report = compare_onnx(graphs, args.layout, src, tgt, weights=args.weights, dtype=args.dtype,
                              backends=backends, progress=status, oracle=oracle, inputs=inputs, **overrides)
    return finish(report, json_path, plot_path)


def run_ctranslate2(args: argparse.Namespace) -> int:
    """`rosetta compare CT2_DIR WEIGHTS`: the CTranslate2 model in each compute type beside the oracle.
    Exit 0 when the held row (float32 on float32 weights) agrees, 1 when it does not, 2 on an error."""
    import json

    from conformance.check.ctranslate2.compare import compare_ctranslate2
    from conformance.check.ctranslate2.model import default_device, require
    from conformance.check.weights import oracle_weights
    from conformance.check.report import window_batch
    from conformance.cli.common import parse_ids, write_outputs
    from conformance.cli.convert import parse_sets
    from conformance.cli.progress import Status
    from conformance.core.errors import InputError

    refused = [flag for flag, given in (("--run", args.run), ("--grads", args.grads), ("--key", args.key),
                                        ("--plot", args.plot),
                                        ("--backends", args.backends not in (None, "none")),
                                        ("--dtype", args.dtype != "float32")) if given]
    if refused:
        raise InputError(refused[0], "does not apply to a CTranslate2 model: compare runs it by tokens in each compute "
                                     "type, and it exposes no tensors to draw or to set beside our backends'")
    if args.weights is None:
        raise InputError("WEIGHTS", "the oracle needs the weights the CTranslate2 model was converted from: a rosetta "
                                    "checkpoint, a Hugging Face folder, or a file with --layout")
    overrides = parse_sets(args.sets)
    json_path, _ = _outputs_checked(args)
    require()
    with Status("rosetta compare") as status:
        status(f"reading {args.weights}")
        oracle = oracle_weights(args.weights, None, args.layout, overrides)
        src, tgt = ((parse_source_arg(oracle[0], args.src), parse_ids(args.tgt, "--tgt")) if args.src
                    else window_batch(oracle[0]))
        report = compare_ctranslate2(args.factory, args.layout, src, tgt, weights=args.weights,
                                     device=default_device(), progress=status, oracle=oracle)
    print(report.to_text())
    if json_path:
        write_outputs({"--json": (json_path, (json.dumps(report.to_json(), indent=2) + "\n").encode())})
        print(f"wrote {json_path} (the report as JSON)")
    return 0 if report.passed else 1


def parse_source_arg(config, text: str):
    """--src against the weights' model: ids, or a features source's .npy of log-mel features."""
    from conformance.cli.common import load_features, parse_ids

    return load_features(text, "--src") if config.source == "features" else parse_ids(text, "--src")


def parse_inputs(text: str) -> dict[str, str]:
    """--inputs "input.1=src_ids,attention_mask.1=src_mask,input.15=tgt_ids" -> {graph input: what}."""
    from conformance.core.errors import InputError

    out = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, what = part.rpartition("=")
        if not sep or not name or not what:
            raise InputError("--inputs", f"expected NAME=WHAT,... (input.1=src_ids), got {part!r}")
        out[name.strip()] = what.strip()
    return out


def _outputs_checked(args):
    """--json and --plot checked before the (long) run, and --src/--tgt given together or not at all."""
    from conformance.cli.common import check_output
    from conformance.core.errors import InputError

    json_path = check_output(args.json, "--json", (".json",)) if args.json else None
    plot_path = check_output(args.plot, "--plot", (".png",)) if args.plot else None
    if bool(args.src) != bool(args.tgt):
        raise InputError("--tgt" if args.src else "--src", "give --src and --tgt together (or neither, for the "
                         "default batch)")
    return json_path, plot_path
