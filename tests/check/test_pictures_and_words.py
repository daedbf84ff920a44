"""What `rosetta check` and `rosetta attention` show must explain itself (issue 16): an exact 0
is marked as such, not drawn at a made-up 1e-18; each tolerance line is labelled; the y axis says
what "scale" is; a passing cell whose relative error looks alarming is footnoted; the attention
picture has a colorbar, query and key axis labels, and a title above (not over) the panels; its
tick labels do not overlap at 64 tokens, and each still reads its own token (issue 45)."""

from __future__ import annotations

import io

import numpy as np
import pytest

from conformance.check.backends import Target
from conformance.check.compare import Comparison
from conformance.check.report import Cell, Report
from conformance.core.config import ModelConfig

CONFIG = ModelConfig(src_vocab_size=8, tgt_vocab_size=8, d_model=8, n_heads=2, d_ff=8, n_encoder_layers=1,
                     n_decoder_layers=1, max_len=8)


def report_with(cells: dict[str, Comparison], dtype="float32") -> Report:
    target = Target("numpy", "cpu", dtype)
    report = Report(CONFIG, "test", [target], list(cells))
    report.cells = {(name, target.label): Cell(comparison) for name, comparison in cells.items()}
    return report


def test_an_exact_zero_is_marked_not_drawn_as_a_measurement():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from conformance.check import plots

    report = report_with({"a": Comparison(passed=True, max_abs=0.0), "b": Comparison(passed=True, max_abs=2e-6, scale=2.0)})
    points = plots.check_points(report)["numpy/cpu/float32"]
    assert points == {"measured": [(1, 1e-6)], "exact": [0], "failed": []}
    figures = []
    close = plt.close
    plt.close = lambda fig=None: figures.append(fig)  # keep the figure to look at it
    try:
        plots.plot_check(report, io.BytesIO())
    finally:
        plt.close = close
    ax = figures[0].axes[0]
    line = next(l for l in ax.lines if l.get_label() == "numpy/cpu/float32")
    assert np.isnan(line.get_ydata()[0]) and line.get_ydata()[1] == 1e-6
    zero = next(l for l in ax.lines if l.get_label() == "numpy/cpu/float32: exactly 0 (identical)")
    assert list(zero.get_xdata()) == [0] and zero.get_transform() == ax.get_xaxis_transform()
    assert min(ax.get_ylim()) > 1e-17, "the axis reaches down to a made-up floor"
    assert "scale = max(1, max |oracle|)" in ax.get_ylabel()
    assert any(t.get_text() == "float32 tolerance: atol = 0.0003" for t in ax.texts)
    close(figures[0])


def test_a_passing_cell_with_a_large_relative_error_is_explained():
    report = report_with({"decoder.0.cross": Comparison(passed=True, max_abs=1e-6, max_rel=1.0),
                          "logits": Comparison(passed=True, max_abs=1e-6, max_rel=1e-4)})
    text = report.to_text()
    row = next(line for line in text.splitlines() if line.startswith("decoder.0.cross"))
    assert row.split()[-1] == "ok*"
    assert next(line for line in text.splitlines() if line.startswith("logits")).split()[-1] == "ok"
    assert "ok*: passes with a max rel error >= 0.01" in text and "near 0" in text
    assert "scale = max(1, max |oracle| of the tensor)" in text
    assert "ok*" not in report_with({"logits": Comparison(passed=True, max_abs=1e-6, max_rel=1e-4)}).to_text()


def test_the_attention_picture_has_a_colorbar_axis_labels_and_a_clear_title():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from conformance.check import plots

    rng = np.random.default_rng(0)
    weights = rng.random((1, 2, 3, 4))
    attention = {"encoder.0.self": weights[..., :3] / weights[..., :3].sum(-1, keepdims=True),
                 "decoder.0.cross": weights / weights.sum(-1, keepdims=True)}
    figures = []
    close = plt.close
    plt.close = lambda fig=None: figures.append(fig)
    try:
        plots.plot_attention(attention, ["a", "b", "c", "d"][:3] + ["d"], ["x", "y", "z"], io.BytesIO(), title="model")
    finally:
        plt.close = close
    fig = figures[0]
    panels = [ax for ax in fig.axes if ax.get_title()]
    colorbars = [ax for ax in fig.axes if "attention weight" in ax.get_ylabel()]
    assert len(panels) == 4 and len(colorbars) == 1
    assert all(ax.get_xlabel().startswith("key (") for ax in panels)
    assert [ax.get_ylabel() for ax in panels if ax.get_ylabel()] == ["query (source token)", "query (target token)"]
    # The title sits above every panel's title: nothing overlaps the first row.
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    suptitle = fig._suptitle.get_window_extent(renderer)
    assert all(suptitle.y0 >= ax.title.get_window_extent(renderer).y1 for ax in panels)
    close(fig)


# -- attention tick labels at 64 tokens (issue 45) -----------------------------------------------


def overlapping(labels, renderer, axis: str) -> list[tuple[str, str]]:
    """Pairs of neighbouring visible tick labels whose boxes overlap along `axis`."""
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels if t.get_visible() and t.get_text()]
    boxes.sort(key=lambda item: item[1].x0 if axis == "x" else item[1].y0)
    return [(a, b) for (a, box_a), (b, box_b) in zip(boxes, boxes[1:])
            if (box_b.x0 < box_a.x1 - 0.5 if axis == "x" else box_b.y0 < box_a.y1 - 0.5)]


@pytest.mark.parametrize("tokens", [64, 13])
def test_attention_tick_labels_do_not_overlap(tokens):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from conformance.check import plots

    rng = np.random.default_rng(0)
    weights = rng.random((1, 2, tokens, tokens))
    weights /= weights.sum(-1, keepdims=True)
    src = [str(int(i)) for i in rng.integers(100, 60000, size=tokens)]  # Marian-like ids, 3-5 digits
    tgt = ["<bos>"] + src[:-1]
    figures = []
    close = plt.close
    plt.close = lambda fig=None: figures.append(fig)
    try:
        plots.plot_attention({"encoder.0.self": weights, "decoder.0.cross": weights}, src, tgt, io.BytesIO(),
                             title="model")
    finally:
        plt.close = close
    fig = figures[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in (ax for ax in fig.axes if ax.get_title()):
        shown_x = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        shown_y = [t for t in ax.get_yticklabels() if t.get_visible() and t.get_text()]
        for axis, labels in (("x", ax.get_xticklabels()), ("y", ax.get_yticklabels())):
            assert not overlapping(labels, renderer, axis), (ax.get_title(), axis, overlapping(labels, renderer, axis)[:3])
        # Every label still reads its own token (a thinned axis labels a subset, each at its place).
        keys = tgt if ax.get_title().startswith("decoder.0.self") else src
        queries = src if ax.get_title().startswith("encoder") else tgt
        assert all(label.get_text() == keys[round(label.get_position()[0])] for label in shown_x)
        assert all(label.get_text() == queries[round(label.get_position()[1])] for label in shown_y)
        if tokens == 13:  # a toy-sized picture keeps every label
            assert len(shown_x) == tokens and len(shown_y) == tokens
        else:  # and a long one keeps at least a quarter of them
            assert len(shown_x) >= tokens // 4 and len(shown_y) >= tokens // 4
    close(fig)
