"""The `onnxruntime` target: impl_torch's model exported to ONNX and run by ONNX Runtime.

    rosetta check --backends numpy,onnxruntime                 (CPU execution provider, float32)

A deployed translation model is rarely the PyTorch module: it is an ONNX graph, traced by torch's
exporter and run by ONNX Runtime, and the trace can drop what the Python did (a mask, a cache
wired to the wrong layer) without any error. This target builds `impl_torch.Model` from the
config and parameters, exports it with `conformance.check.onnx.export` (with every tap that
`rosetta check` compares as an extra graph output) into a temporary folder, loads the two graphs into ONNX
Runtime sessions, and answers a model call with the sessions' tensors, so the report puts the
runtime beside the float64 oracle tensor by tensor.

A call runs the decoder graph twice: on the whole target prefix with an empty cache, and again
with the first half of the positions as a cache (the first call's `present_*` outputs, cut to
those positions, fed back as `past_*`), computing only the rest. Each tensor is the first call's
rows for the first half and the second call's for the rest, so the later positions' logits and
taps are those the cache produced, and a graph that reads its cache wrong shows at the first
tensor it touches. The cache is cut from the whole-prefix call, not made by a call on the first
half alone, so that its values are the oracle's even where a fully masked row (a -inf fill) has
made a NaN that the whole-sequence forward carries into every later layer (0 x NaN).

`generate` is a cached decode loop over the sessions: the encoder graph once, then the decoder
graph on the prefix with the last step's `present_*` as its `past_*` (reordered by the beams'
parents), one new position per call. The tokens are chosen by `conformance.core.generation.search.search`,
the reference search the suite's oracle runs (`runner.oracle_generate`), fed the runtime's logits.

The suite builds a model per example, and an export takes seconds: the two graphs are kept per
(config, dtype, parameters) (`onnx_export.export_bytes`), so the properties that share an example
(forward, encode-decode, determinism, the pairs) pay for one export, and so does a `rosetta
convert --to onnx --taps` of the same checkpoint in the same process.

A features source (Whisper's) is fed to the encoder graph as `src_features` (B, n_mels, frames),
with no mask (its window has no padding); the decoder graph gets a source mask of all S = frames / 2
positions.

Float32 only, on the CPU execution provider: the exporter traces the model in its own dtype.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np

try:
    import onnxruntime
    import onnxscript  # noqa: F401 - torch's exporter needs it, and says so only after tracing
except ImportError as _missing:
    raise ImportError(f"{_missing}: the onnxruntime target needs the [onnx] extra "
                      "(pip install 'rosetta-transformer[onnx]')") from None

import impl_numpy
import impl_torch  # noqa: F401 - the graphs are traced from it: without torch the target is unavailable
from conformance.core.config import ModelConfig
from conformance.core.errors import InputError
from conformance.core.inputs import (check_dtype, check_generate, check_same_batch, expected_mask_shapes,
                                     host_features, host_ids, host_mask)
from conformance.core.output import Encoded, ModelOutput, forward_order, record

NAME = "onnxruntime"
SUPPORTED_DTYPES = ("float32",)
PROVIDER = "CPUExecutionProvider"


def version() -> str:
    import torch

    return f"onnxruntime {onnxruntime.__version__} ({PROVIDER}), exported by torch {torch.__version__}"


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """ONNX Runtime's CPU kernels compute float32 in float32: there is nothing to switch."""
    yield


def precision_settings() -> dict[str, Any]:
    return {"execution_provider": PROVIDER}


# The onnxruntime element types of graph inputs and outputs -> NumPy dtypes (also read by
# conformance.check.onnx.compare): what an empty cache or a fed tensor must be made of.
ELEMENT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                 "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def element_dtype(graph: str, name: str, kind: str) -> np.dtype:
    """The NumPy dtype of the graph input or output `name` whose onnxruntime type is `kind`."""
    if kind not in ELEMENT_TYPES:
        raise InputError(graph, f"{name} is a {kind}, which the {NAME} target cannot feed or read "
                         f"(it knows {', '.join(sorted(ELEMENT_TYPES))})")
    return np.dtype(ELEMENT_TYPES[kind])


