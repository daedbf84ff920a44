"""The statistics the realistic strategies borrow from a trained model: `python benchmarks/realistic_stats.py`.

Runs the built-in default model (trained on the reverse-digits task, `conformance.check.toy`)
in the float64 oracle on held-out task inputs and prints, as Markdown rows for docs/tolerances.md:

- LayerNorm gain and bias ranges;
- token-embedding row norms (after the sqrt(d_model) scale when the config applies it);
- per row of every residual-stream tensor: |mean| / std, and the largest |value| over the
  median |value| (how far the biggest feature stands out);
- per feature of the residual stream: the largest |mean over tokens| against the typical one;
- attention: the largest logit gap within a row, log(w_max / w_min) over unmasked keys, which
  is a lower bound on the range of the pre-softmax logits.
"""

from __future__ import annotations

import math

import numpy as np

from conformance.check.defaults import default_model
from conformance.check import toy


def main(rows: int = 64) -> None:
    import impl_numpy

    config, params, description = default_model()
    src = toy.held_out(size=rows)
    _, tgt, _ = toy.batch(np.random.default_rng(12345), rows)
    model = impl_numpy.Model(config, params)
    result = model(src, tgt, return_attention=True)
    out = {**result.intermediates}
    print(f"model: {description}; {config.summary()}; {rows} held-out rows\n")
    print("| statistic | value |\n| --- | --- |")
    gains = np.concatenate([v for k, v in params.items() if k.endswith("norm.weight")])
    biases = np.concatenate([v for k, v in params.items() if k.endswith("norm.bias")])
    print(f"| LayerNorm gain min / median / max | {gains.min():.3f} / {np.median(gains):.3f} / {gains.max():.3f} |")
    print(f"| LayerNorm bias min / max | {biases.min():.3f} / {biases.max():.3f} |")
    emb = next(v for k, v in params.items() if k.endswith("embedding.weight"))
    factor = math.sqrt(config.d_model) if config.scale_embedding else 1.0
    norms = np.linalg.norm(emb * factor, axis=1)
    print(f"| embedding row norm min / max (x{factor:.1f}) | {norms.min():.2f} / {norms.max():.2f} |")
    print(f"| embedding entry std; per-feature |mean over vocab| max | {emb.std():.3f}; {np.abs(emb.mean(0)).max():.3f} |")
    worst_ratio, worst_peak, worst_feature = 0.0, 0.0, 0.0
    for name, x in out.items():
        if x.ndim != 3 or x.shape[-1] != config.d_model:
            continue
        std = x.std(-1)
        ratio = np.abs(x.mean(-1)) / std
        peak = np.abs(x).max(-1) / np.median(np.abs(x), -1)
        feature = np.abs(x.reshape(-1, x.shape[-1]).mean(0))
        worst_ratio = max(worst_ratio, ratio.max())
        worst_peak = max(worst_peak, peak.max())
        worst_feature = max(worst_feature, feature.max() / np.median(feature))
        print(f"| `{name}`: row |mean|/std max; row max|x|/median|x| max; max |x| | "
              f"{ratio.max():.3f}; {peak.max():.1f}; {np.abs(x).max():.2f} |")
    print(f"| residual stream, all tensors: row |mean|/std max | {worst_ratio:.3f} |")
    print(f"| residual stream, all tensors: row peak/median max | {worst_peak:.1f} |")
    print(f"| residual stream: largest per-feature |mean| / median per-feature |mean| | {worst_feature:.1f} |")
    gap, underflowed = 0.0, 0
    for name, w in result.attention.items():
        with np.errstate(divide="ignore", invalid="ignore"):
            positive = np.where(w > 0, w, np.nan)
            row_gap = np.log(np.nanmax(positive, -1)) - np.log(np.nanmin(positive, -1))
            underflowed = max(underflowed, int(((w == 0) & (positive != positive)).sum()))
        gap = max(gap, float(np.nanmax(row_gap)))
    print(f"| attention: largest log(w_max / w_min) in a row (logit range lower bound) | {gap:.1f} |")
    print(f"| attention weights that underflow to exactly 0 in float64 (masked keys included) | {underflowed} |")


if __name__ == "__main__":
    main()
