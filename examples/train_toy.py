"""Train the built-in default model: a small Transformer that reverses strings of digits.

    python examples/train_toy.py                      # writes ./toy.safetensors
    python examples/train_toy.py --out /tmp/toy.safetensors --steps 500
    python examples/train_toy.py --out conformance/check/data/default.safetensors --force   # replace the shipped model
    python examples/train_toy.py --backend jax --dtype float64 --steps 50   # any backend, the paper's recipe

PyTorch with this project's own `impl_torch` model, teacher forcing, label smoothing, Adam with
the paper's warmup-then-inverse-square-root schedule (section 5.3), seeded, a few minutes on two
CPU cores. Held-out accuracy is measured with greedy decoding (`model.generate`) on sources drawn
from a seed training never uses; the script stops once it is reached and refuses to write a
model that misses the bar. It never overwrites a file unless given `--force` (the shipped built-in
model, conformance/check/data/default.safetensors, included), and says so before training. A line
of progress every `PROGRESS_EVERY` steps, the held-out check every `EVALUATE_EVERY`.

Threads: a model this small runs fastest on one intra-op thread (see conformance/cli/threads.py:
on a busy 2-core machine, two threads made 50 training steps 8x slower), so that is what it uses,
unless OMP_NUM_THREADS or MKL_NUM_THREADS says otherwise.

With `--backend numpy|torch|jax` the same task trains in that backend through the project's own
training API, the same in all three: `model.loss_and_grads` (the loss of docs/training.md) and
`impl_X.Adam` (the paper's Adam and schedule, no gradient clipping), on the same seeded batches
from the same seeded weights, so that runs in different backends can be compared step by step
(in float64 they stay within 1e-9 of each other over 50 steps: tests/training/test_train_toy.py).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

import impl_torch
from conformance import init_params, preset
from conformance.check import toy
from conformance.check.defaults import DEFAULT_CHECKPOINT
from conformance.cli.threads import fit_torch_threads

DEFAULT_OUT = Path("toy.safetensors")  # in the current directory: the shipped model is replaced only on request
PROGRESS_EVERY = 25  # steps between lines of progress
EVALUATE_EVERY = 250  # steps between held-out checks (a greedy decode of 500 sources)


def toy_config():
    """The paper's switches (post-LN, shared and tied embeddings), at a size that trains in minutes."""
    return preset(
        "paper",
        src_vocab_size=toy.VOCAB_SIZE, tgt_vocab_size=toy.VOCAB_SIZE, d_model=64, n_heads=4, d_ff=128,
        n_encoder_layers=2, n_decoder_layers=2, max_len=toy.MAX_DIGITS + 1, pad_id=toy.PAD,
        notes={"task": toy.TASK, "vocab": " ".join(toy.TOKENS), "bos_id": str(toy.BOS), "eos_id": str(toy.EOS),
               "trained_by": "examples/train_toy.py"},
    )


def evaluate(model, src: np.ndarray) -> float:
    model.eval()
    with torch.inference_mode():
        generated = model.generate(src, max_len=toy.MAX_DIGITS + 1, bos_id=toy.BOS, eos_id=toy.EOS)
    model.train()
    return toy.exact_match(generated.cpu().numpy(), src)


def fixed_width(src, tgt_in, labels):
    """Pad a batch with <pad> to the longest possible row: one shape for every step, so JAX
    compiles the training step once (padding is masked and its labels are not counted)."""
    pad = lambda x, width: np.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=toy.PAD)  # noqa: E731
    return pad(src, toy.MAX_DIGITS), pad(tgt_in, toy.MAX_DIGITS + 1), pad(labels, toy.MAX_DIGITS + 1)


