"""Gradient examples: a padded case, its labels and the label smoothing."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st

from conformance.core.config import ModelConfig
from conformance.core.inputs import nan_positions
from conformance.suite.strategies.forward_cases import Case, cases

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
    if config.source == "ids":  # a features source has no padding to empty a row with
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


def relabelled(training: TrainingCase) -> TrainingCase:
    """The same case with other labels at the same counted positions: each counted label moved
    to the next id that is not pad_id (cyclically), a second batch of the same shapes. A label
    only stays where the vocabulary has a single id besides pad_id."""
    labels, pad, vocab = training.labels, training.case.config.pad_id, training.case.config.tgt_vocab_size
    moved = (labels + 1) % vocab
    moved = np.where(moved == pad, (moved + 1) % vocab, moved)
    return replace(training, labels=np.where(labels == pad, pad, moved))
