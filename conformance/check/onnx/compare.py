"""`conformance.compare` on the user's own ONNX files: the graphs beside the oracle, tensor by tensor.

    report = compare_onnx("graphs/", "hf-marian", src_ids, tgt_ids, weights="opus-mt-tiny/")
    rosetta compare graphs/ opus-mt-tiny/ --layout hf-marian

The model is a folder of graphs, one `.onnx` file, an `onnxruntime.InferenceSession`, or a pair
of them (encoder, decoder). Three conventions are read:

    rosetta        `rosetta convert --to onnx`: encoder.onnx (src_ids, src_mask -> cross_*, taps),
                   decoder.onnx (tgt_ids, src_mask, past_*, cross_* -> logits, present_*, taps)
    optimum        optimum-onnx's seq2seq export: encoder_model.onnx (input_ids, attention_mask ->
                   last_hidden_state), decoder_model_merged.onnx (or decoder_model.onnx: input_ids,
                   encoder_hidden_states, encoder_attention_mask, past_key_values.{i}.* -> logits,
                   present.{i}.*)
    one graph      a user's own `torch.onnx.export` of a whole transformers model, one .onnx file
                   (input_ids, attention_mask, decoder_input_ids -> logits first): fed by the
                   layout's [hf.call], its taps found by module scope (`conformance.check.onnx.single`)

The oracle runs on `weights`, the checkpoint the graphs were exported from: a rosetta checkpoint,
a Hugging Face folder (`from_hf_folder`: its config.json gives the sizes and switches), or any
file `rosetta convert` reads, through `layout`. A folder of graphs that is a Hugging Face folder
too (optimum writes config.json beside the graphs) is its own default.

What the graphs give is compared: their outputs that are canonical tensors (every one with
`--taps`), an optimum encoder's `last_hidden_state` as `encoder.output`, the logits. A layout's
`[taps]` may name values of the graphs (a node's output, `/model/encoder/layers.0/.../Add_1_output_0`):
each one found in the encoder graph (an `encoder.*` tensor) or the decoder graph (the rest) is
added as a graph output for the run. A tap that names a value inside a subgraph (an `If` branch
of a merged decoder, which cannot be made a graph output) is reported as not exposed, naming the
node; one that names no value of the graph, as naming none.

The decoder runs twice, as the `onnxruntime` target runs it: on the whole target prefix with an
empty cache, then on the second half with the first half's keys and values as its cache; each
decoder tensor is the first call's rows for the first half and the second call's for the rest, so
a graph that reads its cache wrong shows at the first tensor that touches it. An optimum decoder
without `use_cache_branch` (decoder_model.onnx) runs once: the report's note says "cache not
checked" (decoder_with_past_model.onnx is not read).

A graph takes its decoder input as given: with a layout whose `decoder_input` is "shift-right"
(a system that shifts its targets itself), the graphs are fed shift_right(tgt_ids), as the
oracle is, and every position is compared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from conformance.check import backends as backend_registry
from conformance.check.compare import compare as compare_arrays
from conformance.check.report import Cell, Report, default_targets, run_check
from conformance.check.foreign.report import (YOURS, SideBySide, as_features, as_ids, backend_names,
                                                   oracle_tensors, shift_right)
from conformance.check.tolerances import tolerance
from conformance.check.onnx.single import ONE_GRAPH, OneGraph
from conformance.check.weights import oracle_weights
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.output import forward_order

ROSETTA_FILES = ("encoder.onnx", "decoder.onnx")
OPTIMUM_ENCODER = "encoder_model.onnx"
OPTIMUM_DECODERS = ("decoder_model_merged.onnx", "decoder_model.onnx")


def is_onnx(model: Any) -> bool:
    """Whether `model` is ONNX graphs for `compare_onnx`: an InferenceSession (or a pair), an
    `.onnx` file, or a folder holding rosetta's or optimum's graphs."""
    if isinstance(model, (tuple, list)) and len(model) == 2:
        return all(_is_session(m) or _is_onnx_path(m) for m in model)
    return _is_session(model) or _is_onnx_path(model)


def _is_session(model: Any) -> bool:
    return type(model).__name__ == "InferenceSession" and type(model).__module__.startswith("onnxruntime")


def _is_onnx_path(model: Any) -> bool:
    if not isinstance(model, (str, os.PathLike)):
        return False
    path = Path(model)
    if path.is_dir():
        return any((path / name).is_file() for name in (*ROSETTA_FILES, OPTIMUM_ENCODER))
    return path.suffix == ".onnx"


class Graphs:
    """The encoder and decoder graphs as ONNX protos (to add taps as outputs) and their convention."""

    def __init__(self, encoder, decoder, where: str):
        self.encoder, self.decoder, self.where = encoder, decoder, where
        names = {i.name for i in decoder.graph.input}
        if {"tgt_ids", "src_mask"} <= names:
            self.convention = "rosetta"
        elif "input_ids" in names and "encoder_hidden_states" in names:
            self.convention = "optimum"
        else:
            raise InputError("model", f"{where}: a decoder graph with inputs {sorted(names)}: neither rosetta's "
                                      "(tgt_ids, src_mask, past_*, cross_*) nor optimum's (input_ids, "
                                      "encoder_hidden_states, past_key_values.*)")

    def dtype(self) -> str:
        """The logits' dtype; InputError for an element type the runtime's target cannot read."""
        import onnx

        from conformance.check.onnx.runtime import element_dtype

        logits = next((o for o in self.decoder.graph.output if o.name == "logits"), None)
        if logits is None:
            raise InputError("model", f"{self.where}: the decoder graph has no output named logits")
        # onnxruntime's name for the element type: FLOAT -> tensor(float), as ELEMENT_TYPES keys it.
        kind = f"tensor({onnx.TensorProto.DataType.Name(logits.type.tensor_type.elem_type).lower()})"
        return element_dtype("model", f"{self.where}: the decoder graph's logits", kind).name

    @property
    def cached(self) -> bool:
        """Whether the decoder graph can be run with a cache: rosetta's always; optimum's merged
        graph by its `use_cache_branch` (decoder_model.onnx has none)."""
        return self.convention == "rosetta" or any(i.name == "use_cache_branch" for i in self.decoder.graph.input)


def load_graphs(model: Any) -> Graphs | OneGraph:
    """The graphs of `model` (see `is_onnx`, or `Graphs` read already): the encoder and decoder of a
    folder or a pair, or one graph of the whole model (a file, a session); InputError naming what
    is missing."""
    import onnx

    if isinstance(model, (Graphs, OneGraph)):
        return model
    if isinstance(model, (tuple, list)):
        encoder, decoder = (_proto(m) for m in model)
        return Graphs(encoder, decoder, "the (encoder, decoder) pair")
    if _is_session(model):
        return OneGraph(_proto(model), "the InferenceSession's graph")
    path = Path(model)
    if not path.exists():
        raise InputError("model", f"{path}: no such file or folder")
    if not path.is_dir():
        return OneGraph(onnx.load(str(path)), str(path))
    if all((path / name).is_file() for name in ROSETTA_FILES):
        files = [path / name for name in ROSETTA_FILES]
    else:
        decoder = next((path / name for name in OPTIMUM_DECODERS if (path / name).is_file()), None)
        if not (path / OPTIMUM_ENCODER).is_file() or decoder is None:
            raise InputError("model", f"{path}: no graphs to compare: expected {' + '.join(ROSETTA_FILES)} "
                                      f"(rosetta convert --to onnx) or {OPTIMUM_ENCODER} + "
                                      f"{' or '.join(OPTIMUM_DECODERS)} (optimum-onnx)")
        files = [path / OPTIMUM_ENCODER, decoder]
    return Graphs(*(onnx.load(str(f)) for f in files), str(path))


def _proto(model: Any):
    """An ONNX proto from a path or a session (its file, reloaded, so that taps can be added)."""
    import onnx

    if _is_session(model):
        path = getattr(model, "_model_path", None)
        if not path:
            raise InputError("model", "an InferenceSession made from bytes: compare needs the graph itself, to add "
                                      "taps as outputs: pass the .onnx path")
        return onnx.load(path)
    return onnx.load(str(model))


def _session(proto):
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3
    return onnxruntime.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def with_outputs(proto, names: list[str]):
    """A copy of `proto` with the values `names` added as graph outputs (types from shape inference)."""
    import onnx

    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    inferred = {v.name: v for v in onnx.shape_inference.infer_shapes(proto).graph.value_info}
    present = {o.name for o in proto.graph.output}
    for name in names:
        if name not in present:
            proto.graph.output.append(inferred.get(name) or onnx.helper.make_empty_tensor_value_info(name))
    return proto


def graph_values(proto) -> set[str]:
    """The values of the top-level graph (node outputs and inputs): what can become an output."""
    return {o for node in proto.graph.node for o in node.output} | {i.name for i in proto.graph.input}


def subgraph_values(graph, found: dict[str, str] | None = None) -> dict[str, str]:
    """{value: where} for the values computed inside `graph`'s subgraphs (an If node's branches, a
    Loop's body, at any depth), `where` naming the outermost subgraph that holds it: "the
    else_branch of If node 'optimum::if'"."""
    import onnx

    found = {} if found is None else found
    for node in graph.node:
        for attribute in node.attribute:
            inner = ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                     else list(attribute.graphs) if attribute.type == onnx.AttributeProto.GRAPHS else [])
            for sub in inner:
                where = f"the {attribute.name} of {node.op_type} node {node.name!r}"
                for value in {o for n in sub.node for o in n.output}:
                    found.setdefault(value, where)
                subgraph_values(sub, found)  # deeper subgraphs: setdefault keeps the outer where
    return found


