"""What TorchDynamo's import costs an eager `rosetta generate --backend torch`, side by side.

    python benchmarks/bench_torch_cli_startup.py              # 3 rounds
    python benchmarks/bench_torch_cli_startup.py --rounds 5

Until issue 56, `impl_torch.model` marked its input checks with `torch.compiler.disable`, which
imported TorchDynamo when impl_torch was imported, so every torch `rosetta` call paid for it. The
checks are now marked lazily (`impl_torch.compiling.eager_under_compile`), and an eager run never
loads it (tests/runtimes/test_torch_lazy_dynamo.py). This script times the same command both ways
in fresh processes, interleaved round by round so that the machine's load falls on both alike:

    now:     python -m conformance.cli generate --src "3 1 4 1 5" --backend torch
    before:  the same command in a process that imports torch._dynamo first (what the old import
             of impl_torch did)

Each run's wall clock includes the interpreter's start and every import; it prints each run, the
median of each, the ratio before / now per round and of the medians, and the load average before
and after (a shared machine's other work moves these numbers more than anything measured here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["generate", "--src", "3 1 4 1 5", "--backend", "torch"]
NOW = [sys.executable, "-m", "conformance.cli", *COMMAND]
BEFORE = [sys.executable, "-c", "import sys, torch._dynamo; from conformance.cli import main; "
          f"sys.exit(main({COMMAND!r}))"]


def timed(argv: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of one fresh process; its failure stops the benchmark."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv!r} failed ({done.returncode}):\n{done.stderr}")
    return seconds, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs")
    print(f"now:    {' '.join(NOW[1:])}\nbefore: the same, torch._dynamo imported first")
    timed(NOW)  # warm the file cache once, unmeasured
    now, before = [], []
    for round_ in range(args.rounds):
        # alternate which goes first, so that neither always follows the other
        order = [("now", NOW), ("before", BEFORE)] if round_ % 2 == 0 else [("before", BEFORE), ("now", NOW)]
        seen = {}
        for name, argv in order:
            seen[name] = timed(argv)
        if seen["now"][1] != seen["before"][1]:
            raise SystemExit(f"the two commands printed different ids: {seen['now'][1]!r} and {seen['before'][1]!r}")
        now.append(seen["now"][0])
        before.append(seen["before"][0])
        print(f"round {round_ + 1}: now {now[-1]:.2f} s, before {before[-1]:.2f} s, "
              f"before / now {before[-1] / now[-1]:.2f}x")
    print(f"median: now {statistics.median(now):.2f} s, before {statistics.median(before):.2f} s, "
          f"before / now {statistics.median(before) / statistics.median(now):.2f}x "
          f"(per round {min(b / n for b, n in zip(before, now)):.2f}-{max(b / n for b, n in zip(before, now)):.2f}x)")
    print(f"load average after: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
