"""impl_jax's host work per call: the model flattened on every call against its kept record.

    python benchmarks/bench_jax_host.py             # 6+6 layers at d_model 32: the host's part dominates
    python benchmarks/bench_jax_host.py --base      # the base config (d_model 512, vocab 32000)
    python benchmarks/bench_jax_host.py --rounds 6 --calls 40

Each compiled call hands the model to jit; `impl_jax.flat` keeps its flattening between calls and
checks that nothing it read has changed (issue 28: on a GPU the host prepares a call while the
device waits). One process, the two settings (`impl_jax.flat.KEEP` off, on) alternating for
`--rounds` rounds, each the median of `--calls` calls waited for (`block_until_ready`): a forward
(`model(src, tgt, return_attention=False)`, two executables), a greedy `generate` of 8 tokens (a
cached decoding step per token) and a fused training step (`impl_jax.train_step` with
`impl_jax.Adam`). The 6+6-layer default has the base model's structure (the same modules and
variables to flatten) at a width where the device work is small, which is the host's share of a
GPU call; the ratio is per round, with its range.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import impl_jax  # noqa: E402
from conformance import init_params, preset  # noqa: E402


def main() -> None:
    flat = impl_jax.flat  # loaded with the backend (impl_jax.compiled uses it)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", action="store_true", help="the base config instead of the narrow one")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    sizes = dict(d_model=512, n_heads=8, d_ff=2048, src_vocab_size=32000, tgt_vocab_size=32000) if args.base else \
        dict(d_model=32, n_heads=4, d_ff=64, src_vocab_size=1000, tgt_vocab_size=1000)
    config = preset("flax-wmt", n_encoder_layers=6, n_decoder_layers=6, max_len=256, **sizes)
    model = impl_jax.Model(config, init_params(config, seed=0, dtype=np.float32), dtype="float32")
    optimizer = impl_jax.Adam(model, config.d_model)
    rng = np.random.default_rng(0)
    batch, length = (8, 64) if args.base else (2, 8)
    src = rng.integers(3, config.src_vocab_size, size=(batch, length)).astype(np.int32)
    tgt = rng.integers(3, config.tgt_vocab_size, size=(batch, length)).astype(np.int32)
    src[0, length // 2:] = config.pad_id  # a padded row: the masks take part
    tgt[0, length // 2:] = config.pad_id
    labels = np.roll(tgt, -1, axis=1)
    entries = {
        "forward": lambda: jax.block_until_ready(model(src, tgt, return_attention=False).logits),
        "generate (8 tokens)": lambda: np.asarray(model.generate(src, max_len=9, bos_id=2, eos_id=config.tgt_vocab_size - 1)),
        "training step": lambda: jax.block_until_ready(impl_jax.train_step(model, optimizer, src, tgt, labels)),
    }
    for run in entries.values():  # compiles, and records the model
        run(), run()
    times: dict[str, dict[bool, list[float]]] = {name: {False: [], True: []} for name in entries}
    for _ in range(args.rounds):
        for keep in (False, True):
            flat.KEEP = keep
            for name, run in entries.items():
                each = []
                for _ in range(args.calls):
                    start = time.perf_counter()
                    run()
                    each.append(time.perf_counter() - start)
                times[name][keep].append(statistics.median(each))
    flat.KEEP = True
    print(f"impl_jax, d_model {config.d_model}, 6+6 layers, batch {batch}, lengths {length}, float32, "
          f"on {jax.devices()[0]}; medians of {args.calls} calls, {args.rounds} rounds")
    print(f"{'':<22}{'flattened every call':>22}{'kept record':>14}{'ratio (range)':>24}")
    for name, by in times.items():
        ratios = [on / off for off, on in zip(by[False], by[True])]
        print(f"{name:<22}{statistics.median(by[False]) * 1e3:>19.2f} ms{statistics.median(by[True]) * 1e3:>11.2f} ms"
              f"{statistics.median(ratios):>11.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
