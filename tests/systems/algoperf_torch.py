"""MLCommons AlgoPerf's WMT Transformer in PyTorch (`algoperf/workloads/wmt/wmt_pytorch/models.py`),
re-created for inference with its workload variants.

The structure, `state_dict()` key names and numerics of that `Transformer`, written again from its
published description (no dropout, no packed examples, no decoding cache):

- one `shared_embedding` (nn.Embedding) and one `pos_encoder` (its buffer `pe`, (1, max_len, D),
  the t2t sinusoid computed by torch in float32), registered under the model and again under
  `encoder.` and `decoder.`, so `state_dict()` holds each three times;
- encoder layers `encoder.encoder.layers.{i}`, decoder layers `decoder.decoder.layers.{i}`, each
  with its own `MultiheadAttention` (no biases): self-attention packs q, k, v in `in_proj`
  (3D, D); cross-attention (`multihead_attn`) has `q_proj` (D, D) and `kv_proj` (2D, D);
  `out_proj` (D, D);
- `attention_temp` multiplies the projected queries before `F.scaled_dot_product_attention`;
- feed-forward `linear1` (activated), `linear_glu` (the linear gate, with `glu`), `linear2`, all
  with biases; the decoder layer builds `linear_glu` as nn.Linear(d_hid, d_hid), so a GLU model
  runs only with d_hid == d_model (as in the workload);
- `nn.LayerNorm(eps=1e-6)`: `norm1`, `norm2` (, `norm3`), pre-LN with final norms
  `encoder.encoder.norm` and `decoder.decoder.norm`, or post-LN without them;
- masks from `> 0`: the source on both sides; the decoder's self-attention from the unshifted
  targets on both sides AND causal; cross-attention targets (queries) and source (keys); each
  a float mask of 0 and -1e10 added to the scores;
- the decoder embeds `shift_right(targets)`; logits are `y @ shared_embedding.weight.T / sqrt(D)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PAD = 0
MASKED = -1e10
ACTIVATIONS = {"relu": F.relu, "tanh": torch.tanh}


def shift_right(x: torch.Tensor) -> torch.Tensor:
    return F.pad(x, (1, 0))[:, :-1]


def float_mask(allowed: torch.Tensor, nhead: int) -> torch.Tensor:
    """(B, Tq, Tk) booleans -> (B * H, Tq, Tk) float: 0 where allowed, -1e10 elsewhere."""
    masked = torch.repeat_interleave(torch.logical_not(allowed), repeats=nhead, dim=0)
    return torch.zeros_like(masked, dtype=torch.float32).masked_fill_(masked, MASKED)


def make_src_mask(src: torch.Tensor, nhead: int) -> torch.Tensor:
    return float_mask((src > 0).unsqueeze(-1) & (src > 0).unsqueeze(-2), nhead)


def make_tgt_and_memory_mask(tgt: torch.Tensor, src: torch.Tensor, nhead: int):
    idxs = torch.arange(tgt.shape[-1])
    causal = idxs.unsqueeze(-1) >= idxs.unsqueeze(-2)
    tgt_mask = (tgt > 0).unsqueeze(-1) & (tgt > 0).unsqueeze(-2) & causal
    memory_mask = (tgt > 0).unsqueeze(-1) & (src > 0).unsqueeze(-2)
    return float_mask(tgt_mask, nhead), float_mask(memory_mask, nhead)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int = 256):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        scale_factor = -math.log(10000.0) / (d_model // 2 - 1)
        div_term = torch.exp(torch.arange(d_model // 2) * scale_factor)
        pe = torch.zeros(1, max_len, d_model)
        pe[0, :, : d_model // 2] = torch.sin(position * div_term)
        pe[0, :, d_model // 2 : 2 * (d_model // 2)] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[:, : x.size(1), :]


class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, self_attn: bool, attention_temp: float):
        super().__init__()
        self.embed_dim, self.num_heads, self.self_attn = embed_dim, num_heads, self_attn
        self.head_dim = embed_dim // num_heads
        self.attention_temp = attention_temp
        if self_attn:
            self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        else:
            self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
            self.kv_proj = nn.Linear(embed_dim, 2 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, x, mem=None, attn_mask=None):
        bsz, tgt_len, embed_dim = x.size()
        if self.self_attn:
            q, k, v = self.in_proj(x).split(self.embed_dim, dim=2)
        else:
            q = self.q_proj(x)
            k, v = self.kv_proj(mem).split(self.embed_dim, dim=2)
        seq_len = k.size(1)
        q = q.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_mask = attn_mask.view(bsz, self.num_heads, tgt_len, seq_len)
        q = self.attention_temp * q
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0)
        return self.out_proj(out.transpose(1, 2).contiguous().view(bsz, tgt_len, embed_dim))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, d_hid, activation, glu, eps, attention_temp, pre_ln):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, True, attention_temp)
        self.linear1 = nn.Linear(d_model, d_hid)
        self.glu = glu
        if glu:
            self.linear_glu = nn.Linear(d_model, d_hid)
        self.linear2 = nn.Linear(d_hid, d_model)
        self.pre_ln = pre_ln
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.activation = activation

    def _ff_block(self, inputs):
        x = self.activation(self.linear1(inputs))
        if self.glu:
            x = x * self.linear_glu(inputs)
        return self.linear2(x)

    def forward(self, x, mask):
        if self.pre_ln:
            x = x + self.self_attn(self.norm1(x), attn_mask=mask)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self.self_attn(x, attn_mask=mask))
        return self.norm2(x + self._ff_block(x))


class TransformerEncoder(nn.Module):
    def __init__(self, layers, norm):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x) if self.norm is not None else x


class Encoder(nn.Module):
    def __init__(self, d_model, nhead, d_hid, nlayers, activation, glu, eps, attention_temp, pre_ln):
        super().__init__()
        self.nhead = nhead
        self.shared_embedding = None
        self.pos_encoder = None
        layers = [TransformerEncoderLayer(d_model, nhead, d_hid, activation, glu, eps, attention_temp, pre_ln)
                  for _ in range(nlayers)]
        self.encoder = TransformerEncoder(layers, nn.LayerNorm(d_model, eps=eps) if pre_ln else None)

    def forward(self, src):
        mask = make_src_mask(src, self.nhead)
        return self.encoder(self.pos_encoder(self.shared_embedding(src)), mask)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_model, nhead, d_hid, activation, glu, eps, attention_temp, pre_ln):
        super().__init__()
        self.self_attn = MultiheadAttention(d_model, nhead, True, attention_temp)
        self.multihead_attn = MultiheadAttention(d_model, nhead, False, attention_temp)
        self.linear1 = nn.Linear(d_model, d_hid)
        self.glu = glu
        if glu:
            self.linear_glu = nn.Linear(d_hid, d_hid)  # as published: (d_hid, d_hid), applied to D-wide inputs
        self.linear2 = nn.Linear(d_hid, d_model)
        self.pre_ln = pre_ln
        self.norm1 = nn.LayerNorm(d_model, eps=eps)
        self.norm2 = nn.LayerNorm(d_model, eps=eps)
        self.norm3 = nn.LayerNorm(d_model, eps=eps)
        self.activation = activation

    _ff_block = TransformerEncoderLayer._ff_block

    def forward(self, x, memory, tgt_mask, memory_mask):
        if self.pre_ln:
            x = x + self.self_attn(self.norm1(x), attn_mask=tgt_mask)
            x = x + self.multihead_attn(self.norm2(x), memory, attn_mask=memory_mask)
            return x + self._ff_block(self.norm3(x))
        x = self.norm1(x + self.self_attn(x, attn_mask=tgt_mask))
        x = self.norm2(x + self.multihead_attn(x, memory, attn_mask=memory_mask))
        return self.norm3(x + self._ff_block(x))


class TransformerDecoder(nn.Module):
    def __init__(self, layers, norm):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, x, memory, tgt_mask, memory_mask):
        for layer in self.layers:
            x = layer(x, memory, tgt_mask, memory_mask)
        return self.norm(x) if self.norm is not None else x


class Decoder(nn.Module):
    def __init__(self, d_model, nhead, d_hid, nlayers, activation, glu, eps, attention_temp, pre_ln):
        super().__init__()
        self.nhead = nhead
        self.shared_embedding = None
        self.pos_encoder = None
        layers = [TransformerDecoderLayer(d_model, nhead, d_hid, activation, glu, eps, attention_temp, pre_ln)
                  for _ in range(nlayers)]
        self.decoder = TransformerDecoder(layers, nn.LayerNorm(d_model, eps=eps) if pre_ln else None)

    def forward(self, tgt, memory, src):
        tgt_mask, memory_mask = make_tgt_and_memory_mask(tgt, src, self.nhead)
        y = self.pos_encoder(self.shared_embedding(shift_right(tgt)))
        y = self.decoder(y, memory, tgt_mask, memory_mask)
        return torch.matmul(y, self.shared_embedding.weight.T) / math.sqrt(y.shape[-1])


class Transformer(nn.Module):
    def __init__(self, ntoken=32, d_model=32, nhead=4, d_hid=48, nlayers=2, activation="relu", glu=False,
                 layer_norm_eps=1e-6, attention_temp=1.0, pre_ln=True, max_len=256):
        super().__init__()
        act = ACTIVATIONS[activation]
        self.pos_encoder = PositionalEncoding(d_model, max_len)
        self.shared_embedding = nn.Embedding(ntoken, d_model)
        self.encoder = Encoder(d_model, nhead, d_hid, nlayers, act, glu, layer_norm_eps, attention_temp, pre_ln)
        self.decoder = Decoder(d_model, nhead, d_hid, nlayers, act, glu, layer_norm_eps, attention_temp, pre_ln)
        # Share positional encoding and embedding between encoder and decoder.
        self.encoder.pos_encoder = self.pos_encoder
        self.encoder.shared_embedding = self.shared_embedding
        self.decoder.pos_encoder = self.pos_encoder
        self.decoder.shared_embedding = self.shared_embedding

    def forward(self, src, tgt):
        src, tgt = src.to(torch.int), tgt.to(torch.int)
        return self.decoder(tgt, self.encoder(src), src)


# The workload variants (algoperf/workloads/wmt/wmt_pytorch/workload.py), as constructor arguments.
VARIANTS = {
    "base": dict(),
    "post-ln": dict(pre_ln=False),
    "glu-tanh": dict(glu=True, activation="tanh"),
    "attention-temp": dict(attention_temp=4.0),
}


def make(variant: str = "base", **sizes) -> Transformer:
    return Transformer(**{**sizes, **VARIANTS[variant]}).eval()


@torch.no_grad()
def logits(model: Transformer, src, tgt):
    """Their forward on (src, unshifted targets): (B, T, V) logits."""
    return model(torch.as_tensor(src), torch.as_tensor(tgt))
