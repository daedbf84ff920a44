"""How the error against the float64 oracle grows with size: `python benchmarks/tolerance_law.py`.

Measures, for every target (numpy and torch at float32, torch at float64, float16 and bfloat16,
and JAX at float32 with `--jax`), the suite's error measure

    e = max over tensors and elements of |actual - oracle| / scale,  scale = max(1, max |oracle|)

(the quantity `atol` bounds, `conformance.check.compare`) against the float64 NumPy oracle (torch
at float64 too: the table's float64 row must hold at full size), on
three one-factor sweeps around a base point (post-LN "paper" preset, vocab 1000, B 1, full-length
rows, both stacks of the same depth):

    d_model  32 .. 1024   at length 32, depth 2
    length    8 .. 1024   at d_model 64, depth 2
    depth     1 .. 6      at d_model 64, length 32

Every point runs seeded weights (scale 1) and the trained-like kinds of the realistic strategies
(`conformance.suite.strategies.Trained`: row offsets of 300, outlier dimensions of 1000 with
LayerNorm gains of 4), two seeds each. The third kind, query/key gains of 8 ("sharp"), is
measured and tabulated in its own columns but not fitted (see `SHARP`). Half precision runs the
seeded weights only: the table makes no claim for it on trained-scale numbers
(`realistic_in_domain`).

The law fitted per dtype is a power law, an upper envelope in log-log space:

    e(D, L, N) <= c * D^a * L^b * N^g

(least-squares exponents over every measured point's worst error, then `c` raised until the law
covers every point). `conformance.check.tolerances.SIZE_LAWS` holds the result, and
`scaled_tolerance` multiplies it by a safety factor. The script prints a Markdown table for
docs/tolerances.md, the fitted law, the margin the suite's tolerance keeps at every point, and
writes the plot `docs/tolerance_law.png`.

    python benchmarks/tolerance_law.py --jax                          # post-LN, the published run (~3.5 min)
    python benchmarks/tolerance_law.py --placement pre --seeds 1      # pre-LN with final norms
    python benchmarks/tolerance_law.py --quick                        # three points per sweep, one seed
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from conformance.check import backends
from conformance.check.backends import Target
from conformance.core.presets import preset
from conformance.suite import runner
from conformance.suite.measure import fit_law, normalised_error
from conformance.suite.strategies import Case, Trained

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(d_model=64, length=32, depth=2)
SWEEPS = {
    "d_model": (32, 64, 128, 256, 512, 1024),
    "length": (8, 32, 128, 512, 1024),
    "depth": (1, 2, 4, 6),
}
VOCAB = 1000
# The kinds the law is fitted on: their error is what the arithmetic costs.
KINDS = {
    "seeded": None,
    "offset": Trained(offset=300.0, qk_gain=1 / 300.0, v_gain=1 / 300.0),
    "outliers": Trained(outliers=(3,), outlier_size=1000.0, ln_gain=4.0),
}
# Measured and tabulated, not fitted: query/key gains of 8 in every layer make every attention row
# nearly one-hot, and a float32 rounding of a logit then moves a whole row's weights; the error
# measures how ill-conditioned that computation is (it grows with length and depth whatever the
# backend), not how a backend does its arithmetic. The realistic strategies keep it to small
# sizes for that reason (long and full-size cases draw the other kinds).
SHARP = Trained(qk_gain=8.0)
HALF = ("float16", "bfloat16")


def points(sweeps: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    """The base point and every sweep point, each once."""
    seen, out = set(), []
    for name, values in sweeps.items():
        for value in values:
            point = {**BASE, name: value}
            key = tuple(point.values())
            if key not in seen:
                seen.add(key)
                out.append(point)
    return out


PLACEMENT = {"placement": "post"}  # set by --placement: "post" (the paper's, default) or "pre"


def case_at(point: dict[str, int], seed: int, trained: Trained | None) -> Case:
    d, length, depth = point["d_model"], point["length"], point["depth"]
    pre = PLACEMENT["placement"] == "pre"
    config = preset("paper", norm_placement=PLACEMENT["placement"], final_encoder_norm=pre, final_decoder_norm=pre,
                    d_model=d, n_heads=max(1, d // 64) if d >= 64 else 2, d_ff=4 * d,
                    n_encoder_layers=depth, n_decoder_layers=depth, max_len=length,
                    src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)
    rng = np.random.default_rng([seed, length])
    ids = rng.integers(1, VOCAB, size=(2, 1, length))  # pad_id 0 never drawn: full-length rows
    return Case(config=config, seed=seed, scale=1.0, src_ids=ids[0], tgt_ids=ids[1], trained=trained)


def measure(targets: list[Target], sweeps, seeds) -> list[dict]:
    rows = []
    for point in points(sweeps):
        started = time.perf_counter()
        worst = {}
        for kind, trained in [*KINDS.items(), ("sharp", SHARP)]:
            for seed in seeds:
                case = case_at(point, seed, trained)
                expected = runner.oracle(case)
                for target in targets:
                    if target.dtype in HALF and trained is not None:
                        continue
                    got = runner.run(target, case)
                    e = max(normalised_error(got[n], v) for n, v in expected.items())
                    key = f"{target.label} {kind}"
                    worst[key] = max(worst.get(key, 0.0), e)
        runner.clear_oracle_cache()
        rows.append({**point, **worst})
        print(f"  {point}: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
              + f"  ({time.perf_counter() - started:.1f} s)", flush=True)
    return rows


def envelope(rows: list[dict], dtype: str, kind: str) -> list[float]:
    """Per row, the worst error of any target at `dtype` on weights of `kind` (0 if none ran)."""
    return [max([v for k, v in r.items() if k.endswith(f"/{dtype} {kind}")], default=0.0) for r in rows]


def series(targets: list[Target]) -> list[tuple[str, str]]:
    """(dtype, kind) pairs measured: float32 on every kind, half on seeded weights."""
    dtypes = sorted({t.dtype for t in targets}, key=["float64", "float32", "float16", "bfloat16"].index)
    return [(d, k) for d in dtypes for k in ([*KINDS, "sharp"] if d not in HALF else ["seeded"])]


def plot(rows: list[dict], pairs: list[tuple[str, str]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from conformance.check.tolerances import scaled_tolerance

    colors = {"float64": "C3", "float32": "C0", "float16": "C1", "bfloat16": "C2"}
    markers = {"seeded": "o", "offset": "s", "outliers": "^", "sharp": "x"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 5), sharey=True)
    for ax, name in zip(axes, SWEEPS):
        others = {k: v for k, v in BASE.items() if k != name}
        sweep = sorted((r for r in rows if all(r[k] == v for k, v in others.items())), key=lambda r: r[name])
        xs = [r[name] for r in sweep]
        for dtype, kind in pairs:
            style = "--" if kind == "sharp" else "-"
            ax.plot(xs, np.maximum(envelope(sweep, dtype, kind), 1e-17), style, marker=markers[kind],
                    color=colors[dtype], label=f"{dtype} {kind}" + (" (not fitted)" if kind == "sharp" else ""))
        for dtype in sorted({d for d, _ in pairs}):
            sizes = [{**BASE, name: x} for x in xs]
            ax.plot(xs, [scaled_tolerance(dtype, s["d_model"], s["length"], s["depth"]).atol for s in sizes],
                    ":", color=colors[dtype], linewidth=2.5, alpha=0.7, label=f"{dtype} tolerance")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(name + "  (" + ", ".join(f"{k} {v}" for k, v in others.items()) + ")")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("worst max |backend - oracle| / scale")
    axes[2].legend(fontsize=7, loc="center right")
    fig.suptitle(f"{PLACEMENT['placement']}-LN: error against the float64 oracle by size (worst over the float32 "
                 "backends measured; torch at float64 and half precision); dotted: the suite's tolerance, "
                 "conformance.check.tolerances.scaled_tolerance", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three points per sweep, one seed")
    parser.add_argument("--jax", action="store_true", help="also JAX at float32 (one compile per point)")
    parser.add_argument("--plot", default=str(ROOT / "docs" / "tolerance_law.png"))
    parser.add_argument("--placement", choices=["post", "pre"], default="post",
                        help="LayerNorm placement of the measured models (pre: with final norms)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per size and kind of weights")
    parser.add_argument("--save", help="write the measured rows to this JSON file")
    parser.add_argument("--load", help="fit, tabulate and plot rows saved by --save instead of measuring")
    args = parser.parse_args(argv)
    sweeps = {k: (v[0], BASE[k], v[-1]) if args.quick else v for k, v in SWEEPS.items()}
    seeds = (0,) if args.quick else tuple(range(args.seeds))
    PLACEMENT["placement"] = args.placement
    targets = [Target("numpy", "cpu", "float32"), Target("torch", "cpu", "float32"), Target("torch", "cpu", "float64"),
               Target("torch", "cpu", "float16"), Target("torch", "cpu", "bfloat16")]
    if args.jax:
        targets.append(Target("jax", "cpu", "float32"))
    if args.load:
        rows = json.loads(Path(args.load).read_text())
    else:
        versions = {t.backend: backends.version(t.backend) for t in targets}
        print(f"targets {[t.label for t in targets]}; {versions}; kinds {list(KINDS)} + sharp; seeds {seeds}")
        started = time.perf_counter()
        rows = measure(targets, sweeps, seeds)
        print(f"measured {len(rows)} points in {time.perf_counter() - started:.0f} s\n")
    if args.save:
        Path(args.save).write_text(json.dumps(rows, indent=1))
    labels = sorted({k.rsplit(" ", 1)[0] for r in rows for k in r if " " in k})
    pairs = [(d, k) for d, k in series(targets) if any(l.endswith("/" + d) for l in labels)]

    print("Worst error per target over seeded, offset and outlier weights (half: seeded only), and on sharp weights:\n")
    f32 = [l for l in labels if l.endswith("float32")]
    columns = labels + [f"{l} sharp" for l in f32]
    print("| d_model | length | depth | " + " | ".join(columns) + " |")
    print("| ---: | ---: | ---: | " + " | ".join("---:" for _ in columns) + " |")
    for r in rows:
        cells = [max(r.get(f"{l} {k}", 0.0) for k in KINDS) for l in labels] + [r[c] for c in columns[len(labels):]]
        print(f"| {r['d_model']} | {r['length']} | {r['depth']} | " + " | ".join(f"{v:.1e}" for v in cells) + " |")

    print("\nFitted upper-envelope laws  e <= c * D^a * L^b * N^g  (worst over the dtype's targets):\n")
    print("| dtype | weights | c | a (d_model) | b (length) | g (depth) |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for dtype, kind in pairs:
        c, a, b, g = fit_law(rows, envelope(rows, dtype, kind))
        print(f"| {dtype} | {kind}{' (not used)' if kind == 'sharp' else ''} | {c:.2e} | {a:.2f} | {b:.2f} | {g:.2f} |")

    from conformance.check.tolerances import scaled_tolerance

    print("\nSmallest margin of the suite's tolerance (scaled_tolerance atol / measured worst):")
    for dtype, kind in pairs:
        if kind == "sharp":
            continue
        errors = envelope(rows, dtype, kind)
        margins = [(scaled_tolerance(dtype, r["d_model"], r["length"], r["depth"]).atol / max(e, 1e-300), r)
                   for r, e in zip(rows, errors)]
        m, r = min(margins, key=lambda x: x[0])
        print(f"  {dtype:<9} {kind:<9} {m:7.1f}x  at d_model {r['d_model']}, length {r['length']}, depth {r['depth']}")
    plot(rows, pairs, Path(args.plot))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
