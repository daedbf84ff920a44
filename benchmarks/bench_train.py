"""Training-step speed: impl_torch, impl_jax and impl_numpy against a plain torch.nn.Transformer.

    python benchmarks/bench_train.py            # the base config of the paper, CPU, float32
    python benchmarks/bench_train.py --quick    # a small config and few repeats (a smoke run)

One training step = forward, the loss of docs/training.md (cross-entropy, ignore_index = pad_id,
label smoothing 0.1), backward, and the paper's Adam with its schedule. Base config (d_model 512,
8 heads, d_ff 2048, 6+6 layers, vocab 32000), batch 8, source and target length 64, padded rows.

    impl_torch            impl_torch.train_step(model, impl_torch.Adam(...), ...)
    impl_jax              impl_jax.train_step(...): compiled; the compile is excluded and reported
    impl_numpy float32    impl_numpy.train_step(...): the hand-written backward pass and Adam
    nn.Transformer        PyTorch's own encoder-decoder with the same weights (benchmarks/bench_forward.py),
                          F.cross_entropy, torch.optim.Adam + LambdaLR: the baseline

Calls are interleaved (each round runs every contender once, in a rotating order) so that load
from other processes hits all alike; the report gives each median time and the median of the
per-round ratios to nn.Transformer, against the targets of issue 13: impl_torch <= 1.0x,
impl_jax <= 1.1x, NumPy float32 <= 3x.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import TorchTransformer, workload  # noqa: E402

import impl_numpy  # noqa: E402
import impl_torch  # noqa: E402
from conformance import init_params  # noqa: E402
from conformance.core.training import paper_lrate  # noqa: E402

BASELINE = "nn.Transformer"
TARGETS = {"impl_torch": 1.0, "impl_jax": 1.1, "impl_numpy float32": 3.0}
EPSILON = 0.1


def batch_of(config, batch: int, src_len: int, tgt_len: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    src = rng.integers(2, config.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(2, config.tgt_vocab_size, size=(batch, tgt_len + 1))
    for row in range(batch):  # padded rows: a quarter to all of the length is real
        src[row, rng.integers(src_len // 4, src_len + 1):] = config.pad_id
        tgt[row, rng.integers(tgt_len // 4, tgt_len + 2):] = config.pad_id
    labels = np.where(tgt[:, 1:] == config.pad_id, config.pad_id, tgt[:, 1:])
    return src, tgt[:, :-1].copy(), labels


def contenders(config, params, src, tgt, labels):
    entries = {}

    model = impl_torch.Model(config, params, "float32")
    optimizer = impl_torch.Adam(model, config.d_model)
    entries["impl_torch"] = lambda: float(impl_torch.train_step(model, optimizer, src, tgt, labels,
                                                                label_smoothing=EPSILON))

    baseline = TorchTransformer(config, params).float()
    base_opt = torch.optim.Adam(baseline.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    schedule = torch.optim.lr_scheduler.LambdaLR(base_opt, lambda e: paper_lrate(e + 1, config.d_model))
    src_t, tgt_t, labels_t = (torch.from_numpy(x) for x in (src, tgt, labels))

    def plain_step():
        logits = baseline(src_t, tgt_t)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels_t.reshape(-1),
                               ignore_index=config.pad_id, label_smoothing=EPSILON)
        base_opt.zero_grad(set_to_none=True)
        loss.backward()
        base_opt.step()
        schedule.step()
        return float(loss.detach())

    entries[BASELINE] = plain_step

    skipped = {}
    try:
        import impl_jax

        jmodel = impl_jax.Model(config, params, "float32")
        jopt = impl_jax.Adam(jmodel, config.d_model)
        stats = impl_jax.compile_stats()
        started = time.perf_counter()
        impl_jax.train_step(jmodel, jopt, src, tgt, labels, label_smoothing=EPSILON)  # compiles
        first = time.perf_counter() - started
        after = impl_jax.compile_stats()
        print(f"impl_jax compile (first step, excluded): {first:.1f} s wall, {after['compiles'] - stats['compiles']} "
              f"executables, {after['compile_seconds'] - stats['compile_seconds']:.1f} s XLA")

        def jax_step():
            loss = impl_jax.train_step(jmodel, jopt, src, tgt, labels, label_smoothing=EPSILON)
            return float(loss)  # blocks until the step is done

        entries["impl_jax"] = jax_step
    except ImportError as exc:
        skipped["impl_jax"] = f"not importable: {exc}"

    if hasattr(impl_numpy.Model, "loss_and_grads"):
        nmodel = impl_numpy.Model(config, params, "float32")
        nopt = impl_numpy.Adam(nmodel, config.d_model)
        entries["impl_numpy float32"] = lambda: float(impl_numpy.train_step(nmodel, nopt, src, tgt, labels,
                                                                            label_smoothing=EPSILON))
    else:
        skipped["impl_numpy float32"] = "impl_numpy has no loss_and_grads yet (issue-13a)"
    return entries, skipped


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small config and few rounds")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    config, batch, src_len, tgt_len = workload(args.quick)
    rounds = args.rounds or (3 if args.quick else 7)
    params = init_params(config, seed=0, dtype=np.float32)
    src, tgt, labels = batch_of(config, batch, src_len, tgt_len)
    print(f"config d_model={config.d_model} layers={config.n_encoder_layers}+{config.n_decoder_layers} "
          f"vocab={config.tgt_vocab_size}; batch {batch}, lengths {src_len}/{tgt_len}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    entries, skipped = contenders(config, params, src, tgt, labels)
    for name, run in entries.items():  # warm-up (allocator, first-call paths)
        run()
    times = {name: [] for name in entries}
    names = list(entries)
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            started = time.perf_counter()
            entries[name]()
            times[name].append(time.perf_counter() - started)
    print(f"{'contender':<22}{'median step':>14}{'ratio to ' + BASELINE:>26}{'target':>10}")
    for name in names:
        ratios = [t / b for t, b in zip(times[name], times[BASELINE])]
        ratio = statistics.median(ratios)
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"<= {target:.1f}x " + ("met" if ratio <= target else "MISSED"))
        print(f"{name:<22}{statistics.median(times[name]) * 1e3:>11.1f} ms{ratio:>25.2f}x{verdict:>16}")
    for name, reason in skipped.items():
        print(f"{name:<22} skipped: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
