"""The report of a CTranslate2 model beside the oracle (`ctranslate2_compare.measure`): a row per
compute type (log p error per target position, the share of equal ids per search and where they
first part), its verdict, and the report's table, text and JSON.

Verdict: a row is held when CTranslate2 computes in float32 on float32 weights (model.bin's weight
dtypes): every position's |log p - oracle| <= atol * max(1, max |oracle log p|), the tolerance
table's float32 row for the device (the table's rule for any tensor), and its ids for every search
equal ours. The other compute types, and float32 on quantized weights, are measured, not held. A
report that held no row passes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from conformance.check.ctranslate2.model import BEAMS, HELD
from conformance.check.tolerances import Tolerance, tolerance


@dataclass
class ComputeTypeResult:
    """One compute type against the oracle. `position_error[t]`: the largest |log p| difference at
    target position t (the appended end token last) over the rows that reach it. `held`: the
    tolerance the row is held to (None: measured), with `scale` = max(1, max |oracle log p|)."""

    compute_type: str
    position_error: np.ndarray
    agreement: dict[int, float] = field(default_factory=dict)  # beams -> share of equal ids
    first_split: dict[int, int | None] = field(default_factory=dict)  # beams -> first step where ids part
    held: Tolerance | None = None
    scale: float = 1.0
    unheld: tuple[int, ...] = ()  # searches whose ids are measured, not held (ctranslate2_compare.aligned_search)

    @property
    def max_error(self) -> float:
        return float(np.max(self.position_error))

    @property
    def limit(self) -> float | None:
        return None if self.held is None else self.held.atol * self.scale

    @property
    def passed(self) -> bool | None:
        """None for a measured row; else whether every position is within the limit (NaN is not)
        and every held search's ids equal ours."""
        if self.held is None:
            return None
        within = bool(np.all(self.position_error <= self.limit))  # False for NaN
        return within and all(share == 1.0 for b, share in self.agreement.items() if b not in self.unheld)

    def verdict(self) -> str:
        if self.held is None:
            return "measured"
        if self.passed:
            which = " and ".join(search_name(b) for b in self.agreement if b not in self.unheld) + " "
            return f"ok (<= {self.limit:.1e}, {which if self.unheld else ''}ids equal)"
        problems = []
        beyond = np.flatnonzero(~(self.position_error <= self.limit))
        if beyond.size:
            t = int(beyond[0])
            problems.append(f"log p beyond {self.limit:.1e} from position {t} ({self.position_error[t]:.1e} there)")
        problems += [f"{search_name(b)} ids part at step {self.first_split[b]}" for b in self.agreement
                     if self.agreement[b] != 1.0 and b not in self.unheld]
        return "FAIL: " + "; ".join(problems)

    def to_json(self) -> dict[str, Any]:
        return {"compute_type": self.compute_type, "max_abs": self.max_error,
                "position_error": [float(e) for e in self.position_error],
                "ids_equal": {search_name(b): share for b, share in self.agreement.items()},
                "first_split": {search_name(b): step for b, step in self.first_split.items()},
                "held": self.held is not None, "limit": self.limit, "passed": self.passed,
                "ids_not_held": [search_name(b) for b in self.unheld]}


def search_name(beams: int) -> str:
    return "greedy" if beams == 1 else f"beam {beams}"


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, int | None]:
    """(share of steps where the ids are equal, the first step where any row's ids part, or None).
    A row's steps are its longer output's tokens and the end token after them: an output that stops
    where the other goes on parts at that step."""
    equal = total = 0
    first = None
    for a, b in zip(ours, theirs):
        steps = max(len(a), len(b)) + 1  # the end token (or its absence) is a step too
        a, b = a + [-1] * (steps - len(a)), b + [-1] * (steps - len(b))
        same = [x == y for x, y in zip(a, b)]
        equal, total = equal + sum(same), total + steps
        if not all(same):
            step = same.index(False)
            first = step if first is None else min(first, step)
    return equal / total, first


