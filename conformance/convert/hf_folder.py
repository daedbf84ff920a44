"""Hugging Face model folders as published: `config.json` beside the weights, read without transformers.

    from conformance.convert import from_hf_folder
    config, params = from_hf_folder("opus-mt-en-de/")          # every switch from config.json

The weights are whichever of these the folder holds (the first found):

    model.safetensors                               one file
    model.safetensors.index.json + its shards       `weight_map` names the shard of every key
    pytorch_model.bin                               a state dict, through PyTorch's weights-only unpickler
    flax_model.msgpack                              what transformers <= 4.x wrote for Flax Marian, renamed
                                                    to PyTorch's names by transformers' own rule (below)

`config.json` gives every switch the `hf-marian` layout leaves free or required (activation,
embedding scale, pad id, head count, sizes); a field this layout cannot express is a
`ConfigError` naming it. `generation_config.json` (or, in older folders, the same fields in
`config.json`) is recorded in the checkpoint's notes under "generation", as JSON, for decoding.
Nothing in the folder is executed: JSON is parsed, safetensors headers are validated, and a
pickle goes through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from conformance.convert.readers import read_file
from conformance.convert.sources import GENERATION_KEYS, HF_ACTIVATIONS, merge_switches
from conformance.core.checkpoint import read_tensors
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError


# Marian-family config fields whose non-default value the hf-marian layout cannot express.
# (field, the value Marian models have, why another one cannot be converted)
_UNSUPPORTED = (
    ("normalize_before", False, "pre-LN Marian/BART variants have norms the hf-marian layout does not map"),
    ("normalize_embedding", False, "a LayerNorm on the embeddings (layernorm_embedding) is not a ModelConfig switch"),
    ("add_final_layer_norm", False, "final encoder/decoder norms are not in the hf-marian layout"),
    ("add_bias_logits", False, "a bias inside lm_head is not in the hf-marian layout (it has final_logits_bias)"),
    ("static_position_embeddings", True, "learned position embeddings are not what Marian's sinusoid is"),
    ("share_encoder_decoder_embeddings", True, "separate source and target embeddings are not in the hf-marian layout"),
    ("tie_word_embeddings", True, "an lm_head not tied to the embedding is not in the hf-marian layout"),
)


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
        out: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            if Path(shard).name != shard:
                raise CheckpointError(index, f"names the shard {shard!r}, which is not a file in this folder")
            tensors = read_tensors(folder / shard)[1]
            for key, value in tensors.items():
                if weight_map.get(key) != shard:
                    raise CheckpointError(folder / shard, f"holds {key!r}, which the index places in {weight_map.get(key)!r}")
                out[key] = value
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise CheckpointError(index, f"lists {missing[0]!r} (and {len(missing) - 1} more), which its shard does not hold")
        return out
    if (folder / "pytorch_model.bin").is_file():
        return read_file(folder / "pytorch_model.bin")
    if (folder / "flax_model.msgpack").is_file():
        return flax_to_torch_names(read_file(folder / "flax_model.msgpack"), folder / "flax_model.msgpack")
    raise CheckpointError(folder, "holds no weights this reader knows: model.safetensors, model.safetensors.index.json "
                          "with its shards, pytorch_model.bin, or flax_model.msgpack")


def flax_to_torch_names(flat: dict[str, np.ndarray], path: Path) -> dict[str, np.ndarray]:
    """A transformers Flax model's flattened parameters under its PyTorch twin's names, by the rule
    transformers itself converts them with: a Dense `kernel` (d_in, d_out) is the Linear `weight`
    transposed; a LayerNorm `scale` and an Embed `embedding` are the `weight`. Everything else
    (biases, `final_logits_bias`) keeps its name."""
    out: dict[str, np.ndarray] = {}
    for key, value in flat.items():
        stem, _, leaf = key.rpartition(".")
        if leaf == "kernel":
            if value.ndim != 2:
                raise CheckpointError(path, f"{key} has shape {value.shape}; a Dense kernel is 2-D")
            name, value = f"{stem}.weight", np.ascontiguousarray(value.T)
        elif leaf in ("scale", "embedding"):
            name = f"{stem}.weight"
        else:
            name = key
        if name in out:
            raise CheckpointError(path, f"{key} and another entry both become {name}")
        out[name] = value
    return out


def _field(hf: dict, name: str, path: Path, kind=int):
    if name not in hf:
        raise ConfigError(name, f"is missing from {path}")
    value = hf[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(name, f"{path}: must be an int, got {value!r}")
    return value


def read_switches(folder: Path) -> dict[str, Any]:
    """ModelConfig fields from `config.json` (a Marian config), refusing what hf-marian cannot express."""
    path = folder / "config.json"
    hf = _json(path)
    if hf.get("model_type") != "marian":
        raise ConfigError("model_type", f"{path} says {hf.get('model_type')!r}; this reader converts Marian folders "
                          "(model_type 'marian', layout hf-marian)")
    for name, supported, why in _UNSUPPORTED:
        if name in hf and hf[name] != supported:
            raise ConfigError(name, f"{path} has {name}={hf[name]!r}: {why}")
    vocab = _field(hf, "vocab_size", path)
    decoder_vocab = hf.get("decoder_vocab_size")
    if decoder_vocab is not None and decoder_vocab != vocab:
        raise ConfigError("decoder_vocab_size", f"{path} has decoder_vocab_size={decoder_vocab} != vocab_size={vocab}: "
                          "separate source and target vocabularies are not in the hf-marian layout")
    pairs = {"n_heads": ("encoder_attention_heads", "decoder_attention_heads"),
             "d_ff": ("encoder_ffn_dim", "decoder_ffn_dim")}
    for name, (a, b) in pairs.items():
        if _field(hf, a, path) != _field(hf, b, path):
            raise ConfigError(name, f"{path}: {a}={hf[a]} differs from {b}={hf[b]}; ModelConfig has one {name}")
    activation = hf.get("activation_function", "gelu")  # MarianConfig's default
    if activation not in HF_ACTIVATIONS:
        raise ConfigError("activation", f"{path}: activation_function {activation!r} has no ModelConfig name; known: "
                          f"{sorted(HF_ACTIVATIONS)}")
    scale = hf.get("scale_embedding", False)  # MarianConfig's default
    if not isinstance(scale, bool):
        raise ConfigError("scale_embedding", f"{path}: must be true or false, got {scale!r}")
    return {
        "n_heads": hf["encoder_attention_heads"], "d_ff": hf["encoder_ffn_dim"], "d_model": _field(hf, "d_model", path),
        "n_encoder_layers": _field(hf, "encoder_layers", path), "n_decoder_layers": _field(hf, "decoder_layers", path),
        "max_len": _field(hf, "max_position_embeddings", path), "activation": HF_ACTIVATIONS[activation],
        "scale_embedding": scale, "pad_id": _field(hf, "pad_token_id", path),
    }


def read_generation(folder: Path) -> dict[str, Any]:
    """Special ids and decoding defaults: generation_config.json first, then config.json."""
    found: dict[str, Any] = {}
    for name in ("generation_config.json", "config.json"):
        if (folder / name).is_file():
            data = _json(folder / name)
            for key in GENERATION_KEYS:
                if key in data and data[key] is not None and key not in found:
                    found[key] = data[key]
    return found


def from_hf_folder(folder: str | Path, **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """A published Marian folder -> `(config, params)`; see the module docstring."""
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
                   source_file: str | None = None, **overrides: Any):
    """The `Conversion` of a folder (config, params and the decisions made), as `rosetta convert` prints it.

    `weights` (with the `source_file` they were read from): one weights file of the folder, given
    on its own, converted with the folder's config.json all the same."""
    from conformance.convert.engine import convert_arrays

    folder = Path(folder)
    if not is_hf_folder(folder):
        raise CheckpointError(folder, "is not a model folder (no config.json)")
    read = read_switches(folder)
    arrays = read_weights(folder) if weights is None else weights
    values = merge_switches(read, {}, overrides, "config.json")
    notes = {"source": "Hugging Face folder", "source_file": source_file or folder.name}
    generation = read_generation(folder)
    if generation:
        notes["generation"] = json.dumps(generation, sort_keys=True)
    result = convert_arrays(arrays, "hf-marian", dtype=dtype, notes=notes, **values)
    if source_file is not None:
        result.decisions.insert(1, f"switches read from {folder / 'config.json'}, beside {source_file}")
    return result


