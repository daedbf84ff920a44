"""impl_torch imports TorchDynamo only when something compiles (impl_torch/compiling.py).

`torch.compiler.disable` at import cost every torch `rosetta` call about a second of
`torch._dynamo` imports (issue 56). The host-side checks are now marked lazily: a model built and
run eagerly never loads TorchDynamo, and under `torch.compile` the checks still run eagerly,
outside the graph, with the same refusal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]

EAGER_RUN = """
import sys
import numpy as np
import impl_torch
from conformance.core.presets import preset

config = preset("paper", d_model=8, n_heads=2, d_ff=16, n_encoder_layers=1, n_decoder_layers=1,
                src_vocab_size=9, tgt_vocab_size=9, max_len=6)
model = impl_torch.Model(config)
model(np.array([[3, 4, 0]]), np.array([[1, 3]]))  # numpy ids: the host checks
model(impl_torch.torch.tensor([[3, 4, 0]]), impl_torch.torch.tensor([[1, 3]]))  # tensor ids: the device checks
model.generate(np.array([[3, 4, 0]]), 3, 1, 2)
print(sorted(name for name in sys.modules if name.startswith("torch._dynamo")))
"""


def test_an_eager_model_never_imports_torchdynamo():
    """Before the fix, `import impl_torch` alone loaded torch._dynamo (model.py's decorators)."""
    out = subprocess.run([sys.executable, "-c", EAGER_RUN], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def traced_calls(model, src, tgt) -> list[str]:
    """The functions and methods of every graph TorchDynamo makes of the model's forward."""
    calls = []

    def backend(graph_module, inputs):
        calls.extend(str(node.target) for node in graph_module.graph.nodes
                     if node.op in ("call_function", "call_method"))
        return graph_module.forward

    torch.compile(model, backend=backend)(src, tgt, return_attention=False)
    return calls


def test_the_checks_run_eagerly_under_torch_compile():
    """The compiled model gives the eager logits; its id check is not traced into a graph (the
    bounds' aminmax, which an undecorated check puts there, is in none) and still refuses a bad
    id with the shared error, on the host and on the device path."""
    import impl_torch
    from conformance.core.errors import InputError
    from conformance.core.presets import preset

    config = preset("llmhub", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                    src_vocab_size=12, tgt_vocab_size=12, max_len=8)
    model = impl_torch.Model(config, dtype=torch.float32)
    src, tgt = torch.tensor([[3, 4, 5, 0], [6, 7, 0, 0]]), torch.tensor([[1, 3, 4], [1, 5, 0]])
    compiled = torch.compile(model, backend="eager")
    assert torch.equal(compiled(src, tgt, return_attention=False).logits, model(src, tgt, return_attention=False).logits)
    for bad in (torch.tensor([[1, 12]]), np.array([[1, 12]])):  # the device check, then the host one
        with pytest.raises(InputError, match="src_ids: token id 12 out of range"):
            compiled(bad, tgt[:1])
    calls = traced_calls(model, src, tgt)
    assert calls and not [call for call in calls if "aminmax" in call], calls
