"""The check-and-report tools behind `rosetta check` (and used by the suite).

    backends     which backends and devices are here; one `build` for any target
    compare      array comparison against the oracle, largest errors and where
    tolerances   the per-dtype tolerance table (measured: docs/tolerances.md)
    report       the tensor-by-tensor report of `rosetta check`, first diverging tensor
    plan         how a check holds the oracle's tensors (all at once or one at a time) for a budget
    stream       `rosetta check --stream`: the oracle and each backend a layer at a time, from the memory-mapped file
    plots        the report's and the attention pictures (matplotlib, lazily)
    defaults     the built-in default model (data/default.safetensors)
    toy          the digit-reversal task the default model was trained on
    side_by_side `conformance.compare`: the user's own model as a column of the report
    side_by_side_grads  its backward half: the user's loss and gradients beside the oracle's
    switches     which ModelConfig switches act where each tensor is computed
    user_code    the user's code failing: its own frames of the traceback
    taps         reading a foreign model's tensors where its layout's [taps] say
    onnx_export  impl_torch's model as encoder/decoder ONNX graphs (torch's exporter), `rosetta convert --to onnx`
    onnx_runtime the `onnxruntime` target: those graphs run by ONNX Runtime, beside the oracle
    ctranslate2_check  `rosetta convert --to ctranslate2` (CTranslate2's converter), and `rosetta check`'s ctranslate2 section
    ctranslate2_compare  a CTranslate2 model (ours or the user's) beside the oracle: score_batch log p and translate_batch ids
    ctranslate2_model  a CTranslate2 directory read: vocabularies (ids <-> tokens), config.json, model.bin's header
    ctranslate2_report the CTranslate2 report: a row per compute type, its verdict, table and JSON
    weights      the weights a deployed model (ONNX graphs, a CTranslate2 directory) was made from, read for the oracle
    sharded      sharded runs (impl_jax.shard, impl_torch.parallelize) in a child process, compared with the oracle
    sharded_ranks  the child of sharded_runs: the JAX process, or the torch ranks (forked on the CPU)
    mesh         `rosetta check --mesh`: the default model sharded, every plan, a line per plan

May import: the core, NumPy, the converters (`conformance.convert`, beside the backends), and
the backends (`impl_*`) lazily, by name, through `backends`. Never the suite or the CLI.
"""
