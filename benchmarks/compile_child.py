"""One fresh process's compile times for benchmarks/bench_jax.py --compile (run by it, not by hand).

    python benchmarks/compile_child.py CONFIG_JSON BATCH SRC_LEN TGT_LEN

Builds impl_jax.Model(config) in float32 and times the first call of each entry point: the
forward pass (`model(src, tgt, return_attention=False)`), one training step (`impl_jax.train_step`
with the paper's Adam: loss_and_grads and the update) and `generate` (greedy, 8 tokens, cached).
The layer stacks (ROSETTA_JAX_SCAN) and the persistent cache (ROSETTA_JAX_CACHE) come from the
environment the parent sets. Prints one JSON line: per entry point, the wall time of its first
call and the CPU time the process spent in it (steadier than wall time on a loaded machine), the
tracing and XLA parts (impl_jax.compile_stats), executables compiled and loaded from the
persistent cache, and the wall and CPU time of a second call.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

started = time.perf_counter()
import jax  # noqa: E402

import impl_jax  # noqa: E402
from conformance.core.config import ModelConfig  # noqa: E402
from conformance import init_params  # noqa: E402

imported = time.perf_counter() - started


def main() -> None:
    config = ModelConfig.from_dict(json.loads(sys.argv[1]), complete=True)
    batch, src_len, tgt_len = (int(a) for a in sys.argv[2:5])
    rng = np.random.default_rng(0)
    src = rng.integers(2, config.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(2, config.tgt_vocab_size, size=(batch, tgt_len))
    labels = np.roll(tgt, -1, axis=1)
    model = impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32), dtype="float32")
    optimizer = impl_jax.Adam(model, config.d_model)
    entries = {
        "forward": lambda: model(src, tgt, return_attention=False).logits,
        "train step": lambda: impl_jax.train_step(model, optimizer, src, tgt, labels, label_smoothing=0.1),
        "generate": lambda: model.generate(src[:2], 8, 2, 3),
    }
    report = {"import": imported, "device": str(jax.devices()[0])}
    for name, run in entries.items():
        before = impl_jax.compile_stats()
        start, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(run())
        first, cpu = time.perf_counter() - start, time.process_time() - cpu
        after = impl_jax.compile_stats()
        start, again_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(run())
        again, again_cpu = time.perf_counter() - start, time.process_time() - again_cpu
        report[name] = {"first": first, "cpu": cpu, "again": again, "again cpu": again_cpu,
                        "trace": after["trace_seconds"] - before["trace_seconds"],
                        "xla": after["compile_seconds"] - before["compile_seconds"],
                        "compiles": after["compiles"] - before["compiles"],
                        # a checkout older than the persistent cache (bench_jax --against) counts no hits
                        "loaded": after.get("persistent_hits", 0) - before.get("persistent_hits", 0)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