class Model:
    """`Model(config, params, dtype, *, device, param_dtype)`, the shared surface, over two ONNX
    Runtime sessions exported from `impl_torch.Model(config, params, dtype, param_dtype=...)`."""

    backend = NAME

    def __init__(self, config: ModelConfig, params, dtype: Any = None, *, device: str | None = None,
                 param_dtype: Any = None):
        from conformance.check.onnx.export import export_bytes

        dtype = "float32" if dtype is None else str(dtype)
        check_dtype(self.backend, dtype, SUPPORTED_DTYPES)
        if device not in (None, "cpu"):
            raise InputError("device", f"the {self.backend} target runs on the CPU only, got {device!r}")
        self.config = config
        encoder, decoder = export_bytes(config, params, dtype, param_dtype, taps=True)
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3  # warnings about unused shape hints are not findings
        self.encoder = onnxruntime.InferenceSession(encoder, options, providers=[PROVIDER])
        self.decoder = onnxruntime.InferenceSession(decoder, options, providers=[PROVIDER])
        self.layers = config.n_decoder_layers

    @classmethod
    def of_sessions(cls, config: ModelConfig, encoder, decoder) -> "Model":
        """The model over two sessions of graphs `rosetta convert --to onnx` wrote (with or without
        taps; a graph output that is no tap of ours is kept under its own name): how
        `conformance.check.onnx.compare` runs a user's copy of our export."""
        model = cls.__new__(cls)
        model.config, model.encoder, model.decoder = config, encoder, decoder
        model.layers = config.n_decoder_layers
        return model

    def _src_mask(self, src_ids: np.ndarray, src_mask) -> np.ndarray:
        if src_mask is not None:
            batch, length = src_ids.shape
            expected = expected_mask_shapes(self.config, batch, length, 1)["src_mask"]
            host_mask("src_mask", src_mask, expected, impl_numpy.padding_mask(src_ids, self.config.pad_id))
            raise InputError("src_mask", f"the {self.backend} target derives the source mask from the ids "
                             "(the exported graph's src_mask input); an explicit mask is not passed through")
        return src_ids != self.config.pad_id  # (B, S)

    def _source(self, src_ids, src_mask) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """(the encoder graph's inputs, the source mask (B, S) the decoder graph takes)."""
        if self.config.source == "features":  # log-mel features (B, n_mels, F): no padding, every position
            features = host_features("src_ids", src_ids, self.config)
            if src_mask is not None:
                raise InputError("src_mask", f"the {self.backend} target attends every position of a features "
                                 "source (the exported encoder graph takes no mask); an explicit mask is not passed "
                                 "through")
            kinds = {i.name: i.type for i in self.encoder.get_inputs()}
            if "src_features" not in kinds:
                raise InputError("encoder", f"the encoder graph takes {sorted(kinds)}, not src_features: a graph of "
                                 "`rosetta convert --to onnx` of a features source takes src_features (B, n_mels, F)")
            dtype = element_dtype("encoder", "src_features", kinds["src_features"])
            mask = np.ones((features.shape[0], features.shape[2] // 2), dtype=bool)  # (B, S)
            return {"src_features": features.astype(dtype)}, mask
        src_ids = host_ids("src_ids", src_ids, self.config.src_vocab_size, self.config.max_len).astype(np.int64)
        mask = self._src_mask(src_ids, src_mask)
        return {"src_ids": src_ids, "src_mask": mask}, mask

    def encode(self, src_ids, src_mask=None, *, sink=None, return_attention: bool = True) -> Encoded:
        """The encoder graph's outputs: the cross-attention keys and values and the encoder taps."""
        inputs, mask = self._source(src_ids, src_mask)
        outputs = dict(zip([o.name for o in self.encoder.get_outputs()], self.encoder.run(None, inputs)))
        encoded = Encoded(memory=outputs.get("encoder.output"), src_mask=mask, attention=record(), intermediates=record())
        missing = [name for name in _names("cross", self.layers) if name not in outputs]
        if missing:
            raise InputError("encoder", f"the encoder graph has no output {missing[0]}: a graph of "
                             f"`rosetta convert --to onnx` gives cross_key.i and cross_value.i for each of the "
                             f"{self.layers} decoder layers")
        encoded.cross = [outputs.pop(name) for name in _names("cross", self.layers)]
        for name, value in outputs.items():
            (encoded.attention if _is_attention(name) else encoded.intermediates)[name] = value
        return encoded

    def decode(self, tgt_ids, encoded: Encoded, tgt_mask=None, *, sink=None,
               return_attention: bool = True) -> ModelOutput:
        """The decoder graph on the whole prefix with an empty cache, then on its second half with
        the first half's keys and values as the cache (see the module docstring)."""
        tgt_ids = host_ids("tgt_ids", tgt_ids, self.config.tgt_vocab_size, self.config.max_len).astype(np.int64)
        check_same_batch(encoded.src_mask.shape, tgt_ids.shape)
        batch, length = tgt_ids.shape
        if tgt_mask is not None:  # checked as every backend checks it, then refused
            expected = expected_mask_shapes(self.config, batch, 1, length)["tgt_mask"]
            host_mask("tgt_mask", tgt_mask, expected, impl_numpy.target_mask(self.config, tgt_ids))
            raise InputError("tgt_mask", f"the {self.backend} target derives the target mask from the ids "
                             "inside the exported decoder graph; an explicit mask is not passed through")
        split = max(1, length // 2)
        past = self._empty_cache(batch)
        cross = dict(zip(_names("cross", self.layers), encoded.cross))
        inputs = {"tgt_ids": tgt_ids, "src_mask": encoded.src_mask, **cross}
        whole = self._decode({**inputs, **past})
        present = {name.replace("present", "past", 1): whole.pop(name) for name in _names("present", self.layers)}
        if split == length:  # a single position: no cache to read
            joined = whole
        else:
            rest = self._decode({**inputs, **{name: value[:, :, :split] for name, value in present.items()}})
            # Only our own tensors are joined, along the axis their name says; any other graph
            # output (a user's tap on a converted graph) is the whole-prefix call's, as it is.
            ours = set(forward_order(self.config))
            joined = {name: _join_at(whole[name], rest[name], split, 2 if _is_attention(name) else 1)
                      if name in ours else value for name, value in whole.items()}
        out = ModelOutput(logits=joined.pop("logits"), attention=dict(encoded.attention),
                          intermediates=dict(encoded.intermediates))
        for name, value in joined.items():
            (out.attention if _is_attention(name) else out.intermediates)[name] = value
        if sink is not None:
            for name in forward_order(self.config):
                held = out.attention if name in out.attention else out.intermediates
                if name == "logits":
                    sink(name, out.logits)
                elif name in held:
                    sink(name, held.pop(name))
            out.logits = None
        if not return_attention:
            out.attention = None
        return out

    def _decode(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip([o.name for o in self.decoder.get_outputs()], self.decoder.run(None, inputs)))

    def generate(self, src_ids, max_len: int | None = None, bos_id: int | None = None, eos_id: int | None = None,
                 **options):
        """`impl_numpy.Model.generate`'s surface and search, over the sessions: the encoder graph
        once, then the decoder graph one new position per call, its `present_*` the next call's
        `past_*` (the rows reordered by the beams' parents); with use_cache=False the decoder
        graph on the whole prefix at every step, with an empty cache."""
        from conformance.core.generation.settings import check_sources
        from conformance.core.generation.search import search

        settings = check_generate(self.config, max_len, bos_id, eos_id, **options)
        encoded = self.encode(src_ids, return_attention=False)
        check_sources(encoded.src_mask)  # a row of padding only is refused
        batch = encoded.src_mask.shape[0]
        rows = np.repeat(np.arange(batch), settings.rows)  # (N,): each source once per beam (or sample)
        fixed = {"src_mask": encoded.src_mask[rows], **{name: value[rows] for name, value in
                                                        zip(_names("cross", self.layers), encoded.cross)}}
        empty = self._empty_cache(len(rows))
        cache = {"past": empty}

        def step(tokens: np.ndarray, parents: np.ndarray | None) -> np.ndarray:
            tokens = np.asarray(tokens, dtype=np.int64)  # (N, t + 1): the whole prefix
            if not settings.use_cache:
                return self._decode({"tgt_ids": tokens, **fixed, **empty})["logits"][:, -1]  # (N, V)
            if parents is not None:  # beam search: row i continues row parents[i]
                cache["past"] = {name: value[parents] for name, value in cache["past"].items()}
            outputs = self._decode({"tgt_ids": tokens, **fixed, **cache["past"]})
            cache["past"] = {name.replace("present", "past", 1): outputs[name] for name in _names("present", self.layers)}
            return outputs["logits"][:, -1]  # (N, V): the one new position's

        ids, scores = search(step, batch, settings.max_len, settings.bos_id, settings.eos_id, self.config.pad_id,
                             mask_fill=self.config.mask_fill,
                             src_ids=np.asarray(src_ids) if settings.reads_source else None,  # the ids, as given
                             **settings.search_options())
        ids = np.asarray(ids).astype(np.int64)
        return (ids, scores) if settings.return_scores else ids

    def _empty_cache(self, rows: int) -> dict[str, np.ndarray]:
        shape = (rows, self.config.n_heads, 0, self.config.head_dim)  # (N, H, 0, K)
        kinds = {i.name: i.type for i in self.decoder.get_inputs()}
        if "past_key.0" not in kinds:
            raise InputError("decoder", "the decoder graph has no input past_key.0: a graph of `rosetta convert "
                             "--to onnx` takes past_key.i and past_value.i (B, H, P, K) for each decoder layer")
        dtype = element_dtype("decoder", "past_key.0", kinds["past_key.0"])  # the graph's dtype
        return {name: np.zeros(shape, dtype) for name in _names("past", self.layers)}

    def __call__(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, *, sink=None,
                 return_attention: bool = True) -> ModelOutput:
        """logits (B, T, V) and every tap, as `impl_torch.Model.forward` returns them."""
        return self.decode(tgt_ids, self.encode(src_ids, src_mask), tgt_mask, sink=sink,
                           return_attention=return_attention)


def _names(kind: str, layers: int) -> list[str]:
    return [f"{kind}_{part}.{i}" for i in range(layers) for part in ("key", "value")]


def _is_attention(name: str) -> bool:
    return name.endswith((".self", ".cross"))


def _join_at(whole: np.ndarray, rest: np.ndarray, split: int, axis: int) -> np.ndarray:
    """One decoder tensor: the whole-prefix call's first `split` positions, then the cached call's,
    along the position axis `axis` (1 for (B, T, ...); 2 for attention weights (B, H, T, Tk))."""
    return np.concatenate([np.take(whole, np.arange(split), axis=axis), rest], axis=axis)


def _join(whole: np.ndarray, rest: np.ndarray, split: int) -> np.ndarray:
    """`_join_at` with the axis taken from the rank (4-d: attention weights): for tensors known to
    be (B, T, ...) or (B, H, T, Tk), as conformance.check.onnx.compare's are."""
    return _join_at(whole, rest, split, 2 if whole.ndim == 4 else 1)
