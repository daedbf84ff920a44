"""impl_torch's model as two ONNX graphs, written by torch's own exporter (`torch.onnx.export`).

    rosetta convert model.safetensors graphs/ --to onnx [--taps]      (docs/deployment.md; checked in
                                                                      ONNX Runtime before it lands:
                                                                      conformance.formats.onnx)

    encoder.onnx   src_ids (B, S) int64, src_mask (B, S) bool
                   -> cross_key.{i}, cross_value.{i} (B, H, S, K) for each decoder layer i
                   a features source (Whisper's): src_features (B, n_mels, 2 S) float, no mask
                   (its window has no padding: every one of the S positions is attended)
    decoder.onnx   tgt_ids (B, L) int64: the whole target prefix, src_mask (B, S) bool,
                   past_key.{i}, past_value.{i} (B, H, P, K), cross_key.{i}, cross_value.{i}
                   -> logits (B, L - P, V), present_key.{i}, present_value.{i} (B, H, L, K)

The decoder of a features source takes src_mask as every decoder does, all True (B, S).

The decoder computes the positions P .. L - 1 of the prefix, P being the length of the cache it
is given: with P = 0 it is `Model.decode` on the whole prefix; with P = L - 1 it is one cached
decoding step, whose present keys and values are the next step's past ones. It reads the whole
prefix, not only its new tokens, so that its target mask and positions are `decode`'s own
(`target_mask`, `Positions`, the T5 bias), sliced to the new rows. The cross-attention's keys
and values are projected once per source, by the encoder graph, as `start_cache` projects them.

`taps=True` adds the tensors `rosetta check` compares (`conformance.core.output.forward_order`:
embeddings, each attention's weights, each sublayer's output) as outputs of the same names. The
graphs are traced from impl_torch's own modules: what they compute is impl_torch's forward pass,
with the host-side input checks of `Model.encode`/`decode` left to whoever feeds the graphs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import tempfile
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from conformance.core.output import ModelOutput
from impl_torch import Model, target_mask

OPSET = 18  # >= 17, the first with LayerNormalization
ENCODER_FILE, DECODER_FILE = "encoder.onnx", "decoder.onnx"


def source_mask(src_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) source mask input -> (B, 1, 1, S), the model's mask on the keys."""
    return src_mask[:, None, None, :]


def cache_names(model: Model, kind: str) -> list[str]:
    """`{kind}_key.{i}`, `{kind}_value.{i}` for every decoder layer i, in that order."""
    return [f"{kind}_{part}.{i}" for i in range(model.config.n_decoder_layers) for part in ("key", "value")]


def tap_names(model: Model, stack: str) -> list[str]:
    """The `forward_order` tensors of one stack (the logits are the decoder's first output anyway)."""
    from conformance.core.output import forward_order

    return [name for name in forward_order(model.config) if name.startswith(f"{stack}.")]


class Taps(dict):
    """Where the layers record their tensors during the trace: kept, to become graph outputs."""


class EncoderGraph(nn.Module):
    """The encoder of an ids source: the source ids and their mask in."""

    def __init__(self, model: Model, taps: bool):
        super().__init__()
        self.model, self.taps = model, taps

    def forward(self, src_ids: torch.Tensor, src_mask: torch.Tensor):
        model = self.model
        out = ModelOutput(logits=None, attention=Taps(), intermediates=Taps())
        x = model.embed(src_ids, model.encoder.embedding, model.encoder.position, model.encoder.embedding_norm)
        return self.encoded(x, source_mask(src_mask), out)  # mask (B, 1, 1, S)

    def encoded(self, x: torch.Tensor, mask: torch.Tensor, out: ModelOutput) -> tuple[torch.Tensor, ...]:
        """The encoder stack on the embedded source x (B, S, D): each decoder layer's cross keys and
        values, then the encoder's taps."""
        model = self.model
        out.intermediates["encoder.embeddings"] = x
        memory = model.encoder(x, mask, out, return_attention=self.taps)  # (B, S, D)
        cross = [kv for layer in model.decoder.layers for kv in layer.cross_attn.keys_values(memory)]
        tapped = {**out.attention, **out.intermediates}
        return (*cross, *(tapped[name] for name in tap_names(model, "encoder") if self.taps))


class FeaturesEncoderGraph(EncoderGraph):
    """The encoder of a features source (Whisper's): log-mel features (B, n_mels, F) in, through
    the front end (`Model.embed_source`: two convolutions, each followed by GELU, then the
    positions). No mask: the window has no padding, every one of its S = F / 2 positions is attended."""

    def forward(self, src_features: torch.Tensor):
        out = ModelOutput(logits=None, attention=Taps(), intermediates=Taps())
        x = self.model.embed_source(src_features, out)  # (B, S, D)
        return self.encoded(x, features_mask(x), out)


