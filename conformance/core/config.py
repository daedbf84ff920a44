"""The model config: one frozen dataclass that can express every variant in the family.

Every switch of the family is a field here, and every backend reads the same field the same way
(docs/porting.md's switch table is generated from this class: `switch_table`). A switch is never
implied by another one: a port that forgets to set a switch gets the default written below, and
the default is the paper's choice (Vaswani et al., 2017) wherever the paper makes one.

This module is framework-free (standard library only) so that every backend can import it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from conformance.core.errors import ConfigError

NORM_PLACEMENTS = ("post", "pre")
LAYER_NORM_FORMS = ("standard", "std-eps", "fast-variance", "rms")
POSITIONS = ("sinusoid-interleaved", "sinusoid-split", "sinusoid-t2t", "sinusoid-fairseq", "table", "relative")
POSITION_IDS = ("arange", "non-pad")
DECODER_EMBEDDING_NORMS = ("sum", "tokens")
PAD_MASK_SIDES = ("keys", "queries", "both", "none")
SRC_PAD_MASK_SIDES = ("keys", "both")
ACTIVATIONS = ("relu", "gelu", "gelu-tanh", "silu", "tanh")
SOURCES = ("ids", "features")

MASKED_SCORES = ("replaced", "added")
EMPTY_ROWS = ("softmax", "zeros")

# An added fill must swamp the scores in every dtype: at |fill| >= 1e30 its unit in the last place
# is 1.4e14 in float64 (7.6e22 in float32), so `score + fill` rounds to the fill itself for any
# score below 7e13, and a row of masked scores is a row of equal values. A smaller fill keeps part
# of each score (-1e9 + 3.2 is -999999996.8 in float64, -1e9 in float32): an empty row would then
# weigh its keys by the scores in one dtype and evenly in another.
ADDED_FILL_LIMIT = -1e30

# The string fields and the values each may take.
CHOICES = {
    "norm_placement": NORM_PLACEMENTS,
    "layer_norm_form": LAYER_NORM_FORMS,
    "position": POSITIONS,
    "position_ids": POSITION_IDS,
    "decoder_embedding_norm": DECODER_EMBEDDING_NORMS,
    "tgt_pad_mask": PAD_MASK_SIDES,
    "src_pad_mask": SRC_PAD_MASK_SIDES,
    "activation": ACTIVATIONS,
    "source": SOURCES,
    "masked_scores": MASKED_SCORES,
    "empty_rows": EMPTY_ROWS,
}

# float32's largest finite value. Scores are formed and filled in at least float32 in every
# backend, so a finite fill below -FLOAT32_MAX would silently become -inf there (NaN rows instead
# of the uniform ones the float64 oracle computes).
FLOAT32_MAX = 3.4028234663852886e38

# Every backend precomputes a (max_len, d_model) sinusoid per model, so max_len is bounded: a
# config read from a file must not be able to ask for terabytes. 65536 positions is far beyond the
# systems in variants.md (512 to 5000) and still an explicit, documented limit.
MAX_LEN_LIMIT = 65536

# Fields added after the first checkpoints were written. A stored config that lacks one of them
# predates it and meant its default, which is the behaviour every backend had before the field
# existed; every other field must be named by a stored config (see `from_dict(complete=True)`).
ADDED_FIELDS = ("src_pad_mask", "scale_logits", "ffn_glu", "attention_temp", "position_offset", "position_ids",
                "embedding_norm", "freeze_pad_embedding", "d_head", "scale_scores", "relative_buckets",
                "relative_max_distance", "ffn_bias", "freeze_final_logits_bias", "source", "n_mels", "max_source_len",
                "key_bias", "decoder_embedding_norm", "relative_bias_per_layer", "masked_scores",
                "empty_rows")

_SIZE_FIELDS = (
    "src_vocab_size",
    "tgt_vocab_size",
    "d_model",
    "n_heads",
    "d_ff",
    "max_len",
)


@dataclass(frozen=True)
class ModelConfig:
    """Every number and switch that decides what an encoder-decoder Transformer computes.

    Sizes:
        src_vocab_size, tgt_vocab_size: token vocabularies (V_src, V). Logits are over the target
            vocabulary.
        d_model (D), n_heads (H), d_ff (F): the paper's d_model, h and d_ff (section 3.2.2, 3.3).
        d_head: K, the size of one head; 0 (the paper's) means d_model / n_heads. T5's `d_kv` is
            set on its own (mT5-small: d_model 512, 6 heads of 64), so the attention's inner width
            H * K may differ from D: q, k, v are (D, H K) and o is (H K, D).
        n_encoder_layers, n_decoder_layers: stack depths (the paper's N; 0 is allowed, giving a
            model that is only embeddings, final norms and the output projection).
        max_len: the longest source or target sequence accepted; also the rows of a stored table.

    Source:
        source: "ids" (token ids, the paper's) or "features": log-mel features (B, n_mels, frames),
            float, through Whisper's front end (`AudioEncoder.conv1/conv2` in openai-whisper,
            `WhisperEncoder` in transformers): two 1-D convolutions of kernel 3 and padding 1, the
            second with stride 2, each followed by exact GELU, giving (B, frames / 2, D), to which
            the encoder's position term is added (no embedding scale: there is no token table). A
            features source has no padding: its source mask attends every position unless a caller
            narrows it (`src_mask`, over the S = frames / 2 positions); frames must be even.
            There is no source vocabulary, so src_vocab_size must equal tgt_vocab_size, and no
            source embedding to share.
        n_mels: the feature channels of a features source (Whisper: 80; large-v3: 128).
        max_source_len: the longest encoder sequence (frames / 2) and the rows of the encoder's
            position table (+ position_offset), for a features source whose encoder and decoder
            lengths differ (Whisper: max_source_positions 1500 beside max_target_positions 448);
            0 means max_len (and a value equal to max_len is stored as 0: one spelling per model).
            An ids source is bounded by max_len alone (0).

    Layer structure:
        norm_placement: "post" is the paper's `x = LN(x + sublayer(x))` (section 5.4); "pre" is
            `x = x + sublayer(LN(x))`.
        final_encoder_norm, final_decoder_norm: one LayerNorm after the last layer of each stack
            (pre-LN models need them; `torch.nn.Transformer` always has both).
        layer_norm_eps: passed explicitly everywhere; PyTorch defaults to 1e-5, Flax to 1e-6.
        layer_norm_form: "standard" is `(x - mean) / sqrt(var + eps)` with the biased variance;
            "std-eps" is the Annotated Transformer's `(x - mean) / (std + eps)` with the unbiased
            standard deviation; "fast-variance" is Flax `nn.LayerNorm`'s default
            (`use_fast_variance=True`): the same as "standard" but with the variance computed as
            `max(E[x^2] - E[x]^2, 0)`, which cancels when |mean| >> std; "rms" is T5's
            `T5LayerNorm` (RMSNorm): `x / sqrt(mean(x^2) + eps) * weight`, no mean, no bias
            parameter, its statistics in at least float32.

    Embeddings and positions:
        scale_embedding: multiply token embeddings by sqrt(d_model) before adding positions
            (section 3.4).
        position: "sinusoid-interleaved" (sin on even dims, cos on odd dims, section 3.5),
            "sinusoid-split" (first half sin, second half cos: Marian), "sinusoid-t2t" (split, with
            tensor2tensor's timescales `exp(-ln(1e4) i / (D/2 - 1))` and the table rounded to
            float32, as Flax `examples/wmt`'s `sinusoidal_init` stores it; needs D >= 4), or
            "sinusoid-fairseq" (fairseq's and M2M100/NLLB's `get_embedding`: split, t2t timescales,
            computed in float32 as `torch` does there, and the row of `pad_id` zero: with
            position_offset > pad_id, M2M100's pad_id + 1, no position reads it, and with a
            smaller offset one does, as in fairseq's table), or "table" (a
            stored `(max_len + position_offset, D)` table per stack: learned, or a sinusoid saved as
            a buffer).
        relative_buckets, relative_max_distance: with position "relative" (T5), no position term
            is added to the embeddings; instead each stack learns a bias (relative_buckets, H),
            `{encoder,decoder}.position.relative_bias`, added to every layer's self-attention
            scores at (query i, key j) from the bucket of j - i (`relative_position_buckets`:
            T5's `_relative_position_bucket`, bidirectional in the encoder, causal in the
            decoder; exact up to a quarter (encoder) or half (decoder) of the buckets, then
            logarithmic up to relative_max_distance). Cross-attention has no bias.
        relative_bias_per_layer: with position "relative", every self-attention layer has a bias
            table of its own, `{encoder,decoder}.layers.{i}.self_attn.relative_bias` (UMT5:
            `UMT5LayerSelfAttention` builds every layer's attention with
            has_relative_attention_bias=True), instead of block 0's table serving the stack (T5).
            The buckets are the same; only the table each layer reads differs.
        position_offset: position p reads row `p + position_offset` of the position table, whose
            first rows are never read: 2 in BART and mBART (`BartLearnedPositionalEmbedding.offset`)
            and in M2M100/NLLB (`padding_idx + 1`), 0 elsewhere.
        position_ids: "arange" numbers the tokens 0, 1, 2, ...; "non-pad" (fairseq's
            `make_positions`, M2M100/NLLB's `create_position_ids_from_input_ids`) numbers only the
            tokens that are not `pad_id`, and a pad token gets no position term at all (its row
            is the zero row of `pad_id` there). A cached decoding step's token at position t reads
            row `t + position_offset` unless it is the pad id, as transformers' cached step does.
        embedding_norm: a LayerNorm on the embeddings plus positions, before the first layer (BART
            and mBART's `layernorm_embedding`), `{encoder,decoder}.embedding_norm` in each stack.
        decoder_embedding_norm: what the decoder's embedding LayerNorm normalises: "sum", the
            scaled tokens plus the position term, `LN(E x s + P)` (BART, mBART, and every
            encoder); or "tokens", the scaled tokens alone, the position term added after it,
            `LN(E x s) + P` (BlenderbotSmall's decoder: `BlenderbotSmallDecoder.forward` calls
            `layernorm_embedding(inputs_embeds)` before adding the positions, while its encoder
            norms the sum). "tokens" needs `embedding_norm`.
        share_embeddings: the decoder uses the encoder's token embedding (needs equal vocabs).
        tie_output: the output projection is the target embedding transposed (section 3.4).
        freeze_pad_embedding: training only: the row of `pad_id` in each token embedding gets no
            gradient from lookups, as in `nn.Embedding(padding_idx=pad_id)` (Marian, BART, mBART,
            M2M100, Pegasus). A tied output projection still sends that row its gradient, as in
            PyTorch, where padding_idx masks the lookup's backward only. The forward is unchanged.

    Attention:
        scale_scores: scores are Q K^T / sqrt(K) (the paper, section 3.2.1); False is T5's Q K^T,
            whose initialisation folds the scale into W_q.
        qkv_bias: the q, k and v projections have a bias.
        key_bias: with qkv_bias, whether the key projection has one too; False is Whisper's
            `key = Linear(n_state, n_state, bias=False)` beside biased query, value and output.
            A key bias adds q . b_k to every score of a query, the same for all its keys, which
            the softmax cancels: no output depends on it, so Whisper leaves it out.
        out_proj_bias: the attention output projection has a bias.
        mask_fill: the value written over masked scores before the softmax. `-inf` makes a row
            with every key masked NaN (0/0); a finite value (-1e9, -1e4, ...) makes it a uniform
            average over all keys. Softmax runs in at least float32, so fills such as -1e9 stay
            finite even for float16 models.
        masked_scores: how the fill meets a masked score: "replaced", `where(mask, s, fill)` (the
            paper's tutorials, `masked_fill`, Flax), or "added", `s + where(mask, 0, fill)`
            (transformers' eager attention adds its mask of `finfo(dtype).min`). The forward is the
            same wherever the fill swamps the scores (an added fill must be -inf or at most -1e30,
            `ADDED_FILL_LIMIT`); the backward is not: a replaced score is a constant, so no
            gradient reaches it, while an added one passes the softmax's gradient on. They part on
            a query with every key masked and a finite fill: its weights are uniform, and their
            gradient reaches q and k through the added scores only.
        empty_rows: what a query with no key to attend to gives: "softmax", the softmax of its
            filled row (NaN for a -inf fill, a uniform average of the values for a finite one), or
            "zeros", weights of 0 on every key, so its attention output is 0 and nothing reaches
            q, k or v from it (PyTorch's fused kernels and transformers' SDPA attention,
            `nn.MultiheadAttention` with need_weights=False).
        tgt_pad_mask: where target padding is masked: "keys" `(B, 1, 1, T)` or "queries"
            `(B, 1, T, 1)`, combined by AND with the causal `(1, 1, T, T)`; or "none", causal
            only: Marian and BART start every decoder input with the pad id, so masking padding
            would hide that start token from every query.
            "both" masks padding on the keys AND the queries: a padded query sees no key at all.
        src_pad_mask: where source padding is masked in the encoder's self-attention: "keys"
            `(B, 1, 1, S)`, or "both", keys AND queries `(B, 1, S, S)` (Flax `examples/wmt`'s
            `make_attention_mask(inputs > 0, inputs > 0)`): a padded query then sees no key, which
            with a finite fill makes its output the plain mean of the values. It changes the
            encoder's output only at padded positions, which cross-attention masks anyway.
        attention_temp: every attention's queries are multiplied by it before the scores, so
            `scores = attention_temp * Q K^T / sqrt(K)`: a factor above 1 sharpens the softmax.
            AlgoPerf's WMT workload `WmtWorkloadAttentionTemp` (4.0): `MultiheadAttention.forward`
            in `algoperf/workloads/wmt/wmt_pytorch/models.py` (`q = self.attention_temp * q`) and
            `Encoder1DBlock` / `EncoderDecoder1DBlock` in `wmt_jax/models.py` (the query input
            `cfg.attention_temp * x`, the same product there: the projections have no bias).
            Keys, values and the mask fill are untouched; 1.0 is every other system.
        cross_attn_src_mask: whether source padding is masked in the decoder's cross-attention.
        pad_id: the padding token id (source and target).

    Feed-forward and output:
        activation: "relu" (paper), "gelu" (erf form), "gelu-tanh" (tanh approximation), "silu",
            "tanh" (AlgoPerf's `WmtWorkloadGLUTanH`).
        ffn_glu: the feed-forward is gated: `FFN(x) = (act(x W_1 + b_1) * (x W_gate + b_gate)) W_2
            + b_2`, with a second input matrix `ffn.gate.weight` (D, F) and its bias (F,); the
            activation applies to the linear1 branch only, the gate branch is linear. AlgoPerf's
            WMT workload `WmtWorkloadGLUTanH`: `MlpBlock` in `algoperf/workloads/wmt/wmt_jax/models.py`
            (`Dense_0` activated, `Dense_1` the gate, `Dense_2` the output) and `_ff_block` in
            `wmt_pytorch/models.py` (`linear1` activated, `linear_glu` the gate).
        ffn_bias: linear1, linear2 (and the gate) have biases; T5 has none.
        output_bias: the output projection has its own bias `output.bias`.
        final_logits_bias: a separate `final_logits_bias` vector added to the logits (Marian).
        freeze_final_logits_bias: training only: `final_logits_bias` gets no gradient (a zero
            one), as in transformers, where it is a registered buffer, not a parameter (Marian,
            BART, mBART, Pegasus, PLBart, Blenderbot, BlenderbotSmall): an optimizer step leaves it as it is. The forward is unchanged.
        scale_logits: divide `y W_out` by sqrt(D) before any bias (Flax `examples/wmt` with
            `logits_via_embedding`: "correctly normalize pre-softmax logits for this shared case").
    """

    src_vocab_size: int = 32
    tgt_vocab_size: int = 32
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 64
    d_head: int = 0
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    max_len: int = 64

    source: str = "ids"
    n_mels: int = 80
    max_source_len: int = 0

    norm_placement: str = "post"
    final_encoder_norm: bool = False
    final_decoder_norm: bool = False
    layer_norm_eps: float = 1e-5
    layer_norm_form: str = "standard"

    scale_embedding: bool = True
    position: str = "sinusoid-interleaved"
    position_offset: int = 0
    position_ids: str = "arange"
    embedding_norm: bool = False
    decoder_embedding_norm: str = "sum"
    relative_buckets: int = 32
    relative_max_distance: int = 128
    relative_bias_per_layer: bool = False
    share_embeddings: bool = False
    tie_output: bool = False
    freeze_pad_embedding: bool = False

    scale_scores: bool = True
    qkv_bias: bool = True
    key_bias: bool = True
    out_proj_bias: bool = True
    attention_temp: float = 1.0
    mask_fill: float = -1e9
    masked_scores: str = "replaced"
    empty_rows: str = "softmax"
    tgt_pad_mask: str = "keys"
    src_pad_mask: str = "keys"
    cross_attn_src_mask: bool = True
    pad_id: int = 0

    activation: str = "relu"
    ffn_glu: bool = False
    ffn_bias: bool = True
    output_bias: bool = True
    final_logits_bias: bool = False
    freeze_final_logits_bias: bool = False
    scale_logits: bool = False

    # Free-form provenance (e.g. {"layout": "hf-marian"}); never changes the numbers.
    notes: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        # A private copy, so that the caller's dict cannot change the config afterwards; `notes`
        # takes no part in equality or hashing (compare=False).
        if not isinstance(self.notes, Mapping):
            raise ConfigError("notes", f"must map strings to strings, got {type(self.notes).__name__}")
        object.__setattr__(self, "notes", dict(self.notes))
        # An int where a float is expected is accepted as that float; one too large for a float is
        # refused here rather than overflowing in a later comparison.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "float" and isinstance(value, int) and not isinstance(value, bool):
                try:
                    object.__setattr__(self, f.name, float(value))
                except OverflowError:
                    raise ConfigError(f.name, f"{value} is too large for a float") from None
        # One spelling for one model: an encoder as long as the decoder is max_source_len 0.
        if self.max_source_len == self.max_len and isinstance(self.max_len, int) and not isinstance(self.max_len, bool):
            object.__setattr__(self, "max_source_len", 0)
        self.validate()

    @property
    def head_dim(self) -> int:
        """K, the size of one head: d_head, or d_model / n_heads (section 3.2.2)."""
        return self.d_head or self.d_model // self.n_heads

    @property
    def source_len(self) -> int:
        """The longest encoder sequence and the encoder table's rows: max_source_len, or max_len."""
        return self.max_source_len or self.max_len

    @property
    def inner_dim(self) -> int:
        """H * K, the width of the concatenated heads (d_model unless d_head says otherwise)."""
        return self.n_heads * self.head_dim

    def canonical(self) -> dict[str, Any]:
        """Every field that decides what the model computes (all but `notes`), at the value it acts
        with: `d_head` as `head_dim` (0 means d_model / n_heads) and `max_source_len` as
        `source_len` (0 means max_len). Two configs of one model have equal `canonical()` however
        they spell it (T5's d_kv read back as 64 where a preset said 0); compare these, never the
        fields as written. The values are valid ModelConfig arguments: a max_source_len equal to
        max_len is stored as 0 again."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "notes"}
        out["d_head"] = self.head_dim
        out["max_source_len"] = self.source_len
        return out

    def validate(self) -> None:
        """Raise `ConfigError` (a `ValueError`) naming the first field that is not valid."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "notes":
                if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                    raise ConfigError("notes", "must map strings to strings")
            elif f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f.name, f"must be an int, got {value!r}")
            elif f.type == "bool" and not isinstance(value, bool):
                raise ConfigError(f.name, f"must be a bool, got {value!r}")
            elif f.type == "float" and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ConfigError(f.name, f"must be a number, got {value!r}")
            elif f.type == "str" and not isinstance(value, str):
                raise ConfigError(f.name, f"must be a string, got {value!r}")
        for name in _SIZE_FIELDS:
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.max_len > MAX_LEN_LIMIT:
            raise ConfigError(
                "max_len", f"{self.max_len} exceeds the supported {MAX_LEN_LIMIT}: every backend precomputes a "
                           f"(max_len, d_model) position table"
            )
        if self.n_mels <= 0:
            raise ConfigError("n_mels", f"must be positive, got {self.n_mels}")
        if self.max_source_len < 0 or self.max_source_len > MAX_LEN_LIMIT:
            raise ConfigError("max_source_len", f"must lie in [0, {MAX_LEN_LIMIT}] (0: max_len), got {self.max_source_len}")
        if self.max_source_len and self.source != "features":
            raise ConfigError("max_source_len", f"{self.max_source_len}, but only a features source has a length of its "
                                                f"own (an ids source is bounded by max_len): give 0")
        if self.position_offset < 0 or max(self.max_len, self.source_len) + self.position_offset > MAX_LEN_LIMIT:
            raise ConfigError("position_offset", f"must be >= 0 with max_len + position_offset <= {MAX_LEN_LIMIT}, "
                                                 f"got {self.position_offset}")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.d_head < 0:
            raise ConfigError("d_head", f"must be >= 0 (0: d_model / n_heads), got {self.d_head}")
        if self.relative_buckets < 4:
            raise ConfigError("relative_buckets", f"must be >= 4 (the encoder halves them, then halves again for "
                                                  f"the exact ones), got {self.relative_buckets}")
        if self.relative_max_distance <= self.relative_buckets // 2:
            raise ConfigError("relative_max_distance", f"must exceed relative_buckets // 2 = {self.relative_buckets // 2} "
                                                       f"(the last exact distance), got {self.relative_max_distance}")
        if not self.d_head and self.d_model % self.n_heads:
            raise ConfigError(
                "n_heads", f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    name, f"unknown value {getattr(self, name)!r}; expected one of {list(allowed)}"
                )
        if self.relative_bias_per_layer and self.position != "relative":
            raise ConfigError("relative_bias_per_layer", "says where the relative position bias tables live; it needs "
                                                         f"position 'relative', not {self.position!r}")
        if self.decoder_embedding_norm == "tokens" and not self.embedding_norm:
            raise ConfigError("decoder_embedding_norm", "'tokens' says where the decoder's embedding LayerNorm sits; "
                                                        "without one (embedding_norm false) there is nothing to place")
        if self.position.startswith("sinusoid") and self.d_model % 2:
            raise ConfigError("d_model", f"a sinusoid needs an even d_model, got {self.d_model}")
        if self.position in ("sinusoid-t2t", "sinusoid-fairseq") and self.d_model < 4:
            raise ConfigError("d_model", f"the {self.position} timescales are spaced over D/2 - 1 intervals, so it needs "
                                         f"d_model >= 4, got {self.d_model}")
        if not (self.layer_norm_eps > 0 and math.isfinite(self.layer_norm_eps)):
            raise ConfigError("layer_norm_eps", f"must be positive and finite, got {self.layer_norm_eps}")
        if not (self.attention_temp > 0 and math.isfinite(self.attention_temp)):
            raise ConfigError("attention_temp", f"must be positive and finite, got {self.attention_temp}")
        if math.isnan(self.mask_fill) or self.mask_fill == math.inf or self.mask_fill >= 0:
            raise ConfigError("mask_fill", f"must be negative (finite or -inf), got {self.mask_fill}")
        if math.isfinite(self.mask_fill) and self.mask_fill < -FLOAT32_MAX:
            raise ConfigError(
                "mask_fill", f"a finite fill must be representable in float32 (>= {-FLOAT32_MAX:.8g}), got "
                             f"{self.mask_fill}: scores are filled in at least float32, where it would become -inf"
            )
        if self.masked_scores == "added" and ADDED_FILL_LIMIT < self.mask_fill:
            raise ConfigError(
                "mask_fill", f"masked_scores='added' needs a fill of -inf or at most {ADDED_FILL_LIMIT:g} (it must "
                             f"swamp the scores in every dtype), got {self.mask_fill}: with a smaller one an empty "
                             "row would weigh its keys by their scores in float64 and evenly in float32"
            )
        if not 0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size):
            raise ConfigError(
                "pad_id",
                f"{self.pad_id} is not a valid id for both vocabularies "
                f"(src_vocab_size={self.src_vocab_size}, tgt_vocab_size={self.tgt_vocab_size})",
            )
        if self.source == "features" and self.share_embeddings:
            raise ConfigError("share_embeddings", "a features source has no token embedding to share with the decoder")
        if self.source == "features" and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError("src_vocab_size", f"a features source has no source vocabulary: src_vocab_size is not used, "
                                                f"and must equal tgt_vocab_size ({self.tgt_vocab_size}), got "
                                                f"{self.src_vocab_size}")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ConfigError(
                "share_embeddings",
                f"needs src_vocab_size == tgt_vocab_size, got {self.src_vocab_size} and "
                f"{self.tgt_vocab_size}",
            )

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with some fields changed (validated like any new config)."""
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise ConfigError(sorted(unknown)[0], "is not a ModelConfig field")
        return dataclasses.replace(self, **changes)

    # JSON -------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["notes"] = dict(self.notes)
        # JSON has no infinity; "-inf" is spelled out so that any JSON parser can read the file.
        if math.isinf(out["mask_fill"]):
            out["mask_fill"] = "-inf"
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, complete: bool = False) -> "ModelConfig":
        """A config from a mapping (e.g. parsed JSON). Absent fields take their defaults, unless
        `complete`: a stored config must name every field, because a default silently filled in
        (post-LN for a missing `norm_placement`) is a plausible wrong answer."""
        if not isinstance(data, Mapping):
            raise ConfigError("config", f"must be a JSON object, got {type(data).__name__}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(str(unknown[0]), "is not a ModelConfig field")
        if complete:
            missing = [name for name in known if name not in data and name not in ADDED_FIELDS]
            if missing:
                raise ConfigError(missing[0], "is missing (a stored config names every field)")
        values = dict(data)
        if "mask_fill" in values and isinstance(values["mask_fill"], str):
            try:
                values["mask_fill"] = float(values["mask_fill"])
            except ValueError:
                raise ConfigError("mask_fill", f"must be a number or '-inf', got {values['mask_fill']!r}") from None
        return cls(**values)

    @classmethod
    def from_json(cls, text: str, *, complete: bool = False) -> "ModelConfig":
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError, RecursionError) as exc:
            raise ConfigError("config", f"is not valid JSON: {type(exc).__name__}: {exc}") from None
        return cls.from_dict(data, complete=complete)

    def summary(self) -> str:
        """One line naming the sizes and the switches that differ from the defaults."""
        default = ModelConfig()
        sizes = (
            f"D={self.d_model} H={self.n_heads} F={self.d_ff} "
            f"L={self.n_encoder_layers}+{self.n_decoder_layers} "
            f"V={self.src_vocab_size}/{self.tgt_vocab_size}"
        )
        switches = [
            f"{f.name}={getattr(self, f.name)}"
            for f in fields(self)
            if f.name not in _SIZE_FIELDS + ("n_encoder_layers", "n_decoder_layers", "notes")
            and getattr(self, f.name) != getattr(default, f.name)
        ]
        return " ".join([sizes, *switches])



def inert_switches(config: ModelConfig) -> frozenset[str]:
    """The switches whose value changes nothing `config` computes, forward or backward: any value
    of one of them gives the same numbers, so a system that holds it otherwise does not differ
    there (`conformance.convert.check_exportable`).

        relative_buckets, relative_max_distance   unless position is "relative" (T5's bias only)
        position_offset, position_ids             with position "relative": no position term is read
        masked_scores                             with a -inf fill (s + -inf is -inf, as replaced) or
                                                  empty_rows "zeros" (no gradient leaves an empty row,
                                                  and a masked score elsewhere has weight 0 either way)
        relative_bias_per_layer                   unless position is "relative"
        decoder_embedding_norm                    without embedding_norm (no LayerNorm to place)
        key_bias                                  without qkv_bias (no projection has a bias)
        freeze_final_logits_bias                  without final_logits_bias (nothing to freeze)
    """
    inert = set()
    if config.position == "relative":
        inert |= {"position_offset", "position_ids"}
    else:
        inert |= {"relative_buckets", "relative_max_distance", "relative_bias_per_layer"}
    if not config.embedding_norm:
        inert.add("decoder_embedding_norm")
    if not config.qkv_bias:
        inert.add("key_bias")
    if not config.final_logits_bias:
        inert.add("freeze_final_logits_bias")
    if math.isinf(config.mask_fill) or config.empty_rows == "zeros":
        inert.add("masked_scores")
    return frozenset(inert)


def computes_alike(config: ModelConfig, name: str, value: Any) -> bool:
    """Whether switch `name` at `value` computes what `config`'s own value does: the same value,
    a switch inert in `config` and in `config` with that value (`inert_switches`), or a d_head
    that gives the same head size (0 means d_model / n_heads)."""
    if getattr(config, name) == value:
        return True
    if name == "d_head":
        return not config.d_model % config.n_heads and (value or config.d_model // config.n_heads) == config.head_dim
    if name not in inert_switches(config):
        return False
    try:
        return name in inert_switches(config.replace(**{name: value}))
    except ConfigError:
        return False


# -- The switch table of docs/porting.md ---------------------------------------------------------


def field_docs() -> dict[str, tuple[str, str]]:
    """Every documented `ModelConfig` field: (its group, what it decides), read from the class
    docstring, where each group is a heading ("Attention:") and each entry one or more field names
    before a colon ("qkv_bias: ..."; "final_encoder_norm, final_decoder_norm: ..."); the text of
    an entry that names several fields is each one's."""
    out: dict[str, tuple[str, str]] = {}
    group, names, text = "", [], []

    def close() -> None:
        for name in names:
            out[name] = (group, " ".join(text))

    for line in inspect.cleandoc(ModelConfig.__doc__).splitlines()[1:]:
        heading = re.fullmatch(r"(\w[\w -]*):", line)
        entry = re.fullmatch(r" {4}([a-z][\w ,()]*?): (.*)", line)
        if heading:
            close()
            group, names, text = heading.group(1), [], []
        elif entry:
            close()
            names = [name.strip() for name in re.sub(r"\([^)]*\)", "", entry.group(1)).split(",")]
            text = [entry.group(2).strip()]
        elif line.startswith(" " * 8) and names:
            text.append(line.strip())
    close()
    return out


def _values(f: dataclasses.Field) -> str:
    if f.name in CHOICES:
        return ", ".join(f"`{value}`" for value in CHOICES[f.name])
    return {"bool": "`true`, `false`", "int": "an int", "float": "a number"}[f.type]


def _default(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, float):  # -1e9, not -1000000000.0; 1e-5, not 1e-05
        value = format(value, "g").replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    return f"`{value}`"


def switch_table() -> str:
    """The table of every `ModelConfig` field (its values, default and meaning, by docstring
    group) that docs/porting.md holds between its "switch table" markers; tests/core/
    test_switch_table_docs.py checks the two agree."""
    docs = field_docs()
    rows = ["| field | values | default | what it decides |", "| --- | --- | --- | --- |"]
    group = None
    for f in fields(ModelConfig):
        if f.name == "notes":
            continue
        where, text = docs[f.name]
        if where != group:
            rows.append(f"| **{where}** | | | |")
            group = where
        cell = text.replace("|", "\\|")  # a pipe inside a cell
        rows.append(f"| `{f.name}` | {_values(f)} | {_default(f.default)} | {cell} |")
    return "\n".join(rows)
