"""`rosetta check --stream`: the oracle and every backend a layer at a time (conformance.check.stream).

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
from conformance.check.stream import FEED_NOTES, Weights, run_streamed, stages
from conformance.cli import main
from conformance.core.errors import CheckpointError

# Pre-LN with both final norms, separate embeddings and an untied output with a bias, a -inf fill
# and padded target queries (NaN rows to compare): every stage of the stem has work to do.
CONFIG = ModelConfig(
    src_vocab_size=50, tgt_vocab_size=40, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2, n_decoder_layers=2,
    max_len=16, norm_placement="pre", final_encoder_norm=True, final_decoder_norm=True, share_embeddings=False,
    tie_output=False, output_bias=True, mask_fill=float("-inf"), tgt_pad_mask="queries",
)
BACKENDS = ["numpy", "torch", "jax"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "small.safetensors"
    checkpoint.save(path, CONFIG, {k: v.astype(np.float32) for k, v in init_params(CONFIG, seed=3).items()})
    return path


def cells(report) -> dict:
    """Every cell's comparison as plain values: the per-tensor errors, their places, the verdicts."""
    return {key: (cell.error, None if cell.comparison is None else vars(cell.comparison))
            for key, cell in report.cells.items()}


def test_streamed_with_own_inputs_is_the_unstreamed_report_bit_for_bit(saved):
    config, params = checkpoint.load(saved)
    targets, skipped = default_targets(BACKENDS, ["float32", "float64"])
    targets = [t for t in targets if not (t.backend == "jax" and t.dtype == "float64")]  # one JAX dtype: compiles
    src, tgt = fixed_batch(config, length=9)
    whole = run_check(config, params, str(saved), targets, skipped, src, tgt)
    streamed = run_streamed(config, Weights.open(saved), str(saved), targets, skipped, src, tgt, feed="own")
    assert not streamed.errors and len(streamed.cells) == len(whole.cells) == len(whole.tensors) * len(targets)
    assert cells(streamed) == cells(whole)
    assert streamed.passed == whole.passed


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
    # Our backends' columns are each layer's own error: past the first layer, not the unstreamed cells.
    ours = [key for key in whole.cells if key[1] == "torch/cpu/float32" and key[0] == "encoder.1.ffn"]
    assert ours and cells(streamed)[ours[0]] != cells(whole)[ours[0]]
