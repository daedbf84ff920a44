"""Pictures: attention heatmaps for every layer and head, and a check report's errors per tensor.

matplotlib is imported lazily (the `plot` extra) and always with the non-interactive Agg
backend, so these work on a machine without a screen.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_attention(
    attention: Mapping[str, np.ndarray],
    src_labels: Sequence[str],
    tgt_labels: Sequence[str],
    path: str,
    title: str = "",
    row: int = 0,
) -> tuple[int, int]:
    """One heatmap per attention block (rows) and head (columns) for batch row `row`.

    Axes are labelled with tokens: queries down, keys across. Returns the PNG's (width, height).
    """
    plt = _pyplot()
    blocks = list(attention)
    heads = next(iter(attention.values())).shape[1]
    fig, axes = plt.subplots(len(blocks), heads, figsize=(2.6 * heads + 0.6, 2.6 * len(blocks) + 0.6),
                             squeeze=False, dpi=100)
    for r, name in enumerate(blocks):
        weights = np.asarray(attention[name], dtype=np.float64)[row]  # (H, Tq, Tk)
        queries = src_labels if name.startswith("encoder") else tgt_labels
        keys = tgt_labels if name.endswith(".self") and name.startswith("decoder") else src_labels
        for h in range(heads):
            ax = axes[r][h]
            ax.imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
            ax.set_xticks(range(len(keys)), labels=keys, fontsize=6, rotation=90)
            ax.set_yticks(range(len(queries)), labels=queries, fontsize=6)
            ax.set_title(f"{name} head {h}", fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size


def plot_check(report, path: str) -> tuple[int, int]:
    """Max normalised error per tensor (forward order) for each target, with its tolerance."""
    from conformance.tolerances import tolerance

    plt = _pyplot()
    tensors = report.tensors
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * len(tensors) + 2), 4.8), dpi=100)
    x = np.arange(len(tensors))
    for target in report.targets:
        errors = []
        for tensor in tensors:
            cell = report.cells.get((tensor, target.label))
            if cell is None or cell.comparison is None:
                errors.append(np.nan)
            else:
                c = cell.comparison
                errors.append(max(c.max_abs / c.scale, 1e-18))
        line, = ax.plot(x, errors, marker="o", markersize=3, label=target.label)
        tol = tolerance(target.dtype, target.device).atol
        ax.axhline(tol, color=line.get_color(), linestyle=":", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(x, labels=tensors, rotation=90, fontsize=6)
    ax.set_ylabel("max |backend - oracle| / scale")
    first = report.first_failure()
    ax.set_title(f"rosetta check: {report.source}" + (f" — first diverging: {first[0]} on {first[1]}" if first else ""),
                 fontsize=8)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size

