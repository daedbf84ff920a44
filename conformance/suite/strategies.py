"""Hypothesis strategies: configs over every switch, token batches with hostile padding, weights.

Sizes are small (d_model 8-64, 1-4 heads, 1-3 layers per side, vocab 5-64) so that thousands of
examples run in minutes. Sequence lengths are drawn from a short list and max_len from two
values, so that a jit-compiling backend (JAX) sees a bounded set of shapes: each new
(config, shape) costs a compile, which the suite reports separately from run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from conformance.core.config import ACTIVATIONS, LAYER_NORM_FORMS, NORM_PLACEMENTS, PAD_MASK_SIDES, POSITIONS, SRC_PAD_MASK_SIDES, ModelConfig
from conformance.core.inputs import nan_positions
from conformance.core.params import init_params
from conformance.core.presets import FLOAT32_MIN, PRESETS, preset

# Lengths a batch may have. Few values keep JAX compiles bounded; 1 is the edge case of a
# single token; max_len itself is always reachable.
LENGTHS = (1, 2, 3, 5, 8)
MAX_LENS = (8, 16)
FILLS = (-math.inf, -1e9, -1e4, FLOAT32_MIN)
PADDING_PATTERNS = ("none", "trailing", "all-but-one", "whole-row")
WEIGHT_SCALES = (0.5, 1.0, 2.0)


@st.composite
def configs(draw, max_layers: int = 3) -> ModelConfig:
    """Any valid config: every switch drawn independently, small sizes."""
    heads = draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([2, 4, 8, 16]).filter(lambda k: 8 <= heads * k <= 64))
    share = draw(st.booleans())
    src_vocab = draw(st.integers(5, 64))
    return ModelConfig(
        src_vocab_size=src_vocab,
        tgt_vocab_size=src_vocab if share else draw(st.integers(5, 64)),
        d_model=heads * head_dim,
        n_heads=heads,
        d_ff=draw(st.sampled_from([8, 16, 32, 64, 128])),
        n_encoder_layers=draw(st.integers(1, max_layers)),
        n_decoder_layers=draw(st.integers(1, max_layers)),
        max_len=draw(st.sampled_from(MAX_LENS)),
        norm_placement=draw(st.sampled_from(NORM_PLACEMENTS)),
        final_encoder_norm=draw(st.booleans()),
        final_decoder_norm=draw(st.booleans()),
        layer_norm_eps=draw(st.sampled_from([1e-5, 1e-6, 1e-12])),
        layer_norm_form=draw(st.sampled_from(LAYER_NORM_FORMS)),
        scale_embedding=draw(st.booleans()),
        position=draw(st.sampled_from(POSITIONS)),
        share_embeddings=share,
        tie_output=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        out_proj_bias=draw(st.booleans()),
        mask_fill=draw(st.sampled_from(FILLS)),
        tgt_pad_mask=draw(st.sampled_from(PAD_MASK_SIDES)),
        src_pad_mask=draw(st.sampled_from(SRC_PAD_MASK_SIDES)),
        cross_attn_src_mask=draw(st.booleans()),
        pad_id=draw(st.integers(0, 1)),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        output_bias=draw(st.booleans()),
        final_logits_bias=draw(st.booleans()),
        scale_logits=draw(st.booleans()),
    )


def preset_configs() -> st.SearchStrategy[ModelConfig]:
    """The named presets at a small size (the systems users actually port)."""
    small = dict(d_model=16, n_heads=2, d_ff=32, n_encoder_layers=2, n_decoder_layers=2, max_len=8,
                 src_vocab_size=20, tgt_vocab_size=20)
    return st.sampled_from(sorted(PRESETS)).map(lambda name: preset(name, **small))


def any_configs() -> st.SearchStrategy[ModelConfig]:
    return st.one_of(preset_configs(), configs())


@st.composite
def token_ids(draw, vocab: int, pad_id: int, batch: int, length: int, allow_empty_rows: bool) -> np.ndarray:
    """(batch, length) ids; each row gets a padding pattern. Real tokens never equal pad_id."""
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad_id)
    rows = []
    patterns = PADDING_PATTERNS if allow_empty_rows else PADDING_PATTERNS[:-1]
    for _ in range(batch):
        pattern = draw(st.sampled_from(patterns))
        row = [draw(real) for _ in range(length)]
        if pattern == "trailing" and length > 1:
            keep = draw(st.integers(1, length - 1))
            row[keep:] = [pad_id] * (length - keep)
        elif pattern == "all-but-one":
            row[1:] = [pad_id] * (length - 1)
        elif pattern == "whole-row":
            row = [pad_id] * length
        rows.append(row)
    return np.array(rows, dtype=np.int64)


@dataclass(frozen=True)
class Case:
    """One conformance example: a config, its weights (by seed and scale) and a batch."""

    config: ModelConfig
    seed: int
    scale: float
    src_ids: np.ndarray
    tgt_ids: np.ndarray

    def params(self, dtype=np.float64) -> dict[str, np.ndarray]:
        return init_params(self.config, seed=self.seed, dtype=dtype, scale=self.scale)

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return (f"Case(config=ModelConfig.from_json({self.config.to_json()!r}), seed={self.seed}, "
                f"scale={self.scale}, src_ids=np.{self.src_ids!r}, tgt_ids=np.{self.tgt_ids!r})")


@st.composite
def cases(draw, config_strategy: st.SearchStrategy[ModelConfig] | None = None,
          allow_empty_source_rows: bool = True) -> Case:
    """A config, seeded weights at one of a few scales, and a padded batch (B 1-4)."""
    config = draw(config_strategy if config_strategy is not None else any_configs())
    lengths = [n for n in LENGTHS if n <= config.max_len] + [config.max_len]
    batch = draw(st.integers(1, 4))
    src_len = draw(st.sampled_from(lengths))
    tgt_len = draw(st.sampled_from(lengths))
    src = draw(token_ids(config.src_vocab_size, config.pad_id, batch, src_len, allow_empty_source_rows))
    # The target always starts with a real token (a BOS), as every decoder input does.
    tgt = draw(token_ids(config.tgt_vocab_size, config.pad_id, batch, tgt_len, allow_empty_rows=False))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from(WEIGHT_SCALES))
    return Case(config=config, seed=seed, scale=scale, src_ids=src, tgt_ids=tgt)


def shared_examples(test):
    """Give every property the same example sequence (under the `ci` profile, or when
    $ROSETTA_SEED is set), so a jit-compiling backend compiles each (config, shape) once for
    the whole suite instead of once per property. The `thorough` profile explores freely."""
    import os

    from hypothesis import seed, settings

    chosen = os.environ.get("ROSETTA_SEED")
    if chosen is not None:
        return seed(int(chosen))(test)
    if settings().derandomize:
        return seed(0)(test)
    return test


@dataclass(frozen=True)
class GenerationCase:
    """One decoding example: a model and source batch (`case`, its tgt_ids unused) and the
    arguments of `generate`. The pad id is banned (as Marian's generation config does), so that no
    open row reads a pad token as a query."""

    case: Case
    max_len: int
    bos_id: int
    eos_id: int
    options: tuple[tuple[str, object], ...]

    def arguments(self) -> dict:
        return dict(self.options, banned_ids=(self.case.config.pad_id,))

    def __repr__(self) -> str:
        return (f"GenerationCase({self.case!r}, max_len={self.max_len}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
                f"options={self.options!r})")


@st.composite
def generation_cases(draw) -> GenerationCase:
    """Greedy or beam search (1-3 beams) over a drawn config and a source batch without
    all-padding rows, generating at most 6 tokens, with drawn length penalty and stopping rule."""
    case = draw(cases(st.one_of(preset_configs(), configs(max_layers=2)), allow_empty_source_rows=False))
    config = case.config
    vocab, pad = config.tgt_vocab_size, config.pad_id
    real = st.integers(0, vocab - 1).filter(lambda i: i != pad)
    bos = draw(real)
    eos = draw(real.filter(lambda i: i != bos))
    options = (("num_beams", draw(st.sampled_from([1, 2, 3]))),
               ("length_penalty", draw(st.sampled_from([1.0, 0.0, 0.6, -0.5]))),
               ("early_stopping", draw(st.sampled_from([False, True, "never"]))),
               ("length_penalty_form", draw(st.sampled_from(["hf", "gnmt"]))))
    return GenerationCase(case=case, max_len=min(6, config.max_len), bos_id=bos, eos_id=eos, options=options)


# Label smoothings a training example may use: none, the paper's, and a large one.
LABEL_SMOOTHINGS = (0.0, 0.1, 0.5)


@dataclass(frozen=True)
class TrainingCase:
    """One gradient example: a forward case, its labels (B, T) and the label smoothing."""

    case: Case
    labels: np.ndarray
    label_smoothing: float

    def __repr__(self) -> str:
        return f"TrainingCase(case={self.case!r}, labels=np.{self.labels!r}, label_smoothing={self.label_smoothing})"


@st.composite
def training_cases(draw, config_strategy: st.SearchStrategy[ModelConfig] | None = None) -> TrainingCase:
    """A padded case with labels: a real token wherever the decoder input is real (some dropped
    to pad_id), pad_id after it. Half the batches of two or more rows get a last source row of
    padding only: with a finite fill its attention rows are uniform (the gradient must not reach
    the masked scores); with a -inf fill its whole batch element is NaN, so its labels are all pad
    (a fully padded label row). The first position that may count always does, so the loss is never 0 / 0."""
    case = draw(cases(config_strategy))
    config = case.config
    pad = config.pad_id
    src = case.src_ids.copy()
    batch = src.shape[0]
    real = st.integers(0, config.tgt_vocab_size - 1).filter(lambda i: i != pad)
    if (src[0] == pad).all():
        src[0, 0] = draw(st.integers(0, config.src_vocab_size - 1).filter(lambda i: i != pad))
    if batch >= 2 and draw(st.booleans()):
        src[-1] = pad
    labels = np.full(case.tgt_ids.shape, pad, dtype=np.int64)
    # Where a -inf fill makes the logits NaN nothing may count (core.inputs.nan_positions; the
    # backends refuse such labels): the NaN batch elements and positions keep pad labels.
    may_count = (case.tgt_ids != pad) & ~nan_positions(config, src, case.tgt_ids)
    first = next(iter(map(tuple, np.argwhere(may_count))), None)
    assume(first is not None)  # some label must count: the loss is a mean over them
    for b, t in map(tuple, np.argwhere(may_count)):
        if (b, t) == first or draw(st.integers(0, 4)) > 0:
            labels[b, t] = draw(real)
    case = Case(config=config, seed=case.seed, scale=case.scale, src_ids=src, tgt_ids=case.tgt_ids)
    return TrainingCase(case=case, labels=labels, label_smoothing=draw(st.sampled_from(LABEL_SMOOTHINGS)))
