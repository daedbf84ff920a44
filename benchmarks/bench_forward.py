"""Forward-pass speed of impl_torch against torch.nn.Transformer with the same weights.

    python benchmarks/bench_forward.py            # the base config of the paper, CPU, float32
    python benchmarks/bench_forward.py --quick    # a small config and few repeats (a smoke run)
    python benchmarks/bench_forward.py --threads 2 --no-jax          # issue 44's CPU run
    python benchmarks/bench_forward.py --device cuda --no-jax        # on a GPU, TF32 off

The base config (d_model 512, 8 heads, d_ff 2048, 6+6 layers, vocab 32000) runs a batch of 8
source and target sequences of length 64 in inference (`torch.inference_mode()`). Contenders:

    impl_torch fast       model(src, tgt, return_attention=False): fused SDPA attention
    impl_torch explicit   model(src, tgt): attention weights formed and returned
    nn.Transformer        PyTorch's own encoder-decoder, loaded with the same weights and wrapped
                          with the same embeddings, positions and output projection, masks as in
                          PyTorch's translation tutorial (key padding masks plus a causal mask)
    nn.Transformer compiled   the same module under `torch.compile` (default mode); on CUDA also
                          `mode="max-autotune"` and `mode="reduce-overhead"` (CUDA graphs), each
                          its own compile of its own copy
    impl_torch compiled   impl_torch fast after `model.compile()` (nn.Module's in-place torch.compile)

Each compiled contender's first call (its compile) is timed and printed apart, before the rounds.
`--device cuda` runs the torch contenders on the GPU (matmuls at full float32: TF32 off).

With JAX installed, impl_jax joins (fast and explicit), and its compile time (the first call of a
new shape) is printed for the benchmarked config and, in a full run, for the small `--quick`
config too.

Before timing, every contender's logits are checked against impl_torch's explicit path, so the
comparison is between equal computations. Calls are interleaved (each round runs every
contender once, in a rotating order) so that load from other processes hits all of them alike;
the report gives median times, the median of the per-round ratios to nn.Transformer, and the
achieved GFLOP/s (FLOPs of the matmuls counted analytically) next to a plain matmul's GFLOP/s
measured in the same run.

Another backend joins by appending one more `Contender` (a name and a zero-argument callable
that runs one forward pass to completion and returns the logits) in `contenders()`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

import impl_torch
from conformance import init_params, preset
from conformance.check.compare import to_numpy
from conformance.core.config import ModelConfig
from conformance.core.positions import sinusoid_table

BASELINE = "nn.Transformer"


@dataclass
class Contender:
    """One implementation under test. `run()` computes one forward pass to completion (an
    asynchronous backend must block until its result is ready) and returns the logits."""

    name: str
    run: Callable[[], Any]


# -- The workload ------------------------------------------------------------------------------


def workload(quick: bool) -> tuple[ModelConfig, int, int, int]:
    """(config, batch, source length, target length)."""
    if quick:
        sizes = dict(d_model=128, n_heads=4, d_ff=512, n_encoder_layers=2, n_decoder_layers=2,
                     src_vocab_size=1000, tgt_vocab_size=1000, max_len=32)
        return preset("torch-nn-transformer", **sizes), 4, 32, 32
    sizes = dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6,
                 src_vocab_size=32000, tgt_vocab_size=32000, max_len=64)
    return preset("torch-nn-transformer", **sizes), 8, 64, 64


def forward_flops(config: ModelConfig, batch: int, src_len: int, tgt_len: int) -> int:
    """Floating-point operations of the forward pass's matrix products (2 per multiply-add).

    Elementwise work (softmax, LayerNorm, activations, residuals) is left out: it is a few
    percent here and implementations differ in how they fuse it.
    """
    d, f, v = config.d_model, config.d_ff, config.tgt_vocab_size
    s, t = batch * src_len, batch * tgt_len  # rows of the flattened (B*L, D) activations
    encoder_layer = 2 * (4 * s * d * d)  # q, k, v, o projections
    encoder_layer += 2 * (2 * s * src_len * d)  # Q K^T and weights V, all heads together
    encoder_layer += 2 * (2 * s * d * f)  # two FFN matrices
    decoder_layer = 2 * (4 * t * d * d) + 2 * (2 * t * tgt_len * d)  # masked self-attention
    decoder_layer += 2 * (2 * t * d * d + 2 * s * d * d) + 2 * (2 * t * src_len * d)  # cross
    decoder_layer += 2 * (2 * t * d * f)
    output = 2 * t * d * v
    return config.n_encoder_layers * encoder_layer + config.n_decoder_layers * decoder_layer + output


# -- torch.nn.Transformer with the same weights --------------------------------------------------


class TorchTransformer(torch.nn.Module):
    """torch.nn.Transformer wrapped as in PyTorch's translation tutorial, with our weights.

    Our matrices are stored (d_in, d_out); PyTorch's Linear stores (d_out, d_in), and its
    attention packs q, k, v into one `in_proj_weight` (3D, D). Those are the only transforms.
    """

    def __init__(self, config: ModelConfig, params: dict[str, np.ndarray]):
        super().__init__()
        self.config = config
        self.transformer = torch.nn.Transformer(
            d_model=config.d_model, nhead=config.n_heads, num_encoder_layers=config.n_encoder_layers,
            num_decoder_layers=config.n_decoder_layers, dim_feedforward=config.d_ff, dropout=0.0,
            activation=config.activation, layer_norm_eps=config.layer_norm_eps, batch_first=True,
            norm_first=config.norm_placement == "pre",
        )
        t = lambda name: torch.from_numpy(np.asarray(params[name], dtype=np.float32))  # noqa: E731
        self.src_embedding = torch.nn.Embedding.from_pretrained(t("encoder.embedding.weight"))
        self.tgt_embedding = torch.nn.Embedding.from_pretrained(t("decoder.embedding.weight"))
        table = torch.from_numpy(sinusoid_table(config.max_len, config.d_model, config.position)).float()
        self.register_buffer("positions", table, persistent=False)
        self.generator = torch.nn.Linear(config.d_model, config.tgt_vocab_size)
        with torch.no_grad():
            self.generator.weight.copy_(t("output.weight").T)
            self.generator.bias.copy_(t("output.bias"))
            for i, layer in enumerate(self.transformer.encoder.layers):
                p = f"encoder.layers.{i}"
                self._attention(layer.self_attn, t, f"{p}.self_attn")
                self._norm(layer.norm1, t, f"{p}.self_attn_norm")
                self._ffn(layer, t, f"{p}.ffn")
                self._norm(layer.norm2, t, f"{p}.ffn_norm")
            for i, layer in enumerate(self.transformer.decoder.layers):
                p = f"decoder.layers.{i}"
                self._attention(layer.self_attn, t, f"{p}.self_attn")
                self._norm(layer.norm1, t, f"{p}.self_attn_norm")
                self._attention(layer.multihead_attn, t, f"{p}.cross_attn")
                self._norm(layer.norm2, t, f"{p}.cross_attn_norm")
                self._ffn(layer, t, f"{p}.ffn")
                self._norm(layer.norm3, t, f"{p}.ffn_norm")
            self._norm(self.transformer.encoder.norm, t, "encoder.norm")
            self._norm(self.transformer.decoder.norm, t, "decoder.norm")
        self.eval()

    @staticmethod
    def _attention(mha, t, prefix):
        mha.in_proj_weight.copy_(torch.cat([t(f"{prefix}.{p}_proj.weight").T for p in "qkv"]))  # (3D, D)
        mha.in_proj_bias.copy_(torch.cat([t(f"{prefix}.{p}_proj.bias") for p in "qkv"]))
        mha.out_proj.weight.copy_(t(f"{prefix}.o_proj.weight").T)
        mha.out_proj.bias.copy_(t(f"{prefix}.o_proj.bias"))

    @staticmethod
    def _norm(norm, t, prefix):
        norm.weight.copy_(t(f"{prefix}.weight"))
        norm.bias.copy_(t(f"{prefix}.bias"))

    @staticmethod
    def _ffn(layer, t, prefix):
        layer.linear1.weight.copy_(t(f"{prefix}.linear1.weight").T)
        layer.linear1.bias.copy_(t(f"{prefix}.linear1.bias"))
        layer.linear2.weight.copy_(t(f"{prefix}.linear2.weight").T)
        layer.linear2.bias.copy_(t(f"{prefix}.linear2.bias"))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        scale = math.sqrt(self.config.d_model)
        x = self.src_embedding(src) * scale + self.positions[: src.shape[1]]
        y = self.tgt_embedding(tgt) * scale + self.positions[: tgt.shape[1]]
        # PyTorch's convention: True = may NOT attend.
        src_padding = src == self.config.pad_id
        tgt_padding = tgt == self.config.pad_id
        causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device).triu(1)
        y = self.transformer(x, y, tgt_mask=causal, src_key_padding_mask=src_padding,
                             tgt_key_padding_mask=tgt_padding, memory_key_padding_mask=src_padding)
        return self.generator(y)


# -- Contenders --------------------------------------------------------------------------------


def jax_compile_report(label: str, model, src: np.ndarray, tgt: np.ndarray) -> None:
    """Print impl_jax's compile time of this shape (its first calls), per return_attention setting."""
    from bench_jax import compile_times

    for setting, seconds in compile_times(model, src, tgt).items():
        print(f"impl_jax compile, {label} config (batch {src.shape[0]}, lengths {src.shape[1]}/{tgt.shape[1]}), "
              f"{setting}: first call {seconds['first call']:.2f} s (trace+lower {seconds['trace+lower']:.2f} s, "
              f"XLA {seconds['xla compile']:.2f} s)")


