"""`rosetta check`: the report names the tensor where a divergence starts, in text, JSON and status.

A porting bug shows first in one tensor and in everything computed after it, so the report's job
is to name that first tensor. These tests plant each classic bug in a copy of the NumPy backend
and require the report to name the tensor where the bug lives, and run the command itself on
the built-in default (passes) and on a checkpoint that float32 cannot run (fails, named).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from breaks import BREAKS, broken_copy
from conformance.check import backends
from conformance.core import checkpoint
from conformance import init_params
from conformance.check.backends import Target
from conformance.cli import main
from conformance.core.config import ModelConfig
from conformance.check.defaults import default_model
from conformance.check.report import fixed_batch, run_check

# Every switch a planted break can touch is set so that the break shows on `check`'s fixed batch:
from conformance.core.output import forward_order

# Every switch a planted break can touch is set so that the break shows on `check`'s fixed batch:
# pre-LN with final norms, an epsilon other than the broken 1e-5, a scaled embedding, and padded
# target queries with a -inf fill, so that the fixed batch has fully masked rows.
CONFIG = ModelConfig(
    src_vocab_size=17, tgt_vocab_size=19, d_model=16, n_heads=4, d_ff=24, n_encoder_layers=2,
    n_decoder_layers=2, max_len=8, norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True,
    layer_norm_eps=1e-6, scale_embedding=True, position="sinusoid-interleaved", mask_fill=float("-inf"),
    tgt_pad_mask="queries",
)

# Where each break first shows, in forward order.
FIRST_DIVERGENCE = {
    "wrong LayerNorm epsilon": "encoder.0.self",  # pre-LN: the first LayerNorm feeds the first attention
    "sin and cos swapped": "encoder.embeddings",
    "missing embedding scale": "encoder.embeddings",
    "pre/post-LN swapped": "encoder.0.self",
    "causal mask shifted by one": "decoder.0.self",
    "heads split in the wrong order": "encoder.0.self",
    "mask fill changed": "decoder.0.self",  # the padded queries' rows: NaN (-inf) became uniform
    "final norm dropped": "decoder.output",
    "t2t sinusoid with the paper's timescales": "encoder.embeddings",
    "source padding masked on the keys only": "encoder.0.self",  # padded source queries: NaN became finite
    "logits not divided by sqrt(D)": "logits",
    "attention temperature ignored": "encoder.0.self",
    "GLU gate dropped": "encoder.0.ffn",
    "position offset ignored": "encoder.embeddings",
    "pad tokens numbered as positions": "encoder.embeddings",  # the padded source positions' terms
    "embedding norm dropped": "encoder.embeddings",
    "relative-position bucket off by one": "encoder.0.self",
    "RMSNorm subtracts the mean": "encoder.0.self",  # pre-LN, as for the epsilon above
    # Whisper's front end (a features source): a shape at the convolution that is wrong, the
    # swapped sinusoid at the embeddings, and the value's bias moved into the key where the value
    # lost it (the key's own bias changes no weight: encoder.0.self agrees).
    "Whisper conv stride 1": "encoder.conv2",
    "Whisper conv padding 0": "encoder.conv1",
    "Whisper sinusoid halves swapped": "encoder.embeddings",
    "Whisper key bias added (the value's bias read into the key)": "encoder.0.self_attn",
    "T5 scores scaled by 1/sqrt(K)": "encoder.0.self",
    "empty rows give the softmax, not zeros": "decoder.0.self",  # the padded target queries: zeros became NaN
}
# Breaks that change no number on a CPU (TF32 acts on GPU matmuls only): the check refuses the run
# of that target instead, naming the switch, on every device.
PRECISION_BREAKS = {
    "TF32 left on by full_precision": "full_precision() left reduced precision on:",
    "TF32 turned on by the forward pass": "the model changed matmul precision while it ran:",
}
# Breaks of a switch CONFIG leaves off (Flax examples/wmt's): the check runs with it on.
SWITCHED_ON = {
    "t2t sinusoid with the paper's timescales": dict(position="sinusoid-t2t"),
    "source padding masked on the keys only": dict(src_pad_mask="both"),
    "logits not divided by sqrt(D)": dict(scale_logits=True),
    "attention temperature ignored": dict(attention_temp=4.0),
    "GLU gate dropped": dict(ffn_glu=True, activation="tanh"),
    "position offset ignored": dict(position="table", position_offset=2),
    "pad tokens numbered as positions": dict(position="sinusoid-fairseq", position_ids="non-pad", position_offset=2),
    "embedding norm dropped": dict(embedding_norm=True),
    "relative-position bucket off by one": dict(position="relative", relative_buckets=8, relative_max_distance=20),
    "RMSNorm subtracts the mean": dict(layer_norm_form="rms"),
    "T5 scores scaled by 1/sqrt(K)": dict(scale_scores=False),
    # (an encoder table of 16 rows: the broken front end's 14 positions still find a row each)
    "Whisper conv stride 1": dict(source="features", n_mels=3, src_vocab_size=19, max_source_len=16),
    "Whisper conv padding 0": dict(source="features", n_mels=3, src_vocab_size=19),
    "Whisper sinusoid halves swapped": dict(source="features", n_mels=3, src_vocab_size=19, position="sinusoid-t2t"),
    "Whisper key bias added (the value's bias read into the key)": dict(source="features", n_mels=3,
                                                                        src_vocab_size=19, key_bias=False),
    "empty rows give the softmax, not zeros": dict(empty_rows="zeros"),
}


def test_every_planted_break_has_an_expected_first_tensor():
    assert set(FIRST_DIVERGENCE) | set(PRECISION_BREAKS) == set(BREAKS)
    assert not set(FIRST_DIVERGENCE) & set(PRECISION_BREAKS)


@pytest.mark.parametrize("name", sorted(PRECISION_BREAKS))
def test_the_report_refuses_a_target_that_turns_tf32_on(name):
    backend, edits, patches = BREAKS[name]
    registered = broken_copy(name, backend, edits, patches)
    target = Target(registered, "cpu", "float32")
    try:
        report = run_check(CONFIG, init_params(CONFIG, seed=3), "test", [target])
    finally:
        backends.unregister_backend(registered)
    assert not report.passed
    assert PRECISION_BREAKS[name] in report.errors[target.label], report.errors
    assert "allow_tf32" in report.errors[target.label]
    assert PRECISION_BREAKS[name] in report.to_text()


@pytest.mark.parametrize("name", sorted(FIRST_DIVERGENCE))
def test_the_report_names_the_tensor_where_the_break_lives(name):
    backend, edits, patches = BREAKS[name]
    registered = broken_copy(name, backend, edits, patches)
    target = Target(registered, "cpu", "float64")
    config = CONFIG.replace(**SWITCHED_ON.get(name, {}))
    try:
        report = run_check(config, init_params(config, seed=3), "test", [target])
    finally:
        backends.unregister_backend(registered)
    assert not report.passed
    assert report.first_failure() == (FIRST_DIVERGENCE[name], target.label), report.to_text()
    text = report.to_text()
    assert f"first diverging tensor: {FIRST_DIVERGENCE[name]} on {target.label}" in text
    every_earlier_tensor = forward_order(config)[: forward_order(config).index(FIRST_DIVERGENCE[name])]
    assert all(report.cells[(tensor, target.label)].passed for tensor in every_earlier_tensor)
    if name == "mask fill changed":  # uniform rows where the oracle has NaN: the cell says why
        row = next(line for line in text.splitlines() if line.startswith("decoder.0.self "))
        assert row.split()[-1] == "FAIL:NaN", row


def test_the_fixed_batch_has_the_padding_the_breaks_need():
    src, tgt = fixed_batch(CONFIG)
    assert (src[:, 0] != CONFIG.pad_id).all() and (src == CONFIG.pad_id).any(axis=1).sum() == 2
    assert (tgt == CONFIG.pad_id).any(), "without padded target queries, a changed fill is invisible"


def test_check_passes_on_the_default_model_and_writes_the_same_report_as_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["check", "--backends", "numpy", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    config = default_model()[0]
    rows = [line.split()[0] for line in text.splitlines() if line.split() and line.split()[0] in forward_order(config)]
    assert rows == forward_order(config), "one row per tensor, in forward order"
    assert "result: every backend agrees with the oracle within tolerance" in text
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["first_failure"] is None
    assert [t["tensor"] for t in report["tensors"]] == forward_order(config)
    assert [t["label"] for t in report["targets"]] == ["numpy/cpu/float32"]


def test_check_fails_and_names_the_first_tensor_float32_cannot_hold(tmp_path, capsys):
    """A float64 checkpoint with one exploding layer: exact in float64, inf (then NaN) in float32."""
    config, params, _ = default_model()
    params = {name: value.astype(np.float64) for name, value in params.items()}
    params["encoder.layers.1.ffn.linear2.weight"] = params["encoder.layers.1.ffn.linear2.weight"] * 1e36
    path, out = tmp_path / "exploding.safetensors", tmp_path / "report.json"
    checkpoint.save(path, config, params)
    with np.errstate(over="ignore", invalid="ignore"):
        status = main(["check", str(path), "--backends", "numpy", "--json", str(out)])
    text = capsys.readouterr().out
    assert status == 1
    assert "result: FAIL; first diverging tensor: encoder.1.ffn on numpy/cpu/float32" in text
    report = json.loads(out.read_text())
    assert report["passed"] is False
    assert report["first_failure"] == {"tensor": "encoder.1.ffn", "target": "numpy/cpu/float32"}
    cells = {t["tensor"]: t["results"]["numpy/cpu/float32"] for t in report["tensors"]}
    assert not cells["encoder.1.ffn"]["passed"] and cells["encoder.1.self_attn"]["passed"]


@pytest.mark.parametrize("how", ["a dtype no backend runs", "a device that is not here"])
def test_check_that_runs_nothing_says_so_and_fails(how, monkeypatch, capsys, tmp_path):
    """`all()` over no cells is True: a run that compared nothing must not report agreement."""
    out = tmp_path / "report.json"
    if how == "a dtype no backend runs":
        argv = ["check", "--backends", "numpy", "--dtypes", "float16"]
    else:
        monkeypatch.setattr(backends, "present_devices", lambda backend: ["cpu"])
        monkeypatch.setenv("ROSETTA_DEVICES", "cuda")
        argv = ["check"]
    assert main(argv + ["--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "nothing was checked" in text and "every backend agrees" not in text
    assert "tensor " not in text, "no table of empty columns"
    report = json.loads(out.read_text())
    assert report["passed"] is False and report["checked"] is False


def drawn_figure(monkeypatch):
    """The figure `plot_check` draws, kept for inspection when it is saved."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k))[1])
    return figures


