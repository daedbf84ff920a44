"""`rosetta check --stream`: the oracle and every backend a layer at a time (conformance.check.scale.stream).

Fed each backend's own output from the layer below (`feed="own"`), the streamed report must be
the unstreamed one to the last bit, every cell of every backend; fed the oracle's (the default), a
planted bug must still be named at the tensor where it lives. The memory the streamed check takes
is measured by benchmarks/bench_check_memory.py --stream (docs/scale.md), not here.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from breaks import BREAKS, broken_copy
from conformance import ModelConfig, checkpoint, init_params
from conformance.check import backends
from conformance.check.report import default_targets, fixed_batch, run_check
from conformance.check.scale.stream import FEED_NOTES, FEEDS, Weights, run_streamed, stages
from conformance.cli import main
from conformance.core.errors import CheckpointError, InputError
from conformance.core.presets import PRESETS, preset

# Pre-LN with both final norms, separate embeddings and an untied output with a bias, a -inf fill
# and padded target queries (NaN rows to compare): every stage of the stem has work to do.
CONFIG = ModelConfig(
    src_vocab_size=50, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2, n_decoder_layers=2,
    max_len=16, norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, share_embeddings=False,
    tie_output=False, output_bias=True, mask_fill=float("-inf"), tgt_pad_mask="queries",
)
SMALL = dict(src_vocab_size=40, tgt_vocab_size=40, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2,
             n_decoder_layers=2, max_len=16)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "small.safetensors"
    checkpoint.save(path, CONFIG, {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=3).items()})
    return path


def cells(report) -> dict:
    """Every cell's comparison as plain values: the per-tensor errors, their places, the verdicts."""
    return {key: (cell.error, None if cell.comparison is None else vars(cell.comparison))
            for key, cell in report.cells.items()}


# A features source (Whisper) is not streamed yet: refused by name (below).
@pytest.mark.parametrize("family", sorted(name for name in PRESETS if PRESETS[name].get("source") != "features"))
def test_streamed_with_own_inputs_is_the_unstreamed_report_bit_for_bit(family):
    """NumPy and torch run each op as called: a layer at a time is the same arithmetic. (JAX is
    not held to this: XLA fuses across the layer boundaries of a whole call; docs/scale.md.)"""
    config = preset(family, **SMALL)
    params = {k: v.astype(np.float32) for k, v in init_params(config, seed=3).items()}
    targets, skipped = default_targets(["numpy", "torch"], ["float32", "float64"])
    src, tgt = fixed_batch(config, length=9)
    whole = run_check(config, params, family, targets, skipped, src, tgt)
    streamed = run_streamed(config, Weights.held(config, params), family, targets, skipped, src, tgt, feed="own")
    assert not streamed.errors and len(streamed.cells) == len(whole.cells) == len(whole.tensors) * len(targets)
    assert cells(streamed) == cells(whole)
    assert streamed.passed == whole.passed


def test_a_features_source_is_not_streamed_yet_and_says_so():
    config = preset("hf-whisper", **SMALL)
    params = init_params(config, seed=3)
    src, tgt = fixed_batch(config)
    with pytest.raises(InputError, match="features source") as raised:
        run_streamed(config, Weights.held(config, params), "whisper", [], {}, src, tgt)
    assert raised.value.argument == "stream"


def test_jax_streamed_from_a_checkpoint_agrees(saved):
    """JAX's one streamed run here (each new piece is a compile): its own inputs, float32."""
    config, params = checkpoint.load(saved)
    targets = [backends.Target("jax", "cpu", "float32")]
    src, tgt = fixed_batch(config, length=9)
    streamed = run_streamed(config, Weights.open(saved), str(saved), targets, {}, src, tgt, feed="own")
    assert streamed.passed and not streamed.errors, streamed.to_text()
    assert len(streamed.cells) == len(streamed.tensors)


