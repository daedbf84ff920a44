"""`rosetta train-check`: exits 0 on the default model; on a planted gradient bug exits 1 and names
the parameter where the bug lives (the first out of tolerance in backward order).

The float64 reference is `impl_numpy.Model.loss_and_grads`, the hand-written backward pass."""

from __future__ import annotations

import io
import json
import sys

import numpy as np
import pytest

from conformance import cli, init_params, param_shapes
from conformance.check import backends, report as check_report
from conformance.check.training import (
    backward_order, plot_train_check, run_train_check, train_check_figure, training_batches,
)
from batches import small
from breaks import broken_copy


# A gradient-only bug: the FFN's hidden activation is detached from linear1, plus a term that is 0
# in value (so the forward, and the loss, are bit-identical) but keeps linear1.bias in the graph.
FFN_DETACHED = ("ffn gradient cut at linear1", "torch", [(
    "units = activation(self.activation, self.linear1(x))  # (B, L, F)",
    "units = activation(self.activation, self.linear1(x)).detach() + 0 * self.linear1.bias.sum()  # (B, L, F)",
)], {})


def test_batches_are_padded_and_labels_ignore_padding():
    config = small("hyunwoongko")  # pad_id 1
    batches = training_batches(config, 3, seed=1)
    assert len(batches) == 3
    for src, tgt, labels in batches:
        assert src.shape[0] == tgt.shape[0] == labels.shape[0] and tgt.shape == labels.shape
        assert (labels[tgt == config.pad_id] == config.pad_id).all()
        assert (tgt == config.pad_id).any() and (labels != config.pad_id).any()
        assert src.max() < config.src_vocab_size and tgt.max() < config.tgt_vocab_size
    again = training_batches(config, 3, seed=1)
    assert all((a == b).all() for x, y in zip(batches, again) for a, b in zip(x, y))


def test_backward_order_starts_at_the_output():
    config = small("default")
    order = backward_order(config)
    assert sorted(order) == sorted(param_shapes(config))
    assert order[0].startswith("output.") and order[-1] == "encoder.embedding.weight"


def test_train_check_exits_0_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "train.json"
    status = cli.main(["train-check", "--steps", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "PASS" in text and "step 2" in text
    data = json.loads(out.read_text())
    assert data["passed"] and len(data["reference_losses"]) == 2


def test_train_check_exits_1_naming_the_parameter_of_a_planted_bug(monkeypatch, capsys):
    name, backend, edits, patches = FFN_DETACHED
    registered = broken_copy(name, backend, edits, patches)
    target = backends.Target(registered, "cpu", "float64")
    monkeypatch.setattr(check_report, "default_targets", lambda *args, **kwargs: ([target], {}))
    try:
        status = cli.main(["train-check", "--steps", "1"])
    finally:
        backends.unregister_backend(registered)
    text = capsys.readouterr().out
    assert status == 1, text
    # Default model: 2 decoder layers; the bug's gradient enters at the last layer's linear1.
    assert "backward order is decoder.layers.1.ffn.linear1.bias" in text, text


def test_the_engine_reports_every_target_every_step():
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    targets = [backends.Target("torch", "cpu", "float64"), backends.Target("numpy", "cpu", "float32")]
    result = run_train_check(config, init_params(config), "test", targets, 2)
    assert result.passed, result.to_text()
    assert [(r.step, r.target) for r in result.rows] == [(s, t.label) for s in (1, 2) for t in targets]
    assert all(np.isfinite(r.param_diff) for r in result.rows)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_train_check_shows_its_progress_on_a_terminal_only(monkeypatch, capsys):
    """On a terminal, a status line on stderr names each run of each step as it starts (and is
    cleared before the report); in a pipe, stderr gets nothing extra and stdout is the same."""
    argv = ["train-check", "--steps", "2", "--backends", "numpy", "--dtypes", "float32"]
    assert cli.main(argv) == 0
    piped = capsys.readouterr()
    assert "\r" not in piped.err and "step 1/2" not in piped.err, piped.err
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(argv) == 0
    shown = terminal.getvalue()
    order = [shown.index(f"step {s}/2: {label}") for s in (1, 2) for label in ("numpy/cpu/float64", "numpy/cpu/float32")]
    assert order == sorted(order) and shown.endswith("\r\x1b[K"), shown
    assert capsys.readouterr().out == piped.out


def test_the_train_check_plot_shows_the_loss_and_whole_steps(tmp_path):
    config = small("default", n_encoder_layers=1, n_decoder_layers=1)
    result = run_train_check(config, init_params(config), "test", [backends.Target("numpy", "cpu", "float32")], 3)
    figure = train_check_figure(result)
    loss, divergence = figure.axes
    assert loss.get_ylabel() == "loss" and divergence.get_yscale() == "log"
    assert [list(line.get_ydata()) for line in loss.get_lines()] == [
        result.reference_losses, [r.loss for r in result.rows]]
    for ax in figure.axes:
        assert all(float(tick).is_integer() for tick in ax.get_xticks()), ax.get_xticks()
    assert plot_train_check(result, str(tmp_path / "t.png"))[0] == 1100


def test_the_train_check_plot_is_a_png_whatever_matplotlibs_default_format():
    """`--plot` renders into memory (written atomically later); with no file name to go by,
    matplotlib would use `savefig.format` (a user's matplotlibrc may say pdf)."""
    matplotlib = pytest.importorskip("matplotlib")
    from conformance.check.training import StepResult, TrainCheck, plot_train_check

    report = TrainCheck(source="the default model", reference="numpy float64", steps=2, label_smoothing=0.0,
                        rows=[StepResult(step, "numpy float32", 2.0 / step, 2.0 / step, 0.0, 1e-7, "output.weight",
                                         None, 1e-7, 1e-4) for step in (1, 2)],
                        reference_losses=[2.0, 1.0])
    picture = io.BytesIO()
    with matplotlib.rc_context({"savefig.format": "pdf"}):
        width, height = plot_train_check(report, picture)
    assert picture.getvalue().startswith(b"\x89PNG\r\n\x1a\n"), picture.getvalue()[:8]
    assert (width, height) == (1100, 400)
