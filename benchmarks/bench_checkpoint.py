"""How fast a checkpoint loads: `conformance.checkpoint.load` against a plain read of the same
file and against the safetensors library's own `load_file`, interleaved in one run.

    python benchmarks/bench_checkpoint.py              # the base config at vocab 32000 (~373 MB float32)
    python benchmarks/bench_checkpoint.py --quick      # a ~40 MB file
    python benchmarks/bench_checkpoint.py --file CKPT  # an existing checkpoint

`load` does more than either: it validates the header before reading data, verifies the sha256
digest of header and data, and checks every value is finite. The digest is computed while the
data is read (one worker thread, hashlib releases the GIL), so its cost hides behind the read;
the finiteness check is two allocation-free reductions per tensor. The ratios say what that
costs against a plain read of the bytes. Median and minimum over interleaved rounds, because
this machine is shared: compare ratios, not absolute rates, between runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conformance import checkpoint, preset  # noqa: E402
from conformance.core.params import param_shapes  # noqa: E402


def make_checkpoint(path: Path, quick: bool) -> None:
    sizes = dict(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=2, n_decoder_layers=2) if quick else \
        dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6)
    config = preset("paper", src_vocab_size=32000, tgt_vocab_size=32000, max_len=512,
                    share_embeddings=False, tie_output=False, **sizes)
    rng = np.random.default_rng(0)
    params = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in param_shapes(config).items()}
    checkpoint.save(path, config, params)


def plain_read(path: Path) -> None:
    with open(path, "rb") as f:
        f.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small (~40 MB) file")
    parser.add_argument("--file", type=Path, help="measure this checkpoint instead of making one")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as tmp:
        path = args.file or Path(tmp) / "model.safetensors"
        if not args.file:
            make_checkpoint(path, args.quick)
        size = os.path.getsize(path)
        contenders = {"plain read": plain_read, "safetensors load_file": load_file, "checkpoint.load": checkpoint.load}
        times: dict[str, list[float]] = {name: [] for name in contenders}
        for _ in range(args.rounds):
            for name, run in contenders.items():
                started = time.perf_counter()
                run(path)
                times[name].append(time.perf_counter() - started)
        print(f"file: {size / 1e6:.0f} MB; {args.rounds} interleaved rounds; load average {os.getloadavg()[0]:.2f}")
        print(f"{'contender':<24}{'median GB/s':>12}{'best GB/s':>11}{'median / plain read':>21}")
        plain = statistics.median(times["plain read"])
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:<24}{size / median / 1e9:>12.2f}{size / min(seconds) / 1e9:>11.2f}{median / plain:>20.2f}x")


if __name__ == "__main__":
    main()
