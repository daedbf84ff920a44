"""S1, the "LLMHub" tutorial (variants.md): post-LN, -inf fill, padding id 0, no final norms.

Each stack owns its embedding (scaled by sqrt(d_model)) and its sinusoid buffer
`pos_encoding.pe` (1, max_len, d). All attention projections have biases. The model builds its
masks inside forward(src, tgt): source padding on the keys (B,1,1,S); target padding on the keys
(B,1,1,T) AND causal.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAD = 0


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe = torch.zeros(1, max_len, d_model)
        pe[0, :, 0::2] = torch.sin(position * div_term)
        pe[0, :, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return x + self.pe[:, : x.size(1), :]


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)

    def forward(self, q, k, v, mask=None):
        b = q.size(0)
        q = self.w_q(q).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        k = self.w_k(k).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        v = self.w_v(v).view(b, -1, self.n_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        return self.w_o(out.transpose(1, 2).contiguous().view(b, -1, self.n_heads * self.d_k))


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
        self.ffn = FeedForward(d_model, d_ff)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, mask):
        x = self.norm1(x + self.self_attn(x, x, x, mask))
        return self.norm2(x + self.ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff):
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.cross_attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model, d_ff)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.norm1(x + self.self_attn(x, x, x, tgt_mask))
        x = self.norm2(x + self.cross_attn(x, memory, memory, src_mask))
        return self.norm3(x + self.ffn(x))


class Encoder(nn.Module):
    def __init__(self, vocab, d_model, n_heads, d_ff, n_layers, max_len):
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len)
        self.layers = nn.ModuleList([EncoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])

    def forward(self, src, mask):
        x = self.pos_encoding(self.embedding(src) * math.sqrt(self.d_model))
        for layer in self.layers:
            x = layer(x, mask)
        return x


class Decoder(nn.Module):
    def __init__(self, vocab, d_model, n_heads, d_ff, n_layers, max_len):
        super().__init__()
        self.d_model = d_model
        self.embedding = nn.Embedding(vocab, d_model)
        self.pos_encoding = PositionalEncoding(d_model, max_len)
        self.layers = nn.ModuleList([DecoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])

    def forward(self, tgt, memory, src_mask, tgt_mask):
        x = self.pos_encoding(self.embedding(tgt) * math.sqrt(self.d_model))
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return x


class Transformer(nn.Module):
    def __init__(self, src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
        super().__init__()
        self.encoder = Encoder(src_vocab, d_model, n_heads, d_ff, n_layers, max_len)
        self.decoder = Decoder(tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len)
        self.linear_out = nn.Linear(d_model, tgt_vocab)

    def forward(self, src, tgt):
        src_mask = (src != PAD).unsqueeze(1).unsqueeze(2)  # (B, 1, 1, S)
        t = tgt.size(1)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        tgt_mask = (tgt != PAD).unsqueeze(1).unsqueeze(2) & causal  # (B, 1, T, T): padding on the keys
        memory = self.encoder(src, src_mask)
        return self.linear_out(self.decoder(tgt, memory, src_mask, tgt_mask))


def make(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
    return Transformer(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len).eval()


def logits(model, src, tgt):
    return model(src, tgt)