def tapped(graphs: Graphs, layout, config: ModelConfig, tensors: list[str]) -> tuple[dict, dict, dict]:
    """(encoder taps, decoder taps) as {ONNX value: canonical tensor}, and {tensor: why not} for the
    layout's taps that name no value of their graph."""
    if layout is None:
        return {}, {}, {}
    switches = config.to_dict()
    enc, dec, missing = {}, {}, {}
    values = {"encoder": graph_values(graphs.encoder), "decoder": graph_values(graphs.decoder)}
    inner = {"encoder": subgraph_values(graphs.encoder.graph), "decoder": subgraph_values(graphs.decoder.graph)}
    for tensor in tensors:
        for tap in layout.taps:
            name = tap.module_for(tensor)
            if name is None or not tap.applies(switches):
                continue
            stack = "encoder" if tensor.startswith("encoder.") else "decoder"
            if name in values[stack]:
                (enc if stack == "encoder" else dec)[name] = tensor
            elif name in inner[stack]:
                missing[tensor] = (f"the layout's tap names {name!r}, a value inside {inner[stack][name]} of the "
                                   f"{stack} graph (not an output the graph can expose)")
            else:
                missing[tensor] = (f"the layout's tap names {name!r}, which names no value of the {stack} graph "
                                   "(a torch module's path is no graph value)")
            break
    return enc, dec, missing


