"""What becomes of an adapter target's differences from the oracle (issue 58, docs/own-backend.md).

Hypothesis stops a property at its first failure, and one difference then hides every other. On an
adapter's target (`conformance.check.targets.adapter`) the properties judge each example's first
difference (`judged`):

- one the adapter acknowledges (`KnownDifference`: the tensor, the condition, the reason) is not a
  failure: an explicit example's is recorded as it is, a drawn example's is raised as an
  `Acknowledged` of its own kind, which hypothesis shrinks like any failure while it goes on
  looking for others; the plugin then records it with its shrunk example and passes the property
  if nothing else failed (`settle`);
- any other is raised as a difference of its own kind per tensor (`divergence`), so that
  hypothesis reports each distinct first-diverging tensor it finds (report_multiple_bugs), each
  shrunk, not only the first.

A backend's target is judged as before: its first failure is the property's.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

from conformance.check import backends
from conformance.check.backends import Target

# Each property an adapter runs, by the short name a known difference's `when` uses.
SHORT_NAMES = {"test_every_tensor_matches_the_oracle": "forward", "test_repeated_calls_are_bitwise_identical":
               "determinism", "test_generate_chooses_the_oracles_ids": "generate",
               "test_gradients_match_the_oracle": "gradients"}
# The explicit examples of every property (`strategies.with_examples`), by identity: an
# acknowledged difference there is recorded, not raised (hypothesis stops after the explicit
# examples when one fails, and would draw none).
from conformance.suite.strategies.forward_cases import EXPLICIT  # noqa: E402


class Divergence(AssertionError):
    """A first difference at one tensor on an adapter's target (a subclass per tensor)."""

    tensor = ""


class Acknowledged(AssertionError):
    """A first difference the adapter acknowledges (a subclass per known difference)."""

    index = -1


_KINDS: dict[tuple[type, str], type] = {}


def _kind(base: type, key: str) -> type:
    """A subclass of `base` per key: hypothesis tells failures apart by their exception type."""
    if (base, key) not in _KINDS:
        name = base.__name__ + "_" + re.sub(r"\W", "_", key)
        _KINDS[base, key] = type(name, (base,), {"__module__": __name__, "__qualname__": name})
    return _KINDS[base, key]


def divergence(tensor: str, error: AssertionError) -> Divergence:
    """`error` as a difference at `tensor` of its own kind."""
    new = _kind(Divergence, tensor)(*error.args)
    new.tensor = tensor
    return new


def facts(target: Target, property_name: str, case) -> dict[str, set]:
    """What an example is, for a known difference's `when`: its property (short name), the target's
    dtype, the held config's switches, the padding kinds of its rows and the widths of its batches."""
    from conformance.suite.strategies.ids import batch_width, padding_kinds

    config = case.config
    out = {"property": {SHORT_NAMES.get(property_name, property_name)}, "dtype": {target.dtype}}
    out.update({name: {value} for name, value in config.to_dict().items() if name != "notes"})
    out["mask_fill"] = {config.mask_fill}
    for side, ids in (("src", case.src_ids), ("tgt", case.tgt_ids)):
        out[f"{side}_padding"] = set().union(*(padding_kinds(row, config.pad_id) for row in ids))
        out[f"{side}_width"] = {batch_width(ids, config.pad_id)}
    return out


@contextmanager
def judged(target: Target, property_name: str, example, case) -> Iterator[None]:
    """Run a comparison of `example` (whose case, as the target ran it, is `case`) on `target`: on
    an adapter's target, its first difference acknowledged or raised as its own kind (module
    docstring); on a backend's, as it is."""
    try:
        yield
    except AssertionError as error:
        tensor = getattr(error, "tensor", None)
        if tensor is None or not backends.is_adapter(target.backend):
            raise
        adapter = backends.adapter_of(target.backend)
        known = facts(target, property_name, case)
        for index, difference in enumerate(adapter.known):
            if difference.matches(tensor, known):
                if id(example) in EXPLICIT:
                    record(target.label, property_name, index, tensor, f"explicit example: {example!r}")
                    return
                acknowledged = _kind(Acknowledged, f"{target.label} {index}")(*error.args)
                acknowledged.index, acknowledged.tensor = index, tensor
                raise acknowledged from None
        raise divergence(tensor, error).with_traceback(error.__traceback__) from None


# (target label, property, known difference's index) -> {"tensor", "example"}: the acknowledged
# differences met in this process, each with its smallest example (shrunk by hypothesis, or an
# explicit one when no drawn example met it).
ACKNOWLEDGED: dict[tuple[str, str, int], dict] = {}


def record(label: str, property_name: str, index: int, tensor: str, example: str) -> None:
    entry = ACKNOWLEDGED.setdefault((label, property_name, index), {"tensor": tensor, "example": example})
    shrunk, was_shrunk = not example.startswith("explicit"), not entry["example"].startswith("explicit")
    if (shrunk, -len(example)) > (was_shrunk, -len(entry["example"])):
        entry.update(tensor=tensor, example=example)


def settle(error: BaseException, label: str, property_name: str) -> tuple[BaseException | None, list[str]]:
    """A property's failure on `label` with its acknowledged differences recorded (each with the
    example hypothesis shrank it to, from its notes) and taken out: (what is left to raise, or None
    when every failure was acknowledged; the first-diverging tensors of what is left)."""
    parts = list(error.exceptions) if isinstance(error, BaseExceptionGroup) else [error]
    rest = []
    for part in parts:
        if isinstance(part, Acknowledged):
            notes = [n for n in getattr(part, "__notes__", ()) if n.startswith(("Falsifying", "Failing"))]
            record(label, property_name, part.index, part.tensor, "\n".join(notes) or str(part).splitlines()[0])
        else:
            rest.append(part)
    tensors = [getattr(part, "tensor", "") for part in rest if getattr(part, "tensor", "")]
    if not rest:
        return None, []
    if len(rest) == len(parts):
        return error, tensors
    if len(rest) == 1:
        return rest[0], tensors
    return BaseExceptionGroup(f"{len(rest)} distinct differences (besides the acknowledged ones)", rest), tensors


def acknowledged_lines(acknowledged: dict) -> list[str]:
    """The report's section on acknowledged differences, per target and property."""
    lines = []
    for (label, property_name, index), entry in sorted(acknowledged.items()):
        name = label.rsplit("/", 2)[0]
        known = backends.adapter_of(name).known[index] if backends.is_adapter(name) else None
        what = known.describe() if known is not None else f"known difference {index}"
        lines.append(f"  {label} {property_name}: first difference at {entry['tensor']}, acknowledged: {what}")
        example = entry["example"].replace("Failing test case: ", "").replace("Falsifying example: ", "")
        lines.append("    its smallest example, as drawn (before the adapter's switches and searches hold it):")
        lines += [f"      {line}" for line in example.splitlines()]
    return lines
