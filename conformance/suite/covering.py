"""Covering designs: a few explicit examples that together hold every value of every switch.

A property with a bounded number of drawn examples (5 gradient examples under `ci`) meets only
some switch values by chance: a wrong derivative for one activation in the NumPy oracle passed a
user's `rosetta conformance` run (issue 24). So every property first runs the covering examples
below, one per row of a covering array over the `ModelConfig` switches and the padding kinds,
and hypothesis draws the rest.

The switch values are read from `conformance.core.config`, never listed here
(`strategies.model_configs.switch_values`: bool fields False and True, str fields every value of the
config module's tuples that its validation accepts, numeric fields their declared choices), so a
switch added to `ModelConfig` (a field, a value in a tuple) joins the covering rows without
an edit here. The rows are the same for every property, with the same shapes, so a compiling
backend (JAX) compiles each row's model once per function and dtype for the whole suite, not once
per property. `conformance/suite/test_coverage.py` checks, from what the properties ran
(`record`), that every property saw every value on every target it ran.
"""

from __future__ import annotations

import dataclasses
import zlib
from functools import lru_cache

import numpy as np

from conformance.check import backends
from conformance.check.tolerances import tolerance
from conformance.core.config import ModelConfig, inert_switches
from conformance.core.errors import ConfigError
from conformance.core.inputs import nan_positions
from conformance.suite.strategies import model_configs
from conformance.suite.strategies.forward_cases import Case, empty_target_rows_defined
from conformance.suite.strategies.generation import (MODES, SOURCE_READING, GenerationCase, as_mode, as_whisper,
                                                      whisper_note)
from conformance.suite.strategies.model_configs import switch_values
from conformance.suite.strategies.ids import PADDING_PATTERNS, WIDTHS, batch_width, features, padding_kinds
from conformance.suite.strategies.realistic import LONG_MAX_LENS
from conformance.suite.strategies.training import LABEL_SMOOTHINGS, TrainingCase
from conformance.suite.strategies.weights import LN_GAINS, OFFSETS, OUTLIER_SIZES, QK_GAINS, Trained, kinds_for

# The batch of every covering case: one row per padding kind. The source's whole-row padding comes
# last (the fully-masked property's own convention, `test_fully_masked.with_empty_rows`), beside a
# target row without padding (so that labels count across it); a target row of padding only comes
# first, where the config gives it a value (`empty_target_rows_defined`) and a label still counts;
# where not, the first and last rows swap for a row without padding and a second pad-led one.
# Every other covering case's batch is padded wider than its longest row (where a label counts).
LENGTH = 5
SRC_PADDINGS = PADDING_PATTERNS  # none, trailing, all-but-one, leading, interior, whole-row
TGT_PADDINGS = ("whole-row", *PADDING_PATTERNS[1:-1], "none")
# The target rows where a row of padding only is NaN (or leaves no label finite): the source row
# without padding beside a target row without padding, and a second pad-led one last.
ALL_FINITE_TGT_PADDINGS = ("none", *PADDING_PATTERNS[1:-1], "leading")
PADDING_SWITCHES = {"src padding": PADDING_PATTERNS, "tgt padding": PADDING_PATTERNS,
                    "src width": WIDTHS, "tgt width": WIDTHS}


def all_switch_values() -> dict[str, tuple]:
    """The config's switches and the padding kinds of the source and target rows."""
    return {**switch_values(), **PADDING_SWITCHES}


