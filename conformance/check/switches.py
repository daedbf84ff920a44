"""Which ModelConfig switches act where each canonical tensor is computed: where the user's model
first diverges (`conformance.compare`), one of them, or a weight that went to the wrong place, is
what differs, and the report names them with their converted values."""

from __future__ import annotations

from conformance.core.config import ModelConfig

# The switches that act at each kind of tensor: where a tensor first diverges, one of these (or a
# weight that went to the wrong place) is what differs. Keyed by the name's last part. The head
# count is listed beside them: the tensors cannot tell it, so it is given, and can be given wrong.
# (d_head and the relative-position fields act only in some configs: `_ACTS_WHEN`.)
_HEADS = ("n_heads", "d_head", "scale_scores", "attention_temp")
_RELATIVE = ("relative_buckets", "relative_max_distance", "relative_bias_per_layer")  # a bias on self-attention's scores only
SWITCHES_AT = {
    "embeddings": ("scale_embedding", "position", "position_offset", "position_ids", "embedding_norm",
                   "decoder_embedding_norm", "share_embeddings", "pad_id"),
    "self": ("mask_fill", "empty_rows", "src_pad_mask", "tgt_pad_mask", "pad_id", "qkv_bias", *_HEADS, *_RELATIVE),
    "cross": ("mask_fill", "empty_rows", "cross_attn_src_mask", "pad_id", "qkv_bias", *_HEADS),
    "self_attn": ("layer_norm_eps", "layer_norm_form", "norm_placement", "mask_fill", "empty_rows", "src_pad_mask",
                  "tgt_pad_mask", "pad_id", "qkv_bias", "out_proj_bias", *_HEADS, *_RELATIVE),
    "cross_attn": ("layer_norm_eps", "layer_norm_form", "norm_placement", "mask_fill", "empty_rows",
                   "cross_attn_src_mask", "pad_id", "qkv_bias", "out_proj_bias", *_HEADS),
    "ffn": ("layer_norm_eps", "layer_norm_form", "norm_placement", "activation", "ffn_glu", "ffn_bias"),
    "output": ("layer_norm_eps", "layer_norm_form", "norm_placement", "final_encoder_norm", "final_decoder_norm"),
    "logits": ("tie_output", "output_bias", "final_logits_bias", "scale_logits"),
}
# Attention weights: the encoder's self-attention masks the source, the decoder's the target.
_NOT_IN = {"encoder": ("tgt_pad_mask", "cross_attn_src_mask", "final_decoder_norm", "decoder_embedding_norm"),
           "decoder": ("src_pad_mask", "final_encoder_norm")}

# Fields that act only in some configs: d_head when it is set (0 is d_model / n_heads, which
# n_heads already says), the relative-position fields with position "relative" (T5).
_ACTS_WHEN = {"d_head": lambda config: config.d_head != 0,
              **{name: lambda config: config.position == "relative" for name in _RELATIVE}}


# Switches whose effect differs from one position to the next: where the first positions agree
# and a later one parts, one of these (or a position table's later rows) is what differs.
BY_POSITION = ("position", "position_offset", "position_ids", *_RELATIVE)


def switches_by_position(config: ModelConfig | None = None) -> tuple[str, ...]:
    """BY_POSITION, those that act in `config` when given."""
    return tuple(s for s in BY_POSITION if config is None or s not in _ACTS_WHEN or _ACTS_WHEN[s](config))


def switches_at(tensor: str, config: ModelConfig | None = None) -> tuple[str, ...]:
    """The ModelConfig switches that act where `tensor` is computed: for `config` when given
    (those that act in it), else every one that can."""
    kind = tensor.rsplit(".", 1)[-1]
    stack = tensor.split(".", 1)[0]
    return tuple(s for s in SWITCHES_AT.get(kind, ()) if s not in _NOT_IN.get(stack, ())
                 and (config is None or s not in _ACTS_WHEN or _ACTS_WHEN[s](config)))
