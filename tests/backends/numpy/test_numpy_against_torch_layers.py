"""The NumPy oracle against an independent re-implementation built from PyTorch's own layers.

Nothing here comes from this project's backends: the encoder and decoder are PyTorch's
`nn.TransformerEncoderLayer` / `nn.TransformerDecoderLayer` (with PyTorch's attention, LayerNorm
and mask handling), the sinusoid is computed here from the paper's formula, and only the weights
are taken from our canonical parameters (transposed into PyTorch's `(out, in)` layout).
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the independent reference needs PyTorch")

import impl_numpy  # noqa: E402
from conformance import init_params, preset  # noqa: E402
from conformance.check.compare import assert_close  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402


def paper_sinusoid(length, d_model):
    pe = torch.zeros(length, d_model, dtype=torch.float64)
    for pos in range(length):
        for i in range(0, d_model, 2):
            angle = pos / (10000 ** (i / d_model))
            pe[pos, i] = math.sin(angle)
            pe[pos, i + 1] = math.cos(angle)
    return pe


def t(params, name):
    return torch.from_numpy(params[name]).clone()


def load_attention(mha, params, prefix):
    weight = torch.cat([t(params, f"{prefix}.{p}_proj.weight").T for p in "qkv"])  # (3D, D)
    bias = torch.cat([t(params, f"{prefix}.{p}_proj.bias") for p in "qkv"])
    mha.in_proj_weight.copy_(weight)
    mha.in_proj_bias.copy_(bias)
    mha.out_proj.weight.copy_(t(params, f"{prefix}.o_proj.weight").T)
    mha.out_proj.bias.copy_(t(params, f"{prefix}.o_proj.bias"))


def load_norm(norm, params, prefix):
    norm.weight.copy_(t(params, f"{prefix}.weight"))
    norm.bias.copy_(t(params, f"{prefix}.bias"))


def load_ffn(layer, params, prefix):
    layer.linear1.weight.copy_(t(params, f"{prefix}.linear1.weight").T)
    layer.linear1.bias.copy_(t(params, f"{prefix}.linear1.bias"))
    layer.linear2.weight.copy_(t(params, f"{prefix}.linear2.weight").T)
    layer.linear2.bias.copy_(t(params, f"{prefix}.linear2.bias"))


@torch.no_grad()
def reference_logits(config, params, src, tgt):
    common = dict(d_model=config.d_model, nhead=config.n_heads, dim_feedforward=config.d_ff, dropout=0.0,
                  activation=config.activation, layer_norm_eps=config.layer_norm_eps, batch_first=True,
                  norm_first=config.norm_placement == "pre", dtype=torch.float64)
    enc_layers, dec_layers = [], []
    for i in range(config.n_encoder_layers):
        layer = torch.nn.TransformerEncoderLayer(**common).eval()
        p = f"encoder.layers.{i}"
        load_attention(layer.self_attn, params, f"{p}.self_attn")
        load_norm(layer.norm1, params, f"{p}.self_attn_norm")
        load_ffn(layer, params, f"{p}.ffn")
        load_norm(layer.norm2, params, f"{p}.ffn_norm")
        enc_layers.append(layer)
    for i in range(config.n_decoder_layers):
        layer = torch.nn.TransformerDecoderLayer(**common).eval()
        p = f"decoder.layers.{i}"
        load_attention(layer.self_attn, params, f"{p}.self_attn")
        load_norm(layer.norm1, params, f"{p}.self_attn_norm")
        load_attention(layer.multihead_attn, params, f"{p}.cross_attn")
        load_norm(layer.norm2, params, f"{p}.cross_attn_norm")
        load_ffn(layer, params, f"{p}.ffn")
        load_norm(layer.norm3, params, f"{p}.ffn_norm")
        dec_layers.append(layer)

    src_t, tgt_t = torch.from_numpy(src), torch.from_numpy(tgt)
    pe = paper_sinusoid(max(src.shape[1], tgt.shape[1]), config.d_model)
    scale = math.sqrt(config.d_model)
    x = t(params, "encoder.embedding.weight")[src_t] * scale + pe[: src.shape[1]]
    y = t(params, "decoder.embedding.weight")[tgt_t] * scale + pe[: tgt.shape[1]]
    src_pad = src_t == config.pad_id  # PyTorch: True = may NOT attend
    tgt_pad = tgt_t == config.pad_id
    causal = torch.triu(torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool), diagonal=1)

    for layer in enc_layers:
        x = layer(x, src_key_padding_mask=src_pad)
    if config.final_encoder_norm:
        x = torch.nn.functional.layer_norm(x, (config.d_model,), t(params, "encoder.norm.weight"),
                                           t(params, "encoder.norm.bias"), config.layer_norm_eps)
    for layer in dec_layers:
        y = layer(y, x, tgt_mask=causal, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad)
    if config.final_decoder_norm:
        y = torch.nn.functional.layer_norm(y, (config.d_model,), t(params, "decoder.norm.weight"),
                                           t(params, "decoder.norm.bias"), config.layer_norm_eps)
    return (y @ t(params, "output.weight") + t(params, "output.bias")).numpy()


@pytest.mark.parametrize("name", ["torch-nn-transformer", "pre-ln-tutorial", "llmhub"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_numpy_matches_pytorchs_own_layers(name, activation):
    config = preset(name, src_vocab_size=20, tgt_vocab_size=20, d_model=24, n_heads=3, d_ff=40,
                    n_encoder_layers=2, n_decoder_layers=2, max_len=16, pad_id=0, activation=activation)
    assert config.tgt_pad_mask == "keys" and config.cross_attn_src_mask and config.scale_embedding
    params = init_params(config, seed=7)
    # Padding, but no row without any key: PyTorch's fused kernels and the -inf fill disagree
    # on fully masked rows, which the conformance suite checks between our own backends.
    src = np.array([[5, 6, 7, 8, 9, 0, 0], [3, 4, 5, 6, 7, 8, 9], [9, 0, 0, 0, 0, 0, 0]])
    tgt = np.array([[1, 2, 3, 0, 0], [1, 4, 5, 6, 7], [1, 2, 0, 0, 0]])
    expected = reference_logits(config, params, src, tgt)
    ours = impl_numpy.Model(config, params)(src, tgt).logits
    # Padded target positions attend to real earlier positions only (keys side), so every
    # row is meaningful and compared.
    assert_close(ours, expected, tolerance("float64"), tensor="logits", backend="numpy vs torch.nn layers",
                 dtype="float64", config=config)
    assert np.abs(expected).max() > 0.1  # not a vacuous comparison of near-zeros
