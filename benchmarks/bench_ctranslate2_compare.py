"""`rosetta compare CT2_DIR FOLDER` on a tiny T5: CTranslate2 on its default thread count against
the one thread `conformance.check.ctranslate2.model.intra_threads` gives a small model.

    python benchmarks/bench_ctranslate2_compare.py            # 3 rounds, arms interleaved
    python benchmarks/bench_ctranslate2_compare.py --rounds 5

Builds a random 2+2-layer T5 (d_model 16, vocabulary 32; no end token drawn, so every search runs
to the model's max_len, 512) with transformers, saves it with `save_pretrained`, converts it to a
CTranslate2 directory (`rosetta convert ... --to ctranslate2`), then runs `rosetta compare CT2_DIR
FOLDER` in a fresh process per run, the two arms alternating:

    default   CTranslate2's own intra-op thread count (`intra_threads=0`: 4 OpenMP threads), as
              every compare ran before
    chosen    `intra_threads(config, device)`: one thread for a model below 2M parameters

Each run prints its wall time, its CPU time (user + system, from the child's rusage: what a loaded
machine does not inflate the way it inflates the wall time), the load average at its start, and
its call counts (Translators made, score_batch and translate_batch calls, the oracle's cached decoder
steps). The summary gives each arm's medians and their ratio, chosen / default.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The child: one `rosetta compare`, with the thread count of its arm and a count of the calls.
CHILD = r"""
import io, contextlib, json, sys
import ctranslate2
import conformance.check.ctranslate2.compare as compare
import impl_numpy.decode as decode
counts = {"Translator": 0, "score_batch": 0, "translate_batch": 0, "oracle decoder steps": 0, "intra_threads": []}
if sys.argv[1] == "default":
    compare.intra_threads = lambda config, device: 0
Made = ctranslate2.Translator
class Counted:
    def __init__(self, *args, **kwargs):
        counts["Translator"] += 1
        counts["intra_threads"].append(kwargs.get("intra_threads"))
        self.made = Made(*args, **kwargs)
    def score_batch(self, *args, **kwargs):
        counts["score_batch"] += 1
        return self.made.score_batch(*args, **kwargs)
    def translate_batch(self, *args, **kwargs):
        counts["translate_batch"] += 1
        return self.made.translate_batch(*args, **kwargs)
ctranslate2.Translator = Counted
advance = decode.advance
def counted_advance(*args, **kwargs):
    counts["oracle decoder steps"] += 1
    return advance(*args, **kwargs)
decode.advance = counted_advance
from conformance.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    status = main(["compare", sys.argv[2], sys.argv[3]])
print(json.dumps({"status": status, "counts": counts, "verdict": out.getvalue().strip().splitlines()[-1]}))
"""


def build(folder: Path) -> tuple[Path, Path]:
    """(the save_pretrained folder, its CTranslate2 directory)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32, d_model=16, d_kv=8, num_heads=2, d_ff=32, num_layers=2,
                                   relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in model.parameters():  # no trivial LayerNorm: every weight drawn
            p.copy_(torch.randn(p.shape, generator=generator) / (p.shape[-1] ** 0.5 if p.ndim > 1 else 5))
    model.save_pretrained(folder / "t5")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rosetta = [sys.executable, "-m", "conformance.cli"]
    subprocess.run([*rosetta, "convert", str(folder / "t5"), str(folder / "t5.safetensors")], check=True, env=env,
                   capture_output=True)
    subprocess.run([*rosetta, "convert", str(folder / "t5.safetensors"), str(folder / "t5-ct2"), "--to",
                    "ctranslate2"], check=True, env=env, capture_output=True)
    return folder / "t5", folder / "t5-ct2"


def run(arm: str, ct2_dir: Path, folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the arm decides, not the shell
    env["PYTHONPATH"] = str(ROOT)
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, arm, str(ct2_dir), str(folder)], env=env,
                          capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"arm": arm, "wall": wall, "cpu": cpu, "load": load, **json.loads(done.stdout.strip().splitlines()[-1])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ct2-compare-") as scratch:
        folder, ct2_dir = build(Path(scratch))
        results = []
        for round_ in range(args.rounds):
            for arm in ("default", "chosen"):
                result = run(arm, ct2_dir, folder)
                results.append(result)
                print(f"round {round_} {arm:<8} wall {result['wall']:6.2f} s  cpu {result['cpu']:5.2f} s  "
                      f"load {result['load']:5.2f}  exit {result['status']}  {result['counts']}", flush=True)
    print()
    medians = {}
    for arm in ("default", "chosen"):
        mine = [r for r in results if r["arm"] == arm]
        medians[arm] = (statistics.median(r["wall"] for r in mine), statistics.median(r["cpu"] for r in mine))
        print(f"{arm:<8} median wall {medians[arm][0]:6.2f} s, median cpu {medians[arm][1]:5.2f} s "
              f"(verdict: {mine[0]['verdict']})")
    print(f"chosen / default: wall {medians['chosen'][0] / medians['default'][0]:.3f}, "
          f"cpu {medians['chosen'][1] / medians['default'][1]:.3f}")


if __name__ == "__main__":
    main()
