"""The check-and-report tools behind `rosetta check` (and used by the suite), in rooms by role.

The check itself (this folder):
    backends     which backends and devices are here; one `build` for any target
    compare      array comparison against the oracle, largest errors and where
    tolerances   the per-dtype tolerance table (measured: docs/tolerances.md)
    report       the tensor-by-tensor report of `rosetta check`, first diverging tensor
    probes       the batches a check of another system's copy of a model runs (verify-on-write, the runtimes)
    plan         how a check holds the oracle's tensors (all at once or one at a time) for a budget
    plots        the report's and the attention pictures (matplotlib, lazily)
    switches     which ModelConfig switches act where each tensor is computed
    defaults     the built-in default model (data/default.safetensors)
    toy          the digit-reversal task the default model was trained on
    weights      the weights a deployed model (ONNX graphs, a CTranslate2 directory) was made from, read for the oracle
    training     `rosetta train-check`: N steps in every backend beside the float64 run

Rooms:
    targets/     what runs beside the oracle besides our eager backends, one module per target and
                 one registry: your own backend (adapter), torch-compiled; the runtimes' targets
                 (onnxruntime, ctranslate2) live in their engine's room below and are registered here
    foreign/     the user's own model beside the oracle (`conformance.compare`): a torch/Flax module
                 side by side, its gradients, its report, taps, the user's code frames
    onnx/        ONNX Runtime: impl_torch exported as graphs (`rosetta convert --to onnx`), the
                 `onnxruntime` target, and the user's own graphs beside the oracle
    ctranslate2/ CTranslate2: our checkpoint through its converter (`--to ctranslate2`) and the
                 `ctranslate2` section of `rosetta check`, a CTranslate2 directory read, its report,
                 and the user's own CTranslate2 model beside the oracle
    scale/       what makes a check fit a model too large for memory or a mesh: `--stream`, sharded
                 runs and their ranks, `--mesh`

The two engines are rooms of their own, not split between targets/ and foreign/: a runtime's
target and its compare share how its model is read, its options and its report.

May import: the core, NumPy, the converters (`conformance.convert`, beside the backends), and
the backends (`impl_*`) lazily, by name, through `backends`. Never the suite or the CLI.
"""

from conformance.core.moved import install as _install

# Old paths of the modules that moved into rooms; they keep working for one release.
_install(__name__, {
    "adapter": "conformance.check.targets.adapter",
    "compiled_torch": "conformance.check.targets.torch_compiled",
    "onnx_export": "conformance.check.onnx.export",
    "onnx_runtime": "conformance.check.onnx.runtime",
    "onnx_compare": "conformance.check.onnx.compare",
    "ctranslate2_check": "conformance.check.ctranslate2.target",
    "ctranslate2_compare": "conformance.check.ctranslate2.compare",
    "ctranslate2_model": "conformance.check.ctranslate2.model",
    "ctranslate2_report": "conformance.check.ctranslate2.report",
    "side_by_side": "conformance.check.foreign.side_by_side",
    "side_by_side_grads": "conformance.check.foreign.grads",
    "side_by_side_report": "conformance.check.foreign.report",
    "taps": "conformance.check.foreign.taps",
    "user_code": "conformance.check.foreign.user_code",
    "stream": "conformance.check.scale.stream",
    "sharded": "conformance.check.scale.sharded",
    "sharded_ranks": "conformance.check.scale.ranks",
    "mesh": "conformance.check.scale.mesh",
})
