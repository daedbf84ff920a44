"""P1, torch.nn.Transformer wrapped as in PyTorch's translation tutorial (`Seq2SeqTransformer`).

`TokenEmbedding` scales by sqrt(emb_size); one `PositionalEncoding` buffer `pos_embedding` of
shape (maxlen, 1, emb_size) serves both stacks; `create_mask` builds an all-False source mask, a
float causal mask (-inf above the diagonal), and boolean key-padding masks (True = padding) for
source, target and memory; PAD_IDX is 1. The tutorial is sequence-first; `batch_first=True`
runs the same model batch-first (PyTorch's fast path may then be taken in eval mode), and
`norm_first`, `activation` and `layer_norm_eps` pass through to nn.Transformer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PAD = 1


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size, dropout, maxlen=5000):
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)  # (maxlen, 1, emb_size)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pos_embedding)

    def forward(self, token_embedding, batch_first=False):
        if batch_first:
            return self.dropout(token_embedding + self.pos_embedding[: token_embedding.size(1)].transpose(0, 1))
        return self.dropout(token_embedding + self.pos_embedding[: token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size, emb_size):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, emb_size, nhead, src_vocab_size, tgt_vocab_size,
                 dim_feedforward=512, dropout=0.1, maxlen=5000, norm_first=False, batch_first=False, activation="relu",
                 layer_norm_eps=1e-5):
        super().__init__()
        self.batch_first = batch_first
        self.transformer = nn.Transformer(
            d_model=emb_size, nhead=nhead, num_encoder_layers=num_encoder_layers, num_decoder_layers=num_decoder_layers,
            dim_feedforward=dim_feedforward, dropout=dropout, norm_first=norm_first, batch_first=batch_first,
            activation=activation, layer_norm_eps=layer_norm_eps,
        )
        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(tgt_vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout, maxlen=maxlen)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src), self.batch_first)
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg), self.batch_first)
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None, src_padding_mask, tgt_padding_mask,
                                memory_key_padding_mask)
        return self.generator(outs)


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))


def create_mask(src, tgt):
    """The tutorial's masks for sequence-first (S, B) / (T, B) ids."""
    src_seq_len, tgt_seq_len = src.shape[0], tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len)).type(torch.bool)
    src_padding_mask = (src == PAD).transpose(0, 1)
    tgt_padding_mask = (tgt == PAD).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask


def make(src_vocab, tgt_vocab, d_model, n_heads, d_ff, n_layers, max_len, **transformer_options):
    """`transformer_options`: norm_first, batch_first, activation, layer_norm_eps."""
    return Seq2SeqTransformer(n_layers, n_layers, d_model, n_heads, src_vocab, tgt_vocab, d_ff, maxlen=max_len,
                              **transformer_options).eval()


def logits(model, src, tgt):
    """Batch-first ids in, batch-first logits out, whatever the model's own layout."""
    src_sf, tgt_sf = src.transpose(0, 1), tgt.transpose(0, 1)  # (S, B), (T, B)
    src_mask, tgt_mask, src_pad, tgt_pad = create_mask(src_sf, tgt_sf)
    if model.batch_first:
        return model(src, tgt, src_mask, tgt_mask, src_pad, tgt_pad, src_pad)
    return model(src_sf, tgt_sf, src_mask, tgt_mask, src_pad, tgt_pad, src_pad).transpose(0, 1)
