"""Hugging Face model folders as published: `config.json` beside the weights, read without transformers.

    from conformance.convert import from_hf_folder
    config, params = from_hf_folder("opus-mt-en-de/")          # every switch from config.json
    config, params = from_hf_folder("bart-large-cnn/")         # any family with an [hf] layout

config.json's `model_type` picks the layout: the built-in layout whose `[hf]` table names it
(`hf-marian`, `hf-bart`, `hf-mbart`, `hf-m2m100`, `hf-pegasus`, `hf-t5`, `hf-mt5`; see docs/porting.md,
"Families").
That table says which config.json field gives which switch and size, with the config class's
defaults, and which values the layout cannot express (a `ConfigError` naming the field); one
reader (`conformance.convert.hf_config`) serves every family. The weights are whichever of these
the folder holds (the first found):

    model.safetensors                               one file
    model.safetensors.index.json + its shards       `weight_map` names the shard of every key
    pytorch_model.bin                               a state dict, through PyTorch's weights-only unpickler
    pytorch_model.bin.index.json + its shards       the same, sharded (`pytorch_model-0000i-of-0000n.bin`), each
                                                    shard through the same unpickler; `weight_map` names the
                                                    shard of every key
    flax_model.msgpack                              what transformers <= 4.x wrote for Flax models, renamed
                                                    to PyTorch's names by transformers' own rule (below)
    flax_model.msgpack.index.json + its shards      the same, sharded: `weight_map` names the shard of every
                                                    parameter by its "/"-joined path

`generation_config.json` (or, in older folders without one, the same fields in `config.json`, as
transformers reads them) is recorded in the checkpoint's notes under "generation", as JSON, for
decoding, completed by the family's
`[hf.generation_defaults]` where the folder names none (T5's decoder start: its pad id). An export (`write_folder`) is
the inverse: config.json, generation_config.json and model.safetensors that the family's
`from_pretrained` loads. Nothing in the folder is executed: JSON is parsed, safetensors headers are
validated, and a pickle goes through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from conformance.convert.errors import KeyMismatchError
from conformance.convert.layout import Layout, builtin_layouts, load_layout
from conformance.convert.readers import read_file
from conformance.convert.planner import merge_switches
from conformance.core.checkpoint import read_tensors
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(path, f"is not readable JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, f"must hold a JSON object, got {type(data).__name__}")
    return data


def read_weights(folder: Path) -> dict[str, np.ndarray]:
    """The folder's weights as `{PyTorch key: array}`, from the first format it holds."""
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return dict(read_tensors(single)[1])
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(index, "has no weight_map of key -> shard file name")
        return _shards(folder, index, weight_map, lambda path: read_tensors(path)[1])
    if (folder / "pytorch_model.bin").is_file():
        return read_file(folder / "pytorch_model.bin")
    bin_index = folder / "pytorch_model.bin.index.json"
    if bin_index.is_file():  # each shard through the same weights-only unpickler as one file
        weight_map = _json(bin_index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(bin_index, "has no weight_map of key -> shard file name")
        return _shards(folder, bin_index, weight_map, read_file)
    if (folder / "flax_model.msgpack").is_file():
        return flax_to_torch_names(read_file(folder / "flax_model.msgpack"), folder / "flax_model.msgpack")
    flax_index = folder / "flax_model.msgpack.index.json"
    if flax_index.is_file():
        return flax_to_torch_names(_flax_shards(folder, flax_index), flax_index)
    raise CheckpointError(folder, "holds no weights this reader knows: model.safetensors, model.safetensors.index.json "
                          "with its shards, pytorch_model.bin, pytorch_model.bin.index.json with its shards, or "
                          "flax_model.msgpack (or its index with shards)")


def _flax_shards(folder: Path, index: Path) -> dict[str, np.ndarray]:
    """A sharded Flax checkpoint (transformers 4.x `FlaxPreTrainedModel.save_pretrained` with
    `max_shard_size`): each `flax_model-0000i-of-0000n.msgpack` is a msgpack tree of some of the
    parameters, and the index's `weight_map` names each parameter's shard by its path joined
    with "/". Returns the flat parameters under their "."-joined paths, each checked against the
    index."""
    weight_map = _json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(index, "has no weight_map of parameter path -> shard file name")
    where = {".".join(path.split("/")): shard for path, shard in weight_map.items()}
    return _shards(folder, index, where, read_file)


def _shards(folder: Path, index: Path, where: dict[str, str], read) -> dict[str, np.ndarray]:
    """The arrays of a sharded checkpoint whose index places each key in a shard (`where`: key ->
    shard file name), each shard read by `read(path) -> {key: array}`: every key must be in the
    shard the index names, and every key the index lists must be found."""
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(where.values())):
        if Path(shard).name != shard:
            raise CheckpointError(index, f"names the shard {shard!r}, which is not a file in this folder")
        for key, value in read(folder / shard).items():
            if where.get(key) != shard:
                raise CheckpointError(folder / shard, f"holds {key!r}, which the index places in {where.get(key)!r}")
            out[key] = value
    missing = sorted(set(where) - set(out))
    if missing:
        raise CheckpointError(index, f"lists {missing[0]!r} (and {len(missing) - 1} more), which its shard does not hold")
    return out


