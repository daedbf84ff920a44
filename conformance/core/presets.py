"""Named configs: one per known system in `variants.md`, plus the paper and the built-in default.

A preset fixes the switches (the numerics) of a system; the sizes are small defaults that a caller
overrides (`preset("hf-marian", d_model=512, n_heads=8)`). The weight converters start from these
same presets, so a switch is written down in exactly one place.
"""

from __future__ import annotations

from typing import Any

from conformance.core.config import FLOAT32_MAX, ModelConfig
from conformance.core.errors import ConfigError

# float32's most negative finite value: Hugging Face fills masked scores with `finfo(dtype).min`.
FLOAT32_MIN = -FLOAT32_MAX

_T5: dict[str, Any] = dict(
    norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, layer_norm_form="rms",
    layer_norm_eps=1e-6, scale_embedding=False, position="relative", relative_buckets=32,
    relative_max_distance=128, scale_scores=False, qkv_bias=False, out_proj_bias=False, ffn_bias=False,
    share_embeddings=True, tie_output=True, output_bias=False, scale_logits=True, activation="relu",
    mask_fill=FLOAT32_MIN, tgt_pad_mask="none", pad_id=0,
)

# Whisper in transformers (modeling_whisper.py, WhisperForConditionalGeneration): log-mel features
# through two convolutions with exact GELU (source "features"), pre-LN with final norms (eps 1e-5),
# a key projection without bias beside biased query, value and output, stored position tables on
# both stacks (the encoder's a frozen float32 sinusoid of max_source_positions rows, the decoder's
# learned, max_target_positions rows), no embedding scale (its scale_embedding is never applied),
# the output tied to the decoder's token table without a bias, masked scores at finfo.min, the
# decoder causal only, `nn.Embedding(padding_idx=pad_token_id)`.
_WHISPER: dict[str, Any] = dict(
    source="features", norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, layer_norm_eps=1e-5,
    scale_embedding=False, position="table", qkv_bias=True, key_bias=False, out_proj_bias=True,
    tie_output=True, output_bias=False, activation="gelu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none",
    freeze_pad_embedding=True,
)

