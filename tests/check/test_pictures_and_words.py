"""What `rosetta check` and `rosetta attention` show must explain itself (issue 16): an exact 0
is marked as such, not drawn at a made-up 1e-18; each tolerance line is labelled; the y axis says
what "scale" is; a passing cell whose relative error looks alarming is footnoted; the attention
picture has a colorbar, query and key axis labels, and a title above (not over) the panels."""

from __future__ import annotations

import io

import numpy as np

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
