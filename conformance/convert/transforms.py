"""Tensor transforms between a foreign layout and the canonical key space, both directions.

Import (`forward`): squeeze an axis, split a packed tensor into equal parts or copy one tensor to
several canonical keys, then transpose the matrices a system stores (out, in). Export
(`backward`) undoes exactly that. `recognise_positions` decides what a stored position table is.
"""

from __future__ import annotations

from typing import Any, Mapping

import ml_dtypes
import numpy as np

from conformance.core.config import POSITIONS
from conformance.convert.errors import TensorError
from conformance.convert.layout import TABLES, Entry, Layout
from conformance.convert.planner import needs_transpose
from conformance.core.errors import ConfigError
from conformance.core.positions import sinusoid_table

SINUSOIDS = ("sinusoid-interleaved", "sinusoid-split", "sinusoid-t2t")


def identical(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality (so that NaN payloads and -0.0 count too): what a tied tensor is."""
    return a.dtype == b.dtype and a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def forward(layout: Layout, entry: Entry, values: dict[str, str], key: str, x: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """One stored tensor -> its canonical tensor(s)."""
    targets = [t.format(values) for t in entry.targets]
    if all(t.endswith("position.table") for t in targets):
        x = _position_table(entry, key, x)
    elif entry.squeeze is not None:
        if not -x.ndim <= entry.squeeze < x.ndim or x.shape[entry.squeeze] != 1:
            raise TensorError(key, f"has shape {x.shape}; the layout squeezes axis {entry.squeeze}, which must have size 1")
        x = np.squeeze(x, axis=entry.squeeze)
    if entry.kind == "split":
        n = len(targets)
        if not -x.ndim <= entry.axis < x.ndim or x.shape[entry.axis] % n:
            raise TensorError(key, f"has shape {x.shape}; the layout splits axis {entry.axis} into {n} equal parts "
                              f"({', '.join(targets)})")
        parts = np.split(x, n, axis=entry.axis)
    else:
        parts = [x] * len(targets)  # rename: one target; copy: the same tensor for each target
    if entry.heads is not None:
        if x.ndim != 3:
            raise TensorError(key, f"has shape {x.shape}; the layout stores it per head "
                              f"({'(d_in, H, K)' if entry.heads == 'out' else '(H, K, d_out)'}), so it must be 3-D")
        parts = [x.reshape(x.shape[0], -1) if entry.heads == "out" else x.reshape(-1, x.shape[-1])]
    out = []
    for ckey, part in zip(targets, parts):
        if needs_transpose(layout, entry, ckey):
            rank = 3 if ".frontend." in ckey else 2
            if part.ndim != rank:
                raise TensorError(key, f"has shape {x.shape}; {ckey} is a {'convolution kernel' if rank == 3 else 'matrix'}, "
                                  f"so it must be {rank}-D")
            part = part.T  # (d_out, d_in) -> (d_in, d_out); a Conv1d's (C_out, C_in, 3) -> (3, C_in, C_out)
        out.append((ckey, part))
    return out


def _position_table(entry: Entry, key: str, x: np.ndarray) -> np.ndarray:
    """A stored position buffer as (max_len, D), whichever of the usual forms it takes:
    (max_len, D), batch-first (1, max_len, D) or sequence-first (max_len, 1, D). The layout's
    `squeeze` names the form its system uses; a user's copy that chose the other still fits."""
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        for axis in ([entry.squeeze] if entry.squeeze in (0, 1) else []) + [0, 1]:
            if x.shape[axis] == 1:
                return np.squeeze(x, axis=axis)
    raise TensorError(key, f"has shape {x.shape}; a position table is (max_len, d_model), (1, max_len, d_model) or "
                      "(max_len, 1, d_model)")


def stored_heads(entry: Entry, x: np.ndarray) -> int | None:
    """H as a per-head tensor stores it (`heads`), or None."""
    if entry.heads is None or x.ndim != 3:
        return None
    return int(x.shape[1] if entry.heads == "out" else x.shape[0])


def backward(layout: Layout, entry: Entry, fkey: str, tensors: list[np.ndarray], ckeys: list[str],
             n_heads: int | None = None) -> np.ndarray:
    """The inverse of `forward`: canonical tensor(s) -> the one stored tensor."""
    parts = [t.T if needs_transpose(layout, entry, c) else t for t, c in zip(tensors, ckeys)]
    if entry.heads == "out":
        parts = [p.reshape(p.shape[0], n_heads, -1) for p in parts]  # (d_in, H, K)
    elif entry.heads == "in":
        parts = [p.reshape(n_heads, -1, p.shape[-1]) for p in parts]  # (H, K, d_out)
    if entry.kind == "split":
        x = np.concatenate(parts, axis=entry.axis)
    elif entry.kind == "copy":
        if not all(identical(parts[0], p) for p in parts[1:]):
            raise TensorError(fkey, f"stores one tensor for {', '.join(ckeys)}, but this model's differ")
        x = parts[0]
    else:
        x = parts[0]
    if entry.squeeze is not None:
        x = np.expand_dims(x, entry.squeeze)
    return np.array(x, copy=True, order="C")


def _sinusoid_tolerance(rows: int, dtype: np.dtype) -> np.ndarray:
    """(rows, 1): how far a stored sinusoid may be from ours and still be recognised as one.

    Tutorials compute `pos * freq` in float32: the frequency carries a few ulp of relative error,
    so the angle at position p is off by up to about p * 2 eps, and the table by as much
    (|d sin| <= |d angle|). Measured on the tutorials' own formulas (d_model 16..512, 5000
    positions): at most 0.72 eps (1 + p), so 4 eps (1 + p) leaves a margin of 5. A learned table
    is off by O(0.1) everywhere, far outside this bound.
    """
    # A float64 table may hold a float32 computation widened (a tutorial's or Marian's model after
    # `.double()`): its rounding is float32's, never less.
    eps = max(float(ml_dtypes.finfo(dtype).eps), float(np.finfo(np.float32).eps))
    return 4 * eps * (1 + np.arange(rows, dtype=np.float64))[:, None]


def recognise_positions(layout: Layout, canonical: dict, origin: dict, overrides: Mapping[str, Any], decisions: list[str]):
    """Decide what a stored position table becomes: (position, (encoder rows, decoder rows)), or
    (None, None) if none (the rows differ only for a features source: Whisper's 1500 and 448).

    With `position` given: "table" keeps it; a sinusoid form is checked against the table (within
    the float32-computation tolerance above) and the table dropped. Otherwise a table that is
    bit-identical to our sinusoid in its dtype is recognised (lossless: every backend computes
    exactly that table), and anything else is kept.
    """
    present = [k for k in TABLES if k in canonical]
    if not present:
        return None, None
    if len(present) == 1:
        other = TABLES[1 - TABLES.index(present[0])]
        raise TensorError(origin[present[0]], f"gives {present[0]}, but no key gives {other}: a stored position term needs a table per stack")
    enc, dec = (canonical[k] for k in TABLES)
    for name, table in zip(TABLES, (enc, dec)):
        if table.ndim != 2:
            raise TensorError(origin[name], f"must be a (max_len, d_model) table after the layout's transforms, got shape {table.shape}")
    features = overrides.get("source", layout.base_switches().get("source", "ids")) == "features"
    if enc.shape[1] != dec.shape[1] or (enc.shape != dec.shape and not features):
        raise TensorError(origin[TABLES[1]], f"has shape {dec.shape} but {origin[TABLES[0]]} has {enc.shape}; both stacks "
                          "share max_len (only a features source's encoder has a length of its own, max_source_len)")
    rows = (enc.shape[0], dec.shape[0])  # a features source's encoder table may be longer (Whisper: 1500 and 448)
    width = enc.shape[1]
    # fairseq's sinusoid zeroes the pad id's row (M2M100, FSMT): the id the config will have.
    pad = overrides.get("pad_id", layout.base_switches().get("pad_id", 0))
    wanted = overrides.get("position")
    if wanted is not None and wanted not in POSITIONS:
        raise ConfigError("position", f"unknown value {wanted!r}; expected one of {list(POSITIONS)}")
    if wanted == "table":
        decisions.append(f"position: kept the stored table ({origin[TABLES[0]]}), as asked")
        return "table", rows
    if wanted is not None:
        if width % 2:
            raise ConfigError("position", f"a sinusoid needs an even d_model; the stored table is {width} wide")
        for name, table in zip(TABLES, (enc, dec)):
            exact = sinusoid_table(table.shape[0], width, wanted, pad_id=pad)
            tol = _sinusoid_tolerance(table.shape[0], table.dtype)
            err = np.abs(table.astype(np.float64) - exact)
            bad = err > tol
            if bad.any():
                pos, dim = (int(i) for i in np.unravel_index(int(np.argmax(np.where(bad, err, 0))), err.shape))
                raise TensorError(origin[name], f"is not the {wanted} sinusoid: differs by {err[pos, dim]:.3g} at position "
                                  f"{pos}, dim {dim} (tolerance {tol[pos, 0]:.3g}); keep it with position='table'")
        for name in TABLES:
            del canonical[name]
        decisions.append(f"position: recognised the stored table as the {wanted} sinusoid (as asked) and dropped it")
        return wanted, rows
    if width % 2 == 0:
        preferred = layout.base_switches().get("position")
        # The layout's own sinusoid first (fairseq's too, where it is the system's: FSMT stores it),
        # then the others.
        forms = ([preferred] if isinstance(preferred, str) and preferred.startswith("sinusoid") else []) + \
            [f for f in SINUSOIDS if f != preferred]
        for form in forms:
            if all(identical(table, sinusoid_table(table.shape[0], width, form, pad_id=pad).astype(table.dtype))
                   for table in (enc, dec)):
                for name in TABLES:
                    del canonical[name]
                decisions.append(f"position: the stored table is exactly the {form} sinusoid; recognised and dropped")
                return form, rows
    if not layout.computes_with_stored_positions():
        # The system rebuilds its table when it loads a model (Marian): it only ever computes its
        # own sinusoid, in float32 and widened. A table within float32 rounding of that sinusoid (a
        # live model after `.double()`) is kept as it is, which is exactly what that model computes;
        # any other table is a structure the system does not have (a learned table: another
        # family's keys), refused by name rather than converted.
        form = layout.base_switches().get("position")
        if form in SINUSOIDS and width % 2 == 0:
            worst = max((float(np.max(np.abs(t.astype(np.float64) - sinusoid_table(t.shape[0], width, form, pad_id=pad))
                                       - _sinusoid_tolerance(t.shape[0], np.dtype(np.float32)))), name)
                        for name, t in zip(TABLES, (enc, dec)))
            if worst[0] > 0:
                raise TensorError(origin[worst[1]], f"is not the {form} sinusoid that the {layout.name} system rebuilds when it "
                                  f"loads a model (off by up to {worst[0]:.3g} beyond float32 rounding): a {layout.name} model "
                                  "with a learned or other position table does not exist, so these weights are not one (the "
                                  "keys fit, the structure does not); convert them with the layout of the system that "
                                  f"wrote them, or, if your copy of {layout.name} keeps its table, --set position=table")
    decisions.append(f"position: kept the stored table ({origin[TABLES[0]]}) as position='table'")
    return "table", rows
