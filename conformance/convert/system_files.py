"""Training checkpoints that carry their own options: a layout's `[checkpoint]` table, as data.

Some systems save more than a state dict: OpenNMT-py's `ModelSaver` writes
`{"model": ..., "generator": ..., "vocab": ..., "opt": argparse.Namespace, "optim": ...}`, the
generator's tensors beside the model's and every switch of the run in `opt`. A layout says how to
read such a file in one table, and this module reads every such system by that table alone:

    [checkpoint]
    tensors = { model = "", generator = "generator." }  # entries of tensors, and the prefix their keys take
    options = "opt"                                     # the entry of the system's own options (dotted: "cfg.model")
    classes = ["argparse.Namespace"]                    # what the unpickler may build beyond tensors
    vocabularies = ["vocab.src", "vocab.tgt"]           # token lists (dotted paths into the file)
    [checkpoint.tokens]                                 # a ModelConfig field -> the token whose index
    pad_id = "<blank>"                                  # gives it (the same in every vocabulary)
    [checkpoint.generation]                             # generation note fields -> a token of the
    decoder_start_token_id = "<s>"                      # last vocabulary (the target's)
    [checkpoint.fields]                                 # an option -> the ModelConfig field(s) it
    heads = { to = "n_heads" }                          # gives (the [hf.fields] syntax)
    [checkpoint.unsupported]                            # options whose other values cannot convert
    max_relative_positions = { value = 0, field = "position", why = "..." }

A file is this system's when it is a mapping holding every `tensors` entry and the `options`
entry. Nothing in it runs: PyTorch's restricted unpickler builds tensors and plain containers, and
a class only when the file needs it and `classes` of a built-in layout names it among
`SAFE_CLASSES` (classes whose unpickling sets attributes and calls nothing else); any other global
is refused, named. A user's layout file cannot widen that list.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from conformance.convert.arrays import as_numpy
from conformance.convert.checkpoint_table import SAFE_CLASSES, CheckpointTable, parse_checkpoint_table  # noqa: F401
from conformance.convert.errors import TensorError
from conformance.convert.hf_config import read_fields
from conformance.core.errors import CheckpointError, ConfigError

def allowed_classes() -> set[str]:
    """Every class a built-in layout's `[checkpoint]` lets the unpickler build."""
    from conformance.convert.layout import builtin_layouts

    return {name for layout in builtin_layouts() if layout.checkpoint for name in layout.checkpoint.classes}


@dataclass
class SystemFile:
    """A training checkpoint read by its layout's `[checkpoint]` table: every tensor under the
    layout's keys, the ModelConfig fields the options and vocabularies give (`told`), the
    generation note's ids, and what was read from where (`sources`, for the decisions), with what
    the generation note was read from (`generation_from`, said in the decisions)."""

    layout: Any
    arrays: dict[str, np.ndarray]
    told: dict[str, Any]
    generation: dict[str, Any]
    where: str
    generation_from: str = ""


def _entry(obj: Mapping, path: str, file: Path) -> Any:
    value: Any = obj
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise CheckpointError(file, f"has no entry {path!r}, which its layout reads")
        value = value[part]
    return value


def _index(vocab: Any, token: str, name: str, file: Path) -> int:
    if not isinstance(vocab, (list, tuple)) or not all(isinstance(t, str) for t in vocab):
        raise CheckpointError(file, f"entry {name!r} is not a list of tokens")
    if token not in vocab:
        raise CheckpointError(file, f"vocabulary {name!r} has no token {token!r}, which its layout reads an id from")
    return vocab.index(token)


def system_file(obj: Any, file: Path) -> SystemFile | None:
    """`obj` (a loaded PyTorch file) as a training checkpoint of a built-in layout (its
    `[checkpoint]`), or a file bundling its config with its weights (`[bundle]`), or None."""
    from conformance.convert.layout import builtin_layouts

    for layout in builtin_layouts():
        table = layout.checkpoint
        if table is None or not table.fits(obj):
            continue
        arrays: dict[str, np.ndarray] = {}
        for entry, prefix in table.tensors.items():
            tensors = obj[entry]
            if tensors is None:
                continue  # OpenNMT-py writes generator=None for a LoRA run: no tensors there
            if not isinstance(tensors, Mapping):
                raise CheckpointError(file, f"entry {entry!r} is not a state dict")
            try:
                arrays.update({prefix + str(key): as_numpy(value, str(key)) for key, value in tensors.items()})
            except TensorError as exc:
                raise CheckpointError(file, f"entry {entry!r}: {exc}") from None
        options = _entry(obj, table.options, file)
        values = vars(options) if isinstance(options, argparse.Namespace) else options
        if not isinstance(values, Mapping):
            raise CheckpointError(file, f"entry {table.options!r} holds no options")
        where = f"{file.name}'s {table.options!r}"
        told = read_fields(table.fields, table.unsupported, values, where)
        vocabs = [(name, _entry(obj, name, file)) for name in table.vocabularies]
        for target, token in table.tokens.items():
            ids = {name: _index(vocab, token, name, file) for name, vocab in vocabs}
            if len(set(ids.values())) > 1:
                raise ConfigError(target, f"{file.name}: the token {token!r} has ids {ids}; ModelConfig has one {target}")
            told[target] = next(iter(ids.values()))
        generation = {name: _index(vocabs[-1][1], token, vocabs[-1][0], file) for name, token in table.generation.items()}
        return SystemFile(layout, arrays, told, generation, where,
                          "read from the target vocabulary" if generation else "")
    return bundle_file(obj, file)


