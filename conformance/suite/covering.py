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
from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError
from conformance.core.inputs import nan_positions
from conformance.suite.strategies import model_configs
from conformance.suite.strategies.forward_cases import Case
from conformance.suite.strategies.model_configs import switch_values
from conformance.suite.strategies.generation import MODES, GenerationCase, as_mode
from conformance.suite.strategies.ids import PADDING_PATTERNS, features
from conformance.suite.strategies.realistic import LONG_MAX_LENS
from conformance.suite.strategies.training import LABEL_SMOOTHINGS, TrainingCase
from conformance.suite.strategies.weights import LN_GAINS, OFFSETS, OUTLIER_SIZES, QK_GAINS, Trained, kinds_for

# The batch of every covering case: one row per padding kind. The source's whole-row padding comes
# last (the fully-masked property's own convention, `test_fully_masked.with_empty_rows`); a target
# always starts with a real token (a BOS).
LENGTH = 5
SRC_PADDINGS = PADDING_PATTERNS  # none, trailing, all-but-one, whole-row
TGT_PADDINGS = ("none", "trailing", "all-but-one", "trailing")
PADDING_SWITCHES = {"src padding": PADDING_PATTERNS, "tgt padding": PADDING_PATTERNS[:-1]}


def all_switch_values() -> dict[str, tuple]:
    """The config's switches and the padding kinds of the source and target rows."""
    return {**switch_values(), **PADDING_SWITCHES}


@lru_cache(maxsize=1)
def covering_configs() -> tuple[ModelConfig, ...]:
    """Configs that together hold every value of every switch (a covering array of strength 1).

    Row by row, each switch takes its least used value that the config accepts with the switches
    already set (a value no row may take would be a switch that no config can have, and fails
    here); among equally used values a fixed pseudo-random order per (switch, row) decides, so that
    two switches do not move in lockstep (shared embeddings always with tied outputs). A value that
    acts only beside others (`model_configs.ACTS_ONLY_WITH`: a frozen final_logits_bias needs one)
    is taken only in a row that has them."""
    values = switch_values()
    used = {(name, v): 0 for name, options in values.items() for v in options}
    rows: list[ModelConfig] = []
    while any(count == 0 for count in used.values()):
        if len(rows) > 2 * max(len(options) for options in values.values()):
            missing = [f"{name}={v!r}" for (name, v), count in used.items() if count == 0]
            raise AssertionError(f"no valid config takes {missing}: check ModelConfig's validation")
        config = model_configs.BASE
        for name, options in values.items():
            def order(j, name=name, options=options):
                return used[name, options[j]], zlib.crc32(f"{name} {len(rows)} {j}".encode())

            for j in sorted(range(len(options)), key=order):
                needs = model_configs.ACTS_ONLY_WITH.get((name, options[j]), {})
                if any(getattr(config, other) != value for other, value in needs.items()):
                    continue
                try:
                    config = config.replace(**{name: options[j]})
                    break
                except ConfigError:
                    continue
        for name in values:
            used[name, getattr(config, name)] += 1
        rows.append(config)
    return tuple(rows)


