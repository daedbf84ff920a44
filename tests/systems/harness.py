"""What the converter tests share: batches with padding, running a backend, comparing with a source.

The bar (issue 5): a converted model reproduces its source system's float32 logits within an
absolute 1e-5 (the literal max |ours - source|, not scaled by the logits' size), and NaN exactly
where the source has NaN. Measured on the systems here: at most ~1.4e-6.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from conformance.check import backends
from conformance.check.compare import to_numpy

SOURCE_BAR = 1e-5

# A wrong LayerNorm epsilon (any swap among 1e-5, 1e-6, 1e-12) moves the systems' logits by only
# 1.2e-6 to 2.4e-5 (measured), partly under the float32 bar. Run in float64 (the source with
# `.double()`, our NumPy oracle in float64), a correct port agrees to ~2e-15 (measured on every
# system here), so a bar of 1e-9 sits over 1000x below the smallest wrong-epsilon effect and
# 10^5 above the rounding. A system whose position term stays float32 in `.double()` needs its
# own table handed over (see tests/convert/test_source_systems.py), or its ~7e-8 would count.
FLOAT64_BAR = 1e-9
WRONG_EPSILONS = (1e-5, 1e-6, 1e-12)

BACKENDS = ["numpy", "torch", "jax"]


def backend_param(name: str):
    """A pytest param for a backend that skips, naming the reason, when it cannot be imported."""
    reason = backends.availability([name])[name]
    marks = [pytest.mark.skip(reason=f"impl_{name} {reason}")] if reason else []
    return pytest.param(name, marks=marks, id=name)


BACKEND_PARAMS = [backend_param(name) for name in BACKENDS]


def ids(pad: int, vocab: int, lengths: list[int], length: int, seed: int, first: list[int] | None = None) -> np.ndarray:
    """(B, L) ids: row r has `lengths[r]` real tokens (never `pad`), then padding."""
    rng = np.random.default_rng(seed)
    real = np.array([i for i in range(vocab) if i != pad])
    out = np.full((len(lengths), length), pad, dtype=np.int64)
    for row, n in enumerate(lengths):
        out[row, :n] = rng.choice(real, n)
    return out


def padded_batch(pad: int, src_vocab: int, tgt_vocab: int, seed: int = 0, fully_masked: bool = False):
    """(src, tgt) ids where every padding rule matters: full rows, short rows, a one-token target.

    With `fully_masked`, three more rows produce fully masked attention rows: an all-padding
    source and a target that starts with padding. Batch elements never interact, so one call
    checks both kinds (and a backend that compiles per shape compiles once).
    """
    src_lengths, tgt_lengths = [9, 5, 2], [7, 4, 1]
    if fully_masked:
        src_lengths, tgt_lengths = src_lengths + [6, 0, 3], tgt_lengths + [5, 3, 2]
    src, tgt = ids(pad, src_vocab, src_lengths, 9, seed), ids(pad, tgt_vocab, tgt_lengths, 7, seed + 1)
    if fully_masked:
        tgt[3, 0] = pad
    return src, tgt


def run_backend(backend: str, config, params, src, tgt, dtype: str = "float32", **call) -> np.ndarray:
    """Logits of the converted model on one backend, as a NumPy array of `dtype`."""
    target = backends.Target(backend, "cpu", dtype)
    with backends.full_precision(backend), backends.dtype_scope(target):
        model = backends.build(target, config, params)
        logits = model(src, tgt, **call).logits
    return to_numpy(logits).astype(dtype)


@dataclass
class Difference:
    """How our logits differ from a source's: the largest |ours - source| where both are numbers,
    and the positions where exactly one of them is NaN."""

    max_abs: float
    max_abs_at: tuple[int, ...] | None
    nan_mismatches: int
    first_nan_mismatch_at: tuple[int, ...] | None

    def within(self, bar: float) -> bool:
        return self.max_abs <= bar and not self.nan_mismatches

    def describe(self) -> str:
        text = f"max abs difference {self.max_abs:.3e} at {self.max_abs_at}"
        if self.nan_mismatches:
            text += f"; NaN in {self.nan_mismatches} position(s) where the other is not, first at {self.first_nan_mismatch_at}"
        return text


def difference(ours: np.ndarray, source: np.ndarray) -> Difference:
    a, e = np.asarray(ours, dtype=np.float64), np.asarray(source, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shape {a.shape} differs from the source's {e.shape}")
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    mismatch = nan_a != nan_e
    with np.errstate(invalid="ignore"):
        err = np.where(nan_a | nan_e | (a == e), 0.0, np.abs(a - e))  # a == e: equal infinities
    at = tuple(int(i) for i in np.unravel_index(int(np.argmax(err)), err.shape)) if err.size else None
    first = tuple(int(i) for i in np.argwhere(mismatch)[0]) if mismatch.any() else None
    return Difference(float(err.max()) if err.size else 0.0, at, int(mismatch.sum()), first)


def matches_source(ours: np.ndarray, source: np.ndarray, bar: float = SOURCE_BAR) -> bool:
    return difference(ours, source).within(bar)


def assert_matches_source(ours: np.ndarray, source: np.ndarray, what: str, bar: float = SOURCE_BAR) -> Difference:
    """max |ours - source| <= `bar` (absolute, 1e-5 unless said), NaN exactly where the source has NaN."""
    __tracebackhide__ = True
    result = difference(ours, source)
    assert result.within(bar), f"{what}: {result.describe()} [bar: max abs difference <= {bar:g}]"
    return result


def saved_and_converted(build, tmp_path_factory):
    """name -> (the transformers model `build(name)`, its save_pretrained folder, the folder
    converted with no --set), each built once: the families' tests share one conversion."""
    from conformance.convert import from_hf_folder

    cache = {}

    def get(name):
        if name not in cache:
            model = build(name)
            folder = tmp_path_factory.mktemp(name) / f"tiny-{name}"
            model.save_pretrained(folder)
            cache[name] = (model, folder, from_hf_folder(folder))
        return cache[name]

    return get


def exported_and_reloaded(folder, family, tmp_path, capsys):
    """A Hugging Face `folder` converted to a rosetta checkpoint, exported back to its family's
    layout with `rosetta convert --to`, and loaded by the family's transformers class: the loaded
    model, after checking that the folder holds exactly what transformers reads and that no key
    was missing, mismatched or unexpected."""
    import transformers

    from conformance.cli import main

    ours, out = tmp_path / "ours.safetensors", tmp_path / "exported"
    assert main(["convert", str(folder), str(ours)]) == 0
    assert main(["convert", str(ours), str(out), "--to", family.layout]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded, info = getattr(transformers, family.model_class).from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    return loaded