COMPILE_MODES = {"cpu": (None,), "cuda": (None, "max-autotune", "reduce-overhead")}


def compiled_name(mode: str | None) -> str:
    return f"{BASELINE} compiled" + (f" {mode}" if mode else "")


def contenders(config: ModelConfig, params: dict[str, np.ndarray], src: np.ndarray, tgt: np.ndarray,
               quick: bool, device: str = "cpu", jax: bool = True) -> list[Contender]:
    ours = impl_torch.Model(config, params, dtype=torch.float32, device=device)
    theirs = TorchTransformer(config, params).to(device)
    src_t, tgt_t = torch.from_numpy(src).to(device), torch.from_numpy(tgt).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def finished(function):  # one call run to completion on the device
        def run():
            with torch.inference_mode():
                out = function()
            sync()
            return out
        return run

    entries = [Contender("impl_torch fast", finished(lambda: ours(src_t, tgt_t, return_attention=False).logits)),
               Contender("impl_torch explicit", finished(lambda: ours(src_t, tgt_t).logits)),
               Contender(BASELINE, finished(lambda: theirs(src_t, tgt_t)))]
    for mode in COMPILE_MODES[device]:
        copy = TorchTransformer(config, params).to(device)
        entries.append(first_call(Contender(compiled_name(mode), finished(
            (lambda m: lambda: m(src_t, tgt_t))(torch.compile(copy, mode=mode))))))
    mine = impl_torch.Model(config, params, dtype=torch.float32, device=device)
    mine.compile()
    entries.append(first_call(Contender("impl_torch compiled", finished(
        lambda: mine(src_t, tgt_t, return_attention=False).logits))))
    if not jax:
        return entries
    try:
        import impl_jax
        from bench_jax import jax_contenders
    except ImportError as exc:  # JAX not installed: the torch comparison still stands
        print(f"impl_jax skipped: {exc}")
        return entries
    model = impl_jax.Model(config, params, dtype="float32")
    jax_compile_report("small" if quick else "base", model, src, tgt)
    if not quick:  # the compile time of a small config too, from a model of its own (a cold compile)
        small, batch, src_len, tgt_len = workload(quick=True)
        rng = np.random.default_rng(1)
        jax_compile_report("small", impl_jax.Model(small, init_params(small, seed=0, dtype=np.float32), dtype="float32"),
                           rng.integers(2, small.src_vocab_size, size=(batch, src_len)),
                           rng.integers(2, small.tgt_vocab_size, size=(batch, tgt_len)))
    entries += [Contender(name, run) for name, run in jax_contenders(config, params, src, tgt, model=model)]
    return entries