@dataclass
class CTranslate2Report:
    rows: list[ComputeTypeResult]
    pad_mass: float  # the largest probability the oracle gives an id CTranslate2 lacks (Marian's pad)
    version: str
    max_len: int
    device: str = "cpu"
    skipped: dict[str, str] = field(default_factory=dict)  # compute type -> why it did not run
    banned: tuple[int, ...] = ()  # the ids banned from our generate: those CTranslate2's vocabulary lacks
    source: str = ""  # what was compared with what
    weight_dtypes: tuple[str, ...] = ("float32",)  # model.bin's weight matrices
    notes: list[str] = field(default_factory=list)
    search: list[str] = field(default_factory=list)  # how the two searches were lined up, setting by setting
    calls = "score_batch, translate_batch"  # what CTranslate2 ran (a class attribute: not a field)

    @property
    def checked(self) -> bool:
        return any(row.held is not None for row in self.rows)

    @property
    def passed(self) -> bool:
        """Every held row passed, and one was held: a report that held nothing passes nothing."""
        return self.checked and all(row.passed for row in self.rows if row.held is not None)

    def table(self) -> str:
        searches = list(self.rows[0].agreement) if self.rows else list(BEAMS)
        head = "| compute type | max abs error, log p | per position | " + " | ".join(
            f"{search_name(b)} ids equal, first split" for b in searches) + " | verdict |"
        lines = [head, "|" + "---|" * (4 + len(searches))]
        for row in self.rows:
            ids = " | ".join(f"{row.agreement[b]:.0%}, {'-' if row.first_split[b] is None else row.first_split[b]}"
                             + (" (not held)" if b in row.unheld else "") for b in row.agreement)
            per = " ".join(f"{e:.1e}" for e in row.position_error)
            lines.append(f"| {row.compute_type} | {row.max_error:.2e} | {per} | {ids} | {row.verdict()} |")
        for compute_type, why in self.skipped.items():
            lines.append(f"| {compute_type} | not run: {why} |")
        lines.append(f"({self.version} on {self.device}; oracle: NumPy float64; weights stored as "
                     f"{'+'.join(self.weight_dtypes)}; max_len {self.max_len}; largest probability of an id "
                     f"CTranslate2 lacks {self.pad_mass:.1e})")
        if self.search:
            lines.append("(search aligned: " + "; ".join(self.search) + ")")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_text(self) -> str:
        held = (f"{HELD} on {HELD} weights is held to |log p error| <= atol * max(1, max |oracle log p|) "
                f"(atol {tolerance(HELD, self.device).atol:.0e}, the tolerance table's {HELD} row) and ids equal to "
                "ours; the rest are measured")
        return "\n".join([f"ctranslate2: {self.source}" if self.source else "ctranslate2",
                          "score_batch log p per target position and translate_batch ids against the oracle "
                          "(CTranslate2 exposes no intermediate tensors)", f"verdict: {held}", "", self.table(), "",
                          f"ctranslate2: {'ok' if self.passed else 'FAIL' if self.checked else 'nothing held'}"])

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "version": self.version, "device": self.device, "passed": self.passed,
                "checked": self.checked, "weight_dtypes": list(self.weight_dtypes), "max_len": self.max_len,
                "pad_mass": self.pad_mass, "banned": list(self.banned), "skipped": self.skipped,
                "search": self.search, "notes": self.notes, "compute_types": [row.to_json() for row in self.rows]}


