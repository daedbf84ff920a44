"""`rosetta run CHECKPOINT --backend B --src IDS --tgt IDS --out FILE.npz`: one forward pass, saved."""

from __future__ import annotations

import argparse
import io

import numpy as np

HELP = ("Run a checkpoint on one backend for given source and target ids and write the logits, attention "
        "weights (and optionally intermediates) to an .npz file.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a rosetta checkpoint")
    parser.add_argument("--backend", required=True, choices=["numpy", "torch", "jax"])
    parser.add_argument("--src", required=True, metavar="IDS", help="source ids: a .npy int array (B, S) or rows like 1,2,3;4,5,6")
    parser.add_argument("--tgt", required=True, metavar="IDS", help="decoder input ids: a .npy int array (B, T) or rows like 1,2;3,4")
    parser.add_argument("--out", required=True, metavar="FILE.npz", help="where to write logits, attention/*, src, tgt, config")
    parser.add_argument("--dtype", choices=["float64", "float32", "float16", "bfloat16"], help="default: the checkpoint's dtype")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "gpu"], help="cuda (torch) or gpu (jax); default cpu")
    parser.add_argument("--intermediates", action="store_true", help="also write intermediates/* (each sublayer's output)")


def _npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """The .npz file's bytes, built in memory: written only once everything has been computed."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def run(args: argparse.Namespace) -> int:
    from conformance.check import backends
    from conformance.core import checkpoint
    from conformance.cli.common import check_device, check_output, named_by_flags, parse_ids, write_outputs
    from conformance.core.errors import InputError

    # Everything that can be refused is refused before the model runs, and what needs no
    # framework before one is imported (seconds).
    out_path = check_output(args.out, "--out", (".npz",))
    config, params = checkpoint.load(args.checkpoint)
    src, tgt = parse_ids(args.src, "--src", config.pad_id), parse_ids(args.tgt, "--tgt", config.pad_id)
    try:
        backends.import_backend(args.backend)
    except ImportError as exc:
        raise InputError("--backend", f"the {args.backend} backend is not importable here: {exc}") from None
    check_device(args.backend, args.device)
    dtype = args.dtype or next(iter(params.values())).dtype.name
    target = backends.Target(args.backend, args.device, dtype)
    with backends.full_precision(args.backend), backends.dtype_scope(target), named_by_flags():
        model = backends.build(target, config, params)
        out = model(src, tgt)
        attention = out.attention or {}
        arrays = {"logits": _host(out.logits, dtype), "src": src, "tgt": tgt, "config": np.array(config.to_json())}
        arrays |= {f"attention/{name}": _host(value, dtype) for name, value in attention.items()}
        if args.intermediates:
            arrays |= {f"intermediates/{name}": _host(value, dtype) for name, value in out.intermediates.items()}
    write_outputs({"--out": (out_path, _npz_bytes(arrays))})
    logits = arrays["logits"]
    nan = int(np.isnan(logits.astype(np.float64)).sum())
    print(f"{args.backend}/{args.device}/{dtype}: logits {logits.shape}, {len(attention)} attention maps"
          + (f", {nan} NaN logits" if nan else "") + f"; wrote {out_path}")
    return 0


def _host(value, dtype: str) -> np.ndarray:
    """A backend array on the host in the dtype it was computed in. `to_numpy` widens floats to
    float64; narrowing back is exact. bfloat16 is written as float32 (also exact), because .npz
    has no bfloat16 type that every reader understands."""
    from conformance.check.compare import to_numpy

    array = to_numpy(value)
    if array.dtype.kind == "f":
        array = array.astype(np.float32 if dtype == "bfloat16" else np.dtype(dtype))
    return array
