"""S4, the "Hand-written Transformer" tutorial (variants.md): pre-LN with final norms.

Embeddings `src_embed.embed`, `tgt_embed.embed` scaled by sqrt(d_model); one buffer `pos_enc.pe`
(1, max_len, d); attention projections in a list `linear.0|1|2` (q, k, v) plus `output_linear`,
with bias; masked scores -inf; norms in a list `layernorm.0|1|2`; layers `encoder_layers.{i}`,
`decoder_layers.{i}`; cross-attention queries are normed, the memory is the already-normed
encoder output; final `encoder_norm`, `decoder_norm`; output `generator`. Source padding on the
keys; target padding on the keys AND causal.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAD = 0


class Embedding(nn.Module):
    def __init__(self, vocab, d_model):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.embed(x) * math.sqrt(self.d_model)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.linear = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(3)])
        self.output_linear = nn.Linear(d_model, d_model)

    def forward(self, query, key, value, mask=None):
        b = query.size(0)
        q, k, v = (l(x).view(b, -1, self.h, self.d_k).transpose(1, 2) for l, x in zip(self.linear, (query, key, value)))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        x = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.output_linear(x)


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.linear2(torch.relu(self.linear1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.feed_forward = FeedForward(d_model, d_ff)
        self.layernorm = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(2)])

    def forward(self, x, mask):
        h = self.layernorm[0](x)
        x = x + self.self_attn(h, h, h, mask)
        return x + self.feed_forward(self.layernorm[1](x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.cross_attn = MultiHeadAttention(d_model, n_heads)
        self.feed_forward = FeedForward(d_model, d_ff)
        self.layernorm = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(3)])

    def forward(self, x, memory, src_mask, tgt_mask):
        h = self.layernorm[0](x)
        x = x + self.self_attn(h, h, h, tgt_mask)
        x = x + self.cross_attn(self.layernorm[1](x), memory, memory, src_mask)
        return x + self.feed_forward(self.layernorm[2](x))


class Transformer(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
        super().__init__()
        self.src_embed = Embedding(src_vocab, d_model)
        self.tgt_embed = Embedding(tgt_vocab, d_model)
        self.pos_enc = PositionalEncoding(d_model, max_len)
        self.encoder_layers = nn.ModuleList([EncoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])
        self.decoder_layers = nn.ModuleList([DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])
        self.encoder_norm = nn.LayerNorm(d_model)
        self.decoder_norm = nn.LayerNorm(d_model)
        self.generator = nn.Linear(d_model, tgt_vocab)

    def encode(self, src, src_mask):
        x = self.pos_enc(self.src_embed(src))
        for layer in self.encoder_layers:
            x = layer(x, src_mask)
        return self.encoder_norm(x)

    def decode(self, tgt, memory, src_mask, tgt_mask):
        y = self.pos_enc(self.tgt_embed(tgt))
        for layer in self.decoder_layers:
            y = layer(y, memory, src_mask, tgt_mask)
        return self.decoder_norm(y)

    def forward(self, src, tgt):
        src_mask = (src != PAD)[:, None, None, :]  # (B, 1, 1, S)
        t = tgt.size(1)
        tgt_mask = (tgt != PAD)[:, None, None, :] & torch.tril(torch.ones(t, t, dtype=torch.bool))  # keys AND causal
        return self.generator(self.decode(tgt, self.encode(src, src_mask), src_mask, tgt_mask))


def make(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
    return Transformer(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len).eval()


def logits(model, src, tgt):
    return model(src, tgt)
