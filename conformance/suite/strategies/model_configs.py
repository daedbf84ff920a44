"""Configs: every `ModelConfig` switch, its values read from the config module, at small sizes.

`switch_values()` is the one list of switches and values the suite draws from and covers
(conformance/suite/covering.py): bool fields take False and True, str fields every value of
conformance.core.config's tuples that the config's own validation accepts, numeric fields the
values `NUMERIC_CHOICES` declares (an undeclared one: its default and a second valid value). A
switch added to ModelConfig is drawn and covered without an edit here.
"""

from __future__ import annotations

import math
from dataclasses import fields
from functools import lru_cache

from hypothesis import strategies as st

from conformance.core import config as config_module
from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError
from conformance.core.presets import FLOAT32_MIN, PRESETS, preset

MAX_LENS = (8, 16)
FILLS = (-math.inf, -1e9, -1e4, FLOAT32_MIN)

# Sizes, not switches: the drawn examples vary them.
SIZE_FIELDS = ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "n_encoder_layers",
               "n_decoder_layers", "max_len", "n_mels", "max_source_len")
NOT_SWITCHES = SIZE_FIELDS + ("notes",)
# Numeric switches and their values: the defaults of PyTorch, Flax and BERT; every fill kind (NaN
# rows, a finite fill, float16's and float32's edges); both pad ids.
NUMERIC_CHOICES = {
    "layer_norm_eps": (1e-5, 1e-6, 1e-12),
    "mask_fill": FILLS,
    "pad_id": (0, 1),
    # AlgoPerf WMT's attention temperature: 1.0 (every other system), its workload variant's 4.0,
    # and one factor below 1.
    "attention_temp": (1.0, 0.5, 4.0),
    # Every other system (0) and BART's, mBART's and M2M100's first position row (2).
    "position_offset": (0, 2),
    # T5's relative positions: its own 32 buckets and 128 positions, and 8 and 20, under which the
    # suite's lengths (up to 16) reach the logarithmic buckets (past 2 in the encoder, 4 in the decoder).
    "relative_buckets": (32, 8),
    "relative_max_distance": (128, 20),
    # K from d_model / n_heads (0), or T5's d_kv set apart from it (the attention's width H K != D).
    "d_head": (0, 4),
}
# Switch values that change nothing unless other switches have given values: a covering row takes
# one only where they do (`conformance.suite.covering.covering_configs`), so that the row shows
# what it does. A drawn config takes any.
ACTS_ONLY_WITH = {("freeze_final_logits_bias", True): {"final_logits_bias": True}}
# The config switch values are probed on, and the covering rows start from: small, one layer a
# side (a compile per row and function), equal vocabularies (so that shared embeddings are
# possible), an even d_model >= 4 (every sinusoid).
BASE = ModelConfig(src_vocab_size=13, tgt_vocab_size=13, d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                   n_decoder_layers=1, max_len=8, n_mels=3)
# A features source's sizes: a few mel channels, and an encoder as long as the decoder (0) or longer.
N_MELS = (3, 5)
MAX_SOURCE_LENS = (0, 16)


def _string_candidates() -> list[str]:
    """Every string in a tuple of strings declared in conformance.core.config, in order."""
    found: list[str] = []
    for value in vars(config_module).values():
        if isinstance(value, tuple) and value and all(isinstance(v, str) for v in value):
            found += [v for v in value if v not in found]
    return found


# Switch values that only exist beside another switch's value (the config refuses them alone):
# drawn only where that value was drawn, and probed on the base config with it.
REQUIRES = {("decoder_embedding_norm", "tokens"): {"embedding_norm": True},
            ("relative_bias_per_layer", True): {"position": "relative"}}


def _accepts(name: str, value) -> bool:
    """Whether the config's validation accepts `value` for field `name` on the base config (with
    what `REQUIRES` says the value needs)."""
    try:
        BASE.replace(**{**REQUIRES.get((name, value), {}), name: value})
    except ConfigError as exc:
        return exc.field != name
    return True


def undeclared_choices(name: str, default) -> tuple:
    """A numeric switch not in `NUMERIC_CHOICES`: its default and the first valid one of a few
    alternatives (twice, half, one more, 1, 0.5, 2), so that both sides of it are exercised."""
    for other in (2 * default, default / 2, default + 1, 1, 0.5, 2):
        other = type(default)(other) if isinstance(default, int) and float(other).is_integer() else other
        if other != default and _accepts(name, other):
            return (default, other)
    return (default,)


@lru_cache(maxsize=1)
def switch_values() -> dict[str, tuple]:
    """Every switch of `ModelConfig` and the values the suite draws and covers, in field order."""
    values: dict[str, tuple] = {}
    strings = _string_candidates()
    for f in fields(ModelConfig):
        if f.name in NOT_SWITCHES:
            continue
        if f.type == "bool":
            values[f.name] = (False, True)
        elif f.type == "str":
            values[f.name] = tuple(v for v in strings if _accepts(f.name, v))
        elif f.name in NUMERIC_CHOICES:
            values[f.name] = tuple(NUMERIC_CHOICES[f.name])
        else:
            values[f.name] = undeclared_choices(f.name, getattr(BASE, f.name))
    return values