def first_call(entry: Contender) -> Contender:
    """`entry` after its first call (a compile), whose wall time is printed apart."""
    started = time.perf_counter()
    entry.run()
    print(f"{entry.name}: first call (compile) {time.perf_counter() - started:.1f} s", flush=True)
    return entry


def check_agreement(entries: list[Contender], reference: str = "impl_torch explicit") -> dict[str, float]:
    """Largest |logits - reference logits| / max(1, max |reference|) per contender; exits if > 1e-4."""
    results = {entry.name: to_numpy(entry.run()) for entry in entries}
    expected = results[reference]
    scale = max(1.0, float(np.abs(expected).max()))
    errors = {name: float(np.abs(got - expected).max()) / scale for name, got in results.items()}
    bad = {name: e for name, e in errors.items() if not e <= 1e-4}
    if bad:
        sys.exit(f"logits disagree with {reference!r} (scaled max error): {bad}; timings would compare different computations")
    return errors


# -- Timing ------------------------------------------------------------------------------------


def matmul_gflops(m: int, k: int, n: int, repeats: int, device: str = "cpu") -> float:
    """Median GFLOP/s of one float32 (m, k) @ (k, n) product on this device, right now."""
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / statistics.median(times) / 1e9


def interleaved(entries: list[Contender], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call, per contender; round r runs the contenders rotated by r places."""
    for _ in range(warmup):
        for entry in entries:
            entry.run()
    times: dict[str, list[float]] = {entry.name: [] for entry in entries}
    for r in range(rounds):
        order = entries[r % len(entries):] + entries[: r % len(entries)]
        for entry in order:
            start = time.perf_counter()
            entry.run()
            times[entry.name].append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config and few repeats")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15, or 5 with --quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--no-jax", action="store_true", help="leave impl_jax out (and its compiles)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    # nn.Transformer's encoder packs padded batches into (prototype) nested tensors and says so.
    warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors")
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (5 if args.quick else 15)

    config, batch, src_len, tgt_len = workload(args.quick)
    params = init_params(config, seed=0, dtype=np.float32)
    rng = np.random.default_rng(0)
    # Full-length sequences of real tokens (ids >= 2 are never padding for pad_id 0 or 1), so
    # every implementation does the same work; padding masks are built and applied regardless.
    src = rng.integers(2, config.src_vocab_size, size=(batch, src_len))
    tgt = rng.integers(2, config.tgt_vocab_size, size=(batch, tgt_len))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f}; float32, "
          f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}, inference_mode")
    print(f"config: {config.summary()}; batch {batch}, source length {src_len}, target length {tgt_len}")
    flops = forward_flops(config, batch, src_len, tgt_len)
    print(f"forward pass: {flops / 1e9:.2f} GFLOP in matrix products (counted analytically)")

    with impl_torch.full_precision():
        entries = contenders(config, params, src, tgt, args.quick, args.device, jax=not args.no_jax)
        errors = check_agreement(entries)
        print("logits vs impl_torch explicit (max abs error / max |logit|): "
              + ", ".join(f"{name} {error:.1e}" for name, error in errors.items()))
        rows, d = batch * tgt_len, config.d_model
        before = matmul_gflops(rows, d, config.d_ff, repeats=20, device=args.device)
        times = interleaved(entries, rounds=rounds, warmup=1 if args.quick else 2)
        after = matmul_gflops(rows, d, config.d_ff, repeats=20, device=args.device)

    base = times[BASELINE]
    compiled = times.get(compiled_name(None), base)
    print(f"\n{rounds} interleaved rounds (load average now {os.getloadavg()[0]:.2f}):")
    # The median of per-round ratios is the headline; the ratio of the fastest calls is shown too
    # because on a shared machine a busy spell can still land unevenly within a round.
    print(f"  {'contender':<34}{'median ms':>11}{'min ms':>9}{'median ratio':>14}{'min ratio':>11}"
          f"{'x compiled':>12}{'GFLOP/s':>9}")
    for name, seconds in times.items():
        ratio = statistics.median(s / b for s, b in zip(seconds, base))
        to_compiled = statistics.median(s / b for s, b in zip(seconds, compiled))
        median = statistics.median(seconds)
        print(f"  {name:<34}{median * 1e3:>11.1f}{min(seconds) * 1e3:>9.1f}{ratio:>13.3f}x"
              f"{min(seconds) / min(base):>10.3f}x{to_compiled:>11.3f}x{flops / median / 1e9:>9.1f}")
    print(f"  (ratios are to {BASELINE}, medians of per-round ratios; 'x compiled' to {compiled_name(None)}; "
          "GFLOP/s from the median time)")
    print(f"  plain matmul ({rows}x{d}) @ ({d}x{config.d_ff}), float32: {before:.1f} GFLOP/s before, {after:.1f} after the rounds"
          f" (load average now {os.getloadavg()[0]:.2f})")
    peak = max(before, after)
    for name, seconds in times.items():
        print(f"  {name:<34}reaches {flops / statistics.median(seconds) / 1e9 / peak:.0%} of the plain matmul rate")


if __name__ == "__main__":
    main()
