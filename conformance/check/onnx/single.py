"""One graph: a user's own export of a whole transformers seq2seq model, beside the oracle.

    torch.onnx.export(model, (input_ids, attention_mask, decoder_input_ids), "model.onnx")
    report = compare_onnx("model.onnx", "hf-bart", src_ids, tgt_ids, weights="bart-folder/")
    rosetta compare model.onnx bart-folder/

The graph runs the encoder and the decoder on the whole target prefix at once (no cache), as the
model's forward did when it was exported.

Inputs. By transformers' names, as the layout's `[hf.call]` says (input_ids: the source ids,
attention_mask: 1 where a source id is not pad_id, decoder_input_ids: the decoder's input ids): the
dynamo exporter (torch.onnx.export's default) names the inputs after the forward's arguments. The
TorchScript exporter (`dynamo=False`) names them after its traced values (`input.1`,
`attention_mask.1`, `input.15`); a graph none of whose inputs carries a call's name, but with as
many inputs as its keywords, is fed in the call's order, which is the forward's (and the order
torch.onnx.export passes them in), and the report says so. A graph some of whose inputs carry the
call's names and some not (`input_ids`, `decoder_input_ids`, `decoder_attention_mask`) is refused,
naming the others: an order would feed a named input another's value. A graph without the source
mask (`attention_mask`), run on a batch with source padding, gets the report's hint that the run
gave it no padding mask. `inputs=` (`--inputs` on the command
line) maps each graph input to what it is given instead: `{"input.1": "src_ids", ...}`, by the
names of `conformance.convert.hf_config.CALL_VALUES`.

Outputs. The logits: the output named `logits`, else the graph's first (transformers' output
objects put the logits first, and torch.onnx.export flattens them in that order).

Taps with no taps file. Both exporters record which module computed each node: the TorchScript
exporter in the node's name (`/model/encoder/layers.1/final_layer_norm/LayerNormalization`), the
dynamo exporter in the node's metadata (`pkg.torch.onnx.name_scopes`: `['', 'model', ...,
'model.encoder.layers.1.final_layer_norm', 'layer_norm_4']`, and `namespace`). So the layout's
`[taps]`, written for the live model's module paths, name values of the graph:

    a module's output             the value computed inside the module's scope that the graph reads
                                  outside it (the last, when several are)
    input k                       the k-th floating value of rank 3 the scope reads from outside it,
                                  in the order its nodes first read them
    attention weights (*.self,    the output of the last Softmax inside the module's scope (the
    *.cross)                      module's tuple output is flattened away)

An attribute tap, a module called more than once (`call = k`), a scope the graph does not hold
(a fused attention has no Softmax) is reported as not exposed, with why. Each value found is added
as a graph output for the run, so that a planted bug is named at the first tensor it reaches.
"""

from __future__ import annotations

import ast

import numpy as np

from conformance.core.errors import InputError

ONE_GRAPH = "one graph"
ATTENTION = (".self", ".cross")
# onnx.TensorProto's floating element types (FLOAT, FLOAT16, DOUBLE, BFLOAT16).
FLOATING = {1, 10, 11, 16}


class OneGraph:
    """A whole model in one ONNX graph (the `Graphs` interface of `compare`: `convention`,
    `cached`, `dtype`, `where`)."""

    convention = ONE_GRAPH
    cached = False

    def __init__(self, proto, where: str):
        self.proto, self.where = proto, where
        outputs = [o.name for o in proto.graph.output]
        if not outputs:
            raise InputError("model", f"{where}: the graph has no outputs")
        self.logits = "logits" if "logits" in outputs else outputs[0]

    def dtype(self) -> str:
        import onnx

        from conformance.check.onnx.runtime import element_dtype

        out = next(o for o in self.proto.graph.output if o.name == self.logits)
        kind = f"tensor({onnx.TensorProto.DataType.Name(out.type.tensor_type.elem_type).lower()})"
        return element_dtype("model", f"{self.where}: the graph's logits ({self.logits})", kind).name


# -- Inputs --------------------------------------------------------------------------------------