def features_mask(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, 1, S) all True for the front end's output x (B, S, D): a features source has no padding."""
    return torch.ones((x.shape[0], 1, 1, x.shape[1]), dtype=torch.bool, device=x.device)


class PastAndNew:
    """A decoder layer's self-attention keys and values: the cache's, then the new positions'."""

    fix_ups = None  # the fused kernel's, which it works out itself

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value
        self.present = None

    def keys_values(self, attention, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = attention.keys_values(memory)  # (B, H, T, K)
        self.present = (torch.cat([self.key, k], dim=2), torch.cat([self.value, v], dim=2))  # (B, H, P + T, K)
        return self.present


class Given:
    """A decoder layer's cross-attention keys and values, as the encoder graph projected them."""

    fix_ups = None

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value

    def keys_values(self, attention, memory) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key, self.value


def layer_caches(past: list[torch.Tensor], cross: list[torch.Tensor]) -> list[tuple[PastAndNew, Given]]:
    """Layer i's (self, cross) key and value sources from the flat per-layer inputs."""
    return [(PastAndNew(past[2 * i], past[2 * i + 1]), Given(cross[2 * i], cross[2 * i + 1]))
            for i in range(len(past) // 2)]


class DecoderGraph(nn.Module):
    def __init__(self, model: Model, taps: bool):
        super().__init__()
        self.model, self.taps = model, taps

    def forward(self, tgt_ids: torch.Tensor, src_mask: torch.Tensor, *caches: torch.Tensor):
        model, config = self.model, self.model.config
        n = 2 * config.n_decoder_layers
        past, cross = list(caches[:n]), list(caches[n:])
        start = past[0].shape[2]  # P: the positions the cache holds
        length = tgt_ids.shape[1]  # L
        tgt_mask = target_mask(config, tgt_ids)[:, :, start:, :]  # (B, 1, L - P, L)
        cross_mask = source_mask(src_mask) if config.cross_attn_src_mask else None
        embedding = model.encoder.embedding if config.share_embeddings else model.decoder.embedding
        y = model.embed(tgt_ids, embedding, model.decoder.position, model.decoder.embedding_norm)[:, start:]
        scores = torch.promote_types(y.dtype, torch.float32)
        bias = model.decoder.position.score_bias(length, length, scores)  # (1, H, L, L), or None
        bias = None if bias is None else bias[:, :, start:, :]  # (1, H, L - P, L)
        out = ModelOutput(logits=None, attention=Taps(), intermediates=Taps())
        out.intermediates["decoder.embeddings"] = y
        sources = layer_caches(past, cross)
        y = model.decoder(y, None, tgt_mask, cross_mask, out, bias=bias, return_attention=self.taps, cache=sources)
        logits = model.output(y, embedding)  # (B, L - P, V)
        if model.final_logits_bias is not None:
            logits = logits + model.final_logits_bias.to(logits.dtype)
        present = [t for source, _ in sources for t in source.present]
        tapped = {**out.attention, **out.intermediates}
        return (logits, *present, *(tapped[name] for name in tap_names(model, "decoder") if self.taps))


def export(model: Model, folder: str | os.PathLike, *, taps: bool = False) -> list[Path]:
    """Write `encoder.onnx` and `decoder.onnx` of `model` into the existing `folder`; returns their paths.
    Not run here: `rosetta convert --to onnx` checks the graphs in ONNX Runtime before they land.

    Traced on a batch of 2 with a past of 2 positions; batch, source, target and past lengths are
    dynamic. The parameters are stored inside each file (no external data)."""
    from torch.export import Dim

    config = model.config
    folder = Path(folder)
    batch, src, tgt, past = Dim("batch"), Dim("src_len"), Dim("tgt_len"), Dim("past_len")
    heads, head_dim, layers = config.n_heads, config.head_dim, config.n_decoder_layers
    src_mask = torch.ones((2, 5), dtype=torch.bool)
    if config.source == "features":  # 2 S frames for S positions; the mask is the front end's own
        graph = FeaturesEncoderGraph(model, taps)
        encoder_in = (torch.zeros((2, config.n_mels, 10), dtype=model.dtype),)
        encoder_names, encoder_shapes = ["src_features"], ({0: batch, 2: 2 * src},)
    else:
        graph = EncoderGraph(model, taps)
        encoder_in = (torch.full((2, 5), _real_id(config, config.src_vocab_size), dtype=torch.long), src_mask)
        encoder_names, encoder_shapes = ["src_ids", "src_mask"], ({0: batch, 1: src}, {0: batch, 1: src})
    tgt_ids = torch.full((2, 4), _real_id(config, config.tgt_vocab_size), dtype=torch.long)
    cache = [torch.zeros((2, heads, 2, head_dim), dtype=model.dtype) for _ in range(2 * layers)]
    cross = [torch.zeros((2, heads, 5, head_dim), dtype=model.dtype) for _ in range(2 * layers)]
    encoder_outputs = cache_names(model, "cross") + (tap_names(model, "encoder") if taps else [])
    decoder_outputs = ["logits", *cache_names(model, "present"), *(tap_names(model, "decoder") if taps else [])]
    with torch.no_grad():
        _export(graph.eval(), encoder_in, folder / ENCODER_FILE, encoder_names, encoder_outputs, encoder_shapes)
        past_shape, cross_shape = {0: batch, 2: past}, {0: batch, 2: src}
        _export(DecoderGraph(model, taps).eval(), (tgt_ids, src_mask, *cache, *cross), folder / DECODER_FILE,
                ["tgt_ids", "src_mask", *cache_names(model, "past"), *cache_names(model, "cross")], decoder_outputs,
                ({0: batch, 1: tgt}, {0: batch, 1: src}, (*[past_shape] * len(cache), *[cross_shape] * len(cross))))
    return [folder / ENCODER_FILE, folder / DECODER_FILE]


# The graphs (encoder, decoder bytes) of the last few exports: the suite builds one model per
# example and property, the tests convert and check the same checkpoint, and each export takes
# seconds; what shares a key here shares one export in this process.
EXPORTS: OrderedDict[tuple, tuple[bytes, bytes]] = OrderedDict()
KEPT_EXPORTS = 16


def params_digest(params) -> str:
    """A digest of the parameters (names, dtypes, shapes, values): the export holds their values."""
    digest = hashlib.sha1()
    for name in sorted(params):
        value = np.ascontiguousarray(np.asarray(params[name]))
        digest.update(f"{name} {value.dtype} {value.shape}".encode())
        digest.update(value.tobytes())
    return digest.hexdigest()


def exporter() -> tuple:
    """The functions and classes this module exports with, the objects themselves: a planted
    export bug (tests/breaks.py) replaces one, and a graph exported before (or under another
    planted bug) must not answer for it. Objects, not their id()s: a freed replacement's id can
    be a later one's, while an object held in a key stays alive and distinct."""
    return tuple(sorted(((name, value) for name, value in globals().items() if callable(value)),
                        key=lambda item: item[0]))


def export_bytes(config, params, dtype: str = "float32", param_dtype=None, taps: bool = False) -> tuple[bytes, bytes]:
    """The (encoder, decoder) graph files of `impl_torch.Model(config, params, dtype,
    param_dtype=...)` as `export` writes them, kept per (config, dtype, parameter dtype,
    parameters, taps, exporter) for the process: `rosetta convert --to onnx` and the
    `onnxruntime` target share them."""
    dtype = str(dtype)
    key = (config.to_json(), dtype, str(param_dtype or dtype), params_digest(params), bool(taps), exporter())
    if key not in EXPORTS:
        model = Model(config, params, dtype, param_dtype=param_dtype)
        with tempfile.TemporaryDirectory(prefix="rosetta-onnx-") as folder:
            EXPORTS[key] = tuple(Path(p).read_bytes() for p in export(model, folder, taps=taps))
        while len(EXPORTS) > KEPT_EXPORTS:
            EXPORTS.popitem(last=False)
    EXPORTS.move_to_end(key)
    return EXPORTS[key]


def _real_id(config, vocab: int) -> int:
    """A token id that is not the pad id, for the example inputs."""
    return 1 if config.pad_id != 1 else 2


# The exporter's own chatter (registry misses for torchvision ops, renamed dynamic axes, the
# optimizer's skipped folds): said on every export, about the exporter, never about the model.
QUIET = ("torch.onnx", "onnxscript", "onnx_ir")


def _export(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str], shapes: tuple) -> None:
    levels = {name: logging.getLogger(name).level for name in QUIET}
    try:
        for name in QUIET:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.onnx")
            warnings.filterwarnings("ignore", category=FutureWarning)
            program = torch.onnx.export(module, args, dynamo=True, opset_version=OPSET, input_names=inputs,
                                        output_names=outputs, dynamic_shapes=shapes, external_data=False,
                                        verbose=False)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    program.save(str(path), external_data=False)