def flax_to_torch_names(flat: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """A transformers Flax model's flattened parameters under its PyTorch twin's names, by the rule
    transformers itself converts them with: a Dense `kernel` (d_in, d_out) is the Linear `weight`
    transposed, and a 1-D Conv `kernel` (3, C_in, C_out) (FlaxWhisper's front end) the Conv1d
    `weight` (C_out, C_in, 3), every axis reversed by the same `.T`; a LayerNorm `scale` and an
    Embed `embedding` are the `weight`. Everything else (biases, `final_logits_bias`) keeps its name."""
    out: dict[str, np.ndarray] = {}
    for key, value in flat.items():
        stem, _, leaf = key.rpartition(".")
        if leaf == "kernel":
            if value.ndim not in (2, 3):
                raise CheckpointError(path, f"{key} has shape {value.shape}; a Dense kernel is 2-D, a 1-D Conv's 3-D")
            name, value = f"{stem}.weight", np.ascontiguousarray(value.T)
        elif leaf in ("scale", "embedding"):
            name = f"{stem}.weight"
        else:
            name = key
        if name in out:
            raise CheckpointError(path, f"{key} and another entry both become {name}")
        out[name] = value
    return out


def hf_layouts() -> list[Layout]:
    """The built-in layouts of transformers families (those with an `[hf]` table)."""
    return [layout for layout in builtin_layouts() if layout.hf is not None]


def hf_layout(hf: dict, where: str, layout: str | Layout | None = None) -> Layout:
    """The layout of a Hugging Face config (parsed config.json or `model.config.to_dict()`): the
    built-in one whose `[hf]` table names its model_type, or `layout` when given (which must
    have an `[hf]` table naming it). A config that names no model_type, or one no layout reads,
    is a `CheckpointError` on `where` (model_type is transformers' field, not a ModelConfig one)."""
    model_type = hf.get("model_type")
    says = (f"says model_type {model_type!r}" if model_type is not None else
            "names no model_type (the field transformers' AutoConfig picks the model class by)")
    if layout is not None:
        chosen = load_layout(layout)
        if chosen.hf is None or model_type not in chosen.hf.model_types:
            reads = f"model_type {', '.join(chosen.hf.model_types)}" if chosen.hf else "no [hf] table"
            raise CheckpointError(where, f"{says}, but layout {chosen.name} reads {reads}")
        return chosen
    for candidate in hf_layouts():
        if model_type in candidate.hf.model_types:
            return candidate
    known = ", ".join(f"{t} ({c.name})" for c in hf_layouts() for t in c.hf.model_types)
    what = "no built-in layout reads it" if model_type is not None else "add the family's"
    raise CheckpointError(where, f"{says}; {what}: the folders this converter reads name one of: {known}")


def read_switches(folder: Path, layout: str | Layout | None = None) -> tuple[Layout, dict[str, Any]]:
    """The folder's layout and the ModelConfig fields its `config.json` gives (by the layout's
    `[hf]` table), refusing what the layout cannot express."""
    path = folder / "config.json"
    hf = _json(path)
    chosen = hf_layout(hf, str(path), layout)
    return chosen, chosen.hf.read(hf, str(path))


def read_generation(folder: Path, layout: Layout) -> dict[str, Any]:
    """Special ids and decoding defaults: generation_config.json's, or config.json's in a folder
    without one. As transformers' `from_pretrained`, which then ignores config.json's generation
    fields (a `max_length` there does not apply beside a generation_config.json naming none)."""
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            return layout.hf.generation_of(_json(folder / name))
    return {}


def from_hf_folder(folder: str | Path, **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A published model folder -> `(config, params)`; see the module docstring."""
    result = convert_folder(folder, **overrides)
    return result.config, result.params


def config_beside(path: Path) -> Path | None:
    """The Hugging Face `config.json` next to a weights file (one naming a `model_type`), or None.

    A weights file taken out of its folder loses what only the config tells (activation, embedding
    scale, pad id), and the layout's defaults would silently stand in for them."""
    config = Path(path).parent / "config.json"
    if not Path(path).is_file() or not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None  # not a Hugging Face config: some other tool's file
    return config if isinstance(data, dict) and "model_type" in data else None


def convert_folder(folder: str | Path, *, dtype: str | None = None, weights: dict[str, np.ndarray] | None = None,
                   source_file: str | None = None, layout: str | Layout | None = None, **overrides: Any):
    """The `Conversion` of a folder (config, params and the decisions made), as `rosetta convert` prints it.

    `weights` (with the `source_file` they were read from): one weights file of the folder, given
    on its own, converted with the folder's config.json all the same. `layout`: the layout to read
    it with (default: the one config.json's model_type names)."""
    from conformance.convert.engine import convert_arrays

    folder = Path(folder)
    if not is_hf_folder(folder):
        raise CheckpointError(folder, "is not a model folder (no config.json)")
    chosen, read = read_switches(folder, layout)
    arrays = read_weights(folder) if weights is None else weights
    values = merge_switches(read, {}, overrides, "config.json")
    notes = {"source": "Hugging Face folder", "source_file": source_file or folder.name}
    generation = read_generation(folder, chosen)
    try:
        result = convert_arrays(arrays, chosen, dtype=dtype, notes=notes, **values)
    except KeyMismatchError as exc:
        raise _other_family(folder, chosen, arrays) or exc from None
    record_generation(result, chosen, generation, "the folder")
    beside = f", beside {source_file}" if source_file is not None else ""
    result.decisions.insert(1, f"switches read from {folder / 'config.json'}{beside} (model_type "
                               f"{read_model_type(folder)!r}, layout {chosen.name})")
    return result


def record_generation(result, layout: Layout, generation: dict[str, Any], source: str) -> None:
    """Keep `generation` (the special ids and decoding defaults found) in the checkpoint's
    "generation" note, completed by the family's `[hf.generation_defaults]` for the fields the
    source names none of (T5's decoder start, which T5Config does not have: its pad id), so that
    `generate` needs no ids passed; each completion is said in the decisions.

    A field that changes transformers' output but that `generate` does not apply
    (`conformance.core.generation.note.UNAPPLIED_GENERATION`: do_sample true, sequence_bias, ...)
    is kept in the note and named in a warning (a decision, and a GenerationWarning; `generate`
    names it again at every call); the conversion goes on, the weights being right. Such a field
    at a value that changes nothing is left out of the note."""
    import warnings

    from conformance.core.generation.note import (UNAPPLIED_GENERATION, GenerationWarning, unapplied_generation,
                                                  unapplied_message)

    unapplied = unapplied_generation(generation)
    generation = {name: value for name, value in generation.items()
                  if name not in UNAPPLIED_GENERATION or name in unapplied}
    if unapplied:
        message = unapplied_message(unapplied, f"{source}'s generation settings").replace(
            " (docs/decoding.md)", " (the weights are converted all the same; see docs/decoding.md)")
        result.decisions.append(f"generation warning: {message}")
        warnings.warn(message, GenerationWarning, stacklevel=3)
    for name, field in layout.hf.generation_defaults.items():
        if name not in generation:
            generation[name] = getattr(result.config, field)
            result.decisions.append(f"generation: {name}={generation[name]} ({source} names none; "
                                    f"{layout.hf.architectures[0]} starts from its {field})")
    if generation:
        result.config = result.config.replace(notes={**result.config.notes,
                                                     "generation": json.dumps(generation, sort_keys=True)})


def read_model_type(folder: Path) -> Any:
    return _json(folder / "config.json").get("model_type")


def _other_family(folder: Path, chosen: Layout, arrays: dict) -> CheckpointError | None:
    """When a folder's weights fit other families' keys exactly, its config.json names the wrong
    model_type: say that (naming every family they fit: Pegasus' keys are Blenderbot's), rather
    than list every key the chosen layout misses."""
    from conformance.convert.planner import check_keys

    fits = []
    for other in hf_layouts():
        if other.name != chosen.name:
            try:
                if check_keys(other, arrays).exact:
                    fits.append(other)
            except ValueError:
                continue
    if not fits:
        return None
    named = " or ".join(f"{o.name} (model_type {', '.join(o.hf.model_types)})" for o in fits)
    return CheckpointError(folder / "config.json", f"says model_type {read_model_type(folder)!r} (layout "
                           f"{chosen.name}), but the weights are those of layout {named}")


def folder_files(config: ModelConfig, layout: Layout) -> tuple[dict[str, Any], dict[str, Any] | None, list[str]]:
    """`(config.json, generation_config.json or None, warnings)` for a folder of `config` in
    `layout`'s family: the inverse of `read_switches` and `read_generation`. The special ids come
    from the checkpoint's "generation" note (a converted folder's own); without one, the family's
    `[hf.generation_defaults]` (Marian: the decoder starts with the pad id), or none at all."""
    where = f"the {layout.name} system's config.json"
    hf = layout.hf.write(config, where)
    note = json.loads(config.notes["generation"]) if config.notes.get("generation") else {}
    generation = {k: v for k, v in note.items() if k in layout.hf.generation}
    warnings = []
    if not generation:
        generation = {name: getattr(config, field) for name, field in layout.hf.generation_defaults.items()}
        warnings.append("the checkpoint records no generation settings (note 'generation'), so config.json names no "
                        f"eos_token_id{' and no generation_config.json is written' if not generation else ''}: "
                        f"transformers takes {layout.hf.architectures[0]}'s defaults for the special ids; set them "
                        "before generating with transformers")
    hf.update({k: generation[k] for k in layout.hf.special_ids if k in generation})
    hf["pad_token_id"] = config.pad_id  # the model's padding id, whatever decoding was given
    return hf, (generation or None), warnings


def write_folder(folder: Path, config: ModelConfig, state_dict: dict[str, np.ndarray],
                 layout: str | Layout = "hf-marian") -> list[str]:
    """A new folder that the family's `from_pretrained` loads: config.json, generation_config.json
    (when there are generation settings) and model.safetensors (the layout's state dict, with the
    "pt" format mark transformers checks). Returns the warnings to show. Refuses a folder that exists.
    The folder is built in a hidden directory beside it and renamed into place once complete, so an
    interrupted export leaves no folder. It does not load what it wrote: `conformance.formats`
    (`rosetta convert --to hf-<family>`) checks it with transformers before it lands."""
    from conformance.core.checkpoint import atomic_directory, write_tensors

    layout = load_layout(layout)
    if layout.hf is None:
        raise ConfigError("layout", f"layout {layout.name} has no [hf] table: it describes no Hugging Face folder")
    if folder.exists():
        raise CheckpointError(folder, "already exists; an export writes a new folder")
    hf, generation, warnings = folder_files(config, layout)
    with atomic_directory(folder) as staged:
        staged.mkdir()
        write_tensors(staged / "model.safetensors", state_dict, {"format": "pt"})
        files = [("config.json", hf)] + ([("generation_config.json", generation)] if generation else [])
        for name, data in files:
            (staged / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return warnings