@lru_cache(maxsize=1)
def covering_configs() -> tuple[ModelConfig, ...]:
    """Configs that together hold every value of every switch (a covering array of strength 1).

    Row by row, each switch takes its least used value that the config accepts with the switches
    already set (a value no row may take would be a switch that no config can have, and fails
    here); among equally used values a fixed pseudo-random order per (switch, row) decides, so that
    two switches do not move in lockstep (shared embeddings always with tied outputs). A value
    counts as used only in a row where it acts (`shows`): added scores with a finite fill and
    softmax rows, the -inf fill with softmax rows (its NaN), a value that acts only beside others
    (`model_configs.ACTS_ONLY_WITH`: a frozen final_logits_bias needs one) only beside them, not where
    they compute what any other value would."""
    values = switch_values()
    used = {(name, v): 0 for name, options in values.items() for v in options}
    rows: list[ModelConfig] = []
    while any(count == 0 for count in used.values()):
        if len(rows) > 2 * max(len(options) for options in values.values()):
            missing = [f"{name}={v!r}" for (name, v), count in used.items() if count == 0]
            raise AssertionError(f"no valid config takes {missing}: check ModelConfig's validation")
        # Of a few such rows (tie orders, and each value no row showed yet set first), the one
        # that shows the most values no row showed yet.
        unseen = [(name, v) for (name, v), count in used.items() if count == 0]
        candidates = [_covering_row(values, used, len(rows), salt) for salt in range(CANDIDATES)]
        candidates += [c for c in (_shown(candidates[0], *value) for value in unseen) if c is not None]
        config = max(candidates, key=lambda c: sum(shows(c, n) and not used[n, getattr(c, n)] for n in values))
        for name in values:
            if shows(config, name):
                used[name, getattr(config, name)] += 1
        rows.append(config)
    return tuple(rows)


CANDIDATES = 8  # rows tried per covering row (`covering_configs`): a few orders of equally used values


# What a value needs beside it to show (`shows`), set with it on a row built for it (`_shown`).
SHOWN_WITH = {"mask_fill": dict(empty_rows="softmax"),
              "masked_scores": dict(empty_rows="softmax", cross_attn_src_mask=True, position_ids="arange")}


def _shown(config: ModelConfig, name: str, value) -> ModelConfig | None:
    """`config` with switch `name` at `value` and what it needs to show there (`SHOWN_WITH`, then a
    fill and a position term that let it), or None when no such change does."""
    changes = {**SHOWN_WITH.get(name, {}), **model_configs.REQUIRES.get((name, value), {}),
               **model_configs.ACTS_ONLY_WITH.get((name, value), {}), name: value}
    fills = [{}] if name == "mask_fill" else [{}, *({"mask_fill": f} for f in model_configs.FILLS)]
    positions = [{}, {"position": "sinusoid-interleaved"}]
    for more in ({**f, **p} for p in positions for f in fills):
        try:
            shown = config.replace(**changes, **more)
        except ConfigError:
            continue
        if shows(shown, name):
            return shown
    return None


def _covering_row(values: dict, used: dict, row: int, salt: int) -> ModelConfig:
    """One row: each switch its least used value the config accepts, ties in an order of (row, salt)."""
    config = model_configs.BASE
    for name, options in values.items():
        def order(j, name=name, options=options):
            tie = f"{name} {row} {j}" + (f" {salt}" if salt else "")
            return used[name, options[j]], zlib.crc32(tie.encode())

        for j in sorted(range(len(options)), key=order):
            try:
                config = config.replace(**{name: options[j]})
                break
            except ConfigError:
                continue
    return config


def shows(config: ModelConfig, name: str) -> bool:
    """Whether switch `name` shows its value in `config`: not inert there (`inert_switches`); the
    fill not hidden by empty_rows "zeros" (which gives every empty row zeros, whatever the fill
    would have made of it: NaN or a uniform average); masked scores where their gradients part,
    in an empty row whose keys differ: cross-attention over a source row of padding only, its
    keys told apart by their positions (pad tokens alike, relative positions bias self-attention
    only, "non-pad" position ids give padding none)."""
    if name in inert_switches(config):
        return False
    needs = model_configs.ACTS_ONLY_WITH.get((name, getattr(config, name)), {})
    if any(getattr(config, other) != value for other, value in needs.items()):
        return False
    if name == "mask_fill":
        return config.empty_rows != "zeros"
    if name == "masked_scores":  # log-mel features have no padding: no empty cross-attention row
        return (config.source == "ids" and config.cross_attn_src_mask and config.position != "relative"
                and config.position_ids == "arange")
    return True