def test_streamed_from_the_oracles_inputs_agrees_and_says_so(saved):
    config, params = checkpoint.load(saved)
    targets, skipped = default_targets(["numpy", "torch"], ["float32"])
    src, tgt = fixed_batch(config, length=9)
    heard = []
    streamed = run_streamed(config, Weights.held(config, params), str(saved), targets, skipped, src, tgt,
                            progress=heard.append)
    assert streamed.passed, streamed.to_text()
    assert len(heard) == len(stages(config)) == 2 + 2 + 3 and "encoder layer 2 of 2" in heard[2]
    assert FEED_NOTES["oracle"] in streamed.to_text() and streamed.to_json()["note"] == FEED_NOTES["oracle"]
    # The first tensors have the same inputs either way; past the first layer each cell is that
    # layer's own error, no longer the sum of the errors below it.
    whole = run_check(config, params, str(saved), targets, skipped, src, tgt)
    assert cells(streamed)[("encoder.embeddings", "torch/cpu/float32")] == cells(whole)[("encoder.embeddings", "torch/cpu/float32")]
    # torch's encoder.1.ffn cell is the error of torch's layer 1 itself, run on the oracle's encoder.0.ffn.
    import torch

    import impl_numpy
    import impl_torch
    from conformance.check.compare import compare
    from conformance.check.tolerances import tolerance
    from conformance.core.output import ModelOutput, tensors_of

    oracle = tensors_of(impl_numpy.Model(config, params, "float64", param_dtype="float32")(src, tgt))
    ours = impl_torch.Model(config, params, "float32")
    out = ModelOutput(logits=None, attention={}, intermediates={})
    src_mask, _ = ours.make_masks(src, tgt)
    with backends.full_precision("torch"), torch.no_grad():
        ours.encoder.layers[1](torch.from_numpy(oracle["encoder.0.ffn"].astype(np.float32)),
                               impl_torch.model.encoder_self_mask(config, src_mask), "encoder.1", out,
                               bias=ours.encoder.score_bias(src.shape[1], torch.float32))
    alone = compare(out.intermediates["encoder.1.ffn"], oracle["encoder.1.ffn"], tolerance("float32", "cpu"))
    cell = ("encoder.1.ffn", "torch/cpu/float32")
    assert cells(streamed)[cell] == (None, vars(alone)) and cells(streamed)[cell] != cells(whole)[cell]


@pytest.mark.parametrize("name, first", [("heads split in the wrong order", "encoder.0.self"),
                                         ("missing embedding scale", "encoder.embeddings"),
                                         ("causal mask shifted by one", "decoder.0.self")])
def test_streamed_check_names_a_planted_bug_where_it_lives(saved, name, first):
    config, params = checkpoint.load(saved)
    backend, edits, patches = BREAKS[name]
    broken = broken_copy(name, backend, edits, patches)
    try:
        targets = [backends.Target("numpy", "cpu", "float32"), backends.Target(broken, "cpu", "float64")]
        src, tgt = fixed_batch(config, length=9)
        report = run_streamed(config, Weights.open(saved), str(saved), targets, {}, src, tgt)
    finally:
        backends.unregister_backend(broken)
    assert not report.passed and not report.errors
    assert report.first_failure() == (first, f"{broken}/cpu/float64")
    assert report.first_failure(targets[0]) is None  # the real backend, beside it, passes


def test_rosetta_check_stream_reports_and_exits_as_the_unstreamed_check(saved, tmp_path, capsys):
    status = main(["check", str(saved), "--stream", "--backends", "numpy", "--dtypes", "float32"])
    captured = capsys.readouterr()
    assert status == 0 and "result: every backend agrees with the oracle" in captured.out
    assert captured.err.count("rosetta check --stream:") == len(stages(CONFIG))
    assert "decoder layer 2 of 2" in captured.err
    assert main(["check", str(saved), "--feed", "own", "--backends", "numpy"]) != 0
    assert "--feed" in capsys.readouterr().err


def test_a_corrupt_checkpoint_is_refused_before_any_layer_runs(saved, tmp_path):
    data = bytearray(saved.read_bytes())
    data[-3] ^= 0x01  # a flipped bit in the last tensor
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        Weights.open(corrupt)


def test_a_checkpoint_changed_after_its_digest_was_verified_is_refused(saved, tmp_path):
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(saved.read_bytes())
    weights = Weights.open(copy)
    keys = ["encoder.layers.0.ffn.linear1.weight"]
    assert weights.read(keys)[keys[0]].shape == (CONFIG.d_model, CONFIG.d_ff)
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # as a write would leave it
    with pytest.raises(CheckpointError, match="changed while it was being checked"):
        weights.read(keys)


