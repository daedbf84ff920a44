"""`rosetta train-check`: exits 0 on the default model; on a planted gradient bug exits 1 and names
the parameter where the bug lives (the first out of tolerance in backward order).

The float64 reference is `impl_numpy.Model.loss_and_grads`, the hand-written backward pass."""

from __future__ import annotations

import json

import numpy as np

from conformance import cli, init_params, param_shapes
from conformance.check import backends, report as check_report
from conformance.check.training import backward_order, run_train_check, training_batches
from batches import small
from breaks import broken_copy


# A gradient-only bug: the FFN's hidden activation is detached from linear1, plus a term that is 0
# in value (so the forward, and the loss, are bit-identical) but keeps linear1.bias in the graph.
FFN_DETACHED = ("ffn gradient cut at linear1", "torch", [(
    "return self.linear2(activation(self.activation, self.linear1(x)))",
    "return self.linear2(activation(self.activation, self.linear1(x)).detach() + 0 * self.linear1.bias.sum())",
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
