"""Whisper in ONNX, run in ONNX Runtime itself: optimum-onnx's export checked tensor by tensor, and
`rosetta convert --to onnx` of a features source (its encoder graph takes log-mel features),
checked on write.

optimum's export is tests/fixtures/optimum_whisper_onnx (a tiny random Whisper, every norm and bias
jittered, exported by optimum-onnx 0.1.0 in a throwaway environment: tests/fixtures/make_optimum_marian_onnx.py
whisper). Its encoder graph takes exactly a whole window (2 x max_source_positions = 16 frames).
The layout tests/fixtures/optimum_whisper_onnx_taps.toml points the encoder's tensors at values of
that graph; the decoder's sit inside the merged graph's If branches, so the logits are its only
tensor compared (the decoder run whole, then again with half of the prefix as its cache). Planted
bugs in the graphs are each named at the tensor where they first show.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

# One worker under `--dist loadgroup`: the export is paid once, beside the other ONNX tests.
pytestmark = [pytest.mark.xdist_group("onnx"),
              pytest.mark.filterwarnings("ignore::conformance.core.generation.note.GenerationWarning")]

pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed: pip install 'rosetta-transformer[onnx]'")
onnx = pytest.importorskip("onnx", reason="the [onnx] extra is not installed")
pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
pytest.importorskip("torch", reason="the graphs are exported from impl_torch")

from onnx import numpy_helper  # noqa: E402

import impl_numpy  # noqa: E402
from breaks import WHISPER_EXPORT_BREAKS, planted_in_the_export  # noqa: E402
from conformance.check.onnx.compare import compare_onnx  # noqa: E402
from conformance.check.report import window_batch  # noqa: E402
from conformance.cli import main  # noqa: E402
from conformance.convert.hf_folder import from_hf_folder  # noqa: E402
from conformance.core import checkpoint  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
OPTIMUM = FIXTURES / "optimum_whisper_onnx"
TAPS = FIXTURES / "optimum_whisper_onnx_taps.toml"
ENCODER_TAPS = ("encoder.conv2", "encoder.embeddings", "encoder.0.self", "encoder.0.self_attn", "encoder.0.ffn",
                "encoder.1.self", "encoder.1.self_attn", "encoder.1.ffn", "encoder.output")


def rows(out: str) -> dict[str, str]:
    return {line.split()[0]: line for line in out.splitlines() if line[:1].isalpha() and len(line.split()) > 1}


def test_rosetta_compare_checks_the_optimum_whisper_export_tensor_by_tensor(capsys):
    assert main(["compare", str(OPTIMUM), "--layout", str(TAPS), "--backends", "none"]) == 0
    out = capsys.readouterr().out
    found = rows(out)
    for tensor in (*ENCODER_TAPS, "logits"):
        assert found[tensor].rstrip().endswith("ok"), f"{tensor}: {found[tensor]}\n{out}"
    # conv1's output is channels-first in the graph (B, D, F): named as not exposed, never transposed to fit.
    assert "not exposed" in found["encoder.conv1"] and "not exposed" in found["decoder.0.self"], out
    assert "result: ok" in out, out


def plant(tmp_path: Path, graph: str, change) -> Path:
    """A copy of optimum's folder with `change(proto)` applied to one of its graphs."""
    folder = tmp_path / "planted"
    shutil.copytree(OPTIMUM, folder)
    proto = onnx.load(str(folder / graph))
    change(proto)
    onnx.save(proto, str(folder / graph))
    return folder


def edited(proto, name: str, change) -> None:
    tensor = next(t for t in proto.graph.initializer if t.name == name)
    tensor.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(tensor).copy()), name))


def positions_halves_swapped(proto) -> None:
    """The encoder's sinusoid stored [cos | sin] instead of [sin | cos] (the constant the graph adds
    after the front end: the only (max_source_positions, D) initializer)."""
    table = next(t.name for t in proto.graph.initializer if list(t.dims) == [8, 16])
    edited(proto, table, lambda a: np.concatenate([a[:, 8:], a[:, :8]], axis=1))


def conv1_kernel_reversed(proto) -> None:
    """conv1's kernel read the wrong way round along its 3 taps (a Flax (3, C_in, C_out) kernel
    copied into a Conv1d (C_out, C_in, 3) weight with only two axes transposed)."""
    edited(proto, "conv1.weight", lambda w: w[:, :, ::-1].copy())


