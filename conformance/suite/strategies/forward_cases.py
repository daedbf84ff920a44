"""Cases: a config, its weights and a padded batch, the example every forward property draws; and
how a property takes explicit examples and the shared example sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from conformance.core.config import ModelConfig
from conformance.core.params import init_params
from conformance.suite.strategies.model_configs import any_configs
from conformance.suite.strategies.ids import LENGTHS, sources, token_ids
from conformance.suite.strategies.weights import Trained

WEIGHT_SCALES = (0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Case:
    """One conformance example: a config, its weights (by seed and scale, and the `Trained`
    transformation when there is one) and a batch. `src_ids` is the source, ids (B, S) or a
    features source's log-mel features (B, n_mels, 2 S), float64."""

    config: ModelConfig
    seed: int
    scale: float
    src_ids: np.ndarray
    tgt_ids: np.ndarray
    trained: Trained | None = None

    def params(self, dtype=np.float64) -> dict[str, np.ndarray]:
        if self.trained is None:
            return init_params(self.config, seed=self.seed, dtype=dtype, scale=self.scale)
        params = init_params(self.config, seed=self.seed, dtype=np.float64, scale=self.scale)
        return {k: v.astype(dtype) for k, v in self.trained.apply(self.config, params, self.seed).items()}

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        trained = "" if self.trained is None else f", trained={self.trained!r}"
        return (f"Case(config=ModelConfig.from_json({self.config.to_json()!r}), seed={self.seed}, "
                f"scale={self.scale}, src_ids=np.{self.src_ids!r}, tgt_ids=np.{self.tgt_ids!r}{trained})")


@st.composite
def cases(draw, config_strategy: st.SearchStrategy[ModelConfig] | None = None,
          allow_empty_source_rows: bool = True) -> Case:
    """A config, seeded weights at one of a few scales, and a padded batch (B 1-4): rows padded
    every way `strategies.ids` draws, some batches wider than their longest row."""
    config = draw(config_strategy if config_strategy is not None else any_configs())
    lengths = [n for n in LENGTHS if n <= config.max_len] + [config.max_len]
    batch = draw(st.integers(1, 4))
    src_len = draw(st.sampled_from([n for n in LENGTHS if n <= config.source_len] + [config.source_len]))
    tgt_len = draw(st.sampled_from(lengths))
    src = draw(sources(config, batch, src_len, allow_empty_source_rows))
    # A target row may start with the pad id (Marian's and BART's decoder inputs do), and be all
    # padding where the config gives such a row a value (`empty_target_rows_defined`).
    tgt = draw(token_ids(config.tgt_vocab_size, config.pad_id, batch, tgt_len,
                         allow_empty_rows=empty_target_rows_defined(config)))
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from(WEIGHT_SCALES))
    return Case(config=config, seed=seed, scale=scale, src_ids=src, tgt_ids=tgt)


def empty_target_rows_defined(config: ModelConfig) -> bool:
    """Whether a target row of padding only has a value under `config`, not the 0 / 0 of a -inf
    fill's softmax over a query with no key: its target padding is not masked (Marian's causal-only
    decoder), or the fill is finite (a uniform average), or such queries give zeros."""
    return config.tgt_pad_mask == "none" or not math.isinf(config.mask_fill) or config.empty_rows == "zeros"


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


# The explicit examples of every property, by identity (`with_examples`): an adapter's
# acknowledged difference there is recorded rather than raised (conformance.suite.differences).
EXPLICIT: set[int] = set()


def with_examples(examples, argument: str = "case"):
    """Run `examples` as explicit examples of a property drawing `argument` (default `case`), in this order."""
    from hypothesis import example

    examples = list(examples)
    EXPLICIT.update(id(case) for case in examples)
    _KEPT.extend(examples)  # alive as long as the process: their ids stay theirs

    def decorate(test):
        for case in reversed(examples):
            test = example(**{argument: case})(test)
        return test

    return decorate


_KEPT: list = []
