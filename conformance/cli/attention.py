"""`rosetta attention CHECKPOINT --src ... --out attn.png`: every layer's and head's attention."""

from __future__ import annotations

import argparse

HELP = "Draw every layer's and head's attention weights as labelled heatmaps (PNG)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.check import toy
    from conformance.cli.common import add_backend_argument

    parser.add_argument("checkpoint", nargs="?", help="a rosetta checkpoint (default: the built-in default model)")
    parser.add_argument("--src", required=True, help="source: a features source's log-mel .npy (B, n_mels, frames), "
                        "or digits for the toy model (trained on "
                        f"{toy.MIN_DIGITS}-{toy.MAX_DIGITS} digits), or IDS ('5,6,7' or a .npy file)")
    parser.add_argument("--tgt", help="decoder input IDS; default: the start id followed by the model's own output, "
                        "decoded as `rosetta generate` does with the checkpoint's recorded settings, up to its end id "
                        "(for a checkpoint that records its special ids, and the built-in toy model)")
    parser.add_argument("--out", required=True, help="the PNG file to write (its name must end in .png)")
    parser.add_argument("--row", type=int, default=0, help="which batch row to draw (default 0)")
    add_backend_argument(parser)


def run(args: argparse.Namespace) -> int:
    import io
    import sys

    import numpy as np

    from conformance.check import backends, toy
    from conformance.cli.common import (check_output, labels, load_model, named_by_flags, parse_ids, parse_source,
                                        source_form, write_outputs)
    from conformance.check.compare import to_numpy
    from conformance.check.plots import plot_attention
    from conformance.cli.generate import decoding
    from conformance.core.errors import InputError

    out_path = check_output(args.out, "--out", (".png",))
    if args.row < 0:
        raise InputError("--row", f"must be a batch row index >= 0, got {args.row}")
    config, model = load_model(args.checkpoint, args.backend)
    if backends.kind(args.backend) == "torch":  # torch and torch-compiled
        from conformance.cli.threads import fit_torch_threads

        fit_torch_threads(config)
    src = parse_source(config, args.src)
    form = source_form(config, args.src, src)
    if form:
        print(f"rosetta attention: {form}", file=sys.stderr)
    if config.notes.get("task") == toy.TASK and toy.range_warning(src):
        print(f"rosetta attention: warning: {toy.range_warning(src)}", file=sys.stderr)
    if args.row >= src.shape[0]:
        raise InputError("--row", f"row {args.row} does not exist: --src has {src.shape[0]} row(s), numbered from 0")
    settings = None if args.tgt else decoding(config)
    if args.tgt:
        tgt = parse_ids(args.tgt, "--tgt")
    elif settings is not None:
        # One place is left for the start token in front of what it generates.
        settings["max_len"] = max(1, min(settings["max_len"], config.max_len - 1))
        with named_by_flags():
            out = to_numpy(model.generate(src, **settings)).astype(np.int64)
        # The decoder's queries are what it read: the start token and the tokens it generated. The
        # end token it wrote last was never fed back, so its row would show a prediction nobody made.
        ended = np.flatnonzero(out[args.row] == settings["eos_id"])
        out = out[:, : ended[0] if ended.size else out.shape[1]]
        tgt = np.concatenate([np.full((src.shape[0], 1), settings["bos_id"]), out], axis=1)[:, : config.max_len]
    else:
        raise InputError("--tgt", "is required for a checkpoint that records no special ids (no generation settings, "
                         "not the built-in toy model): the decoder input ids to draw attention for")
    with named_by_flags():
        output = model(src, tgt)
    attention = {name: to_numpy(w) for name, w in output.attention.items()}
    row = args.row
    picture = io.BytesIO()
    # A features source's encoder positions are labelled by the frame each is centred on (f0, f2, ...).
    src_labels = (labels(config, src[row]) if config.source == "ids"
                  else [f"f{2 * s}" for s in range(src.shape[2] // 2)])
    size = plot_attention(attention, src_labels, labels(config, tgt[row]), picture,
                          title=f"{args.checkpoint or 'built-in default'} ({args.backend})", row=row)
    write_outputs({"--out": (out_path, picture.getvalue())})
    print(f"wrote {out_path} ({size[0]}x{size[1]} px, {len(attention)} blocks x {config.n_heads} heads)")
    return 0
