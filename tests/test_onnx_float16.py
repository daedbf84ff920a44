"""impl_torch exported to ONNX in float16 and run by ONNX Runtime's CPU execution provider: every
tensor within the float16 row of docs/tolerances.md against the float64 oracle (the numbers of
docs/deployment.md's float16 column)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.xdist_group("onnx")

onnxruntime = pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed")
pytest.importorskip("onnxscript", reason="torch's ONNX exporter needs onnxscript (the [onnx] extra)")
pytest.importorskip("torch", reason="the graphs are exported from impl_torch")

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from conformance.check import onnx_export, onnx_runtime  # noqa: E402
from conformance.check.compare import compare  # noqa: E402
from conformance.check.defaults import default_model  # noqa: E402
from conformance.check.report import fixed_batch  # noqa: E402
from conformance.check.tolerances import tolerance  # noqa: E402
from conformance.core.output import forward_order, tensors_of  # noqa: E402


def test_a_float16_export_agrees_with_the_oracle_in_onnx_runtime(tmp_path):
    config, params, _ = default_model()
    src_ids, tgt_ids = fixed_batch(config)
    encoder, decoder = onnx_export.export(impl_torch.Model(config, params, "float16"), tmp_path, taps=True)
    sessions = [onnxruntime.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for p in (encoder, decoder)]
    assert sessions[1].get_outputs()[0].type == "tensor(float16)"  # the graph computes in float16
    got = tensors_of(onnx_runtime.Model.of_sessions(config, *sessions)(src_ids, tgt_ids))
    expected = tensors_of(impl_numpy.Model(config, params, dtype="float64")(src_ids, tgt_ids))
    for name in forward_order(config):
        assert got[name].dtype == np.float16, f"{name}: {got[name].dtype}"
        result = compare(got[name], expected[name], tolerance("float16", "cpu"))
        assert result.passed, f"onnxruntime/cpu/float16 {name}: {result}"