def bundle_layout(obj: Any):
    """The built-in layout whose `[bundle]` entries are `obj`'s top level (a loaded file), or None."""
    from conformance.convert.layout import builtin_layouts

    if not isinstance(obj, Mapping):
        return None
    return next((layout for layout in builtin_layouts() if layout.bundle is not None
                 and layout.bundle.config in obj and layout.bundle.weights in obj), None)


def bundle_file(obj: Any, file: Path) -> SystemFile | None:
    """`obj` as a checkpoint that bundles its config with its weights (a layout's `[bundle]`:
    openai-whisper's {"dims", "model_state_dict"}; `conformance.convert.bundles`), or None."""
    layout = bundle_layout(obj)
    if layout is None:
        return None
    table = layout.bundle
    where = f"{file.name}'s {table.config!r}"
    weights = obj[table.weights]
    if not isinstance(weights, Mapping):
        raise CheckpointError(file, f"its {table.weights!r} entry must be a state dict, got {type(weights).__name__}")
    try:
        arrays = {str(key): as_numpy(value, str(key)) for key, value in weights.items()}
    except TensorError as exc:
        raise CheckpointError(file, f"entry {table.weights!r}: {exc}") from None
    generation = table.generation_note(obj[table.config]) or {}
    if generation:
        kind = "multilingual" if generation["is_multilingual"] else "English-only"
        origin = (f"the decoding settings of {layout.name}'s decode, from its n_vocab ({obj[table.config]['n_vocab']}: "
                  f"{kind} special ids) and its DecodingOptions' defaults ([bundle.generation]; docs/whisper.md)")
    elif table.generation is not None:
        origin = (f"no note: {layout.name}'s tokenizer numbers no special ids for n_vocab="
                  f"{obj[table.config].get('n_vocab')!r}; pass bos_id and eos_id to generate")
    else:
        origin = ""
    return SystemFile(layout, arrays, table.read(obj[table.config], where), generation, where, origin)


def convert_system_file(system: SystemFile, *, layout=None, dtype: str | None = None,
                        notes: Mapping[str, str] | None = None, **overrides: Any):
    """The `Conversion` of a training checkpoint: its arrays with its layout (or `layout`), the
    switches its options and vocabularies give, then `overrides`, which may not contradict them."""
    from conformance.convert.engine import convert_arrays
    from conformance.convert.planner import merge_switches

    values = merge_switches(system.told, {}, overrides, system.where)
    chosen = system.layout if layout is None else layout
    result = convert_arrays(system.arrays, chosen, dtype=dtype, notes=notes, **values)
    vocabularies = system.layout.checkpoint is not None and system.layout.checkpoint.vocabularies
    result.decisions.insert(1, f"switches read from {system.where}{' and its vocabularies' if vocabularies else ''} "
                               f"(layout {system.layout.name}): "
                               + ", ".join(f"{k}={v!r}" for k, v in sorted(system.told.items())))
    if system.generation:
        result.config = result.config.replace(notes={**result.config.notes,
                                                     "generation": json.dumps(system.generation, sort_keys=True)})
        if system.layout.bundle is not None:  # a whole decode's settings: said by where they come from
            result.decisions.append(f"generation: {system.generation_from}, in the \"generation\" note")
        else:
            result.decisions.append("generation: " + ", ".join(f"{k}={v}" for k, v in sorted(system.generation.items()))
                                    + f" ({system.generation_from})")
    elif system.generation_from:  # a bundle whose tokenizer numbers no special ids for its vocabulary
        result.decisions.append(f"generation: {system.generation_from}")
    return result
