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
        # None for a test hypothesis does not drive (it has no examples to count).
        self.counts = {"run": 0, "rejected": 0} if getattr(self.handle, "inner_test", None) is not None else None

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


def examples_table(examples: dict[tuple[str, str], dict[str, int]], per_table: int = 8) -> list[str]:
    """A row per property, a column per target (numbered, the targets named above each table):
    `ran / rejected`, blank where the property did not run on that target."""
    labels = sorted({label for _, label in examples})
    names = sorted({name for name, _ in examples})
    lines = []
    for start in range(0, len(labels), per_table):  # a few targets a table, so that a row fits a terminal
        chunk = list(enumerate(labels[start:start + per_table], start=start + 1))
        lines.append("  " + "  ".join(f"[{n}] {label}" for n, label in chunk))
        lines.append(f"  {'property':<44}" + "".join(f"{f'[{n}]':>10}" for n, _ in chunk))
        for name in names:
            cells = [examples.get((name, label)) for _, label in chunk]
            if any(cells):
                lines.append(f"  {name.removeprefix('test_')[:44]:<44}" + "".join(
                    f"{'' if c is None else str(c['run']) + ' / ' + str(c['rejected']):>10}" for c in cells))
    return lines
