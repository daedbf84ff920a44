"""impl_torch exported to ONNX in float16 and run by ONNX Runtime's CPU execution provider: every
tensor within the float16 row of docs/tolerances.md against the float64 oracle (the numbers of
docs/deployment.md's float16 column, measured on the default model by the thorough profile; CI
exports the small model of tests/runtimes/test_onnx.py in float16 instead)."""

from __future__ import annotations

import numpy as np
import pytest

# On the worker of tests/runtimes/test_onnx.py and tests/runtimes/test_onnx_compare.py: the exporter's first export in a
# process pays a one-time warm-up (measured: this file's export and test_onnx_compare's untapped one,
# 16.5 + 16.5 CPU-s in two processes, 24.5 in one).
pytestmark = pytest.mark.xdist_group("onnx")

onnxruntime = pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")
pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
pytest.importorskip("torch", reason="the graphs are exported from impl_torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from conformance.check.onnx import export as onnx_export  # noqa: E402
from conformance.check.onnx import runtime as onnx_runtime
from conformance.check.compare import compare  # noqa: E402
from conformance.check.defaults import default_model  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.core.output import forward_order, tensors_of  # noqa: E402
from thorough import thorough_only  # noqa: E402


def agrees_in_float16(config, params, encoder, decoder) -> None:
    """Every tensor of the float16 graphs, run by ONNX Runtime, within the float16 tolerance."""
    src_ids, tgt_ids = fixed_batch(config)
    sessions = [onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"]) for graph in (encoder, decoder)]
    assert sessions[1].get_outputs()[0].type == "tensor(float16)"  # the graph computes in float16
    got = tensors_of(onnx_runtime.Model.of_sessions(config, *sessions)(src_ids, tgt_ids))
    expected = tensors_of(impl_numpy.Model(config, params, dtype="float64")(src_ids, tgt_ids))
    for name in forward_order(config):
        assert got[name].dtype == np.float16, f"{name}: {got[name].dtype}"
        result = compare(got[name], expected[name], tolerance("float16", "cpu"))
        assert result.passed, f"onnxruntime/cpu/float16 {name}: {result}"


def test_a_small_float16_export_agrees_with_the_oracle_in_onnx_runtime():
    from conformance import init_params
    from test_onnx import CONFIG

    params = init_params(CONFIG, seed=3)
    agrees_in_float16(CONFIG, params, *onnx_export.export_bytes(CONFIG, params, "float16", taps=True))


@thorough_only("a D=64 float16 export (~35 CPU-s); test_a_small_float16_export_agrees_with_the_oracle_in_onnx_runtime "
               "exports the small model")
def test_a_float16_export_agrees_with_the_oracle_in_onnx_runtime(tmp_path):
    config, params, _ = default_model()
    encoder, decoder = onnx_export.export(impl_torch.Model(config, params, "float16"), tmp_path, taps=True)
    agrees_in_float16(config, params, encoder.read_bytes(), decoder.read_bytes())
