"""S2, "Vanilla Transformer explained" after hyunwoongko/transformer (variants.md).

Its own LayerNorm with `gamma`/`beta` and eps 1e-12 (biased variance, inside the sqrt);
embeddings `emb.tok_emb` (nn.Embedding, padding_idx=1) not scaled; the sinusoid
`pos / 10000 ** (2i / d)` is a plain tensor attribute, not in the state dict; all projections
with bias (`w_q|w_k|w_v|w_concat`); masked scores -10000; source padding on the keys, target
padding on the queries AND causal; the output projection lives in the decoder (`decoder.linear`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAD = 1


class LayerNorm(nn.Module):
    def __init__(self, d_model, eps=1e-12):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(d_model))
        self.beta = nn.Parameter(torch.zeros(d_model))
        self.eps = eps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, unbiased=False, keepdim=True)
        out = (x - mean) / torch.sqrt(var + self.eps)
        return self.gamma * out + self.beta


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        self.encoding = torch.zeros(max_len, d_model)
        self.encoding.requires_grad = False
        pos = torch.arange(0, max_len).float().unsqueeze(dim=1)
        _2i = torch.arange(0, d_model, step=2).float()
        self.encoding[:, 0::2] = torch.sin(pos / (10000 ** (_2i / d_model)))
        self.encoding[:, 1::2] = torch.cos(pos / (10000 ** (_2i / d_model)))

    def forward(self, x):
        return self.encoding[: x.size(1), :]


class TokenEmbedding(nn.Embedding):
    def __init__(self, vocab_size, d_model):
        super().__init__(vocab_size, d_model, padding_idx=1)


class TransformerEmbedding(nn.Module):
    def __init__(self, vocab_size, d_model, max_len):
        super().__init__()
        self.tok_emb = TokenEmbedding(vocab_size, d_model)
        self.pos_emb = PositionalEncoding(d_model, max_len)

    def forward(self, x):
        return self.tok_emb(x) + self.pos_emb(x)


class ScaleDotProductAttention(nn.Module):
    def forward(self, q, k, v, mask=None):
        d_tensor = k.size(-1)
        score = (q @ k.transpose(2, 3)) / math.sqrt(d_tensor)
        if mask is not None:
            score = score.masked_fill(mask == 0, -10000)
        return torch.softmax(score, dim=-1) @ v


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.attention = ScaleDotProductAttention()
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_concat = nn.Linear(d_model, d_model)

    def split(self, tensor):
        batch_size, length, d_model = tensor.size()
        return tensor.view(batch_size, length, self.n_head, d_model // self.n_head).transpose(1, 2)

    def concat(self, tensor):
        batch_size, head, length, d_tensor = tensor.size()
        return tensor.transpose(1, 2).contiguous().view(batch_size, length, head * d_tensor)

    def forward(self, q, k, v, mask=None):
        q, k, v = self.split(self.w_q(q)), self.split(self.w_k(k)), self.split(self.w_v(v))
        return self.w_concat(self.concat(self.attention(q, k, v, mask=mask)))


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, hidden):
        super().__init__()
        self.linear1 = nn.Linear(d_model, hidden)
        self.linear2 = nn.Linear(hidden, d_model)

    def forward(self, x):
        return self.linear2(torch.relu(self.linear1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head):
        super().__init__()
        self.attention = MultiHeadAttention(d_model, n_head)
        self.norm1 = LayerNorm(d_model)
        self.ffn = PositionwiseFeedForward(d_model, ffn_hidden)
        self.norm2 = LayerNorm(d_model)

    def forward(self, x, src_mask):
        _x = x
        x = self.norm1(self.attention(q=x, k=x, v=x, mask=src_mask) + _x)
        _x = x
        return self.norm2(self.ffn(x) + _x)


class DecoderLayer(nn.Module):
    def __init__(self, d_model, ffn_hidden, n_head):
        super().__init__()
        self.self_attention = MultiHeadAttention(d_model, n_head)
        self.norm1 = LayerNorm(d_model)
        self.enc_dec_attention = MultiHeadAttention(d_model, n_head)
        self.norm2 = LayerNorm(d_model)
        self.ffn = PositionwiseFeedForward(d_model, ffn_hidden)
        self.norm3 = LayerNorm(d_model)

    def forward(self, dec, enc, trg_mask, src_mask):
        _x = dec
        x = self.norm1(self.self_attention(q=dec, k=dec, v=dec, mask=trg_mask) + _x)
        _x = x
        x = self.norm2(self.enc_dec_attention(q=x, k=enc, v=enc, mask=src_mask) + _x)
        _x = x
        return self.norm3(self.ffn(x) + _x)


class Encoder(nn.Module):
    def __init__(self, enc_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers):
        super().__init__()
        self.emb = TransformerEmbedding(enc_voc_size, d_model, max_len)
        self.layers = nn.ModuleList([EncoderLayer(d_model, ffn_hidden, n_head) for _ in range(n_layers)])

    def forward(self, x, src_mask):
        x = self.emb(x)
        for layer in self.layers:
            x = layer(x, src_mask)
        return x


class Decoder(nn.Module):
    def __init__(self, dec_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers):
        super().__init__()
        self.emb = TransformerEmbedding(dec_voc_size, d_model, max_len)
        self.layers = nn.ModuleList([DecoderLayer(d_model, ffn_hidden, n_head) for _ in range(n_layers)])
        self.linear = nn.Linear(d_model, dec_voc_size)

    def forward(self, trg, enc_src, trg_mask, src_mask):
        trg = self.emb(trg)
        for layer in self.layers:
            trg = layer(trg, enc_src, trg_mask, src_mask)
        return self.linear(trg)


class Transformer(nn.Module):
    def __init__(self, src_pad_idx, trg_pad_idx, enc_voc_size, dec_voc_size, d_model, n_head, max_len, ffn_hidden, n_layers):
        super().__init__()
        self.src_pad_idx, self.trg_pad_idx = src_pad_idx, trg_pad_idx
        self.encoder = Encoder(enc_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers)
        self.decoder = Decoder(dec_voc_size, max_len, d_model, ffn_hidden, n_head, n_layers)

    def make_src_mask(self, src):
        return (src != self.src_pad_idx).unsqueeze(1).unsqueeze(2)  # (B, 1, 1, S)

    def make_trg_mask(self, trg):
        trg_pad_mask = (trg != self.trg_pad_idx).unsqueeze(1).unsqueeze(3)  # (B, 1, T, 1): on the queries
        trg_len = trg.shape[1]
        trg_sub_mask = torch.tril(torch.ones(trg_len, trg_len)).type(torch.ByteTensor)
        return trg_pad_mask & trg_sub_mask

    def forward(self, src, trg):
        src_mask = self.make_src_mask(src)
        trg_mask = self.make_trg_mask(trg)
        return self.decoder(trg, self.encoder(src, src_mask), trg_mask, src_mask)


def make(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len):
    return Transformer(PAD, PAD, src_vocab, tgt_vocab, d_model, n_heads, max_len, d_ff, n_layers).eval()


def logits(model, src, tgt):
    return model(src, tgt)