@dataclass
class WhisperRow(ComputeTypeResult):
    """One compute type of a Whisper model against the oracle (`ctranslate2_whisper.measure`):
    `position_error[k]`, the largest |logits error| at generated step k (teacher-forced on
    CTranslate2's own ids); the encoder's output error; the no-speech probability's (None: not
    compared); greedy ids in `agreement[1]`. Held, every error is within atol * its own scale."""

    encoder_error: float = 0.0
    encoder_scale: float = 1.0
    no_speech_error: float | None = None

    @property
    def encoder_limit(self) -> float | None:
        return None if self.held is None else self.held.atol * self.encoder_scale

    @property
    def passed(self) -> bool | None:
        if self.held is None:
            return None
        no_speech = self.no_speech_error is None or self.no_speech_error <= self.held.atol
        return bool(self.encoder_error <= self.encoder_limit) and no_speech and bool(super().passed)

    def verdict(self) -> str:
        if self.held is None:
            return "measured"
        if self.passed:
            return f"ok (encoder <= {self.encoder_limit:.1e}, logits <= {self.limit:.1e}, greedy ids equal)"
        problems = []
        if not self.encoder_error <= self.encoder_limit:  # NaN too
            problems.append(f"the encoder output beyond {self.encoder_limit:.1e} ({self.encoder_error:.1e})")
        beyond = np.flatnonzero(~(self.position_error <= self.limit))
        if beyond.size:
            k = int(beyond[0])
            problems.append(f"logits beyond {self.limit:.1e} from generated position {k} "
                            f"({self.position_error[k]:.1e} there)")
        if self.no_speech_error is not None and not self.no_speech_error <= self.held.atol:
            problems.append(f"the no-speech probability beyond {self.held.atol:.1e} ({self.no_speech_error:.1e})")
        if self.agreement.get(1, 1.0) != 1.0:
            problems.append(f"greedy ids part at generated position {self.first_split[1]}")
        return "FAIL: " + "; ".join(problems)

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "encoder_max_abs": self.encoder_error, "encoder_limit": self.encoder_limit,
                "no_speech_max_abs": self.no_speech_error, "logits_max_abs": self.max_error}


@dataclass
class WhisperReport(CTranslate2Report):
    """A Whisper model's report: a row per compute type (`WhisperRow`), the prompt both searches
    started from, and `max_len` the tokens generated after it."""

    prompt: list[int] = field(default_factory=list)
    calls = "encode, generate"

    def batch_note(self) -> str:
        return f"the features, greedy from the prompt {self.prompt}"

    def table(self) -> str:
        lines = ["| compute type | encoder output, max abs error | logits, max abs error | per generated position | "
                 "no-speech probability | greedy ids equal, first split | verdict |", "|" + "---|" * 7]
        for row in self.rows:
            per = " ".join(f"{e:.1e}" for e in row.position_error)
            speech = "-" if row.no_speech_error is None else f"{row.no_speech_error:.1e}"
            split = "-" if row.first_split.get(1) is None else row.first_split[1]
            lines.append(f"| {row.compute_type} | {row.encoder_error:.2e} | {row.max_error:.2e} | {per} | {speech} | "
                         f"{row.agreement.get(1, 0.0):.0%}, {split} | {row.verdict()} |")
        for compute_type, why in self.skipped.items():
            lines.append(f"| {compute_type} | not run: {why} |")
        lines.append(f"({self.version} on {self.device}; oracle: NumPy float64; weights stored as "
                     f"{'+'.join(self.weight_dtypes)}; prompt {self.prompt}; {self.max_len} tokens after it at most)")
        if self.search:
            lines.append("(search aligned: " + "; ".join(self.search) + ")")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_text(self) -> str:
        held = (f"{HELD} on {HELD} weights is held to |error| <= atol * max(1, max |oracle|) for the encoder output "
                f"and each step's logits (atol {tolerance(HELD, self.device).atol:.0e}, the tolerance table's {HELD} "
                "row), the no-speech probability within atol, and greedy ids equal to ours; the rest are measured")
        return "\n".join([f"ctranslate2 (Whisper): {self.source}" if self.source else "ctranslate2 (Whisper)",
                          "Whisper.encode's output against the oracle's encoder output; Whisper.generate's greedy ids "
                          "and each step's logits against the oracle on the same prefix", f"verdict: {held}", "",
                          self.table(), "",
                          f"ctranslate2: {'ok' if self.passed else 'FAIL' if self.checked else 'nothing held'}"])

    def to_json(self) -> dict[str, Any]:
        return {**super().to_json(), "model": "whisper", "prompt": list(self.prompt)}
