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
    fig.savefig(path, format="png")
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size


# The log axis cannot show an error of 0; a perfect cell is drawn at this floor.
ERROR_FLOOR = 1e-18


def check_points(report) -> dict[str, dict[str, list]]:
    """What `plot_check` draws for each target label.

    `measured`: (x, normalised error) for every cell whose verdict is a size, i.e. a pass, or a
    failure by magnitude (drawn above its tolerance line). `failed`: the x of every failing cell
    whose failure is not a size (NaN where the oracle has none or the reverse, a wrong shape, a
    non-finite error, a tensor not returned, a backend that crashed): no point on the axis would
    be true for it (its finite error may well be tiny), so it is marked at the top of the axis.
    """
    points = {}
    for target in report.targets:
        measured, failed = [], []
        for x, tensor in enumerate(report.tensors):
            cell = report.cells.get((tensor, target.label))
            c = cell.comparison if cell is not None else None
            if c is None:  # the tensor was not returned, or the backend could not run at all
                if target.label in report.errors or (cell is not None and cell.error):
                    failed.append(x)
                continue
            if not c.passed and (c.nan_mismatches or c.shape_problem or not np.isfinite(c.max_abs)):
                failed.append(x)
                continue
            measured.append((x, max(c.max_abs / c.scale, ERROR_FLOOR)))
        points[target.label] = {"measured": measured, "failed": failed}
    return points


def plot_check(report, path: str) -> tuple[int, int]:
    """Max normalised error per tensor (forward order) for each target, with its tolerance; a
    failing cell that an error size cannot show is a marker at the top of the axis."""
    from conformance.check.tolerances import tolerance

    plt = _pyplot()
    tensors = report.tensors
    # Room on the right for the legend, which sits beside the axis: the top holds failure markers.
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * len(tensors) + 2) + 3.5, 4.8), dpi=100)
    x = np.arange(len(tensors))
    points = check_points(report)
    for target in report.targets:
        errors = np.full(len(tensors), np.nan)  # a gap where there is no size to draw
        for i, error in points[target.label]["measured"]:
            errors[i] = error
        line, = ax.plot(x, errors, marker="o", markersize=3, label=target.label)
        tol = tolerance(target.dtype, target.device).atol
        ax.axhline(tol, color=line.get_color(), linestyle=":", linewidth=0.8)
        failed = points[target.label]["failed"]
        if failed:
            # x in data coordinates, y as a fraction of the axis: the top, whatever the scale.
            ax.plot(failed, [0.97] * len(failed), transform=ax.get_xaxis_transform(), linestyle="none",
                    marker="v", markersize=7, color=line.get_color(), clip_on=False,
                    label=f"{target.label}: FAIL (NaN positions, error)")
    ax.set_yscale("log")
    ax.set_xticks(x, labels=tensors, rotation=90, fontsize=6)
    ax.set_ylabel("max |backend - oracle| / scale")
    first = report.first_failure()
    ax.set_title(f"rosetta check: {report.source}" + (f" — first diverging: {first[0]} on {first[1]}" if first else ""),
                 fontsize=8)
    if report.targets:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, format="png")
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size