def test_compare_streams_our_backends_beside_the_users_model():
    torch = pytest.importorskip("torch")
    from systems import from_scratch, randomize_
    from systems.harness import padded_batch

    import conformance

    sizes = dict(src_vocab=23, tgt_vocab=19, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)
    torch.manual_seed(0)
    model = randomize_(from_scratch.make(**sizes), 1)
    src, tgt = padded_batch(from_scratch.PAD, sizes["src_vocab"], sizes["tgt_vocab"])
    options = dict(backends=["numpy", "torch"], n_heads=sizes["n_heads"])
    streamed = conformance.compare(model, "from-scratch", src, tgt, stream=True, **options)
    whole = conformance.compare(model, "from-scratch", src, tgt, **options)
    assert streamed.ok and streamed.note == FEED_NOTES["oracle"] and not whole.note, str(streamed)
    yours = [key for key in whole.cells if key[1] == whole.yours.label]
    assert yours and {key: cells(streamed)[key] for key in yours} == {key: cells(whole)[key] for key in yours}
    # Our backends' columns from the first layer on are each layer's own error
    # (test_streamed_from_the_oracles_inputs_agrees_and_says_so checks one against the layer run alone).


# Bugs planted in the glue around the layers (each model.py's masks and biases, target embedding,
# final norms and logits), where a stream module that copied the glue would not see them: the
# preset that exercises each, the config changes it needs, the edit, the first tensor it breaks.
GLUE_BREAKS = {
    "final_logits_bias dropped": ("hf-bart", {}, [(
        "            logits = logits + self.logits_bias(cast(self.final_logits_bias, logits.dtype))\n        return",
        "            pass\n        return")], "logits"),
    "the decoder reads the encoder's table": ("hf-m2m100", {"share_embeddings": False, "tie_output": False}, [(
        "return self.encoder.embedding if self.config.share_embeddings else self.decoder.embedding",
        "return self.encoder.embedding")], "decoder.embeddings"),
    "the encoder's final norm skipped": ("hf-t5", {}, [(
        "\"\"\"`encoder.output`: x after", "return x\n        \"\"\"`encoder.output`: x after")],
        "encoder.output"),
    "the stack's score bias built in float16": ("hf-t5", {}, [(
        "bias = self.position.score_bias(length, length, dtype, tape=tape)  # (1, H, S, S)",
        "bias = self.position.score_bias(length, length, np.float16, tape=tape)  # (1, H, S, S)")], "encoder.0.self"),
}


@pytest.mark.parametrize("name", GLUE_BREAKS)
def test_streamed_check_names_a_planted_bug_in_the_glue_around_the_layers(name):
    family, changes, edits, first = GLUE_BREAKS[name]
    config = preset(family, **SMALL).replace(**changes)
    params = {k: v.astype(np.float32) for k, v in init_params(config, seed=1).items()}
    src, tgt = fixed_batch(config, length=7)
    broken = broken_copy(name, "numpy", edits, {})
    try:
        targets = [backends.Target(broken, "cpu", "float64")]
        assert run_check(config, params, family, targets, {}, src, tgt).first_failure() == (first, targets[0].label)
        for feed in FEEDS:
            report = run_streamed(config, Weights.held(config, params), family, targets, {}, src, tgt, feed=feed)
            assert report.first_failure() == (first, targets[0].label), feed
    finally:
        backends.unregister_backend(broken)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch-compiled"])
def test_a_backend_that_cannot_run_a_layer_at_a_time_is_refused(saved, capsys, backend):
    """Not run under another backend's label: refused before the checkpoint is hashed."""
    assert main(["check", str(saved), "--stream", "--backends", f"numpy,{backend}", "--dtypes", "float32"]) == 2
    assert f"{backend} cannot run a layer at a time (--stream)" in capsys.readouterr().err
    with pytest.raises(InputError, match="cannot run a layer at a time"):
        run_streamed(CONFIG, Weights.open(saved), str(saved), [backends.Target(backend, "cpu", "float32")], {},
                     *fixed_batch(CONFIG, length=9))


def test_a_file_that_is_no_checkpoint_is_refused_in_the_words_of_load(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(np.random.default_rng(0).bytes(5000))
    with pytest.raises(CheckpointError) as whole:
        checkpoint.load(junk)
    with pytest.raises(CheckpointError) as streamed:
        Weights.open(junk)
    assert str(streamed.value) == str(whole.value) and "convert it first: rosetta convert" in str(whole.value)


def test_rosetta_check_stream_exits_1_on_a_divergence_and_refuses_max_memory(saved, capsys):
    backend, edits, patches = BREAKS["missing embedding scale"]
    broken = broken_copy("missing embedding scale", backend, edits, patches)
    try:
        assert main(["check", str(saved), "--stream", "--backends", f"numpy,{broken}", "--dtypes", "float64"]) == 1
    finally:
        backends.unregister_backend(broken)
    assert f"{broken}/cpu/float64" in capsys.readouterr().out
    assert main(["check", str(saved), "--stream", "--max-memory", "1G", "--backends", "numpy"]) == 2
    assert "--max-memory" in capsys.readouterr().err
