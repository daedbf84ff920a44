"""`rosetta generate CHECKPOINT --src "..."`: greedy or beam search decoding with any backend."""

from __future__ import annotations

import argparse
import json

HELP = "Decode a source sequence (greedy, or beam search with --beams) and print the output (token ids, or text for the built-in toy model)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.cli.common import add_backend_argument

    parser.add_argument("checkpoint", nargs="?", help="a rosetta checkpoint (default: the built-in default model)")
    parser.add_argument("--src", required=True, help="source: digits for the toy model ('3 1 4'), or IDS ('5,6,7;8,9,10' or a .npy file)")
    parser.add_argument("--max-len", type=int, default=None, help="longest output in tokens (default: the checkpoint's, else the model's max_len)")
    parser.add_argument("--bos", type=int, default=None, help="begin-of-sequence id (default: the checkpoint's; 1 for the toy model)")
    parser.add_argument("--eos", type=int, default=None, help="end-of-sequence id (default: the checkpoint's; 2 for the toy model)")
    parser.add_argument("--beams", type=int, default=None, help="beam size; 1 is greedy (default: the checkpoint's, else 1)")
    parser.add_argument("--length-penalty", type=float, default=None,
                        help="Hugging Face's length penalty alpha: scores divided by length**alpha (default: the checkpoint's, else 1.0)")
    add_backend_argument(parser)


def recorded_generation(config) -> dict:
    """The decoding defaults a checkpoint records under its "generation" note (Hugging Face's
    generation_config.json names, see `conformance.convert.sources.GENERATION_KEYS`), as
    `generate` arguments: bos_id, eos_id, num_beams, length_penalty, max_len, forced_eos, banned_ids."""
    from conformance.core.errors import ConfigError

    text = config.notes.get("generation")
    if not text:
        return {}
    try:
        recorded = json.loads(text)
    except ValueError:
        raise ConfigError("notes", "the checkpoint's \"generation\" note is not JSON") from None
    if not isinstance(recorded, dict):
        raise ConfigError("notes", "the checkpoint's \"generation\" note is not a JSON object")
    out = {}
    eos = recorded.get("eos_token_id")
    if isinstance(eos, list):  # Hugging Face allows several end tokens; generate takes one
        eos = eos[0] if len(eos) == 1 else None
    for name, value in (("bos_id", recorded.get("decoder_start_token_id")), ("eos_id", eos),
                        ("num_beams", recorded.get("num_beams")), ("length_penalty", recorded.get("length_penalty"))):
        if value is not None:
            out[name] = value
    if recorded.get("max_new_tokens") is not None:  # Hugging Face: it wins over max_length
        out["max_len"] = min(int(recorded["max_new_tokens"]), config.max_len)
    elif recorded.get("max_length") is not None:  # Hugging Face counts the start token
        out["max_len"] = min(int(recorded["max_length"]) - 1, config.max_len)
    if recorded.get("forced_eos_token_id") is not None and recorded.get("forced_eos_token_id") == eos:
        out["forced_eos"] = True
    banned = [words[0] for words in recorded.get("bad_words_ids") or [] if isinstance(words, list) and len(words) == 1]
    if banned:
        out["banned_ids"] = banned
    return out


def decoding(config, *, max_len=None, bos=None, eos=None, beams=None, length_penalty=None) -> dict | None:
    """`model.generate`'s keyword arguments: each one given, else the checkpoint's recorded
    generation settings, else the toy model's ids and the plain defaults. None when no start or
    end id is known (neither given nor recorded)."""
    from conformance.check import toy

    is_toy = config.notes.get("task") == toy.TASK
    recorded = recorded_generation(config)
    bos = bos if bos is not None else recorded.get("bos_id", toy.BOS if is_toy else None)
    eos = eos if eos is not None else recorded.get("eos_id", toy.EOS if is_toy else None)
    if bos is None or eos is None:
        return None
    return dict(max_len=max_len if max_len is not None else recorded.get("max_len", config.max_len), bos_id=bos,
                eos_id=eos, num_beams=beams if beams is not None else recorded.get("num_beams", 1),
                length_penalty=length_penalty if length_penalty is not None else recorded.get("length_penalty", 1.0),
                forced_eos=recorded.get("forced_eos", False), banned_ids=recorded.get("banned_ids", ()))


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from conformance.check import toy
    from conformance.check.compare import to_numpy
    from conformance.cli.common import labels, load_model, named_by_flags, parse_source, source_form
    from conformance.cli.progress import Status
    from conformance.core.errors import InputError

    if args.max_len is not None and args.max_len < 1:  # 0 is not "the default"; said before the model loads
        raise InputError("--max-len", f"must be an int in [1, the model's max_len], got {args.max_len}")
    config, model = load_model(args.checkpoint, args.backend)
    is_toy = config.notes.get("task") == toy.TASK
    settings = decoding(config, max_len=args.max_len, bos=args.bos, eos=args.eos, beams=args.beams,
                        length_penalty=args.length_penalty)
    if settings is None:
        raise InputError("--bos/--eos", "this checkpoint does not say its special ids; pass --bos and --eos")
    src = parse_source(config, args.src)
    form = source_form(config, args.src, src)
    if form:
        print(f"rosetta generate: {form}", file=sys.stderr)
    eos = settings["eos_id"]
    with named_by_flags(), Status("rosetta generate") as status:
        status(f"decoding {len(src)} row(s) on {args.backend}, up to {settings['max_len']} tokens")
        generated = to_numpy(model.generate(src, **settings)).astype(np.int64)
    for row in generated:
        # A row ends at its <eos>; what follows is the padding of rows that ended early.
        ended = np.flatnonzero(row == eos)
        row = row[: ended[0]] if ended.size else row
        if is_toy:
            print(toy.decode_ids(row))
        else:
            print(" ".join(labels(config, row)))
    return 0
