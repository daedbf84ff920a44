"""Key patterns: a foreign key or canonical key with `{i}` and `{p:a|b}` captures, both directions.

`{name}` captures a layer index (a number); `{name:a|b}` one of the listed words, and
`{name:a=x|b=y}` also maps the foreign word `a` to the canonical word `x`. The foreign side of an
entry declares the captures; the canonical side uses them as `{name}`. Matching a foreign key
yields canonical words, and formatting a foreign pattern takes canonical words, so values flow
between the two sides (import and export) without either side knowing the other's spelling.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

CAPTURE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([^{}]*))?\}")
_NUMBER = r"(?:0|[1-9][0-9]*)"


@dataclass(frozen=True)
class Capture:
    """One `{name}` in a pattern: a layer index, or one word of a list (with its canonical word)."""

    name: str
    choices: tuple[tuple[str, str], ...] | None = None  # (foreign word, canonical word) pairs

    def regex(self, side: str) -> str:
        if self.choices is None:
            return _NUMBER
        words = [foreign if side == "foreign" else canonical for foreign, canonical in self.choices]
        # Longest first, so that `q|q_proj` cannot stop at the shorter word inside a longer key.
        return "(?:" + "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)) + ")"

    def to_canonical(self, word: str) -> str:
        return word if self.choices is None else dict(self.choices)[word]

    def to_foreign(self, word: str) -> str:
        return word if self.choices is None else {c: f for f, c in self.choices}[word]


class Pattern:
    """A key pattern on one side ("foreign" or "canonical") over a shared set of captures.

    `match` returns the captured values in canonical words; `format` takes canonical words. So
    values flow between the two sides of an entry without either side knowing the other's words.
    """

    def __init__(self, text: str, captures: Mapping[str, Capture], side: str):
        self.text = text
        self.side = side
        self.parts: list[str | Capture] = []
        regex = []
        position = 0
        for m in CAPTURE.finditer(text):
            literal = text[position : m.start()]
            self.parts.append(literal)
            regex.append(re.escape(literal))
            capture = captures[m.group(1)]
            self.parts.append(capture)
            regex.append(f"(?P<{capture.name}>{capture.regex(side)})")
            position = m.end()
        self.parts.append(text[position:])
        regex.append(re.escape(text[position:]))
        self.names = frozenset(p.name for p in self.parts if isinstance(p, Capture))
        self._regex = re.compile("".join(regex))

    def match(self, key: str) -> dict[str, str] | None:
        m = self._regex.fullmatch(key)
        if m is None:
            return None
        convert = (lambda c, w: c.to_canonical(w)) if self.side == "foreign" else (lambda c, w: w)
        return {p.name: convert(p, m.group(p.name)) for p in self.parts if isinstance(p, Capture)}

    def format(self, values: Mapping[str, str]) -> str:
        out = []
        for part in self.parts:
            if isinstance(part, Capture):
                word = values[part.name]
                out.append(part.to_foreign(word) if self.side == "foreign" else word)
            else:
                out.append(part)
        return "".join(out)

    def combinations(self) -> Iterator[tuple[dict[str, str], str]]:
        """(values, key) for every key this pattern can produce with layer index 0."""
        captures = [p for p in self.parts if isinstance(p, Capture)]
        choices = [
            ["0"] if c.choices is None else [canonical for _, canonical in c.choices] for c in captures
        ]
        for combo in itertools.product(*choices):
            values = dict(zip((c.name for c in captures), combo))
            yield values, self.format(values)

    def examples(self) -> Iterator[str]:
        return (key for _, key in self.combinations())

    def __repr__(self) -> str:
        return f"Pattern({self.text!r})"


def glob(text: str) -> re.Pattern:
    """A drop pattern: `*` stands for any run of characters, everything else is literal."""
    return re.compile(".*".join(re.escape(part) for part in text.split("*")))
