"""What runs beside the float64 oracle besides our three eager backends: one module per target.

    adapter         your own backend, through the adapter protocol (docs/own-backend.md)
    torch_compiled  the `torch-compiled` target: impl_torch under `torch.compile`

The runtimes' targets live in their engine's room: `onnxruntime` in conformance.check.onnx.runtime,
`ctranslate2` in conformance.check.ctranslate2.target. `TARGETS` below is the one registry of
every target asked for by name; conformance.check.backends builds them.

May import what conformance.check may.
"""

# Targets asked for by name only, never in the default set (`--backends numpy,torch-compiled`):
# name -> (the module with a backend's surface, the built-in backend it behaves like).
# `onnxruntime` (conformance.check.onnx.runtime) is impl_torch's model exported to ONNX and run by
# ONNX Runtime's CPU execution provider: host arrays in and out, on the CPU, as NumPy's are.
TARGETS = {"torch-compiled": ("conformance.check.targets.torch_compiled", "torch"),
           "onnxruntime": ("conformance.check.onnx.runtime", "numpy")}

# Targets that expose no intermediate tensors, so no backend surface: `rosetta check --backends
# numpy,ctranslate2` checks them in a section of their own (conformance/cli/check.py); anywhere else
# (the suite, `rosetta compare --backends`, the tensor table) the name is refused with this reason.
SECTION_TARGETS = {"ctranslate2": "CTranslate2 exposes no intermediate tensors, attention weights or gradients, which "
                                  "the suite's properties and the tensor table compare: rosetta check --backends "
                                  "numpy,ctranslate2 checks its score_batch log p and translate_batch ids in a section "
                                  "of its own, and conformance.compare / rosetta compare take a CTranslate2 model "
                                  "directory (docs/deployment.md)"}
