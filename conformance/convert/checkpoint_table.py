"""A layout's `[checkpoint]` table, parsed: how a system's training checkpoint holds its tensors,
options and vocabularies (read by `conformance.convert.system_files`, which documents the table).
Framework-free, and imported by `conformance.convert.layout`, so it imports no reader."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Mapping

from conformance.convert.errors import LayoutError
from conformance.convert.hf_config import FieldSpec, Unsupported, parse_fields, parse_unsupported

# The classes a checkpoint's pickle may build besides tensors and containers: a Namespace holds
# plain values and is rebuilt by setting its __dict__.
SAFE_CLASSES = {"argparse.Namespace": argparse.Namespace}

_TABLE_KEYS = {"tensors", "options", "classes", "vocabularies", "tokens", "generation", "fields", "unsupported"}


@dataclass(frozen=True)
class CheckpointTable:
    tensors: Mapping[str, str]
    options: str
    classes: tuple[str, ...]
    vocabularies: tuple[str, ...] = ()
    tokens: Mapping[str, str] = field(default_factory=dict)
    generation: Mapping[str, str] = field(default_factory=dict)
    fields: tuple[FieldSpec, ...] = ()
    unsupported: tuple[Unsupported, ...] = ()

    def fits(self, obj: Any) -> bool:
        """Whether a loaded file holds every tensor entry and the options (a dotted path)."""
        if not isinstance(obj, Mapping) or not all(e in obj for e in self.tensors):
            return False
        value: Any = obj
        for part in self.options.split("."):
            if not isinstance(value, Mapping) or part not in value:
                return False
            value = value[part]
        return value is not None


def parse_checkpoint_table(table: Any, where: str) -> CheckpointTable:
    """Validate a layout's raw `[checkpoint]` table; `LayoutError` names the first problem."""
    where = f"{where} [checkpoint]"
    if not isinstance(table, dict):
        raise LayoutError(where, "must be a table")
    unknown = sorted(set(table) - _TABLE_KEYS)
    if unknown:
        raise LayoutError(where, f"unknown key(s) {unknown}; expected some of {sorted(_TABLE_KEYS)}")
    tensors = table.get("tensors")
    if not isinstance(tensors, dict) or not tensors or not all(isinstance(v, str) for v in tensors.values()):
        raise LayoutError(where, "tensors must be a table of entry = \"the prefix its keys take\"")
    options = table.get("options")
    if not isinstance(options, str) or not options:
        raise LayoutError(where, "options must name the entry that holds the system's options")
    classes = table.get("classes", [])
    if not isinstance(classes, list) or any(c not in SAFE_CLASSES for c in classes):
        raise LayoutError(where, f"classes may only name classes known to unpickle safely: {sorted(SAFE_CLASSES)}")
    vocabularies = table.get("vocabularies", [])
    if not isinstance(vocabularies, list) or not all(isinstance(v, str) and v for v in vocabularies):
        raise LayoutError(where, "vocabularies must be a list of dotted paths to token lists")
    tokens, generation = table.get("tokens", {}), table.get("generation", {})
    for name, value in (("tokens", tokens), ("generation", generation)):
        if not isinstance(value, dict) or not all(isinstance(v, str) and v for v in value.values()):
            raise LayoutError(where, f"[checkpoint.{name}] must be a table of field = \"token\"")
    if (tokens or generation) and not vocabularies:
        raise LayoutError(where, "tokens are looked up in vocabularies: name them")
    fields_ = parse_fields(table["fields"], where, "[checkpoint.fields]") if "fields" in table else ()
    unsupported = parse_unsupported(table.get("unsupported", {}), where, "[checkpoint.unsupported]")
    return CheckpointTable(dict(tensors), options, tuple(classes), tuple(vocabularies), dict(tokens), dict(generation),
                           fields_, unsupported)
