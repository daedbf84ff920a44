"""Issue 45 (a fourth newcomer walk), the tools' part: examples/train_toy.py writes beside the user
and never over the shipped model unless asked, and shows its progress from the start (item 15);
the status line gives way to another line on stderr (the JAX compile notice) instead of sharing it,
and `rosetta attention`'s tick labels do not overlap at 64 tokens (item 19)."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import numpy as np
import pytest

from conformance.check.defaults import DEFAULT_CHECKPOINT

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_toy.py"


def script():
    spec = importlib.util.spec_from_file_location("train_toy_walk4", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- item 15: train_toy.py's output and progress -------------------------------------------------


def test_train_toy_writes_beside_the_user_by_default():
    module = script()
    assert module.DEFAULT_OUT == Path("toy.safetensors")
    assert module.DEFAULT_OUT.resolve() != DEFAULT_CHECKPOINT.resolve()


def test_train_toy_refuses_to_overwrite_the_shipped_model_before_training(capsys):
    before = DEFAULT_CHECKPOINT.stat().st_mtime_ns
    with pytest.raises(SystemExit) as exit_:
        script().main(["--out", str(DEFAULT_CHECKPOINT), "--steps", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "shipped" in err and "--force" in err and str(DEFAULT_CHECKPOINT) in err, err
    assert DEFAULT_CHECKPOINT.stat().st_mtime_ns == before


def test_train_toy_refuses_an_existing_file_unless_forced(tmp_path, capsys):
    out = tmp_path / "mine.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(SystemExit) as exit_:
        script().main(["--out", str(out), "--steps", "1"])
    assert exit_.value.code == 2 and "--force" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


def test_train_toy_shows_progress_before_its_first_evaluation(tmp_path, capsys):
    out = tmp_path / "toy.safetensors"
    module = script()
    status = module.main(["--out", str(out), "--steps", str(module.PROGRESS_EVERY + 1), "--batch", "8"])
    assert status == 1 and not out.exists()  # far from the bar after so few steps: not written
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("training the toy model"), lines
    assert "thread" in lines[0], lines[0]
    progress = [line for line in lines if line.startswith(f"step {module.PROGRESS_EVERY:5d}")]
    assert len(progress) == 1 and "loss" in progress[0] and "held-out" not in progress[0], lines
    assert "held-out" in lines[-2], lines  # the check at the last step, then why nothing was written
    assert module.PROGRESS_EVERY < module.EVALUATE_EVERY


# -- item 19: the status line and another line on stderr -----------------------------------------


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_printed_to_stderr_during_a_status_gets_a_line_of_its_own(monkeypatch):
    from conformance.cli.progress import Status

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Status("rosetta generate") as status:
        status("decoding 1 row(s) on jax")
        print("impl_jax: tracing and compiling decode, a new shape: this takes seconds", file=sys.stderr)
        status("still decoding")
    shown = terminal.getvalue()
    # The notice starts on a cleared line of its own, ends with its newline, and the status comes back after it.
    assert "s)impl_jax" not in shown, repr(shown)
    assert "\r\x1b[Kimpl_jax: tracing and compiling decode, a new shape: this takes seconds\n" in shown, repr(shown)
    after = shown.split("seconds\n", 1)[1]
    assert after.startswith("\r\x1b[Krosetta generate: decoding 1 row(s) on jax"), repr(after)
    assert shown.endswith("\r\x1b[K") and sys.stderr is terminal


def test_the_status_leaves_a_pipe_alone(monkeypatch):
    from conformance.cli.progress import Status

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with Status("rosetta generate") as status:
        status("decoding")
        print("a notice", file=sys.stderr)
    assert piped.getvalue() == "a notice\n" and sys.stderr is piped


# -- item 19: attention tick labels at 64 tokens -------------------------------------------------


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
