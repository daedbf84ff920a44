"""`rosetta generate CHECKPOINT --src "..."`: greedy, beam search or sampling with any backend."""

from __future__ import annotations

import argparse

from conformance.core.generation.note import HF_DEFAULT_NEW_TOKENS

HELP = ("Decode a source sequence (greedy, beam search with --beams, or sampling with --sample) and print the output "
        "(token ids, or text for the built-in toy model).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from conformance.check import toy
    from conformance.cli.common import add_backend_argument

    parser.add_argument("checkpoint", nargs="?", help="a rosetta checkpoint (default: the built-in default model)")
    parser.add_argument("--src", required=True, help="source: a features source's log-mel .npy (B, n_mels, frames), "
                        "or digits for the toy model ('3 1 4'; it was trained on "
                        f"{toy.MIN_DIGITS}-{toy.MAX_DIGITS} digits, and warns outside that range), or IDS "
                        "('5,6,7;8,9,10' or a .npy file; shorter rows are padded with the checkpoint's pad id)")
    parser.add_argument("--max-len", type=int, default=None,
                        help="longest output in tokens, the start token not counted (default: the checkpoint's; for a "
                             "converted Hugging Face model that records none, transformers' default: "
                             f"{HF_DEFAULT_NEW_TOKENS} new tokens, within max_position_embeddings; else the model's "
                             "max_len)")
    parser.add_argument("--bos", type=int, default=None, help="begin-of-sequence id (default: the checkpoint's; 1 for the toy model)")
    parser.add_argument("--eos", type=int, default=None, help="end-of-sequence id (default: the checkpoint's; 2 for the toy model)")
    parser.add_argument("--beams", type=int, default=None, help="beam size; 1 is greedy (default: the checkpoint's, else 1)")
    parser.add_argument("--length-penalty", type=float, default=None,
                        help="Hugging Face's length penalty alpha: scores divided by length**alpha (default: the checkpoint's, else 1.0)")
    parser.add_argument("--beam-rule", choices=("hf", "flax", "openai"), default="hf",
                        help="hf: Hugging Face's beam search (default); flax: Flax examples/wmt's, as t5x and AlgoPerf "
                             "(every end among the best 2*beams finishes, GNMT length penalty); openai: openai-whisper's "
                             "(each beam proposes beams+1 ids; ends once round(beams x patience) have finished); see "
                             "docs/decoding.md")
    parser.add_argument("--patience", type=float, default=None,
                        help="with --beam-rule openai: wait for round(beams x patience) finished hypotheses per row "
                             "(openai-whisper's patience; default 1.0)")
    parser.add_argument("--sample", action="store_true", help="sample each token instead of searching (greedy when "
                        "no other flag is given); reproducible with --seed")
    parser.add_argument("--temperature", type=float, default=None, help="with --sample: logits divided by T > 0 (default 1)")
    parser.add_argument("--top-k", type=int, default=None, help="with --sample: keep the K best ids (default 0: all)")
    parser.add_argument("--top-p", type=float, default=None,
                        help="with --sample: keep the best ids whose probabilities sum to P, 0 < P <= 1 (default 1: all)")
    parser.add_argument("--seed", type=int, default=None,
                        help="with --sample: the NumPy seed of the uniforms (the same ids in every backend; default: fresh)")
    parser.add_argument("--no-repeat-ngram-size", type=int, default=None,
                        help="no n-gram of N tokens twice in a row's output, its start token included (Hugging Face's "
                             "no_repeat_ngram_size; default: the checkpoint's, else 0: off)")
    parser.add_argument("--forced-bos", type=int, default=None,
                        help="the id every row's first token must be (Hugging Face's forced_bos_token_id: mBART-50's "
                             "and NLLB's target language; default: the checkpoint's, else none)")
    parser.add_argument("--bad-words", default=None,
                        help="id sequences never generated, 'A,B;C' (Hugging Face's bad_words_ids: the last id of each "
                             "is banned where the others end the output; default: the checkpoint's)")
    parser.add_argument("--min-length", type=int, default=None,
                        help="the end token is banned while the output plus its start token is shorter than N "
                             "(Hugging Face's min_length; default: the checkpoint's, else 0: off)")
    parser.add_argument("--min-new-tokens", type=int, default=None,
                        help="the end token is banned while the output is shorter than N (Hugging Face's "
                             "min_new_tokens, which replaces min_length; default: the checkpoint's, else off)")
    parser.add_argument("--prefix", default=None,
                        help="Whisper's forced prompt after the start token, ids 'A,B,C' ('detect' for the language "
                             "detected at that step, as in 'detect,50359'; '' for none), which begin the printed rows "
                             "(generate's prefix; default: the checkpoint's Whisper prompt, else none)")
    parser.add_argument("--timestamps", action=argparse.BooleanOptionalAction, default=None,
                        help="Whisper's timestamp rules on or off (generate's return_timestamps; the checkpoint's "
                             "prompt then drops or keeps its no-timestamps id; default: the checkpoint's, else off)")
    parser.add_argument("--max-initial-timestamp-index", default=None, metavar="N",
                        help="with --timestamps: the first timestamp is at most <|0.00|> + N; 'none' for no bound "
                             "(generate's max_initial_timestamp_index; default: the checkpoint's)")
    parser.add_argument("--no-speech-prob", action="store_true",
                        help="after each row's ids, a tab and 'no_speech_prob=P': the source row's probability of "
                             "Whisper's no-speech id at the start token (generate's return_no_speech_prob)")
    add_backend_argument(parser)


SAMPLING_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed"}


def sampling(args: argparse.Namespace) -> dict:
    """generate's sampling arguments from the flags, checked before any model loads."""
    from conformance.cli.common import named_by_flags
    from conformance.core.generation.settings import check_sampling
    from conformance.core.errors import InputError

    given = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    if not args.sample:
        if given:
            raise InputError(SAMPLING_FLAGS[next(iter(given))], "applies only with --sample")
        return {}
    if args.beams not in (None, 1):
        raise InputError("--beams", f"--sample draws one token at a time (beam sampling is not supported); got --beams "
                                    f"{args.beams}")
    if args.beam_rule != "hf":
        raise InputError("--beam-rule", "is a beam search rule; --sample samples instead")
    with named_by_flags():
        check_sampling(True, *(given.get(name) for name in SAMPLING_FLAGS), 1, "hf")
    return {"do_sample": True, "num_beams": 1, **given}


PROCESSOR_FLAGS = {"no_repeat_ngram_size": "--no-repeat-ngram-size", "forced_bos_id": "--forced-bos",
                   "bad_words_ids": "--bad-words", "min_length": "--min-length", "min_new_tokens": "--min-new-tokens"}


def processors(args: argparse.Namespace) -> dict:
    """generate's logits-processor arguments from the flags (those not given are left to the
    checkpoint's note); --bad-words 'A,B;C' is [[A, B], [C]]."""
    from conformance.core.errors import InputError

    out = {}
    if args.no_repeat_ngram_size is not None:
        out["no_repeat_ngram_size"] = args.no_repeat_ngram_size
    if args.forced_bos is not None:
        out["forced_bos_id"] = args.forced_bos
    for name in ("min_length", "min_new_tokens"):
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    if args.bad_words is not None:
        try:
            out["bad_words_ids"] = [[int(token) for token in word.split(",")] for word in args.bad_words.split(";")]
        except ValueError:
            raise InputError("--bad-words", f"must be id sequences like '5,6;7' (',' within a sequence, ';' between "
                                            f"them), got {args.bad_words!r}") from None
    return out


def whisper(args: argparse.Namespace) -> dict:
    """generate's Whisper arguments from the flags (those not given are left to the checkpoint's
    note): --prefix 'detect,50359' is [None, 50359] and '' is (); --max-initial-timestamp-index
    'none' is False (no bound). Their values are generate's to check, under these flags."""
    from conformance.core.errors import InputError

    out = {}
    if args.prefix is not None:
        words = [word.strip() for word in args.prefix.split(",")] if args.prefix.strip() else []
        try:
            out["prefix"] = [None if word == "detect" else int(word) for word in words]
        except ValueError:
            raise InputError("--prefix", f"must be ids like '50259,50359,50363' ('detect' for a language to detect, "
                                         f"'' for none), got {args.prefix!r}") from None
    if args.timestamps is not None:
        out["return_timestamps"] = args.timestamps
    if args.max_initial_timestamp_index is not None:
        given = args.max_initial_timestamp_index.strip()
        try:
            out["max_initial_timestamp_index"] = False if given == "none" else int(given)
        except ValueError:
            raise InputError("--max-initial-timestamp-index", f"must be an int >= 0, or 'none' for no bound, got "
                                                              f"{given!r}") from None
    if args.patience is not None:
        if args.beam_rule != "openai":
            raise InputError("--patience", f"applies with --beam-rule openai (openai-whisper's beam search), got "
                                           f"--beam-rule {args.beam_rule}")
        out["patience"] = args.patience
    if args.no_speech_prob:
        out["return_no_speech_prob"] = True
    return out


def recorded_generation(config) -> dict:
    """The decoding defaults a checkpoint records under its "generation" note, as `generate`
    arguments (`conformance.core.generation.note.generation_note`, which `generate` applies itself)."""
    from conformance.core.generation.note import generation_note

    return generation_note(config)


def decoding(config, *, max_len=None, bos=None, eos=None, beams=None, length_penalty=None) -> dict | None:
    """`model.generate`'s keyword arguments: each one given, else the checkpoint's recorded
    generation settings, else the toy model's ids and the plain defaults. None when no start or
    end id is known (neither given nor recorded). The logits processors (forced end and first
    tokens, banned ids and words, no repeated n-gram) are left out: `generate` reads them from the
    note itself, so that an explicit --bad-words replaces the note's whole list, as in transformers.

    The length: `max_len`, else the note's (`generation_note`: its max_new_tokens or max_length,
    or, when it names neither, transformers' own default of `HF_DEFAULT_NEW_TOKENS` new tokens),
    else, with no note (the toy model, a model trained here), the model's max_len."""
    from conformance.check import toy

    is_toy = config.notes.get("task") == toy.TASK
    recorded = recorded_generation(config)
    bos = bos if bos is not None else recorded.get("bos_id", toy.BOS if is_toy else None)
    eos = eos if eos is not None else recorded.get("eos_id", toy.EOS if is_toy else None)
    if bos is None or eos is None:
        return None
    return dict(max_len=max_len if max_len is not None else recorded.get("max_len", config.max_len), bos_id=bos,
                eos_id=eos, num_beams=beams if beams is not None else recorded.get("num_beams", 1),
                length_penalty=length_penalty if length_penalty is not None else recorded.get("length_penalty", 1.0))


def transformers_length(config) -> bool:
    """Whether `config`'s generation note (read and checked by `decoding` first) names neither
    max_length nor max_new_tokens, so that the length is transformers' default."""
    import json

    text = config.notes.get("generation")
    if not text:
        return False
    note = json.loads(text)
    return note.get("max_length") is None and note.get("max_new_tokens") is None


def overflow_error(model, config, src, bos: int, where: str, nan) -> Exception | None:
    """When a forward pass on `src` with the start token gives a non-finite tensor, the error that
    names the first one (in forward order, as `rosetta check` reads a report) and what it means,
    after the search's own `nan` (a `NaNLogitsError`: its step and row); None when the pass is
    finite or cannot run for any reason (the search's error then stands).

    NaN logits in a decode come from one of two places: a query whose every key is masked with
    mask_fill=-inf (0 / 0 in the softmax: an input problem), or a value that overflowed (a
    product of weights too large for the dtype: the checkpoint's). The pass keeps no tensor: only
    the first non-finite one's facts, and the name and largest |value| of the one before it."""
    import math

    import numpy as np

    from conformance.check.compare import to_numpy
    from conformance.core.errors import CheckpointError, InputError
    from conformance.core.output import forward_order

    wanted = set(forward_order(config)) | {"logits"}
    first: dict = {}  # the first non-finite tensor: its name, dtype, kinds and batch row
    before: list = []  # the finite tensor just before it: (name, largest |value|)

    def keep(name, tensor):
        if first or name not in wanted:
            return
        values = to_numpy(tensor)
        bad = ~np.isfinite(values)
        if not bad.any():
            before[:] = [(name, float(np.abs(values).max()) if values.size else 0.0)]
            return
        kinds = " and ".join(word for word, found in (("NaN", np.isnan(values).any()), ("inf", np.isinf(values).any()))
                             if found)
        first.update(name=name, dtype=str(getattr(tensor, "dtype", "")).replace("torch.", ""), kinds=kinds,
                     row=int(np.argwhere(bad)[0][0]))

    tgt = np.full((src.shape[0], 1), bos, dtype=np.int64)
    try:
        with np.errstate(all="ignore"):
            model(src, tgt, sink=keep)
    except Exception:  # noqa: BLE001 - a diagnosis that cannot run must not replace the search's error
        return None
    if not first:
        return None
    name = first["name"]
    previous = ""
    if before:
        previous = f", the tensor before it, {before[0][0]}, being finite (largest |value| {before[0][1]:.3g})"
    what = "attention weights, " if name.endswith((".self", ".cross")) else ""
    found = (f"decoding produced NaN logits at step {nan.step}, row {nan.row}; the first non-finite tensor is {name} "
             f"({what}{first['kinds']}, batch row {first['row']}) of a forward pass on --src with the start token "
             f"{bos}{previous}")
    if math.isinf(config.mask_fill):
        return InputError("src_ids", f"{found}: with mask_fill=-inf, a query with no key to attend to is NaN "
                                     "(is the start id the pad id?), or a value overflowed")
    return CheckpointError(where, f"{found}: a value overflowed {first['dtype']} there (mask_fill={config.mask_fill:g} "
                                  "is finite, so no masked row made it): check the weights' magnitudes, or run in "
                                  "a wider dtype")


def run(args: argparse.Namespace) -> int:
    import sys

    import numpy as np

    from conformance.check import backends, toy
    from conformance.check.compare import to_numpy
    from conformance.cli.common import labels, load_model, named_by_flags, parse_source, source_form
    from conformance.cli.progress import Status
    from conformance.core.errors import InputError, NaNLogitsError

    if args.max_len is not None and args.max_len < 1:  # 0 is not "the default"; said before the model loads
        raise InputError("--max-len", f"must be an int in [1, the model's max_len], got {args.max_len}")
    sampled = sampling(args)
    constraints = processors(args)
    whispered = whisper(args)
    config, model = load_model(args.checkpoint, args.backend)
    if backends.kind(args.backend) == "torch":  # torch and torch-compiled
        from conformance.cli.threads import fit_torch_threads

        fit_torch_threads(config)
    is_toy = config.notes.get("task") == toy.TASK
    settings = decoding(config, max_len=args.max_len, bos=args.bos, eos=args.eos, beams=args.beams,
                        length_penalty=args.length_penalty)
    if settings is None:
        raise InputError("--bos/--eos", "this checkpoint does not say its special ids; pass --bos and --eos")
    settings.update(sampled, **constraints, **whispered, beam_rule=args.beam_rule)
    src = parse_source(config, args.src)
    form = source_form(config, args.src, src)
    if form:
        print(f"rosetta generate: {form}", file=sys.stderr)
    if is_toy and toy.range_warning(src):
        print(f"rosetta generate: warning: {toy.range_warning(src)}", file=sys.stderr)
    if args.max_len is None and transformers_length(config):
        print(f"rosetta generate: up to {settings['max_len']} tokens: the checkpoint's generation settings name no "
              f"max_length or max_new_tokens, so transformers' default applies ({HF_DEFAULT_NEW_TOKENS} new tokens, "
              "start token and all within max_position_embeddings); --max-len sets another limit", file=sys.stderr)
    eos = settings["eos_id"]
    import warnings

    from conformance.core.generation.note import GenerationWarning

    with named_by_flags(), Status("rosetta generate") as status, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GenerationWarning)
        status(f"decoding {len(src)} row(s) on {args.backend}, up to {settings['max_len']} tokens")
        try:
            returned = model.generate(src, **settings)
            generated, no_speech = returned if args.no_speech_prob else (returned, None)
            generated = to_numpy(generated).astype(np.int64)
        except InputError as exc:  # under the flag the user typed
            if isinstance(exc, NaNLogitsError):  # name the first non-finite tensor, not --src
                overflow = overflow_error(model, config, src, settings["bos_id"],
                                          args.checkpoint or "the built-in default model", exc)
                if overflow is not None:
                    raise overflow from None
            if exc.argument not in PROCESSOR_FLAGS:
                raise
            raise InputError(PROCESSOR_FLAGS[exc.argument], exc.problem) from None
    for message in dict.fromkeys(str(w.message) for w in caught if issubclass(w.category, GenerationWarning)):
        print(f"rosetta generate: warning: {message}", file=sys.stderr)  # what the note asks and generate skips
    for w in caught:  # anything else, as Python would have shown it
        if not issubclass(w.category, GenerationWarning):
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    cut = []
    for number, row in enumerate(generated):
        # A row ends at its <eos>; what follows is the padding of rows that ended early.
        ended = np.flatnonzero(row == eos)
        if not ended.size:
            cut.append(number)
        row = row[: ended[0]] if ended.size else row
        shown = toy.decode_ids(row) if is_toy else " ".join(labels(config, row))
        if no_speech is not None:  # the row's source: generate returns one row per source row here
            shown += f"\tno_speech_prob={float(to_numpy(no_speech)[number]):.6g}"
        print(shown)
    if cut:
        # The end token is not printed, so a row the limit cut off would look like one that ended.
        rows = ", ".join(map(str, cut[:10])) + (f" and {len(cut) - 10} more" if len(cut) > 10 else "")
        more = ("--max-len raises it" if settings["max_len"] < config.max_len
                else f"it is the model's max_len, {config.max_len}")
        print(f"rosetta generate: row{'s' if len(cut) > 1 else ''} {rows} reached the length limit of "
              f"{settings['max_len']} tokens without an end token: cut off, not ended ({more})", file=sys.stderr)
    return 0