def run_rosetta(graphs: Graphs, config: ModelConfig, src_ids, tgt_ids, taps: tuple[dict, dict]) -> dict[str, np.ndarray]:
    """Our own export's graphs, run as the onnxruntime target runs them (whole prefix, then cached)."""
    from conformance.check.onnx import runtime as onnx_runtime

    encoder = _session(with_outputs(graphs.encoder, list(taps[0])))
    decoder = _session(with_outputs(graphs.decoder, list(taps[1])))
    model = onnx_runtime.Model.of_sessions(config, encoder, decoder)
    out = model(src_ids, tgt_ids)
    return {**(out.attention or {}), **out.intermediates, "logits": out.logits}


def run_optimum(graphs: Graphs, config: ModelConfig, src_ids, tgt_ids, taps: tuple[dict, dict]) -> dict[str, np.ndarray]:
    """optimum's encoder, then its decoder on the whole prefix without a cache and again on the
    second half with the first half's self-attention cache (`use_cache_branch` of a merged graph)."""
    from conformance.check.onnx.runtime import _is_attention, _join_at, element_dtype

    encoder = _session(with_outputs(graphs.encoder, list(taps[0])))
    decoder = _session(with_outputs(graphs.decoder, list(taps[1])))
    inputs = {i.name: i for i in decoder.get_inputs()}
    dtype = element_dtype("model", "encoder_hidden_states", inputs["encoder_hidden_states"].type)
    if config.source == "features":  # Whisper's encoder: input_features (B, n_mels, F), no mask (no padding)
        values = _run(encoder, {"input_features": np.asarray(src_ids, dtype)})
        fixed = {}
    else:
        mask = (src_ids != config.pad_id).astype(np.int64)  # (B, S)
        values = _run(encoder, {"input_ids": src_ids, "attention_mask": mask})
        fixed = {"encoder_attention_mask": mask}
    memory = values.pop("last_hidden_state")  # (B, S, D)
    values["encoder.output"] = memory
    batch, length = tgt_ids.shape
    fixed["encoder_hidden_states"] = memory
    past = {name: np.zeros((batch, config.n_heads, 1 if name.endswith(("encoder.key", "encoder.value")) else 0,
                            config.head_dim), dtype)
            for name in inputs if name.startswith("past_key_values.")}

    def call(ids, cache, use_cache):
        feed = {"input_ids": ids, **fixed, **cache}
        if "use_cache_branch" in inputs:
            feed["use_cache_branch"] = np.array([use_cache])
        return _run(decoder, {k: v for k, v in feed.items() if k in inputs})

    whole = call(tgt_ids, past, False)
    split = max(1, length // 2)
    present = {name.replace("present.", "past_key_values.", 1): whole.pop(name) for name in list(whole)
               if name.startswith("present.")}
    if split < length and "use_cache_branch" in inputs:  # a merged decoder: its cached branch too
        cache = {name: value if ".encoder." in name else value[:, :, :split] for name, value in present.items()}
        rest = call(tgt_ids[:, split:], cache, True)
        rest = {k: v for k, v in rest.items() if not k.startswith("present.")}
        # The position axis from the canonical name a tap gives the value: (B, H, T, Tk) attention
        # weights join on 2, the rest (B, T, ...) on 1.
        axis = {name: 2 if _is_attention(taps[1].get(name, name)) else 1 for name in whole}
        whole = {name: _join_at(whole[name], rest[name], split, axis[name]) if name in rest else whole[name]
                 for name in whole}
    values.update(whole)
    return values


def _run(session, inputs) -> dict[str, np.ndarray]:
    missing = [i.name for i in session.get_inputs() if i.name not in inputs]
    if missing:
        raise InputError("model", f"a graph with the input(s) {missing}, which compare does not feed (it feeds "
                                  f"optimum's names: {', '.join(sorted(inputs))})")
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))


