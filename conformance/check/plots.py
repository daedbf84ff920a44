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


TICK_POINTS = 7
PANEL_INCHES, LARGEST_PANEL_INCHES = 2.6, 6.0


def _panel_inches(tokens: int) -> float:
    """A panel's side: 2.6 in up to the toy's lengths, growing with the tokens to 6 in (64 tokens)."""
    return min(max(PANEL_INCHES, 0.095 * tokens), LARGEST_PANEL_INCHES)


def _label_every(tokens: int, side: float, characters: int) -> int:
    """Label every k-th token, k the least that keeps neighbouring labels apart on a panel of
    `side` inches (most of which is the axis): a label across the axis takes its font's height
    and a gap, one along it its characters' width."""
    room = 0.8 * side * 72 / max(tokens, 1)  # points per token along the axis
    needed = TICK_POINTS * (1.3 if characters <= 1 else 0.65 * characters + 0.6)
    return max(1, -int(-needed // room))


def plot_attention(
    attention: Mapping[str, np.ndarray],
    src_labels: Sequence[str],
    tgt_labels: Sequence[str],
    path,
    title: str = "",
    row: int = 0,
) -> tuple[int, int]:
    """One heatmap per attention block (rows) and head (columns) for batch row `row`, written as
    PNG to `path` (a file name or a binary file object).

    Queries run down each panel, keys across, both labelled with their tokens; one colorbar gives
    the scale (weights in [0, 1], the same for every panel). Returns the PNG's (width, height).
    """
    plt = _pyplot()
    blocks = list(attention)
    heads = next(iter(attention.values())).shape[1]
    side = _panel_inches(max(len(src_labels), len(tgt_labels)))
    # Constrained layout keeps the title, the colorbar and the labels out of the panels.
    fig, axes = plt.subplots(len(blocks), heads, figsize=(side * heads + 0.6, side * len(blocks) + 0.6),
                             squeeze=False, dpi=100, layout="constrained")
    image = None
    for r, name in enumerate(blocks):
        weights = np.asarray(attention[name], dtype=np.float64)[row]  # (H, Tq, Tk)
        queries = src_labels if name.startswith("encoder") else tgt_labels
        keys = tgt_labels if name.endswith(".self") and name.startswith("decoder") else src_labels
        query_side = "source" if name.startswith("encoder") else "target"
        key_side = "target" if name.endswith(".self") and name.startswith("decoder") else "source"
        for h in range(heads):
            ax = axes[r][h]
            image = ax.imshow(weights[h], vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest", aspect="auto")
            # Short tokens read upright; longer ones (<bos>, ids of several digits) are turned.
            turn = 90 if max((len(k) for k in keys), default=0) > 2 else 0
            x_every = _label_every(len(keys), side, max((len(k) for k in keys), default=1) if not turn else 1)
            y_every = _label_every(len(queries), side, 1)
            ax.set_xticks(range(0, len(keys), x_every), labels=list(keys)[::x_every], fontsize=TICK_POINTS,
                          rotation=turn)
            ax.set_yticks(range(0, len(queries), y_every), labels=list(queries)[::y_every], fontsize=TICK_POINTS)
            ax.set_xlabel(f"key ({key_side} token)", fontsize=7)
            if h == 0:
                ax.set_ylabel(f"query ({query_side} token)", fontsize=7)
            ax.set_title(f"{name}, head {h}", fontsize=8)
    if image is not None:
        colorbar = fig.colorbar(image, ax=axes, shrink=0.6, aspect=40, pad=0.01)
        colorbar.set_label("attention weight (each query row sums to 1)", fontsize=8)
    if title:
        fig.suptitle(f"{title}: batch row {row}", fontsize=10)
    fig.savefig(path, format="png")
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size


def check_points(report) -> dict[str, dict[str, list]]:
    """What `plot_check` draws for each target label.

    `measured`: (x, normalised error) for every cell whose verdict is a size and not zero, i.e. a
    pass, or a failure by magnitude (drawn above its tolerance line). `exact`: the x of every cell
    whose error is exactly 0 (identical to the oracle): a log axis has no place for 0, so these are
    marked along the bottom, never drawn as a made-up small number. `failed`: the x of every
    failing cell whose failure is not a size (NaN where the oracle has none or the reverse, a
    wrong shape, a non-finite error, a tensor not returned, a backend that crashed): no point on
    the axis would be true for it (its finite error may well be tiny), so it is marked at the top.
    """
    points = {}
    for target in report.targets:
        measured, exact, failed = [], [], []
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
            if c.max_abs == 0.0:
                exact.append(x)
                continue
            measured.append((x, c.max_abs / c.scale))
        points[target.label] = {"measured": measured, "exact": exact, "failed": failed}
    return points


def plot_check(report, path) -> tuple[int, int]:
    """Max normalised error per tensor (forward order) for each target, with each dtype's
    tolerance as a labelled line; an exact 0 is a marker along the bottom, a failing cell that an
    error size cannot show a marker along the top. `path`: a file name or a binary file object."""
    from conformance.check.tolerances import tolerance

    plt = _pyplot()
    tensors = report.tensors
    # Room on the right for the legend, which sits beside the axis: the top holds failure markers.
    fig, ax = plt.subplots(figsize=(max(8.0, 0.32 * len(tensors) + 2) + 3.5, 4.8), dpi=100)
    x = np.arange(len(tensors))
    points = check_points(report)
    tolerances: dict[float, list[str]] = {}
    for target in report.targets:
        tolerances.setdefault(tolerance(target.dtype, target.device).atol, []).append(target.dtype)
    # The range of what is drawn (errors and tolerance lines), a decade of room either side, fixed
    # before anything is drawn: markers in axis coordinates must not stretch it.
    ax.set_yscale("log")
    drawn = [e for p in points.values() for _, e in p["measured"] if np.isfinite(e) and e > 0] + list(tolerances)
    if drawn:
        ax.set_ylim(min(drawn) / 10, max(drawn) * 10)
        ax.set_autoscaley_on(False)
    for target in report.targets:
        errors = np.full(len(tensors), np.nan)  # a gap where there is no size to draw
        for i, error in points[target.label]["measured"]:
            errors[i] = error
        line, = ax.plot(x, errors, marker="o", markersize=3, label=target.label)
        exact = points[target.label]["exact"]
        if exact:
            # y as a fraction of the axis: the bottom edge, whatever the scale.
            ax.plot(exact, [0.03] * len(exact), transform=ax.get_xaxis_transform(), linestyle="none", marker="s",
                    markersize=5, markerfacecolor="none", color=line.get_color(), clip_on=False,
                    label=f"{target.label}: exactly 0 (identical)")
        failed = points[target.label]["failed"]
        if failed:
            ax.plot(failed, [0.97] * len(failed), transform=ax.get_xaxis_transform(), linestyle="none",
                    marker="v", markersize=7, color=line.get_color(), clip_on=False,
                    label=f"{target.label}: FAIL (NaN positions, error)")
    for atol, dtypes in sorted(tolerances.items()):
        names = "/".join(sorted(set(dtypes)))
        ax.axhline(atol, color="0.35", linestyle="--", linewidth=0.9)
        ax.annotate(f"{names} tolerance: atol = {atol:g}", xy=(1.0, atol), xycoords=("axes fraction", "data"),
                    xytext=(-4, 3), textcoords="offset points", ha="right", va="bottom", fontsize=7, color="0.25")
    ax.set_xticks(x, labels=tensors, rotation=90, fontsize=7)
    ax.set_xlabel("tensor, in forward order", fontsize=8)
    ax.set_ylabel("max |backend - oracle| / scale\nscale = max(1, max |oracle|) of the tensor", fontsize=8)
    first = report.first_failure()
    ax.set_title(f"{getattr(report, 'command', 'rosetta check')}: {report.source}" + (f" — first diverging: {first[0]} on {first[1]}" if first else "")
                 + "\nerror of each backend against the float64 NumPy oracle; below its dashed line a tensor passes",
                 fontsize=8)
    if report.targets:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, format="png")
    size = tuple(int(v) for v in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return size