PRESETS: dict[str, dict[str, Any]] = {
    # Vaswani et al. (2017): post-LN, shared source/target embedding tied to the output (3.4).
    "paper": dict(
        norm_placement="post", scale_embedding=True, position="sinusoid-interleaved",
        share_embeddings=True, tie_output=True, output_bias=False, mask_fill=-1e9,
    ),
    # S0 "Transformer-from-Scratch": only the encoder has a final norm; q/k/v without bias;
    # target padding on the queries; the decoder's cross-attention sees every source position.
    "from-scratch": dict(
        norm_placement="post", final_encoder_norm=True, final_decoder_norm=False,
        scale_embedding=True, position="sinusoid-interleaved", qkv_bias=False, out_proj_bias=True,
        mask_fill=-1e9, tgt_pad_mask="queries", cross_attn_src_mask=False, pad_id=0,
    ),
    # S1 "LLMHub": post-LN, -inf fill, target padding on the keys, padding id 0.
    "llmhub": dict(
        norm_placement="post", scale_embedding=True, position="sinusoid-interleaved",
        mask_fill=float("-inf"), tgt_pad_mask="keys", pad_id=0,
    ),
    # S2 hyunwoongko/transformer: LayerNorm eps 1e-12, no embedding scale, -1e4 fill, pad id 1.
    "hyunwoongko": dict(
        norm_placement="post", layer_norm_eps=1e-12, scale_embedding=False,
        position="sinusoid-interleaved", mask_fill=-1e4, tgt_pad_mask="queries", pad_id=1,
    ),
    # S3 "sublayer-norm": each sublayer owns its residual and norm, which is post-LN.
    "sublayer-norm": dict(
        norm_placement="post", scale_embedding=False, position="sinusoid-interleaved",
        mask_fill=-1e9, tgt_pad_mask="queries", pad_id=0,
    ),
    # S4 "pre-ln-tutorial": pre-LN with final norms on both stacks, -inf fill.
    "pre-ln-tutorial": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True,
        scale_embedding=True, position="sinusoid-interleaved", mask_fill=float("-inf"),
        tgt_pad_mask="keys", pad_id=0,
    ),
    # P1 torch.nn.Transformer wrapped as in PyTorch's translation tutorial: both final norms are
    # always present; boolean masks mean -inf; the tutorial's PAD_IDX is 1.
    "torch-nn-transformer": dict(
        norm_placement="post", final_encoder_norm=True, final_decoder_norm=True,
        scale_embedding=True, position="sinusoid-interleaved", mask_fill=float("-inf"),
        tgt_pad_mask="keys", cross_attn_src_mask=True, pad_id=1,
    ),
    # P2 Hugging Face Marian: SiLU, split sinusoid, shared and tied embeddings plus a separate
    # final_logits_bias (a registered buffer: not trained), masked scores at the dtype's most negative
    # finite value, and a causal-only target mask (its decoder_start_token_id is the pad id).
    "hf-marian": dict(
        norm_placement="post", scale_embedding=True, position="sinusoid-split",
        share_embeddings=True, tie_output=True, output_bias=False, final_logits_bias=True,
        activation="silu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none", freeze_pad_embedding=True,
        freeze_final_logits_bias=True,
    ),
    # The BART family in transformers (modeling_bart, modeling_mbart, modeling_m2m_100,
    # modeling_pegasus): Marian's attention and masks (finfo.min fill, a causal-only target mask:
    # `decoder_attention_mask` is None in generate() and training), one shared embedding tied to
    # `lm_head`, LayerNorm eps 1e-5, and `nn.Embedding(padding_idx=pad_token_id)` for the tokens.
    # Activation, embedding scale and pad id are config.json's (`[hf]` in each layout); the values
    # here are the released models'.
    # P5 BART: post-LN, `layernorm_embedding`, a learned table read 2 rows in
    # (`BartLearnedPositionalEmbedding.offset`), GELU, no embedding scale, final_logits_bias.
    "hf-bart": dict(
        norm_placement="post", embedding_norm=True, scale_embedding=False, position="table", position_offset=2,
        share_embeddings=True, tie_output=True, output_bias=False, final_logits_bias=True, activation="gelu",
        mask_fill=FLOAT32_MIN, tgt_pad_mask="none", pad_id=1, freeze_pad_embedding=True, freeze_final_logits_bias=True,
    ),
    # P6 mBART: BART pre-LN, with a final LayerNorm on each stack (`encoder.layer_norm`) after the
    # embedding LayerNorm; released models scale the embedding (facebook/mbart-large-cc25).
    "hf-mbart": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, embedding_norm=True,
        scale_embedding=True, position="table", position_offset=2, share_embeddings=True, tie_output=True,
        output_bias=False, final_logits_bias=True, activation="gelu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none",
        pad_id=1, freeze_pad_embedding=True, freeze_final_logits_bias=True,
    ),
    # P7 M2M100 / NLLB: pre-LN with final norms, no embedding LayerNorm, fairseq's float32 sinusoid
    # (not stored: a non-persistent buffer) numbering only non-pad tokens from pad_id + 1, ReLU,
    # scaled embedding, and no final_logits_bias (lm_head alone gives the logits).
    "hf-m2m100": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, scale_embedding=True,
        position="sinusoid-fairseq", position_offset=2, position_ids="non-pad", share_embeddings=True,
        tie_output=True, output_bias=False, activation="relu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none",
        pad_id=1, freeze_pad_embedding=True,
    ),
    # P8 Pegasus: pre-LN with final norms, Marian's split sinusoid from position 0 (a frozen table
    # that save_pretrained keeps), final_logits_bias, pad id 0 (also the decoder start); released
    # models (google/pegasus-*) use ReLU and a scaled embedding.
    "hf-pegasus": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, scale_embedding=True,
        position="sinusoid-split", share_embeddings=True, tie_output=True, output_bias=False,
        final_logits_bias=True, activation="relu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none", pad_id=0,
        freeze_pad_embedding=True, freeze_final_logits_bias=True,
    ),
    # PLBart (modeling_plbart): BART's modules, the embedding scaled (PLBartConfig.scale_embedding).
    "hf-plbart": dict(
        norm_placement="post", embedding_norm=True, scale_embedding=True, position="table", position_offset=2,
        share_embeddings=True, tie_output=True, output_bias=False, final_logits_bias=True, activation="gelu",
        mask_fill=FLOAT32_MIN, tgt_pad_mask="none", pad_id=1, freeze_pad_embedding=True,
        freeze_final_logits_bias=True,
    ),
    # BlenderbotSmall (modeling_blenderbot_small): BART's modules, a learned table read from row 0,
    # and the decoder's layernorm_embedding on the tokens before the positions are added.
    "hf-blenderbot-small": dict(
        norm_placement="post", embedding_norm=True, decoder_embedding_norm="tokens", scale_embedding=False,
        position="table", position_offset=0, share_embeddings=True, tie_output=True, output_bias=False,
        final_logits_bias=True, activation="gelu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none", pad_id=0,
        freeze_pad_embedding=True, freeze_final_logits_bias=True,
    ),
    # Blenderbot (modeling_blenderbot): Pegasus' modules with a learned table from row 0, GELU and
    # no embedding scale (BlenderbotConfig's defaults).
    "hf-blenderbot": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, scale_embedding=False,
        position="table", share_embeddings=True, tie_output=True, output_bias=False, final_logits_bias=True,
        activation="gelu", mask_fill=FLOAT32_MIN, tgt_pad_mask="none", pad_id=0, freeze_pad_embedding=True,
        freeze_final_logits_bias=True,
    ),
    # FSMT (modeling_fsmt: fairseq's WMT19 transformers): post-LN without final norms or an embedding
    # LayerNorm, fairseq's float32 sinusoid over non-pad tokens from pad_id + 1 (a frozen table the
    # folder stores), separate source and target embeddings (their own vocabularies) and an untied
    # output_projection without bias, ReLU, scaled embeddings; padding masked on the keys in both
    # stacks (the decoder's start token is the end token, not the pad), finfo.min fills.
    "hf-fsmt": dict(
        norm_placement="post", scale_embedding=True, position="sinusoid-fairseq", position_offset=2,
        position_ids="non-pad", share_embeddings=False, tie_output=False, output_bias=False, activation="relu",
        mask_fill=FLOAT32_MIN, tgt_pad_mask="keys", pad_id=1, freeze_pad_embedding=True,
    ),
    # fairseq's TransformerModel (fairseq/models/transformer), transformer_wmt_en_de and its kin at
    # their defaults: FSMT's numerics (the WMT19 models were fairseq's), with fairseq's own masks:
    # padding and the future filled with -inf (MultiheadAttention, future_mask).
    "fairseq-transformer": dict(
        norm_placement="post", scale_embedding=True, position="sinusoid-fairseq", position_offset=2,
        position_ids="non-pad", share_embeddings=False, tie_output=False, output_bias=False, activation="relu",
        mask_fill=float("-inf"), tgt_pad_mask="keys", pad_id=1, freeze_pad_embedding=True,
    ),
    # P9 T5 v1.0 (transformers modeling_t5; t5-small ... t5-11b): pre-LN with T5LayerNorm (RMSNorm
    # in float32, eps 1e-6, a scale and no bias) and a final norm on each stack; scores Q K^T
    # unscaled (T5 folds the scale into W_q's initialisation); no bias anywhere; heads of d_kv,
    # apart from d_model / H; the learned relative position bias of block 0 added to every
    # self-attention layer's scores; one shared embedding (no padding_idx, no scale) tied to
    # lm_head, whose input is scaled by d_model^-1/2 (`scale_decoder_outputs`); ReLU; masked
    # scores at finfo.min; the decoder masked causally only (it starts with the pad id 0).
    "hf-t5": _T5,
    # T5 v1.1, Flan-T5, ByT5 (same class): gated GELU (tanh form, `gelu_new`) and an lm_head of
    # its own, unscaled (config.json's `tie_word_embeddings: false`).
    "hf-t5-v1_1": {**_T5, "ffn_glu": True, "activation": "gelu-tanh", "tie_output": False, "scale_logits": False},
    # mT5 (modeling_mt5): T5 v1.1's numerics; MT5ForConditionalGeneration never scales the logits.
    "hf-mt5": {**_T5, "ffn_glu": True, "activation": "gelu-tanh", "tie_output": False, "scale_logits": False},
    # UMT5 (modeling_umt5): T5 v1.1's numerics (gated GELU, untied head) with a relative position
    # bias table in every self-attention layer, and the logits always scaled by d_model^-1/2
    # (`if self.config.tie_word_embeddings`, which UMT5Config forces to True).
    "hf-umt5": {**_T5, "relative_bias_per_layer": True, "ffn_glu": True, "activation": "gelu-tanh", "tie_output": False,
                "scale_logits": True},
    # P4 The Annotated Transformer: pre-LN via SublayerConnection, its own (x-mean)/(std+eps)
    # LayerNorm with eps 1e-6, final norms on both stacks.
    "annotated-transformer": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True,
        layer_norm_eps=1e-6, layer_norm_form="std-eps", scale_embedding=True,
        position="sinusoid-interleaved", mask_fill=-1e9, tgt_pad_mask="keys",
    ),
    # P3 Flax `examples/wmt` (linen): pre-LN with final norms, no attention biases, the t2t
    # sinusoid stored in float32, no embedding scale, Flax's fast-variance LayerNorm (eps 1e-6),
    # padding masked on both sides in the encoder, masked scores at float32's most negative
    # finite value (`finfo(dtype).min`: the same weights in float64, where every masked score's
    # exp underflows to 0 as well). The decoder embeds `shift_right(targets)`, whose first id is
    # 0 = pad, so its padding mask is causal only here; see docs/flax.md for feeding it. A wmt
    # config with `logits_via_embedding` is `tie_output=True, output_bias=False, scale_logits=True`.
    "flax-wmt": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True,
        layer_norm_eps=1e-6, layer_norm_form="fast-variance", scale_embedding=False,
        position="sinusoid-t2t", qkv_bias=False, out_proj_bias=False, mask_fill=FLOAT32_MIN,
        tgt_pad_mask="none", src_pad_mask="both", cross_attn_src_mask=True, pad_id=0,
        activation="relu", output_bias=True,
    ),
    # MLCommons AlgoPerf's WMT Transformer (algoperf/workloads/wmt/wmt_jax/models.py), its base
    # workload: Flax examples/wmt with one shared embedding and logits through it / sqrt(D). Its
    # variants are switches on top: norm_placement="post" without final norms (WmtWorkloadPostLN),
    # ffn_glu=True with activation="tanh" (WmtWorkloadGLUTanH), attention_temp=4.0
    # (WmtWorkloadAttentionTemp).
    "algoperf-wmt-flax": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True,
        layer_norm_eps=1e-6, layer_norm_form="fast-variance", scale_embedding=False,
        position="sinusoid-t2t", qkv_bias=False, out_proj_bias=False, mask_fill=FLOAT32_MIN,
        tgt_pad_mask="none", src_pad_mask="both", cross_attn_src_mask=True, pad_id=0,
        activation="relu", share_embeddings=True, tie_output=True, output_bias=False, scale_logits=True,
    ),
    # Its PyTorch twin (wmt_pytorch/models.py): nn.LayerNorm's two-pass variance, and masks of
    # -1e10 added to the scores (the same softmax as a -1e10 fill for any score below 512 in
    # magnitude). Its position buffer is the t2t sinusoid computed by torch in float32; an import
    # keeps that table as stored (position="table").
    "algoperf-wmt-torch": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True,
        layer_norm_eps=1e-6, layer_norm_form="standard", scale_embedding=False,
        position="sinusoid-t2t", qkv_bias=False, out_proj_bias=False, mask_fill=-1e10,
        tgt_pad_mask="none", src_pad_mask="both", cross_attn_src_mask=True, pad_id=0,
        activation="relu", share_embeddings=True, tie_output=True, output_bias=False, scale_logits=True,
    ),
    # Whisper in transformers (modeling_whisper.py, WhisperForConditionalGeneration): see _WHISPER.
    "hf-whisper": _WHISPER,
    # openai-whisper (whisper/model.py): the same logits (its -inf causal mask never meets an empty
    # row), and a token embedding without padding_idx.
    "openai-whisper": {**_WHISPER, "freeze_pad_embedding": False},
    # OpenNMT-py 3.x's transformer (onmt/encoders/transformer.py, onmt/decoders/transformer.py) at
    # its option defaults: pre-LN with a final LayerNorm on each stack (eps norm_eps 1e-6), no q/k/v/o
    # biases (add_qkvbias false) and no feed-forward biases (add_ffnbias false), the embedding scaled
    # by sqrt(d) inside PositionalEncoding and its sinusoid stored as a buffer, masked scores filled
    # with -1e18, target padding masked on the keys AND causal, separate embeddings (each an
    # nn.Embedding with the pad token's padding_idx) and a generator of its own with a bias; pad id 1
    # ("<blank>" in its vocabularies).
    "opennmt-py": dict(
        norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, layer_norm_eps=1e-6,
        scale_embedding=True, position="table", qkv_bias=False, out_proj_bias=False, ffn_bias=False,
        mask_fill=-1e18, tgt_pad_mask="keys", cross_attn_src_mask=True, pad_id=1, share_embeddings=False,
        tie_output=False, output_bias=True, activation="relu", freeze_pad_embedding=True,
    ),
    # The built-in default for `rosetta check`: small, post-LN, with padding on both sides.
    "default": dict(
        src_vocab_size=24, tgt_vocab_size=24, d_model=32, n_heads=4, d_ff=64,
        n_encoder_layers=2, n_decoder_layers=2, max_len=32,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The config of a named system, with any field overridden (sizes, usually)."""
    if name not in PRESETS:
        raise ConfigError("preset", f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})
