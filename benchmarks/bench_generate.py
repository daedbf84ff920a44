"""Decoding speed against transformers' `generate`, and the KV cache against the plain loop.

    python benchmarks/bench_generate.py                    # base size, batch 8, 64 new tokens, CPU
    python benchmarks/bench_generate.py --quick            # a small config (a smoke run)
    python benchmarks/bench_generate.py --contenders hf,torch,jax --repeats 3
    python benchmarks/bench_generate.py --cache            # cached vs uncached, batch 1, 128 new tokens
    python benchmarks/bench_generate.py --device cuda      # torch and transformers on CUDA, JAX on its GPU

The same weights everywhere: a random `MarianMTModel` (transformers) of the base size (d_model
512, 8 heads, d_ff 2048, 6+6 layers, vocab 32000, float32) is read into this project's config and
parameters by `conformance.convert.from_hf_marian` (the hf-marian layout), and every backend is
built from those. The sources (length 32, no padding) and the settings are the same for every
contender; the end token is banned, so no row stops early and every contender does the same work
(HF: `bad_words_ids=[[eos]]`, `max_length` = new tokens + 1, since it counts the start token).

Speed: greedy and beam 4, after two untimed calls of each (impl_torch records its CUDA graphs on
the second call of a shape), each contender timed in turn within every repeat (interleaved, so load
on the shared machine affects all alike), the median of the repeats reported with its ratio to
transformers' time. JAX is compiled first (one call per setting), its compile time printed apart.
The ids are compared with transformers' (float32: a near-tie could flip one; reported, not hidden).

Cache (`--cache`): greedy at batch 1 for 128 new tokens, `use_cache=True` against
`use_cache=False` (the whole decoder over the whole prefix per token), per backend, interleaved.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from conformance.check.compare import to_numpy

BASE = dict(vocab_size=32000, d_model=512, heads=8, d_ff=2048, layers=6, max_position_embeddings=512)
QUICK = dict(vocab_size=1000, d_model=64, heads=4, d_ff=128, layers=2, max_position_embeddings=256)
PAD, BOS, EOS = 0, 0, 1  # Marian's: the decoder starts from the pad id


def marian(sizes: dict, device: str):
    """A random float32 MarianMTModel of `sizes` (transformers' own initialisation, seed 0)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    config = MarianConfig(vocab_size=sizes["vocab_size"], d_model=sizes["d_model"],
                          encoder_layers=sizes["layers"], decoder_layers=sizes["layers"],
                          encoder_attention_heads=sizes["heads"], decoder_attention_heads=sizes["heads"],
                          encoder_ffn_dim=sizes["d_ff"], decoder_ffn_dim=sizes["d_ff"],
                          max_position_embeddings=sizes["max_position_embeddings"], pad_token_id=PAD,
                          eos_token_id=EOS, decoder_start_token_id=BOS, forced_eos_token_id=None)
    model = MarianMTModel(config).eval().to(device)
    model.generation_config.bad_words_ids = None
    model.generation_config.forced_eos_token_id = None
    return model


def hf_generate(model, src, new_tokens: int, num_beams: int):
    import torch

    with torch.inference_mode():
        ids = model.generate(input_ids=src, attention_mask=torch.ones_like(src), max_length=new_tokens + 1,
                             min_length=0, num_beams=num_beams, do_sample=False, bad_words_ids=[[EOS]],
                             length_penalty=1.0, early_stopping=False, num_return_sequences=1)
    return ids[:, 1:]


def build(backend: str, config, params, device: str):
    if backend == "numpy":
        import impl_numpy

        return impl_numpy.Model(config, params, "float32")
    if backend == "torch":
        import impl_torch

        return impl_torch.Model(config, params, "float32", device=device)
    import impl_jax

    return impl_jax.Model(config, params, "float32", device="gpu" if device == "cuda" else device)


def timed(function):
    """(result as a host array, seconds), waiting for the device to finish."""
    started = time.perf_counter()
    result = to_numpy(function())  # a host copy: torch's and JAX's queues drained
    return result, time.perf_counter() - started


def machine(device: str) -> str:
    import torch

    line = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
            f"{os.getloadavg()[0]:.2f} (shared: numbers move with the load); torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if device == "cuda":
        line += f"; device {torch.cuda.get_device_name()}"
    return line