def feeds(graph: OneGraph, layout, pad_id: int, inputs: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """({graph input: what it is given (CALL_VALUES)}, how that was decided, in words)."""
    from conformance.convert.hf_config import CALL_VALUES

    names = [i.name for i in graph.proto.graph.input if i.name not in {t.name for t in graph.proto.graph.initializer}]
    if inputs is not None:
        unknown = sorted(set(inputs) - set(names))
        bad = {k: v for k, v in inputs.items() if v not in CALL_VALUES}
        if unknown or bad:
            raise InputError("inputs", f"maps the graph's inputs {names} to some of {sorted(CALL_VALUES)}; got "
                                       f"{'unknown input(s) ' + str(unknown) if unknown else ''}"
                                       f"{' and ' if unknown and bad else ''}{'values ' + str(bad) if bad else ''}")
        missing = [n for n in names if n not in inputs]
        if missing:
            raise InputError("inputs", f"gives nothing for the graph's input(s) {missing}")
        return dict(inputs), "as inputs= maps them"
    # the call's tensors (a flag such as FSMT's use_cache=false is the live model's, no graph input)
    call = {k: v for k, v in (layout.hf.call.items() if layout is not None and layout.hf is not None else ())
            if not isinstance(v, bool)}
    if not call:
        raise InputError("inputs", f"{graph.where}: a one-graph export is fed by transformers' names, which the layout "
                                   f"{getattr(layout, 'name', '(none: a rosetta checkpoint)')} does not give ([hf.call]); "
                                   f"map its inputs {names} with inputs= (--inputs NAME=src_ids,...)")
    if all(n in call for n in names):
        if "tgt_ids" not in {call[n] for n in names}:
            raise InputError("model", f"{graph.where}: one .onnx file is one graph, and this one takes no decoder "
                                      f"input (its inputs: {', '.join(names)}): the graph of a whole model takes the "
                                      "decoder's ids too; an encoder or decoder graph is compared with its "
                                      "other half: pass the pair (encoder, decoder) or the folder with both "
                                      "(encoder.onnx + decoder.onnx, or encoder_model.onnx + "
                                      "decoder_model_merged.onnx)")
        return {n: call[n] for n in names}, "by name, as the layout's [hf.call] says"
    named = [n for n in names if n in call]
    if named:  # some by name, some not: an order would feed the named ones something else
        unmatched = [n for n in names if n not in call]
        raise InputError("inputs", f"{graph.where}: the graph's input(s) {unmatched} are not among the layout's "
                                   f"[hf.call] names ({', '.join(call)}), while {named} are; it is not fed by order "
                                   f"(that would give a named input another's value): map every input with inputs= "
                                   f"(--inputs NAME=src_ids,...), each to one of "
                                   f"{', '.join(sorted(CALL_VALUES))}")
    if len(names) == len(call):
        return dict(zip(names, call.values())), ("in the order of the layout's [hf.call] (the forward's), the graph's "
                                                 "input names not being its")
    raise InputError("inputs", f"{graph.where}: the graph's inputs {names} are not the layout's [hf.call] names "
                               f"({', '.join(call)}) nor as many: map them with inputs= (--inputs NAME=src_ids,...)")


def fixed_shapes(graph: OneGraph, feed: dict[str, str]) -> dict[str, tuple[int, ...]]:
    """{"src_ids": (B, S), "tgt_ids": (B, T)} where the graph was exported for fixed shapes (no
    dynamic_shapes / dynamic_axes: every dimension a number); empty where any is symbolic."""
    shapes = {}
    for value in graph.proto.graph.input:
        if value.name not in feed:
            continue
        dims = value.type.tensor_type.shape.dim
        if not dims or any(not d.HasField("dim_value") for d in dims):
            return {}
        side = "src_ids" if feed[value.name].startswith("src") else "tgt_ids"
        shapes[side] = tuple(d.dim_value for d in dims)
    return shapes


def check_shapes(graph: OneGraph, feed: dict[str, str], src_ids: np.ndarray, tgt_ids: np.ndarray) -> None:
    """InputError when the graph takes fixed shapes and the batch has others."""
    fixed = fixed_shapes(graph, feed)
    given = {"src_ids": src_ids.shape, "tgt_ids": tgt_ids.shape}
    wrong = {side: shape for side, shape in fixed.items() if tuple(given[side]) != shape}
    if wrong:
        side = sorted(wrong)[0]
        raise InputError(side, f"is {tuple(given[side])}; {graph.where} was exported for fixed shapes ("
                               + ", ".join(f"{k} {v}" for k, v in sorted(fixed.items()))
                               + ": torch.onnx.export without dynamic_shapes): give a batch of those shapes "
                                 "(--src/--tgt), or export with dynamic_shapes")


def default_batch(graph: OneGraph, config, layout, inputs: dict[str, str] | None) -> tuple[np.ndarray, np.ndarray]:
    """`fixed_batch`'s padded rows, at the graph's fixed shapes when it has them: row 0 full,
    then rows ending in padding (two pads, then all but one token), repeated to the batch size."""
    from conformance.check.report import fixed_batch

    fixed = fixed_shapes(graph, feeds(graph, layout, config.pad_id, inputs)[0])
    if set(fixed) != {"src_ids", "tgt_ids"}:
        return fixed_batch(config)
    rng = np.random.default_rng(0)

    def rows(shape: tuple[int, ...], vocab: int) -> np.ndarray:
        choices = np.array([i for i in range(vocab) if i != config.pad_id])
        out = rng.choice(choices, size=shape)
        for r in range(shape[0]):
            real = (shape[1], max(1, shape[1] - 2), 1)[r % 3]
            out[r, real:] = config.pad_id
        return out

    return rows(fixed["src_ids"], config.src_vocab_size), rows(fixed["tgt_ids"], config.tgt_vocab_size)


def fed(what: dict[str, str], src_ids: np.ndarray, tgt_ids: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    given = {"src_ids": src_ids, "tgt_ids": tgt_ids, "src_mask": (src_ids != pad_id).astype(np.int64),
             "tgt_mask": (tgt_ids != pad_id).astype(np.int64)}
    return {name: given[value] for name, value in what.items()}


# -- Scopes: which module computed each node -------------------------------------------------------


def node_scope(node) -> str | None:
    """The module path (`model.encoder.layers.1.final_layer_norm`, "" for the root) that computed
    `node`, as its exporter recorded it, or None where it recorded none."""
    meta = {p.key: p.value for p in node.metadata_props}
    if "pkg.torch.onnx.name_scopes" in meta:  # dynamo: the scopes from the root in, then the FX node
        try:
            scopes = ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
        except (ValueError, SyntaxError):
            scopes = None
        if isinstance(scopes, list) and len(scopes) >= 2:
            return str(scopes[-2])
    if "namespace" in meta:  # dynamo: "path: class/path: class/.../fx node: op"
        entries = meta["namespace"].split("/")
        if len(entries) >= 2:
            return entries[-2].split(": ")[0]
    if node.name.startswith("/"):  # TorchScript: /model/encoder/layers.1/final_layer_norm/LayerNormalization
        return ".".join(node.name.split("/")[1:-1])
    return None


class Scopes:
    """The graph's nodes by the module that computed them, and what each module read and gave."""

    def __init__(self, proto):
        import onnx

        graph = proto.graph
        self.nodes = list(graph.node)  # topologically sorted, as ONNX requires
        self.scope = [node_scope(node) for node in self.nodes]
        self.outputs = {o.name for o in graph.output}
        self.constants = {i.name for i in graph.initializer} | {
            o for node in self.nodes if node.op_type == "Constant" for o in node.output}
        inferred = onnx.shape_inference.infer_shapes(proto).graph
        self.types = {}
        for value in [*inferred.value_info, *inferred.input, *inferred.output]:
            tensor = value.type.tensor_type
            rank = len(tensor.shape.dim) if tensor.HasField("shape") else None
            self.types[value.name] = (tensor.elem_type, rank)
        self.recorded = any(scope is not None for scope in self.scope)

    def within(self, path: str) -> list[int]:
        return [i for i, scope in enumerate(self.scope)
                if scope is not None and (scope == path or scope.startswith(path + "."))]

    def output_of(self, path: str) -> str | None:
        """The value computed inside `path` that the graph reads outside it (the last such)."""
        inside = set(self.within(path))
        made = {o: i for i in inside for o in self.nodes[i].output}
        read_outside = {v for j, node in enumerate(self.nodes) if j not in inside for v in node.input}
        given = [o for o, i in sorted(made.items(), key=lambda item: item[1])
                 if (o in read_outside or o in self.outputs) and self.types.get(o, (1, None))[0] in FLOATING]
        return given[-1] if given else None

    def input_of(self, path: str, index: int) -> str | None:
        """The `index`-th floating value of rank 3 that `path` reads from outside it, by first read."""
        inside = self.within(path)
        made = {o for i in inside for o in self.nodes[i].output}
        read = []
        for i in inside:
            for value in self.nodes[i].input:
                kind, rank = self.types.get(value, (None, None))
                if (value and value not in made and value not in self.constants and value not in read
                        and kind in FLOATING and rank == 3):
                    read.append(value)
        return read[index] if index < len(read) else None

    def softmax_in(self, path: str) -> str | None:
        found = [self.nodes[i].output[0] for i in self.within(path) if self.nodes[i].op_type == "Softmax"]
        return found[-1] if found else None


def tapped(graph: OneGraph, layout, config, tensors: list[str]) -> tuple[dict, dict, dict]:
    """({graph value: the canonical tensors it is}, {}, {tensor: why not}): the layout's taps found
    in the graph by module scope (module docstring)."""
    if layout is None or not layout.taps:
        return {}, {}, {}
    scopes = Scopes(graph.proto)
    if not scopes.recorded:
        why = "the graph records no module scopes (neither node names /module/... nor name_scopes metadata)"
        return {}, {}, {t: why for t in tensors if any(tap.module_for(t) for tap in layout.taps)}
    switches = config.to_dict()
    found, missing = {}, {}
    for tensor in tensors:
        for tap in layout.taps:
            path = tap.module_for(tensor)
            if path is None or not tap.applies(switches):
                continue
            value, why = _value(scopes, tensor, path, tap)
            if value is None:
                missing[tensor] = why
            else:  # one value may be two tensors: the last layer's output is the stack's
                found[value] = (*found.get(value, ()), tensor)
            break
    return found, {}, missing


def _value(scopes: Scopes, tensor: str, path: str, tap) -> tuple[str | None, str]:
    if tap.attribute is not None:
        return None, f"the layout's tap reads {path}'s attribute {tap.attribute!r}, which a graph does not keep"
    if tap.call not in (None, 0):
        return None, f"the layout's tap reads call {tap.call} of {path}, which the graph's scopes do not tell apart"
    if not scopes.within(path):
        return None, f"no node of the graph was computed in {path} (the layout's tap {tap.describe()})"
    if tensor.endswith(ATTENTION):
        value = scopes.softmax_in(path)
        return value, f"no Softmax inside {path}: its attention weights are not a value of the graph (fused)"
    if isinstance(tap.input, int):
        value = scopes.input_of(path, tap.input)
        return value, f"{path} reads no {tap.input}-th (B, L, D) value from outside it in the graph"
    if tap.input is not None:
        return None, f"the layout's tap reads {path}'s keyword {tap.input!r}, which a graph does not keep"
    value = scopes.output_of(path)
    return value, f"nothing computed inside {path} is read outside it in the graph"


# -- The report -----------------------------------------------------------------------------------


def describe_feed(feed: dict[str, str], how: str, pad_id: int) -> str:
    spelled = {"src_ids": "src_ids", "tgt_ids": "tgt_ids", "src_mask": f"(src_ids != {pad_id})",
               "tgt_mask": f"(tgt_ids != {pad_id})"}
    return (f"one graph, run once on the whole batch (no cache), fed {how}: "
            + ", ".join(f"{name} = {spelled[what]}" for name, what in feed.items()))