def cache_of_the_next_layer(proto) -> None:
    """The decoder's two layers read each other's self-attention cache (in the graph and its If branches)."""
    swap = {f"past_key_values.{a}.decoder.{part}": f"past_key_values.{b}.decoder.{part}"
            for a, b in ((0, 1), (1, 0)) for part in ("key", "value")}

    def rewire(graph):
        for node in graph.node:
            node.input[:] = [swap.get(name, name) for name in node.input]
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    rewire(attribute.g)

    rewire(proto.graph)


@pytest.mark.parametrize("graph, change, where", [
    ("encoder_model.onnx", positions_halves_swapped, "encoder.embeddings"),
    # conv1's own output is not exposed (channels-first): the bug is named at the next tensor, conv2's.
    ("encoder_model.onnx", conv1_kernel_reversed, "encoder.conv2"),
    # the first call runs the whole prefix with no cache; the cached half of the logits parts.
    ("decoder_model_merged.onnx", cache_of_the_next_layer, "logits"),
], ids=["sinusoid halves swapped", "conv1 kernel reversed", "decoder cache of the next layer"])
def test_a_planted_bug_in_the_optimum_whisper_export_is_named_at_its_tensor(tmp_path, graph, change, where):
    folder = plant(tmp_path, graph, change)
    config, _ = from_hf_folder(OPTIMUM)
    report = compare_onnx(folder, str(TAPS), *window_batch(config), backends=())
    assert not report.errors, report.errors
    assert report.first_divergence == where, report.to_text()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The optimum fixture's weights as a rosetta checkpoint: (path, config, params)."""
    config, params = from_hf_folder(OPTIMUM)
    path = tmp_path_factory.mktemp("onnx-whisper") / "whisper.safetensors"
    checkpoint.save(path, config, params)
    return path, config, params


@pytest.fixture(scope="module")
def exported(saved):
    """`rosetta convert whisper.safetensors graphs/ --to onnx --taps`, checked on write."""
    path = saved[0]
    folder = path.parent / "graphs"
    assert main(["convert", str(path), str(folder), "--to", "onnx", "--taps"]) == 0
    return folder


def test_to_onnx_writes_a_features_encoder_and_checks_it_on_write(saved, exported, capsys):
    import onnxruntime

    encoder = onnxruntime.InferenceSession(str(exported / "encoder.onnx"), providers=["CPUExecutionProvider"])
    (features,) = encoder.get_inputs()
    assert features.name == "src_features" and features.type == "tensor(float)" and len(features.shape) == 3
    # The graphs themselves beside the oracle, every tensor (the front end's included), on a whole
    # window (16 frames; the export traced 10: frames are dynamic).
    _, config, params = saved
    report = compare_onnx(exported, None, *window_batch(config), weights=str(saved[0]), backends=())
    assert report.ok and report.first_divergence is None, report.to_text()
    for tensor in ("encoder.conv1", "encoder.conv2", "encoder.embeddings", "decoder.0.cross", "logits"):
        assert report.cells[(tensor, report.yours.label)].comparison.passed, report.to_text()


def test_the_written_graphs_generate_the_oracles_ids(saved, exported):
    import onnxruntime

    from conformance.check.onnx.runtime import Model

    _, config, params = saved
    sessions = [onnxruntime.InferenceSession(str(exported / name), providers=["CPUExecutionProvider"])
                for name in ("encoder.onnx", "decoder.onnx")]
    features = window_batch(config)[0][:, :, :12]  # 6 encoder positions of the 8
    ours = Model.of_sessions(config, *sessions).generate(features, max_len=12, bos_id=46, eos_id=45, num_beams=2)
    oracle = impl_numpy.Model(config, params, dtype="float64").generate(features, max_len=12, bos_id=46, eos_id=45,
                                                                         num_beams=2)
    assert ours.tolist() == oracle.tolist()


@pytest.mark.parametrize("name", sorted(WHISPER_EXPORT_BREAKS))
def test_a_planted_export_fault_of_a_features_source_is_refused_on_write(saved, tmp_path, capsys, name):
    out = tmp_path / "graphs"
    with planted_in_the_export(name):
        status = main(["convert", str(saved[0]), str(out), "--to", "onnx", "--taps"])
    err = capsys.readouterr().err
    assert status == 1, err
    assert f"first diverging tensor {WHISPER_EXPORT_BREAKS[name][2]}" in err, err
    assert not out.exists()
