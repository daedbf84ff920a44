"""The `scale` profile's time, estimated before it starts (printed by the pytest plugin once
collection is done, so that the properties are imported under the loaded profile)."""

from __future__ import annotations


def forward_flops(d_model: int, d_ff: int, layers: int, vocab: int, src: int, tgt: int) -> float:
    """Multiply-adds x 2 of one forward pass (matmuls only): projections, attention, logits."""
    d = d_model
    encoder = 2 * src * (4 * d * d + 2 * d * d_ff) + 4 * src * src * d
    decoder = (2 * tgt * (4 * d * d + 2 * d * d_ff) + 4 * tgt * tgt * d   # self-attention and FFN
               + 2 * tgt * 2 * d * d + 2 * src * 2 * d * d + 4 * tgt * src * d)  # cross-attention
    return layers * (encoder + decoder) + 2 * tgt * d * vocab


def full_size_runs_per_example(requested: str | None) -> int:
    """Model runs per drawn full-size example: the oracle, then every target of the realistic
    property that runs full size (compiling backends at float32 only). Half precision runs full
    size on accelerators only, which this CPU estimate does not count."""
    import os

    from conformance.check import backends
    from conformance.suite.realistic import REALISTIC_DTYPES
    from conformance.suite.runner import ORACLE

    if requested:
        os.environ["ROSETTA_BACKENDS"] = requested
    runs = 1
    available = backends.availability()
    for name in backends.requested_backends():
        if available[name]:
            continue
        for dtype in REALISTIC_DTYPES:
            if dtype not in backends.dtypes(name) or backends.Target(name, "cpu", dtype) == ORACLE:
                continue
            if backends.compiles(name) and dtype != "float32":
                continue
            runs += 1
    return runs


def scale_estimate(requested: str | None = None) -> str:
    """The `scale` profile's time, estimated before it starts: one full-size oracle run (d_model
    512, 6+6 layers, vocab 32000, 512 tokens a side: build and forward) is timed, scaled by the FLOPs
    of the sizes the profile draws (their mean, and their largest), and multiplied by the runs per
    example and the examples."""
    import time

    import numpy as np

    from conformance.check.backends import Target
    from conformance.core.presets import preset
    from conformance.suite import runner, strategies
    from conformance.suite.profiles import SCALE_EXAMPLES

    d, length = 512, 512
    config = preset("paper", d_model=d, n_heads=d // strategies.SCALE_HEAD_DIM, d_ff=4 * d,
                    n_encoder_layers=strategies.SCALE_LAYERS, n_decoder_layers=strategies.SCALE_LAYERS,
                    src_vocab_size=strategies.SCALE_VOCAB, tgt_vocab_size=strategies.SCALE_VOCAB, max_len=length)
    ids = np.random.default_rng(0).integers(1, strategies.SCALE_VOCAB, size=(1, length))
    started = time.perf_counter()
    runner.run(Target("numpy", "cpu", "float64"), strategies.Case(config, 0, 1.0, ids, ids))
    measured = time.perf_counter() - started

    def flops(d_model: int, src: int, tgt: int) -> float:
        return forward_flops(d_model, 4 * d_model, strategies.SCALE_LAYERS, strategies.SCALE_VOCAB, src, tgt)

    # Every size the strategy can draw, equally likely (drawing the examples here would run
    # hypothesis before pytest, which then ignored the loaded profile: measured, 100 examples).
    sizes = [(dm, n, t) for dm in strategies.SCALE_D_MODELS for n in strategies.SCALE_LENGTHS for t in (n, n // 2)]
    mean = sum(flops(*s) for s in sizes) / len(sizes) / flops(d, length, length)
    largest = max(flops(*s) for s in sizes) / flops(d, length, length)
    runs = full_size_runs_per_example(requested)
    typical, worst = (measured * r * runs * SCALE_EXAMPLES / 60 for r in (mean, largest))
    return (f"rosetta conformance --profile scale: one full-size oracle run (d_model {d}, 6+6 layers, vocab "
            f"{strategies.SCALE_VOCAB}, {length} tokens a side) took {measured:.1f} s; an example costs "
            f"{mean:.1f}x its FLOPs on average and {largest:.1f}x at most; {runs} runs per example (oracle and "
            f"targets) x {SCALE_EXAMPLES} examples: about {typical:.0f} min for the full-size property, "
            f"{worst:.0f} min if every example is the largest (every target priced at the float64 oracle's "
            f"speed), plus the small properties at {SCALE_EXAMPLES} examples each.")
