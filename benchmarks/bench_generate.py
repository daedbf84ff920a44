"""Decoding speed: KV-cached against uncached greedy, and beam 4, per backend, in one run.

    python benchmarks/bench_generate.py            # the base config, source 32, 64 new tokens
    python benchmarks/bench_generate.py --quick    # a small config, 16 new tokens (a smoke run)
    python benchmarks/bench_generate.py --backends torch,jax,numpy

The base config (d_model 512, 8 heads, d_ff 2048, 6+6 layers, vocab 32000, float32, CPU) decodes
batches of 1 and 8 sources of length 32 for exactly 64 new tokens: the end token is banned, so no
row stops early and every contender does the same work. For each backend and batch:

    cached     generate(..., use_cache=True): one decoder step per token against the KV cache
    uncached   generate(..., use_cache=False): the whole decoder over the whole prefix per token
    beam 4     generate(..., num_beams=4), cached

It prints tokens per second (new tokens x batch / seconds), the cached/uncached speed-up, and
whether the time per token stays flat (mean of the last 16 cached steps / mean of the first 16).
JAX's compile time is measured apart (a warm-up call of every shape first, counted by
`impl_jax.compile_stats()`); its uncached run uses `buckets` (16, 32, 64), or it would compile
once per prefix length. NumPy is not in the default list: uncached at this size takes minutes.

Every contender's ids are checked against the first backend's cached ids before the numbers
are trusted (float32: a near-tie could flip one; it is reported, not hidden).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from conformance import init_params, preset
from conformance.check.compare import to_numpy

BASE = dict(src_vocab_size=32000, tgt_vocab_size=32000, d_model=512, n_heads=8, d_ff=2048,
            n_encoder_layers=6, n_decoder_layers=6, max_len=128)
QUICK = dict(src_vocab_size=1000, tgt_vocab_size=1000, d_model=64, n_heads=4, d_ff=128,
             n_encoder_layers=2, n_decoder_layers=2, max_len=64)
BOS, EOS = 1, 2


def build(backend: str, config, params, buckets=None):
    if backend == "numpy":
        import impl_numpy

        return impl_numpy.Model(config, params, "float32")
    if backend == "torch":
        import impl_torch

        return impl_torch.Model(config, params, "float32")
    import impl_jax

    return impl_jax.Model(config, params, "float32", buckets=buckets)


def sync(backend: str, value):
    if backend == "jax":
        value.block_until_ready()
    return value


def timed_generate(backend, model, src, new_tokens, **options):
    """(ids, seconds, per-step seconds of the cached decoder steps)."""
    steps: list[float] = []
    cls = type(model)
    original = cls.decode_step

    def timed_step(self, tgt_ids, cache):
        started = time.perf_counter()
        out = sync(backend, original(self, tgt_ids, cache))
        steps.append(time.perf_counter() - started)
        return out

    # On the class, not the instance: an attribute set on an nnx.Module changes its pytree, and
    # JAX would compile the model again.
    cls.decode_step = timed_step
    try:
        started = time.perf_counter()
        ids = model.generate(src, new_tokens, BOS, EOS, banned_ids=[EOS], **options)
        ids = to_numpy(sync(backend, ids))
        return ids, time.perf_counter() - started, steps
    finally:
        cls.decode_step = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config and 16 new tokens")
    parser.add_argument("--backends", default="torch,jax", help="comma-separated (default: torch,jax)")
    args = parser.parse_args()
    sizes, new_tokens, src_len = (QUICK, 16, 32) if args.quick else (BASE, 64, 32)
    config = preset("paper", **sizes)
    params = init_params(config, seed=0, dtype=np.float32)
    rng = np.random.default_rng(0)
    chosen = args.backends.split(",")

    print(f"config: d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, "
          f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, vocab {config.tgt_vocab_size}; "
          f"source {src_len}, {new_tokens} new tokens, float32, CPU")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} (shared: numbers move with the load)")
    if "torch" in chosen:
        import torch

        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    reference: dict[int, np.ndarray] = {}
    rows = []
    for batch in (1, 8):
        src = rng.integers(3, config.src_vocab_size, size=(batch, src_len))
        for backend in chosen:
            compile_note = ""
            model = build(backend, config, params)
            uncached_model = build(backend, config, params, buckets=(16, 32, 64)) if backend == "jax" else model
            if backend == "jax":
                import impl_jax

                impl_jax.reset_stats()
                model.generate(src, new_tokens, BOS, EOS, banned_ids=[EOS])  # compile the cached shapes
                model.generate(src, new_tokens, BOS, EOS, banned_ids=[EOS], num_beams=4)
                uncached_model.generate(src, new_tokens, BOS, EOS, banned_ids=[EOS], use_cache=False)
                stats = impl_jax.compile_stats()
                compile_note = (f"  [JAX compile, apart: {stats['compiles']} executables, "
                                f"{stats['trace_seconds'] + stats['compile_seconds']:.1f} s]")
            cached_ids, cached_s, steps = timed_generate(backend, model, src, new_tokens)
            uncached_ids, uncached_s, _ = timed_generate(backend, uncached_model, src, new_tokens, use_cache=False)
            _, beam_s, _ = timed_generate(backend, model, src, new_tokens, num_beams=4)
            reference.setdefault(batch, cached_ids)
            agree = (uncached_ids == cached_ids).all() and (cached_ids == reference[batch]).all()
            window = min(16, len(steps) // 2)
            flat = np.mean(steps[-window:]) / np.mean(steps[:window])
            tokens = new_tokens * batch
            rows.append((batch, backend, tokens / cached_s, tokens / uncached_s, tokens / beam_s,
                         uncached_s / cached_s, flat, agree, compile_note))
    print()
    print(f"{'batch':>5} {'backend':<7} {'cached tok/s':>13} {'uncached tok/s':>15} {'beam-4 tok/s':>13} "
          f"{'cached/uncached':>16} {'last16/first16':>15}  ids")
    for batch, backend, cached, uncached, beam, speedup, flat, agree, note in rows:
        print(f"{batch:>5} {backend:<7} {cached:>13.1f} {uncached:>15.1f} {beam:>13.1f} {speedup:>15.1f}x "
              f"{flat:>14.2f}x  {'same' if agree else 'DIFFER'}{note}")
    print("\ntargets: cached >= 5x uncached at 64 tokens (torch, JAX); last 16 tokens <= 1.3x the first 16")


if __name__ == "__main__":
    main()