def run_one_graph(graph: OneGraph, config: ModelConfig, src_ids, tgt_ids, taps: tuple[dict, dict],
                  feed: dict[str, str]) -> dict[str, np.ndarray]:
    """One graph of a whole model on the whole batch, fed as `single.feeds` says, with the tapped
    values as extra outputs; its logits as "logits"."""
    from conformance.check.onnx.single import fed

    values = _run(_session(with_outputs(graph.proto, list(taps[0]))), fed(feed, src_ids, tgt_ids, config.pad_id))
    values["logits"] = values.pop(graph.logits)
    return values


def runtime_errors() -> tuple[type[Exception], ...]:
    """What ONNX Runtime raises for a graph it cannot load or run (its classes share no base)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return tuple(c for c in vars(state).values() if isinstance(c, type) and issubclass(c, Exception))


def compare_onnx(model: Any, layout: Any, src_ids, tgt_ids, *, weights=None, run: Callable | None = None,
                 dtype: str = "float32", backends: Any = None, grads: bool = False, labels=None,
                 label_smoothing: float = 0.0, progress: Callable[[str], None] | None = None,
                 oracle: tuple[ModelConfig, dict, Any] | None = None, inputs: dict[str, str] | None = None,
                 **overrides: Any) -> SideBySide:
    """The user's ONNX graphs beside the oracle (and our backends), tensor by tensor; see the
    module's docstring. `layout`: the layout of `weights` (None: a rosetta checkpoint, or a
    Hugging Face folder's own). `run` and `grads` do not apply to graphs: refused. `model` may be
    the `Graphs` of `load_graphs` and `oracle` the (config, params, layout) of `oracle_weights`,
    read already (the CLI reads them first, for the default batch): then they are not read again.
    `inputs`: for one graph of the whole model, {graph input: what it is given} (`single.feeds`)
    where its inputs are not the layout's [hf.call] names."""
    if run is not None:
        raise InputError("run", "ONNX graphs are run by compare itself (their inputs are named): no run function")
    if grads:
        raise InputError("grads", "ONNX graphs have no backward pass to compare")
    progress = progress or (lambda message: None)
    tgt_ids = as_ids("tgt_ids", tgt_ids)
    progress("reading the graphs")
    graphs = load_graphs(model)
    if inputs is not None and graphs.convention != ONE_GRAPH:
        raise InputError("inputs", f"maps the inputs of one graph of a whole model; {graphs.where} holds "
                                   f"{graphs.convention}'s encoder and decoder graphs, fed by their own names")
    if oracle is None:
        progress("reading the weights the graphs were exported from")
        oracle = oracle_weights(weights, model if not isinstance(model, (tuple, list, Graphs, OneGraph)) else None,
                                layout, overrides)
    config, params, layout = oracle
    # The source as the weights' model takes it: ids, or a features source's log-mel features.
    src_ids = as_features(src_ids) if config.source == "features" else as_ids("src_ids", src_ids)
    if src_ids.shape[0] != tgt_ids.shape[0]:
        raise InputError("tgt_ids", f"has {tgt_ids.shape[0]} rows, src_ids {src_ids.shape[0]}")
    feed = None
    if graphs.convention == ONE_GRAPH:
        from conformance.check.onnx import single

        feed, how = single.feeds(graphs, layout, config.pad_id, inputs)
        single.check_shapes(graphs, feed, src_ids, tgt_ids)
    # A shift-right layout describes a system that shifts its targets itself; a graph takes its
    # decoder input as given. The oracle and the graphs both read shift_right(tgt_ids), so every
    # position is compared (no position of one stands beside another position of the other).
    shifted = layout is not None and layout.tap_options["decoder_input"] == "shift-right"
    ours_tgt = shift_right(tgt_ids) if shifted else tgt_ids

    names = backend_names(backends)
    targets, skipped = default_targets(names, [dtype]) if names else ([], {})
    source = f"ONNX graphs ({graphs.convention}) against {weights or graphs.where}"
    if targets:
        report = run_check(config, params, source, targets, skipped, src_ids, ours_tgt, progress=progress)
    else:
        report = Report(config=config, source=source, targets=[], tensors=forward_order(config), skipped=skipped)
    yours = backend_registry.Target(YOURS, "cpu", graphs.dtype())
    result = SideBySide(**{f: getattr(report, f) for f in Report.__dataclass_fields__},
                        layout=layout.name if layout is not None else "rosetta", yours=yours,
                        batch_axis=0 if layout is None else layout.tap_options["batch_axis"])
    result.targets = [yours, *result.targets]
    if feed is not None:
        result.note = single.describe_feed(feed, how, config.pad_id)
        # A graph exported without the source mask masks no padding: said before any switch.
        result.unmasked = "src_mask" not in feed.values() and bool((src_ids == config.pad_id).any())
        result.unmasked_remedy = (f"export the graph with the source mask as an input (its inputs: {', '.join(feed)}; "
                                  "torch.onnx.export(model, (input_ids, attention_mask, decoder_input_ids), ...)), "
                                  "or compare it on a batch without source padding")
    elif not graphs.cached:
        result.note = ("cache not checked: the decoder graph has no use_cache_branch, so it ran on the whole prefix "
                       "only (optimum's decoder_with_past_model.onnx is not read; decoder_model_merged.onnx is)")
    reference = oracle_tensors(config, params, src_ids, ours_tgt)
    taps_of = single.tapped if feed is not None else tapped
    enc, dec, missing = taps_of(graphs, layout, config, result.tensors)
    progress(f"your graphs in ONNX Runtime ({yours.label})")
    runner = (run_rosetta if graphs.convention == "rosetta" else run_optimum) if feed is None else (
        lambda *args: run_one_graph(*args, feed))
    try:
        got = runner(graphs, config, src_ids, ours_tgt, (enc, dec))
    except (*runtime_errors(), InputError) as exc:  # the graphs failing in the runtime: the report's error
        result.errors[yours.label] = f"{type(exc).__name__}: {exc}"
        return result
    for name, tensors in {**enc, **dec}.items():  # a value of the graph is one tensor, or several (one graph)
        if name in got:
            value = got.pop(name)
            got.update({tensor: value for tensor in (tensors if isinstance(tensors, tuple) else (tensors,))})
    tol = tolerance(yours.dtype, yours.device)
    for tensor in result.tensors:
        if tensor in got and got[tensor] is not None:
            ours, theirs = reference[tensor], np.asarray(got[tensor])
            result.cells[(tensor, yours.label)] = Cell(comparison=compare_arrays(theirs, ours, tol))
        else:
            why = missing.get(tensor) or ("not an output of the graphs, and no tap of the layout names a value "
                                          "of theirs for it")
            result.cells[(tensor, yours.label)] = Cell(unavailable=why)
    return result
