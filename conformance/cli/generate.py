"""`rosetta generate CHECKPOINT --src "..."`: greedy decoding with any backend."""

from __future__ import annotations

import argparse

HELP = "Greedy-decode a source sequence and print the output (token ids, or text for the built-in toy model)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.cli.common import add_backend_argument

    parser.add_argument("checkpoint", nargs="?", help="a rosetta checkpoint (default: the built-in default model)")
    parser.add_argument("--src", required=True, help="source: digits for the toy model ('3 1 4'), or IDS ('5,6,7;8,9,10' or a .npy file)")
    parser.add_argument("--max-len", type=int, default=None, help="longest output in tokens (default: the model's max_len)")
    parser.add_argument("--bos", type=int, default=None, help="begin-of-sequence id (default: 1 for the toy model)")
    parser.add_argument("--eos", type=int, default=None, help="end-of-sequence id (default: 2 for the toy model)")
    add_backend_argument(parser)


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from conformance.check import toy
    from conformance.check.compare import to_numpy
    from conformance.cli.common import labels, load_model, parse_source, source_form
    from conformance.core.errors import InputError

    if args.max_len is not None and args.max_len < 1:  # 0 is not "the default"
        raise InputError("--max-len", f"must be at least 1, got {args.max_len}")
    config, model = load_model(args.checkpoint, args.backend)
    is_toy = config.notes.get("task") == toy.TASK
    bos = args.bos if args.bos is not None else (toy.BOS if is_toy else None)
    eos = args.eos if args.eos is not None else (toy.EOS if is_toy else None)
    if bos is None or eos is None:
        raise InputError("--bos/--eos", "this checkpoint does not say its special ids; pass --bos and --eos")
    src = parse_source(config, args.src)
    form = source_form(config, args.src, src)
    if form:
        print(f"rosetta generate: {form}", file=sys.stderr)
    generated = to_numpy(model.generate(src, max_len=args.max_len if args.max_len is not None else config.max_len,
                                        bos_id=bos, eos_id=eos)).astype(np.int64)
    for row in generated:
        # A row ends at its <eos>; what follows is the padding of rows that ended early.
        ended = np.flatnonzero(row == eos)
        row = row[: ended[0]] if ended.size else row
        if is_toy:
            print(toy.decode_ids(row))
        else:
            print(" ".join(labels(config, row)))
    return 0