def speed(args, sizes, hf_model, config, params) -> None:
    import torch

    chosen = [c for c in args.contenders.split(",") if c]
    rng = np.random.default_rng(0)
    src = rng.integers(2, sizes["vocab_size"], size=(args.batch, args.src_len))
    src_torch = torch.as_tensor(src, device=args.device)
    models = {c: build(c, config, params, args.device) for c in chosen if c != "hf"}
    settings = [("greedy", 1), ("beam 4", 4)]

    def run(contender: str, num_beams: int):
        if contender == "hf":
            return lambda: hf_generate(hf_model, src_torch, args.new_tokens, num_beams)
        return lambda: models[contender].generate(src, args.new_tokens, BOS, EOS, num_beams=num_beams,
                                                  banned_ids=[EOS])

    if "jax" in models:
        import impl_jax

        impl_jax.reset_stats()
        started = time.perf_counter()
        for _, beams in settings:
            timed(run("jax", beams))
        stats = impl_jax.compile_stats()
        print(f"JAX compile (apart): {stats['compiles']} executables, "
              f"{stats['trace_seconds'] + stats['compile_seconds']:.1f} s of {time.perf_counter() - started:.1f} s "
              "(the first call of each setting)")
    # Two untimed calls of each contender and setting first: impl_torch on CUDA records its CUDA
    # graphs on the second call of a shape (impl_torch/graphs.py), and every contender's first call
    # pays for allocation and kernel selection.
    for _ in range(2):
        for _, beams in settings:
            for contender in chosen:
                timed(run(contender, beams))
    times = {(c, name): [] for c in chosen for name, _ in settings}
    ids = {}
    for _ in range(args.repeats):
        for name, beams in settings:
            for contender in chosen:
                ids[contender, name], seconds = timed(run(contender, beams))
                times[contender, name].append(seconds)
    tokens = args.batch * args.new_tokens
    print(f"\nbatch {args.batch}, source {args.src_len}, {args.new_tokens} new tokens, float32, {args.device}; "
          f"median of {args.repeats} interleaved repeats")
    print(f"{'setting':<8} {'contender':<10} {'seconds':>8} {'tok/s':>8} {'x transformers':>15}  ids vs transformers")
    for name, _ in settings:
        reference = times.get(("hf", name))
        for contender in chosen:
            seconds = statistics.median(times[contender, name])
            ratio = f"{seconds / statistics.median(reference):.2f}x" if reference else "-"
            if "hf" in chosen and contender != "hf":
                same = ids[contender, name].shape == ids["hf", name].shape and (
                    ids[contender, name] == ids["hf", name]).all()
                agree = "same" if same else f"DIFFER ({(ids[contender, name] != ids['hf', name]).any(1).sum()} rows)"
            else:
                agree = ""
            print(f"{name:<8} {contender:<10} {seconds:>8.3f} {tokens / seconds:>8.1f} {ratio:>15}  {agree}")
    print("\ntargets (issue 29, CPU): impl_torch greedy and beam 4 <= 1.0x transformers; impl_jax after compile <= 1.0x")


def cache(args, sizes, config, params) -> None:
    chosen = [c for c in args.contenders.split(",") if c and c != "hf"]
    rng = np.random.default_rng(1)
    src = rng.integers(2, sizes["vocab_size"], size=(1, args.src_len))
    new_tokens = args.cache_tokens
    models = {}
    for contender in chosen:
        models[contender] = build(contender, config, params, args.device)
        if contender == "jax":  # the uncached JAX loop compiles per prefix length without buckets
            import impl_jax

            models[contender, "uncached"] = impl_jax.Model(config, params, "float32", buckets=(32, 64, 128))
    for contender in chosen:  # warm-up: JAX compiles, torch allocates (and records its CUDA graphs on a second call)
        for _ in range(2):
            models[contender].generate(src, new_tokens, BOS, EOS, banned_ids=[EOS])
        models.get((contender, "uncached"), models[contender]).generate(src, new_tokens, BOS, EOS,
                                                                       banned_ids=[EOS], use_cache=False)
    times = {(c, mode): [] for c in chosen for mode in ("cached", "uncached")}
    for _ in range(args.repeats):
        for contender in chosen:
            for mode in ("cached", "uncached"):
                model = models.get((contender, mode), models[contender])
                _, seconds = timed(lambda: model.generate(src, new_tokens, BOS, EOS, banned_ids=[EOS],
                                                          use_cache=mode == "cached"))
                times[contender, mode].append(seconds)
    print(f"\ncache: batch 1, source {args.src_len}, {new_tokens} new tokens, greedy, float32, {args.device}; "
          f"median of {args.repeats} interleaved repeats")
    print(f"{'backend':<8} {'cached s':>9} {'uncached s':>11} {'uncached/cached':>16}")
    for contender in chosen:
        cached_s = statistics.median(times[contender, "cached"])
        uncached_s = statistics.median(times[contender, "uncached"])
        print(f"{contender:<8} {cached_s:>9.3f} {uncached_s:>11.3f} {uncached_s / cached_s:>15.1f}x")
    print("\ntarget (issue 29): cached >= 5x faster than uncached at batch 1 for 128 new tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small config")
    parser.add_argument("--contenders", default="hf,torch,jax", help="of hf, torch, jax, numpy (default hf,torch,jax)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cpu (default) or cuda")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--src-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", action="store_true", help="cached against uncached instead (batch 1)")
    parser.add_argument("--cache-tokens", type=int, default=128)
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); "
                         "run on a machine with a GPU, or leave --device out for the CPU")
    from conformance.convert import from_hf_marian

    sizes = QUICK if args.quick else BASE
    hf_model = marian(sizes, args.device)
    config, params = from_hf_marian(hf_model.cpu())
    hf_model.to(args.device)
    print(f"config: d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, "
          f"{config.n_encoder_layers}+{config.n_decoder_layers} layers, vocab {config.tgt_vocab_size} "
          "(a random MarianMTModel, read by from_hf_marian)")
    print(machine(args.device))
    if args.cache:
        cache(args, sizes, config, params)
    else:
        speed(args, sizes, hf_model, config, params)


if __name__ == "__main__":
    main()