# Our activation -> the activation_function a MarianConfig spells it with (the first of HF_ACTIVATIONS).
def _hf_activation(name: str) -> str:
    return next(hf for hf, ours in HF_ACTIVATIONS.items() if ours == name)


def folder_files(config: ModelConfig) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """`(config.json, generation_config.json, warnings)` for a Marian folder of `config`: the
    inverse of `read_switches` and `read_generation`. The special ids come from the checkpoint's
    "generation" note (a converted folder's own); without one, Marian's convention (the decoder
    starts with the pad id) and a warning that no end-of-sequence id is known."""
    generation = json.loads(config.notes["generation"]) if config.notes.get("generation") else {}
    warnings = []
    if not generation:
        generation = {"decoder_start_token_id": config.pad_id, "pad_token_id": config.pad_id}
        warnings.append("the checkpoint records no generation settings (note 'generation'), so "
                        "generation_config.json names no eos_token_id; add it before generating with transformers")
    hf = {
        "architectures": ["MarianMTModel"], "model_type": "marian",
        "vocab_size": config.src_vocab_size, "decoder_vocab_size": config.tgt_vocab_size, "d_model": config.d_model,
        "encoder_layers": config.n_encoder_layers, "decoder_layers": config.n_decoder_layers,
        "encoder_attention_heads": config.n_heads, "decoder_attention_heads": config.n_heads,
        "encoder_ffn_dim": config.d_ff, "decoder_ffn_dim": config.d_ff, "max_position_embeddings": config.max_len,
        "activation_function": _hf_activation(config.activation), "scale_embedding": config.scale_embedding,
        "share_encoder_decoder_embeddings": True, "tie_word_embeddings": True,
        **{k: generation[k] for k in ("pad_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id")
           if k in generation},
    }
    hf["pad_token_id"] = config.pad_id  # the model's padding id, whatever decoding was given
    return hf, generation, warnings


def write_folder(folder: Path, config: ModelConfig, state_dict: dict[str, np.ndarray]) -> list[str]:
    """A new folder that `MarianMTModel.from_pretrained` loads: config.json, generation_config.json
    and model.safetensors (the hf-marian state dict, with the "pt" format mark transformers checks).
    Returns the warnings to show. Refuses a folder that exists."""
    from conformance.core.checkpoint import write_tensors

    if folder.exists():
        raise CheckpointError(folder, "already exists; an export writes a new folder")
    hf, generation, warnings = folder_files(config)
    folder.mkdir()
    write_tensors(folder / "model.safetensors", state_dict, {"format": "pt"})
    for name, data in (("config.json", hf), ("generation_config.json", generation)):
        (folder / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return warnings
