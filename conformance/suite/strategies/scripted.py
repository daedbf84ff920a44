"""Scripted decoders: next-token logits drawn directly, for the search-rule property
(`conformance/suite/test_search_rules.py`).

A random model's next-token distributions are flat, its ties rare and its end tokens come at
random, which puts the search's rules to a weak test. A scripted decoder is a table instead:
source row b's logits at step t after token p are `table[b, t, p]` (B, max_len, V, V), whatever
came before p. Each row of the table is drawn as one kind of step (`ROW_KINDS`):

    peaked    one token far above the rest (a confident step)
    tie       two tokens exactly level at the top (the rule: the lower index first)
    near-tie  two tokens at the top apart by 1e-9 to 1e-3
    flat      every token within half a nat
    levels    integer levels 0 to -3 (ties between whole paths of different beams)
    end       the end token on top, by a drawn margin
    end-tie   the end token level with another at the top (an ending that ties an open beam)

and each source row gets the step from which its end token may win (early, late or never; before
it the end token sits below every other token) and a confident path from the start token (steps
where one token wins after the path's previous one: a long confident continuation). In half the
scripts every row ends early and often (`ENDING_KINDS`): the finished lists fill up, and the
stopping bounds decide.

The shapes are fixed (`BATCH`, `MAX_LEN`, `VOCAB`): a compiling backend (JAX) compiles each
search rule once for the whole property. The length penalty is drawn with the table: it is data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

BATCH, MAX_LEN, VOCAB = 2, 6, 6
PAD, BOS, EOS = 0, 1, 2
ROW_KINDS = ("peaked", "tie", "near-tie", "flat", "levels", "end", "end-tie")
# The kinds of a row's steps once its end token may win, when it ends often.
ENDING_KINDS = ("end", "end-tie", "peaked")
NEAR_GAPS = (1e-9, 1e-6, 1e-3)
# Penalties that make length matter both ways, strongly and not at all.
LENGTH_PENALTIES = (1.0, 0.0, 2.0, -0.5, 0.6, -2.0)


@dataclass(frozen=True)
class Script:
    """A scripted decoder: `table` (B, max_len, V, V) float64, its logits per (source row, step,
    previous token), and the length penalty of the searches run on it."""

    table: np.ndarray
    length_penalty: float

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """(N, V): the logits after each row's prefix tokens (N, t), rows of one source together
        (the reference search's `step`)."""
        n, t = tokens.shape
        source = np.arange(n) // (n // self.table.shape[0])
        return self.table[source, t - 1, tokens[:, -1]]

    def __repr__(self) -> str:
        return (f"Script(length_penalty={self.length_penalty!r}, "
                f"table=np.array({self.table.tolist()!r}))")


def scripted_step(data, ids, position):
    """A scripted decoder's step for the backends' `search_steps`: data["table"] (B, max_len, V,
    V) and data["source"] (N,), each decoder row's source row; ids (N,) the newest tokens. Plain
    indexing, the same in NumPy, torch and jax.numpy (position may be traced)."""
    return data["table"][data["source"], position, ids]  # (N, V)


# The strategies are built once (hypothesis validates a strategy where it is first drawn from: a
# new one per row cost two thirds of the property's time).
IDS = st.integers(0, VOCAB - 1)
NOT_END = IDS.filter(lambda i: i != EOS)
CONTINUATION = IDS.filter(lambda i: i not in (PAD, EOS))


def levels(*values: float):
    """A row (V,) of the given levels."""
    return st.lists(st.sampled_from(values), min_size=VOCAB, max_size=VOCAB).map(np.array)


@st.composite
def _peaked(draw, base=levels(-4.0, -6.0, -9.0, -13.0)) -> np.ndarray:
    row = draw(base)
    row[draw(IDS)] = 0.0
    return row


@st.composite
def _tied(draw, near: bool, base=levels(-1.0, -2.5, -5.0), pair=st.lists(IDS, min_size=2, max_size=2, unique=True),
          gap=st.sampled_from(NEAR_GAPS)) -> np.ndarray:
    row = draw(base)
    first, second = draw(pair)
    row[first] = 0.0
    row[second] = -draw(gap) if near else 0.0
    return row


@st.composite
def _ending(draw, base=levels(-1.0, -2.0, -4.0), top=st.sampled_from([0.0, -0.5, -1.0 + 1e-9])) -> np.ndarray:
    row = draw(base)
    row[EOS] = draw(top)
    return row


@st.composite
def _ending_tied(draw, base=levels(-1.0, -3.0)) -> np.ndarray:
    row = draw(base)
    row[EOS] = row[draw(NOT_END)] = 0.0
    return row


# One step's logits (V,) per kind (`ROW_KINDS`), the end token not yet lowered.
STEP_ROWS = {"peaked": _peaked(), "tie": _tied(False), "near-tie": _tied(True),
             "flat": levels(0.0, -0.125, -0.25, -0.5), "levels": levels(0.0, -1.0, -2.0, -3.0), "end": _ending(),
             "end-tie": _ending_tied()}
ANY_KIND, ENDING_KIND = st.sampled_from(ROW_KINDS), st.sampled_from(ENDING_KINDS)
END_FROM_EARLY = st.sampled_from([0, 1, 2])
END_FROM_ANY = st.sampled_from([0, 1, 2, MAX_LEN - 2, MAX_LEN - 1, MAX_LEN])


# Length penalties above 0: a longer hypothesis's sum is divided by more, so a long continuation
# can overtake the finished ones late (`late_overtakes`).
OVERTAKING_PENALTIES = (1.0, 2.0, 0.6)
# One script in six is a late overtake, on purpose (issue 56): more would leave the drawn kinds too
# few stops to reach (tests/generation/test_device_search.py counts them in 25 draws).
SCRIPT_KINDS = ("drawn",) * 5 + ("late overtake",)


@st.composite
def late_overtakes(draw) -> Script:
    """The case where Flax's stopping bound decides (`device_search.flax_update`): in each row
    three content tokens start level; two of them end at once (filling the finished slots with
    sums of one token), the third's ending is better still, and it also goes on, a nat or so
    worse, then confidently (log-probability ~0) until it ends late. Scored at its own length the
    open beam is worse than every finished slot, so a bound read there stops the search; scored at
    max_decode_len, as Flax's rule scores it, it may still win, and it does: divided by a longer
    length, its sum beats the finished ones. Both rows (the stop is one for the batch) draw their
    own tokens, margins and ending step; the penalty is one of `OVERTAKING_PENALTIES`."""
    low = draw(st.sampled_from([-10.0, -6.0]))
    table = np.full((BATCH, MAX_LEN, VOCAB, VOCAB), low)
    for b in range(BATCH):
        long, *ending = draw(st.permutations([3, 4, 5]))  # the content ids (PAD, BOS, EOS are 0-2)
        worse = draw(st.sampled_from([1.0, 0.75, 0.5]))  # the long path's second step, below its ending
        ends_at = draw(st.sampled_from([MAX_LEN - 1, MAX_LEN - 2, MAX_LEN - 3]))
        table[b, 0, BOS, [long, *ending]] = 0.0
        table[b, 1, ending, EOS] = 0.0
        table[b, 1, long, EOS] = -draw(st.sampled_from([0.0, 0.25]))
        table[b, 1, long, long] = -worse
        table[b, 2:, long, long] = 0.0
        table[b, ends_at, long, long], table[b, ends_at, long, EOS] = low, 0.0
    return Script(table=table, length_penalty=draw(st.sampled_from(OVERTAKING_PENALTIES)))


def late_overtake_script() -> Script:
    """The late overtake every profile runs first (`late_overtakes` at its first values: ends at the
    last step, penalty 1): a wrong stopping bound in Flax's rule is met whatever the draw."""
    table = np.full((BATCH, MAX_LEN, VOCAB, VOCAB), -10.0)
    table[:, 0, BOS, [3, 4, 5]] = 0.0
    table[:, 1, [4, 5], EOS] = 0.0
    table[:, 1, 3, EOS], table[:, 1, 3, 3] = 0.0, -1.0
    table[:, 2:, 3, 3] = 0.0
    table[:, MAX_LEN - 1, 3, 3], table[:, MAX_LEN - 1, 3, EOS] = -10.0, 0.0
    return Script(table=table, length_penalty=1.0)


def late_overtake(trace: list[dict], ids: np.ndarray) -> bool:
    """Whether a Flax-rule search (its reference trace and ids) met a late overtake: at some step
    every row's finished slots were filled and beat its best open beam scored at its own length
    (where a bound read at that length stops), and a row's returned hypothesis ended later."""
    lengths = np.where((ids == EOS).any(axis=1), np.argmax(ids == EOS, axis=1) + 1, ids.shape[1])
    for s, record in enumerate(trace):
        if "worst" in record and (record["worst"] > record["open_now"]).all():
            return bool((lengths > s + 1).any())
    return False


@st.composite
def scripts(draw) -> Script:
    """A scripted decoder over `BATCH` source rows, `MAX_LEN` steps and `VOCAB` ids, and a length
    penalty (`LENGTH_PENALTIES`); one in six a late overtake (`late_overtakes`)."""
    if draw(st.sampled_from(SCRIPT_KINDS)) == "late overtake":
        return draw(late_overtakes())
    table = np.empty((BATCH, MAX_LEN, VOCAB, VOCAB))
    # Every row ends often, from an early step (the finished lists fill up and a search may stop
    # before max_len, which takes every row), or each row ends from its own step, or never.
    often = draw(st.booleans())
    for b in range(BATCH):
        # The end token may win from step `end_from` on (MAX_LEN: never); before, it is last.
        end_from = draw(END_FROM_EARLY if often else END_FROM_ANY)
        for t in range(MAX_LEN):
            kinds = ENDING_KIND if often and t >= end_from else ANY_KIND
            for p in range(VOCAB):
                table[b, t, p] = draw(STEP_ROWS[draw(kinds)])
        # A long confident continuation: from the start token, one path of peaked steps.
        length = draw(st.integers(0, MAX_LEN))
        previous = BOS
        for t in range(length):
            token = draw(CONTINUATION)
            table[b, t, previous] = np.where(np.arange(VOCAB) == token, 0.0, table[b, t, previous] - 3.0)
            previous = token
        table[b, :end_from, :, EOS] = table[b, :end_from].min(axis=-1) - draw(st.sampled_from([0.5, 8.0]))
    return Script(table=table, length_penalty=draw(st.sampled_from(LENGTH_PENALTIES)))
