"""S3, the "Transformer code walkthrough" blog (variants.md): norms inside the sublayer modules.

Each attention module owns its residual and LayerNorm (`W_Q|W_K|W_V|W_O` with bias, plus
`layer_norm`), and so does the FFN (`linear1|linear2|layer_norm`): net effect post-LN.
Embeddings `src_embed`, `tgt_embed` not scaled; one shared buffer `pos_encoder.pe` (1, max_len, d);
layers are bare lists `encoder.{i}`, `decoder.{i}`; no final norms; output `linear`; masked
scores -1e9; source padding on the keys, target padding on the queries AND causal; Xavier-uniform
init on every matrix.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAD = 0


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.pe[:, : x.size(1)]


class MultiHeadAttention(nn.Module):
    """Attention that owns its residual connection and LayerNorm: LN(q_in + attn(q_in, kv))."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)
        self.W_O = nn.Linear(d_model, d_model)
        self.layer_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q_in, kv_in, mask=None):
        residual, b = q_in, q_in.size(0)
        q = self.W_Q(q_in).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        k = self.W_K(kv_in).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        v = self.W_V(kv_in).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        context = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, -1, self.n_heads * self.d_k)
        return self.layer_norm(residual + self.dropout(self.W_O(context)))


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.linear2 = nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.layer_norm(x + self.dropout(self.linear2(torch.relu(self.linear1(x)))))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model, d_ff)

    def forward(self, x, src_mask):
        return self.ffn(self.self_attn(x, x, src_mask))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.cross_attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model, d_ff)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.self_attn(x, x, tgt_mask)
        x = self.cross_attn(x, memory, src_mask)
        return self.ffn(x)


class Transformer(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
        super().__init__()
        self.src_embed = nn.Embedding(src_vocab, d_model)
        self.tgt_embed = nn.Embedding(tgt_vocab, d_model)
        self.pos_encoder = PositionalEncoding(d_model, max_len)
        self.encoder = nn.ModuleList([EncoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])
        self.decoder = nn.ModuleList([DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])
        self.linear = nn.Linear(d_model, tgt_vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt):
        src_mask = (src != PAD).unsqueeze(1).unsqueeze(2)  # (B, 1, 1, S)
        t = tgt.size(1)
        causal = torch.tril(torch.ones(t, t)).bool()
        tgt_mask = (tgt != PAD).unsqueeze(1).unsqueeze(3) & causal  # (B, 1, T, T): padding on the queries
        x = self.pos_encoder(self.src_embed(src))
        for layer in self.encoder:
            x = layer(x, src_mask)
        y = self.pos_encoder(self.tgt_embed(tgt))
        for layer in self.decoder:
            y = layer(y, x, src_mask, tgt_mask)
        return self.linear(y)


def make(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
    return Transformer(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len).eval()


def logits(model, src, tgt):
    return model(src, tgt)