def values_of(options) -> st.SearchStrategy:
    """A strategy over a switch's values: `booleans()` for False and True, `integers` over a range
    of ints (the draws the suite made before its switches were read from the config module)."""
    options = tuple(options)
    if options == (False, True) and all(type(v) is bool for v in options):
        return st.booleans()
    if all(type(v) is int for v in options) and options == tuple(range(options[0], options[-1] + 1)):
        return st.integers(options[0], options[-1])
    return st.sampled_from(options)


# The switches the realistic strategies do not draw (`configs(fixed=MEASURED_ON)`): those added
# after the trained-scale and long-sequence tolerances were measured (Whisper's features source
# and key bias). The realistic properties meet their values in the covering rows; their drawn
# examples stay those the tolerances were measured on (a new draw moves every later example).
MEASURED_ON = {"source": "ids", "key_bias": True}


@st.composite
def configs(draw, max_layers: int = 3, min_layers: int = 1, head_dims=(2, 4, 8, 16), d_models=(8, 64),
            vocabs=st.integers(5, 64), d_ffs=st.sampled_from([8, 16, 32, 64, 128]),
            max_lens=st.sampled_from(MAX_LENS), notes=None, fixed=None) -> ModelConfig:
    """Any valid config: every switch (`switch_values`) drawn independently, small sizes.

    The sizes are the suite's unless given: 1-4 heads of `head_dims` with d_model in `d_models`
    (inclusive), `min_layers`-`max_layers` layers a side, vocabularies from `vocabs`, d_ff from
    `d_ffs`, max_len from `max_lens`. A switch added to ModelConfig is drawn too, after the others.
    `fixed`: switches given, not drawn ({name: value})."""
    heads = draw(st.integers(1, 4))
    low, high = d_models
    head_dim = draw(st.sampled_from(list(head_dims)).filter(lambda k: low <= heads * k <= high))
    values = switch_values()
    fixed = dict(fixed or {})

    def switch(name, options=None):
        if name in fixed:
            return fixed[name]
        return draw(values_of(options if options is not None else values[name]))

    # A features source (Whisper's) has no source vocabulary or embedding to share: one vocabulary.
    source = switch("source")
    features = source == "features"
    share = False if features else draw(st.booleans())
    src_vocab = draw(vocabs)
    d_model = heads * head_dim
    drawn = dict(
        source=source,
        n_mels=draw(st.sampled_from(N_MELS)) if features else ModelConfig.n_mels,
        max_source_len=draw(st.sampled_from(MAX_SOURCE_LENS)) if features else 0,
        src_vocab_size=src_vocab,
        tgt_vocab_size=src_vocab if share or features else draw(vocabs),
        d_model=d_model,
        n_heads=heads,
        d_ff=draw(d_ffs),
        n_encoder_layers=draw(st.integers(min_layers, max_layers)),
        n_decoder_layers=draw(st.integers(min_layers, max_layers)),
        max_len=draw(max_lens),
        norm_placement=switch("norm_placement"),
        final_encoder_norm=switch("final_encoder_norm"),
        final_decoder_norm=switch("final_decoder_norm"),
        layer_norm_eps=switch("layer_norm_eps"),
        layer_norm_form=switch("layer_norm_form"),
        scale_embedding=switch("scale_embedding"),
        position=switch("position", [p for p in values["position"]
                                     if d_model >= 4 or p not in ("sinusoid-t2t", "sinusoid-fairseq")]),
        share_embeddings=share,
        tie_output=switch("tie_output"),
        qkv_bias=switch("qkv_bias"),
        out_proj_bias=switch("out_proj_bias"),
        mask_fill=(fill := switch("mask_fill")),
        # Added scores need a fill that swamps them (config.ADDED_FILL_LIMIT): -inf or float32's edge.
        masked_scores=switch("masked_scores", [v for v in values["masked_scores"]
                                               if v != "added" or fill <= config_module.ADDED_FILL_LIMIT]),
        tgt_pad_mask=switch("tgt_pad_mask"),
        src_pad_mask=switch("src_pad_mask"),
        cross_attn_src_mask=switch("cross_attn_src_mask"),
        pad_id=switch("pad_id"),
        activation=switch("activation"),
        output_bias=switch("output_bias"),
        final_logits_bias=switch("final_logits_bias"),
        scale_logits=switch("scale_logits"),
    )
    for name in values:  # switches added since, each value only beside what it requires
        if name not in drawn:
            drawn[name] = switch(name, [v for v in values[name]
                                        if all(drawn.get(k) == w for k, w in REQUIRES.get((name, v), {}).items())])
    return ModelConfig(**drawn, **({} if notes is None else {"notes": notes}))


def preset_configs() -> st.SearchStrategy[ModelConfig]:
    """The named presets at a small size (the systems users actually port)."""
    small = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, max_len=8,
                 src_vocab_size=20, tgt_vocab_size=20)
    return st.sampled_from(sorted(PRESETS)).map(lambda name: preset(name, **small))


def any_configs() -> st.SearchStrategy[ModelConfig]:
    return st.one_of(preset_configs(), configs())


def small_configs(fixed=None) -> st.SearchStrategy[ModelConfig]:
    """`configs()` kept to d_model <= 32 and two layers a side: realistic numbers, small cost."""
    return configs(max_layers=2, fixed=fixed).filter(lambda c: c.d_model <= 32)