def _row(rng: np.random.Generator, vocab: int, pad_id: int, pattern: str, length: int) -> list[int]:
    real = [int(i) for i in rng.integers(0, vocab - 1, size=length)]
    row = [i + (i >= pad_id) for i in real]  # never pad_id
    if pattern == "trailing":
        row[length // 2 + 1:] = [pad_id] * (length - length // 2 - 1)
    elif pattern == "all-but-one":
        row[1:] = [pad_id] * (length - 1)
    elif pattern == "whole-row":
        row = [pad_id] * length
    return row


def _batch(rng, vocab: int, pad_id: int, patterns, length: int = LENGTH) -> np.ndarray:
    return np.array([_row(rng, vocab, pad_id, p, length) for p in patterns], dtype=np.int64)  # (len(patterns), L)


@lru_cache(maxsize=4)
def covering_cases(max_len: int | None = None, src_paddings: tuple[str, ...] = SRC_PADDINGS) -> tuple[Case, ...]:
    """One case per covering config: seeded weights at scale 1, a batch with one row per padding
    kind. `max_len`: the configs' table size and the batch's length (long sequences)."""
    out = []
    for i, config in enumerate(covering_configs()):
        length = LENGTH
        if max_len is not None:
            config, length = config.replace(max_len=max_len), max_len
        rng = np.random.default_rng([24, i])
        if config.source == "features":  # no padding; frames for length - 1 positions, so that a
            # front end that keeps every frame (stride 1) still fits the table, and shows as a shape
            src = features(rng, len(src_paddings), config.n_mels, max(length - 1, 1))
        else:
            src = _batch(rng, config.src_vocab_size, config.pad_id, src_paddings, length)
        tgt = _batch(rng, config.tgt_vocab_size, config.pad_id, TGT_PADDINGS[:len(src_paddings)], length)
        out.append(Case(config=config, seed=2400 + i, scale=1.0, src_ids=src, tgt_ids=tgt))
    return tuple(out)


def covering_long_cases() -> tuple[Case, ...]:
    """The covering cases at the shorter long length (512): positions far out, sums over many keys."""
    return covering_cases(max_len=min(LONG_MAX_LENS))


def covering_realistic_cases() -> tuple[Case, ...]:
    """The covering cases with trained-like weights, the kinds a config can be checked on
    (`strategies.kinds_for`) in turn, each at its realistic extreme."""
    out = []
    for i, case in enumerate(covering_cases()):
        kinds = kinds_for(case.config)
        kind = kinds[i % len(kinds)]
        trained = {"offset": Trained(offset=OFFSETS[0], qk_gain=1 / OFFSETS[0], v_gain=1 / OFFSETS[0]),
                   "outliers": Trained(outliers=(3, 11), outlier_size=OUTLIER_SIZES[0], ln_gain=LN_GAINS[0]),
                   "sharp": Trained(qk_gain=QK_GAINS[0])}[kind]
        out.append(dataclasses.replace(case, trained=trained))
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
    turn, bos and eos two real ids.

    The first case (greedy) ends where a minimum length must hold it back: its end id is the
    oracle's own first greedy choice on row 0, and min_length 3 bans it for the first two steps, so a
    backend that does not apply min_length ends that row at once, whatever examples hypothesis draws.
    That case takes no processor (one could change that first choice); the others take them in turn."""
    out = []
    for i, case in enumerate(covering_cases(src_paddings=SRC_PADDINGS[:-1])):
        pad = case.config.pad_id
        real = [t for t in range(case.config.tgt_vocab_size) if t != pad]
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
            options += tuple((name, ids if value == "ids" else value)
                             for name, value in COVERING_PROCESSORS[i % len(COVERING_PROCESSORS)].items())
        out.append(GenerationCase(case=case, max_len=min(6, case.config.max_len), bos_id=bos, eos_id=eos,
                                  options=options))
    return tuple(out)


def oracle_first_choice(case: Case, bos: int) -> int:
    """The float64 oracle's greedy first token on the case's row 0 after `bos` (the pad id banned,
    as every generation case bans it)."""
    model = backends.build(backends.Target("numpy", "cpu", "float64"), case.config, case.params())
    logits = np.array(model(case.src_ids[:1], np.full((1, 1), bos)).logits[0, -1])  # (V,)
    logits[case.config.pad_id] = -np.inf
    return int(np.argmax(logits))


# -- What the properties ran -------------------------------------------------------------------


def padding_kind(row: np.ndarray, pad_id: int) -> str:
    """One row's padding kind, as `PADDING_PATTERNS` names it ("other" for a pattern it does not)."""
    is_pad = row == pad_id
    if not is_pad.any():
        return "none"
    if is_pad.all():
        return "whole-row"
    real = int((~is_pad).sum())
    if is_pad[real:].all() and not is_pad[:real].any():
        return "all-but-one" if real == 1 and len(row) > 1 else "trailing"
    return "other"


def seen_values(case: Case) -> set[tuple[str, object]]:
    """(switch, value) of everything a case exercises: its config's switches and its rows' padding
    (a features source's rows have none)."""
    config = case.config
    seen = {(name, getattr(config, name)) for name in switch_values()}
    if config.source == "features":
        seen.add(("src padding", "none"))
    else:
        seen |= {("src padding", padding_kind(row, config.pad_id)) for row in case.src_ids}
    seen |= {("tgt padding", padding_kind(row, config.pad_id)) for row in case.tgt_ids}
    return seen


# property name -> {(switch, value): why that property never sees it}
NEVER = {
    "test_generate_chooses_the_oracles_ids": {
        ("src padding", "whole-row"): "a source of padding only has nothing to translate (generation_cases)"},
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
    return [f"{name}={value!r}" for name, options in all_switch_values().items() for value in options
            if (name, value) not in seen and (name, value) not in never]


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
        if self.property is None:
            return
        self.seen.setdefault((self.item or self.property, target_label), set()).update(seen_values(case))


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
