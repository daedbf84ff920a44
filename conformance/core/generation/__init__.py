"""Decoding, written once for every backend: `generate`'s settings, the logits processors and the searches.

    settings    `generate`'s arguments, their checks, and their resolution against the
                checkpoint's note (`resolve` -> `Generation`)
    note        the checkpoint's generation note (transformers' generation_config.json) as
                `generate` arguments, and the settings it records that `generate` does not apply
    processors  Hugging Face's logits processors, in its order, for the reference search
    search      the reference search on the host in float64 NumPy: greedy, both beam rules,
                sampling (the oracle of every backend's `generate`)
    device      the same rules as pure functions over a small array adapter, which each backend's
                `generate` runs in its own arrays on its device

The semantics are docs/decoding.md's.

May import what the core may: the standard library, NumPy and the core itself (framework-free).
"""