def _row(rng: np.random.Generator, vocab: int, pad_id: int, pattern: str, length: int, width: int | None = None
         ) -> list[int]:
    """A row of `length` ids with `pattern`'s padding laid out over its first `width` positions
    (all of them by default), the rest padding (a batch wider than its longest row)."""
    width = length if width is None else width
    real = [int(i) for i in rng.integers(0, vocab - 1, size=width)]
    row = [i + (i >= pad_id) for i in real]  # never pad_id
    if pattern == "trailing":
        row[width // 2 + 1:] = [pad_id] * (width - width // 2 - 1)
    elif pattern == "all-but-one":
        row[1:] = [pad_id] * (width - 1)
    elif pattern == "leading":
        row[:width // 2] = [pad_id] * (width // 2)
    elif pattern == "interior":  # pads at 1 .. width // 2: real tokens on both sides from width 3 on
        row[1:width // 2 + 1] = [pad_id] * (width // 2)
    elif pattern == "whole-row":
        row = [pad_id] * width
    return row + [pad_id] * (length - width)


def _batch(rng, vocab: int, pad_id: int, patterns, length: int = LENGTH, wider: bool = False) -> np.ndarray:
    width = length - 1 if wider else length
    return np.array([_row(rng, vocab, pad_id, p, length, width) for p in patterns], dtype=np.int64)  # (len(patterns), L)


@lru_cache(maxsize=4)
def covering_cases(max_len: int | None = None, src_paddings: tuple[str, ...] = SRC_PADDINGS) -> tuple[Case, ...]:
    """One case per covering config: seeded weights at scale 1, a batch with one row per padding
    kind, every other one padded wider than its longest row (its rows' last position padding).
    `max_len`: the configs' table size and the batch's length (long sequences)."""
    out = []
    for i, config in enumerate(covering_configs()):
        length = LENGTH
        if max_len is not None:
            config, length = config.replace(max_len=max_len), max_len
        # A -inf fill's NaN spreads over a whole batch row: the first layout that leaves a real
        # target token finite (where labels may count), wider first on every other case.
        defined = empty_target_rows_defined(config)
        layouts = [(wider, tgt_paddings) for wider in ((True, False) if i % 2 else (False,))
                   for tgt_paddings in ((TGT_PADDINGS,) if defined else ()) + (ALL_FINITE_TGT_PADDINGS,)]
        for wider, tgt_paddings in layouts:
            rng = np.random.default_rng([24, i])
            if config.source == "features":  # no padding; frames for length - 1 positions, so that a
                # front end that keeps every frame (stride 1) still fits the table, and shows as a shape
                src = features(rng, len(src_paddings), config.n_mels, max(length - 1, 1))
            else:
                src = _batch(rng, config.src_vocab_size, config.pad_id, src_paddings, length, wider)
            tgt = _batch(rng, config.tgt_vocab_size, config.pad_id, tgt_paddings[:len(src_paddings)], length, wider)
            if ((tgt != config.pad_id) & ~nan_positions(config, src, tgt)).any():
                break
        out.append(Case(config=config, seed=2400 + i, scale=1.0, src_ids=src, tgt_ids=tgt))
    return tuple(out)


def covering_long_cases() -> tuple[Case, ...]:
    """The covering cases at the shorter long length (512): positions far out, sums over many keys."""
    return covering_cases(max_len=min(LONG_MAX_LENS))


# LayerNorm forms that take rows with a large mean (`kinds_for`: not fast-variance, which cancels
# there by definition), each met at float32 by the realistic property's covering rows (issue 56).
LARGE_MEAN_FORMS = ("standard", "std-eps", "rms")


def covering_realistic_cases() -> tuple[Case, ...]:
    """The covering cases with trained-like weights, the kinds a config can be checked on
    (`strategies.kinds_for`) in turn, each at its realistic extreme; then every LayerNorm form
    (`LARGE_MEAN_FORMS`) with rows of a large mean (the offset kind: |mean| / std of 1000), on a
    covering row that is post-LN with that form where there is one, else on the first such row
    with its form changed. A LayerNorm whose statistics cancel there (E[x^2] - E[x]^2, written
    out for one form only) is met whatever the draw."""
    trained = {"offset": Trained(offset=OFFSETS[0], qk_gain=1 / OFFSETS[0], v_gain=1 / OFFSETS[0]),
               "outliers": Trained(outliers=(3, 11), outlier_size=OUTLIER_SIZES[0], ln_gain=LN_GAINS[0]),
               "sharp": Trained(qk_gain=QK_GAINS[0])}
    out = []
    for i, case in enumerate(covering_cases()):
        kinds = kinds_for(case.config)
        out.append(dataclasses.replace(case, trained=trained[kinds[i % len(kinds)]]))
    post = [case for case in covering_cases() if "offset" in kinds_for(case.config)]
    for form in LARGE_MEAN_FORMS:
        if any(c.trained.offset and c.config.layer_norm_form == form for c in out):
            continue
        same = [case for case in post if case.config.layer_norm_form == form]
        case = same[0] if same else dataclasses.replace(post[0], config=post[0].config.replace(layer_norm_form=form))
        out.append(dataclasses.replace(case, trained=trained["offset"]))
    return tuple(out)


def covering_training_cases() -> tuple[TrainingCase, ...]:
    """The covering cases with labels (as `strategies.training_cases` makes them: a real token
    wherever one may count, every fifth dropped to pad_id), the label smoothings in turn.

    A ReLU row's weights are reseeded until the oracle's ReLU inputs stay clear of the kink by twice
    the float32 tolerance: the gradient property assumes away a lower-precision case nearer the kink
    (`relu_kink_distance`), and a covering row it threw away would leave `relu` unseen there."""
    out = []
    for i, case in enumerate(covering_cases()):
        config = case.config
        for _ in range(50):
            if relu_kink_distance(case) > 2 * tolerance("float32").atol:
                break
            case = dataclasses.replace(case, seed=case.seed + 1000)
        else:
            raise RuntimeError(f"covering row {i}: no seed keeps its ReLU inputs clear of the kink")
        rng = np.random.default_rng([24, i, 1])
        labels = np.full(case.tgt_ids.shape, config.pad_id, dtype=np.int64)
        may_count = (case.tgt_ids != config.pad_id) & ~nan_positions(config, case.src_ids, case.tgt_ids)
        for n, (b, t) in enumerate(map(tuple, np.argwhere(may_count))):
            if n == 0 or n % 5:
                labels[b, t] = _row(rng, config.tgt_vocab_size, config.pad_id, "none", 1)[0]
        out.append(TrainingCase(case=case, labels=labels, label_smoothing=LABEL_SMOOTHINGS[i % len(LABEL_SMOOTHINGS)]))
    return tuple(out)


# Generation options, taken in turn by the covering rows (every value of each is met).
GENERATION_OPTIONS = {
    "num_beams": (1, 2, 3),
    "length_penalty": (1.0, 0.0, 0.6, -0.5),
    "early_stopping": (False, True, "never"),
    "length_penalty_form": ("hf", "gnmt"),
}


# transformers' processors of shipped generation configs (`strategies.generation.shipped_processors`),
# taken in turn by the covering rows, so that `ci` runs each under every search it has (the token
# lists: two real ids other than the row's start and end ids, "ids" below).
COVERING_PROCESSORS = (
    {"repetition_penalty": 1.6, "exponential_decay_length_penalty": (1, 1.5), "suppress_tokens": "ids"},
    {"encoder_repetition_penalty": 1.4, "begin_suppress_tokens": "ids", "renormalize_logits": True},
    {"encoder_no_repeat_ngram_size": 2, "repetition_penalty": 0.7, "renormalize_logits": True},
)


def covering_generation_cases() -> tuple[GenerationCase, ...]:
    """The covering cases as decoding examples: no all-padding source row (a source of padding only
    has nothing to translate), the options and the shipped processors (`COVERING_PROCESSORS`) in
    turn, bos and eos two real ids. A source row whose first step is NaN (a -inf fill's padded
    queries under src_pad_mask "both") has its padding replaced by real tokens: every backend
    refuses such a source alike (generation_cases).

    The first case (greedy) ends where a minimum length must hold it back: its end id is the
    oracle's own first greedy choice on row 0, and min_length 3 bans it for the first two steps, so a
    backend that does not apply min_length ends that row at once, whatever examples hypothesis draws.
    That case takes no processor (one could change that first choice); the others take them in turn.
    The other features rows decode as Whisper, `WHISPER_ROWS` in turn."""
    out, carried, whispered = [], [], 0
    for i, case in enumerate(covering_cases(src_paddings=SRC_PADDINGS[:-1])):
        pad = case.config.pad_id
        real = [t for t in range(case.config.tgt_vocab_size) if t != pad]
        first = np.full((len(case.src_ids), 1), real[i % len(real)])
        nan = nan_positions(case.config, case.src_ids, first)[:, 0]  # (B,)
        if nan.any():
            filled = np.where(case.src_ids == pad, real[0], case.src_ids)
            case = dataclasses.replace(case, src_ids=np.where(nan[:, None], filled, case.src_ids))
        options = tuple((name, values[i % len(values)]) for name, values in GENERATION_OPTIONS.items())
        # Every third case of each beam count decodes with Flax's rule, every third samples.
        options = as_mode(options, MODES[(i // 3) % 3], seed=i, temperature=(1.0, 0.5, 2.0)[i % 3],
                          top_k=(0, 3, 1)[(i // 2) % 3], top_p=(1.0, 0.9, 0.5)[(i // 4) % 3])
        bos, eos = real[i % len(real)], real[(i + 1) % len(real)]
        if i == 0 and dict(options)["num_beams"] == 1:  # the first start id whose greedy choice is another id
            bos, first = next(((b, f) for b in real if (f := oracle_first_choice(case, b)) != b), (bos, bos))
            if first != bos:
                eos, options = first, options + (("min_length", 3),)
        if ("min_length", 3) not in options:
            ids = (real[(i + 2) % len(real)], real[(i + 3) % len(real)])
            chosen = COVERING_PROCESSORS[i % len(COVERING_PROCESSORS)].items()
            options += tuple((name, ids if value == "ids" else value) for name, value in chosen
                             if case.config.source == "ids" or name not in SOURCE_READING)
            if case.config.source != "ids":  # a features source has no ids for these to read
                carried += [(_search(options), name, value) for name, value in chosen if name in SOURCE_READING]
        gcase = GenerationCase(case=case, max_len=min(6, case.config.max_len), bos_id=bos, eos_id=eos,
                               options=options)
        note = whisper_note(case.config.tgt_vocab_size, pad) if case.config.source == "features" else None
        if note is not None and ("min_length", 3) not in options:  # Whisper's decoding, in turn
            whispered += 1
            gcase = as_whisper(gcase, note, **whisper_row(WHISPER_ROWS[(whispered - 1) % len(WHISPER_ROWS)], options))
        out.append(gcase)
    return tuple(with_carried(out, carried))


# Whisper's decoding (`strategies.generation.as_whisper`), taken in turn by the features rows (not the
# minimum-length one): the note's prompt, an explicit one with the language detected, one with the
# language given and <|notimestamps|>; the timestamp rules with a bound of 0 and 1; the
# no-speech probability; and, where the row runs a beam search, openai-whisper's rule with
# patience 2 (Flax's rule, whose stopping bound it replaces, is met by the token-ids rows).
WHISPER_ROWS = (
    dict(prefix=("de", "task", "notimestamps"), timestamps=False, initial=None, no_speech=True),
    dict(prefix="note", timestamps=True, initial=0, no_speech=True, patience=2.0),
    dict(prefix=(None, "task"), timestamps=True, initial=1, no_speech=False),
)


def whisper_row(row: dict, options) -> dict:
    """A `WHISPER_ROWS` row for a case of `options`: openai's rule only where it runs a beam search."""
    beams = not dict(options).get("do_sample") and dict(options).get("num_beams", 1) > 1
    return {**row, "patience": row.get("patience") if beams else None}


def _search(options) -> str:
    """The search a case's options run, as the processors' coverage groups them: flax, sample,
    greedy or beam (every other beam rule; `runner.search_of` tells them apart for adapters)."""
    options = dict(options)
    if options.get("beam_rule") == "flax":
        return "flax"
    return "sample" if options.get("do_sample") else "greedy" if options.get("num_beams", 1) == 1 else "beam"


def with_carried(cases: list[GenerationCase], carried: list) -> list[GenerationCase]:
    """`cases` with each source-reading processor a features case could not take, (search, name,
    value), added to the first case of the same search over token ids that lacks it (not the
    minimum-length case), so that every processor still meets every search."""
    for search, name, value in carried:
        for k, gcase in enumerate(cases):
            options = dict(gcase.options)
            if (gcase.case.config.source == "ids" and _search(gcase.options) == search and name not in options
                    and options.get("min_length") != 3):
                cases[k] = dataclasses.replace(gcase, options=gcase.options + ((name, value),))
                break
    return cases


def oracle_first_choice(case: Case, bos: int) -> int:
    """The float64 oracle's greedy first token on the case's row 0 after `bos` (the pad id banned,
    as every generation case bans it)."""
    model = backends.build(backends.Target("numpy", "cpu", "float64"), case.config, case.params())
    logits = np.array(model(case.src_ids[:1], np.full((1, 1), bos)).logits[0, -1])  # (V,)
    logits[case.config.pad_id] = -np.inf
    return int(np.argmax(logits))


# -- What the properties ran -------------------------------------------------------------------


def seen_values(case: Case) -> set[tuple[str, object]]:
    """(switch, value) of everything a case exercises: its config's switches where they show their
    value (`shows`), its rows' padding kinds and its batches' widths (a features source's rows have
    no padding)."""
    config = case.config
    seen = {(name, getattr(config, name)) for name in switch_values() if shows(config, name)}
    if config.source == "features":
        seen.add(("src padding", "none"))
    else:
        seen |= {("src padding", kind) for row in case.src_ids for kind in padding_kinds(row, config.pad_id)}
        seen.add(("src width", batch_width(case.src_ids, config.pad_id)))
    seen |= {("tgt padding", kind) for row in case.tgt_ids for kind in padding_kinds(row, config.pad_id)}
    seen.add(("tgt width", batch_width(case.tgt_ids, config.pad_id)))
    if case.trained is not None and case.trained.offset:
        seen.add(("large-mean rows", config.layer_norm_form))
    return seen


# Values a property must see beyond the switches and padding kinds: property name -> {name: values}.
# A property that runs no model (`SCRIPTED`) must see its own values only.
PROPERTY_VALUES = {
    "test_every_tensor_matches_the_oracle_at_trained_scale": {"large-mean rows": LARGE_MEAN_FORMS},
    # Flax's stopping bound decides (strategies.scripted.late_overtakes), met by the reference's trace.
    "test_device_search_follows_the_reference_rules": {"scripted case": ("flax late overtake",)},
}
SCRIPTED = {"test_device_search_follows_the_reference_rules"}

# property name -> {(switch, value): why that property never sees it}
NEVER = {
    "test_generate_chooses_the_oracles_ids": {
        ("src padding", "whole-row"): "a source of padding only has nothing to translate (generation_cases)",
        **{(side, kind): "the search makes its own decoder inputs: a drawn target row is never read"
           for side, kinds in (("tgt padding", PADDING_PATTERNS), ("tgt width", WIDTHS)) for kind in kinds}},
}


# (property name, dtype) -> {(switch, value): why that property never sees it in that dtype}
_HALF_GRADIENTS = {
    ("activation", "relu"): "half precision's ReLU exclusion is its own forward tolerance, which leaves out "
                            "nearly every ReLU model (test_gradients)",
    ("attention_temp", 4.0): "half-precision gradients are claimed up to attention temperature 1 "
                             "(tolerances.in_gradient_domain)",
}
NEVER_IN = {("test_gradients_match_the_oracle", dtype): _HALF_GRADIENTS for dtype in ("float16", "bfloat16")}


def missed(property_name: str, seen: set[tuple[str, object]], dtype: str | None = None) -> list[str]:
    """`switch=value` for every value a property should have seen and did not, in field order
    (`dtype`: the target's, for the values a property never sees in that dtype)."""
    never = {**NEVER.get(property_name, {}), **NEVER_IN.get((property_name, dtype), {})}
    return [f"{name}={value!r}" for name, options in expected_values(property_name).items() for value in options
            if (name, value) not in seen and (name, value) not in never]


def expected_values(property_name: str) -> dict[str, tuple]:
    """Every value `property_name` must see: the switches and padding kinds (`all_switch_values`),
    and its own (`PROPERTY_VALUES`); a property that runs no model its own only."""
    own = PROPERTY_VALUES.get(property_name, {})
    return dict(own) if property_name in SCRIPTED else {**all_switch_values(), **own}


def coverage_problems(seen: dict[tuple[str, str], set], passed: set[str] | None = None) -> list[str]:
    """One line per (property run, target) that missed a value: `seen` as `Recorder.seen` keeps it,
    keyed by the pytest item (or the property's name); only the items in `passed` when given."""
    problems = []
    for (item, label), values in sorted(seen.items()):
        if passed is not None and item not in passed:
            continue
        gaps = missed(item.split("::")[-1].split("[")[0], values, label.rsplit("/", 1)[-1])
        if gaps:
            problems.append(f"{item} on {label} missed {', '.join(gaps)}")
    return problems


class Recorder:
    """What the properties ran: `seen[(property, target label)]` = the (switch, value) pairs of
    every case that reached a backend (after hypothesis' `assume`s and the property's skips).
    `property` is set by the suite's pytest plugin while a property runs, or by `recording`."""

    def __init__(self):
        self.property: str | None = None
        self.item: str | None = None
        self.seen: dict[tuple[str, str], set] = {}
        self.passed: set[str] = set()  # the pytest items that passed (their records are complete)

    def add(self, target_label: str, case: Case) -> None:
        self.note(target_label, seen_values(case))

    def note(self, target_label: str, values) -> None:
        """Record (name, value) pairs a property ran on a target (a scripted decoder's, say)."""
        if self.property is None:
            return
        self.seen.setdefault((self.item or self.property, target_label), set()).update(values)


RECORDER = Recorder()


class recording:
    """`with recording("test_x") as seen:` records what runs meanwhile as property `test_x`."""

    def __init__(self, property_name: str):
        self.name = property_name

    def __enter__(self) -> dict:
        self.before = (RECORDER.property, RECORDER.item, RECORDER.seen)
        RECORDER.property, RECORDER.item, RECORDER.seen = self.name, None, {}
        return RECORDER.seen

    def __exit__(self, *exc):
        RECORDER.property, RECORDER.item, RECORDER.seen = self.before
        return False


def relu_kink_distance(case: Case) -> float:
    """How far the oracle's ReLU inputs stay from the kink at 0: min |pre-activation| / scale over
    every FFN of the float64 forward (inf for other activations).

    ReLU's derivative jumps at 0. An input within rounding of 0 may land on the other side in a
    lower precision (measured: |x| = 4.9e-7 in float64, negative in float32), and the gradient then
    legitimately differs by that unit's whole contribution (2.5e-2). A gradient comparison in a
    lower precision is only a claim where the inputs are further from 0 than its forward tolerance.
    """
    from conformance.check.compare import tensor_scale

    if case.config.activation != "relu":
        return float("inf")
    model = backends.build(backends.Target("numpy", "cpu", "float64"), case.config, case.params())  # the oracle
    tape = {}  # the oracle's forward keeps nothing on the model: each FFN's (hidden, units, gate) on a tape
    model.decode(case.tgt_ids, model.encode(case.src_ids, tape=tape), tape=tape)
    hidden = [tape[layer.ffn][0] for layer in [*model.encoder.layers, *model.decoder.layers]]
    return min(float(np.nanmin(np.abs(h))) / tensor_scale(h) for h in hidden)
