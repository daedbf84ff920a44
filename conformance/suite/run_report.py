"""What a suite run reports beyond pass and fail: how many examples each property ran and how many
its assumptions rejected, per target (`ExampleCounter`, `examples_table`), read by the plugin.

A property's settings say how many examples hypothesis draws at most; a run may draw fewer (a
compiling backend under `ci`), and a property's `assume` rejects some (a ReLU too near its kink in
float32, a held config the adapter cannot build). The counts say what was checked: the explicit
(covering) examples and the drawn ones that reached the comparison, and those rejected.
"""

from __future__ import annotations

import functools


class ExampleCounter:
    """While in use, counts the examples a property's test function runs (its hypothesis handle's
    `inner_test`, which hypothesis lets a caller wrap): "run", those that reached the end or
    failed, and "rejected", those an `assume` or `reject` turned away. A shrinking failure's
    examples count too."""

    def __init__(self, test):
        self.handle = getattr(test, "hypothesis", None)
        self.counts = {"run": 0, "rejected": 0}

    def __enter__(self):
        inner = getattr(self.handle, "inner_test", None)
        if inner is None:
            return self
        from hypothesis.errors import UnsatisfiedAssumption

        counts = self.counts

        @functools.wraps(inner)
        def counted(*args, **kwargs):
            try:
                result = inner(*args, **kwargs)
            except UnsatisfiedAssumption:
                counts["rejected"] += 1
                raise
            except BaseException:
                counts["run"] += 1
                raise
            counts["run"] += 1
            return result

        self.inner = inner
        self.handle.inner_test = counted
        return self

    def __exit__(self, *exc):
        if getattr(self, "inner", None) is not None:
            self.handle.inner_test = self.inner
        return False


def examples_table(examples: dict[tuple[str, str], dict[str, int]]) -> list[str]:
    """A row per property, a column per target: `ran/rejected` (blank where it did not run)."""
    labels = sorted({label for _, label in examples})
    names = sorted({name for name, _ in examples})
    width = max(len(label) for label in labels)
    short = {name: name.removeprefix("test_")[:44] for name in names}
    lines = []
    for start in range(0, len(labels), 4):  # four targets a table, so that a row fits a terminal
        chunk = labels[start:start + 4]
        lines.append(f"  {'property':<44} " + " ".join(f"{label:>{width}}" for label in chunk))
        for name in names:
            cells = [examples.get((name, label)) for label in chunk]
            if not any(cells):
                continue
            lines.append(f"  {short[name]:<44} " + " ".join(
                f"{'' if c is None else str(c['run']) + ' / ' + str(c['rejected']):>{width}}" for c in cells))
    return lines
