"""The error types every backend raises. All are `ValueError`s, so `except ValueError` catches them.

| type              | raised for                                          | names              |
| ----------------- | --------------------------------------------------- | ------------------ |
| `ConfigError`     | a config field that is not valid                    | the field          |
| `InputError`      | a bad argument to a model call (ids, masks, dtype)  | the argument       |
| `NaNLogitsError`  | NaN logits of a row a search still decodes         | "src_ids", step, row |
| `CheckpointError` | a checkpoint file that cannot be trusted            | the file           |
| `VerificationError` | a written output that failed its check (nothing left) | the destination  |
| `TooLargeError`   | a config whose parameters cannot fit in memory      | the field          |

`TooLargeError` is a `ConfigError` and also a `MemoryError`: it is raised before anything is
allocated, in place of the `MemoryError` (or the killed process) the allocation would end in.

Each carries the name it blames as an attribute (`field`, `argument`, `path`) so that tests and
tools can compare errors across backends without parsing messages.
"""

from __future__ import annotations

import os


class ConfigError(ValueError):
    """A `ModelConfig` field is not valid. `.field` names it; `.fields` every field the error is
    about (`(field,)`, or all of them when several must be given at once, `.field` the first)."""

    def __init__(self, field: str, problem: str, *, fields: tuple[str, ...] = ()):
        self.field = field
        self.fields = tuple(fields) or (field,)
        self.problem = problem
        where = f"ModelConfig.{field}" if len(self.fields) == 1 else "ModelConfig"
        super().__init__(f"{where}: {problem}")


class InputError(ValueError):
    """An argument of a model call is not valid. `.argument` names it (e.g. "src_ids")."""

    def __init__(self, argument: str, problem: str):
        self.argument = argument
        self.problem = problem
        super().__init__(f"{argument}: {problem}")


class NaNLogitsError(InputError):
    """A search met NaN logits in a row it still decodes (`.step`, `.row`: the decoder row). An
    `InputError` on "src_ids" (a row of the call's input gave them); the message names the causes
    the model's `mask_fill` allows (`conformance.core.generation.search.nan_error`)."""

    def __init__(self, step: int, row: int, problem: str):
        self.step = step
        self.row = row
        super().__init__("src_ids", problem)


class CheckpointError(ValueError):
    """A checkpoint file cannot be loaded (or saved). `.path` names the file."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class VerificationError(CheckpointError):
    """What a writer wrote did not pass its check before it was renamed into place (`conformance.formats`,
    `conformance.check.ctranslate2.target.convert`), so nothing was left at `.path`. The message
    names what ran the output and where it first parted from the float64 oracle; `.verdicts`
    holds the checks made (the failed one among them). A `CheckpointError` on the destination."""

    def __init__(self, path: str | os.PathLike, problem: str, verdicts: tuple = ()):
        self.verdicts = tuple(verdicts)
        super().__init__(path, problem)


class TooLargeError(ConfigError, MemoryError):
    """A config's parameters cannot fit in the memory this process can hold; refused before any is allocated.

    `.field` names the size that makes them large, `.needed` and `.limit` are bytes (what the
    parameters take, what the machine has)."""

    def __init__(self, field: str, problem: str, needed: int, limit: int):
        self.needed = needed
        self.limit = limit
        super().__init__(field, problem)