def test_the_plot_marks_a_nan_failure_instead_of_drawing_it_as_agreement(monkeypatch, tmp_path):
    """A failure by NaN positions can have a tiny finite error; drawn as that error it would look
    like perfect agreement. It is a labelled marker at the top of the axis instead."""
    from conformance.check.plots import plot_check

    backend, edits, patches = BREAKS["mask fill changed"]
    registered = broken_copy("mask fill changed", backend, edits, patches)
    target = Target(registered, "cpu", "float64")
    try:
        report = run_check(CONFIG, init_params(CONFIG, seed=3), "test", [target])
    finally:
        backends.unregister_backend(registered)
    nan_failures = [t for t in report.tensors
                    if report.cells[(t, target.label)].comparison.nan_mismatches]
    assert "decoder.0.self" in nan_failures
    figures = drawn_figure(monkeypatch)
    plot_check(report, str(tmp_path / "check.png"))
    ax = figures[0].axes[0]
    errors = next(line for line in ax.lines if line.get_label() == target.label)
    marks = [line for line in ax.lines if line.get_label().startswith(f"{target.label}: FAIL")]
    assert len(marks) == 1, [line.get_label() for line in ax.lines]
    failed_x = {int(x) for x in marks[0].get_xdata()}
    for tensor in nan_failures:
        x = report.tensors.index(tensor)
        assert np.isnan(errors.get_ydata()[x]), f"{tensor}: drawn as an error of {errors.get_ydata()[x]:.1e}"
        assert x in failed_x
    # At the top of the axis (y in axes coordinates), whatever the data's range.
    assert marks[0].get_transform() == ax.get_xaxis_transform()
    assert set(marks[0].get_ydata()) == {0.97}
    passing = [report.tensors.index(t) for t in report.tensors if report.cells[(t, target.label)].passed]
    # A passing cell is a point, or (an error of exactly 0) a marker along the bottom: never both, never neither.
    exact = {int(x) for line in ax.lines if line.get_label() == f"{target.label}: exactly 0 (identical)"
             for x in line.get_xdata()}
    assert passing and all(np.isfinite(errors.get_ydata()[x]) != (x in exact) for x in passing)
    assert not failed_x & set(passing)


def test_check_names_each_model_on_a_terminal_as_it_starts(monkeypatch, capsys):
    """The check's status line (stderr, a terminal only): the oracle, then each target in turn."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["check", "--backends", "numpy"]) == 0
    shown = terminal.getvalue()
    marks = [shown.index(m) for m in ("oracle (numpy/cpu/float64)", "numpy/cpu/float32 (1 of 1)")]
    assert marks == sorted(marks) and shown.endswith("\r\x1b[K"), shown
    assert "\r" not in capsys.readouterr().out