def train_in(backend: str, steps: int, *, batch: int = 64, dtype: str = "float64", warmup: int = 400,
             label_smoothing: float = 0.1, seed: int = 0, log=print):
    """Train the toy for `steps` steps in `backend` with `loss_and_grads` and the backend's `Adam`;
    returns the model and the losses. Batches come from `np.random.default_rng(seed)`, weights
    from `init_params(config, seed=seed)`: the same in every backend."""
    import contextlib
    import importlib

    package = importlib.import_module(f"impl_{backend}")
    if backend == "torch":
        fit_torch_threads(toy_config())
    scope = package.enable_x64() if backend == "jax" and dtype == "float64" else contextlib.nullcontext()
    rng = np.random.default_rng(seed)
    config = toy_config()
    losses = []
    with scope:
        model = package.Model(config, init_params(config, seed=seed), dtype)
        optimizer = package.Adam(model, config.d_model, warmup=warmup)
        started = time.perf_counter()
        for step in range(1, steps + 1):
            src, tgt_in, labels = fixed_width(*toy.batch(rng, batch))
            loss = package.train_step(model, optimizer, src, tgt_in, labels, label_smoothing=label_smoothing)
            losses.append(float(np.asarray(loss.detach() if hasattr(loss, "detach") else loss)))
            if step % 10 == 0 or step == steps:
                log(f"{backend}/{dtype} step {step:5d}  loss {losses[-1]:.10f}  ({time.perf_counter() - started:.1f} s)")
    return model, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help=f"the checkpoint to write (default: {DEFAULT_OUT}, in the current directory)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite --out if it exists (needed to replace the shipped model, "
                             f"{DEFAULT_CHECKPOINT})")
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=400)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--target-accuracy", type=float, default=0.99)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["numpy", "torch", "jax"],
                        help="train through loss_and_grads and impl_X.Adam in this backend (writes --out only if given)")
    parser.add_argument("--dtype", default="float64", help="with --backend: the dtype to train in (default float64)")
    args = parser.parse_args(argv)
    writes = not args.backend or args.out is not None  # --backend writes only an --out given
    args.out = args.out if args.out is not None else DEFAULT_OUT
    if writes and args.out.exists() and not args.force:
        shipped = args.out.resolve() == DEFAULT_CHECKPOINT.resolve()
        parser.error(f"{args.out} exists{' (the shipped built-in model)' if shipped else ''}; "
                     "pass --force to overwrite it, or name another file with --out")
    if args.backend:
        model, _ = train_in(args.backend, args.steps, batch=args.batch, dtype=args.dtype, warmup=args.warmup,
                            label_smoothing=args.label_smoothing, seed=args.seed)
        if writes:
            import importlib

            importlib.import_module(f"impl_{args.backend}").save(model, args.out)
            print(f"wrote {args.out}")
        return 0

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    config = toy_config()
    fit_torch_threads(config)
    print(f"training the toy model with impl_torch on {torch.get_num_threads()} intra-op thread(s): up to "
          f"{args.steps} steps, loss every {PROGRESS_EVERY}, held-out exact match every {EVALUATE_EVERY} (stops at "
          f"{args.target_accuracy}); writes {args.out}", flush=True)
    model = impl_torch.Model(config, init_params(config, seed=args.seed, dtype=np.float32))
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    # lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)   (section 5.3), times 2 for a small model
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 2 * config.d_model**-0.5 * min((step + 1) ** -0.5, (step + 1) * args.warmup**-1.5))
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=toy.PAD, label_smoothing=args.label_smoothing)
    held_out = toy.held_out()
    started = time.perf_counter()
    accuracy = 0.0
    for step in range(1, args.steps + 1):
        src, tgt_in, labels = toy.batch(rng, args.batch)
        out = model(torch.from_numpy(src), torch.from_numpy(tgt_in), return_attention=False)
        loss = loss_fn(out.logits.reshape(-1, config.tgt_vocab_size), torch.from_numpy(labels).reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % EVALUATE_EVERY == 0 or step == args.steps:
            accuracy = evaluate(model, held_out)
            print(f"step {step:5d}  loss {loss.item():.4f}  held-out exact match {accuracy:.3f}  "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
            if accuracy >= args.target_accuracy:
                break
        elif step % PROGRESS_EVERY == 0:
            print(f"step {step:5d}  loss {loss.item():.4f}  ({time.perf_counter() - started:.0f} s)", flush=True)
    if accuracy < 0.95:
        print(f"held-out accuracy {accuracy:.3f} is below 0.95; not writing {args.out}")
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    impl_torch.save(model, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.2f} MB), held-out exact match {accuracy:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
