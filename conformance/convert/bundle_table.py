"""A layout's `[bundle]` table: a checkpoint file that bundles its config with its weights, as data.

openai-whisper saves `{"dims": asdict(ModelDimensions), "model_state_dict": state_dict}`, which
`whisper.load_model(path)` reads. The layout that describes its keys says, in one table, which
entry holds the config and which the state dict, which config entry gives which ModelConfig
field (as `[hf.fields]` does for a config.json: `conformance.convert.hf_config.FieldSpec`), and
what the system fixes that its config does not state:

    [bundle]
    config = "dims"                     # the entry holding the config: names -> numbers
    weights = "model_state_dict"        # the entry holding the state dict
    ffn_ratio = 4                       # d_ff = ffn_ratio * d_model (optional)
    pad_id = [[51865, 50257], [0, 50256]]   # [least vocabulary, pad_id]: the first reached (optional)
    [bundle.fields]
    n_audio_state = { to = "d_model" }  # every entry is required (no default)
    [bundle.generation]                 # optional: the tokenizer's ids and the decoding defaults
    multilingual_vocab = 51865          # (openai-whisper's; `BundleTable.generation_note`)

`conformance.convert.bundles` recognises such a file by its two entries (never by its key names),
reads it and writes it. Framework-free: JSON-like values in, ModelConfig field values out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from conformance.core.config import ModelConfig
from conformance.core.errors import ConfigError
from conformance.convert.errors import LayoutError
from conformance.convert.hf_config import FieldSpec, _field_spec, _to_ours, _to_theirs, _value_of

_TABLE_KEYS = {"config", "weights", "fields", "ffn_ratio", "pad_id", "generation"}

# What a [bundle.generation] table holds (openai-whisper's tokenizer and DecodingOptions).
_GENERATION_KEYS = {"multilingual_vocab", "end_of_text", "language_base", "after_languages", "languages", "blank",
                    "non_speech", "timestamps", "max_initial_timestamp", "chunk_length"}


@dataclass(frozen=True)
class BundleTable:
    config: str
    weights: str
    fields: tuple[FieldSpec, ...]
    ffn_ratio: int | None = None
    pad_ids: tuple[tuple[int, int], ...] = ()
    generation: dict | None = None

    def read(self, data: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The ModelConfig fields the file's config entry `data` gives (every entry required; two
        entries giving one field must agree), with the padding its vocabulary implies."""
        if not isinstance(data, Mapping):
            raise ConfigError(self.config, f"{where}: the {self.config!r} entry must map names to numbers, got "
                              f"{type(data).__name__}")
        values: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for spec in self.fields:
            if spec.hf not in data:
                raise ConfigError(spec.to[0], f"{where}: the {self.config!r} entry has no {spec.hf!r}")
            for target in spec.to:
                value = _to_ours(spec, target, data[spec.hf], where)
                if target in values and values[target] != value:
                    raise ConfigError(target, f"{where}: {origin[target]}={values[target]!r} and {spec.hf}={value!r} "
                                      f"both give {target}, which ModelConfig holds once")
                values[target], origin[target] = value, spec.hf
        if self.pad_ids and "tgt_vocab_size" in values:
            values["pad_id"] = self.pad_id(values["tgt_vocab_size"], where)
        return values

    def pad_id(self, vocab: int, where: str,
               advice: str = "give pad_id (--set pad_id=N)") -> int:
        """The padding id a vocabulary of `vocab` ids implies (the first [least vocabulary, id] reached).
        `advice` ends the refusal of a vocabulary without that id: reading a file, the pad_id to give;
        writing one (`write`), that the file cannot hold such a vocabulary."""
        for least, pad in self.pad_ids:
            if vocab >= least:
                if pad >= vocab:
                    raise ConfigError("pad_id", f"{where}: a vocabulary of {vocab} ids has no id {pad}, the padding "
                                      f"this system's tokenizer implies for it: {advice}")
                return pad
        raise ConfigError("pad_id", f"{where}: no padding id is known for a vocabulary of {vocab}: give pad_id")

    def generation_note(self, data: Mapping[str, Any]) -> dict | None:
        """The decoding settings of the system's `decode` for a file whose config entry is `data`,
        under transformers' generation_config.json names (the checkpoint's "generation" note), from
        the `[bundle.generation]` table: openai-whisper's tokenizer's special ids, which follow
        from n_vocab as `get_tokenizer(model.is_multilingual, num_languages=model.num_languages)`
        numbers them, and `DecodingOptions`' defaults (language detected, "transcribe",
        timestamps, suppress_tokens "-1", suppress_blank, max_initial_timestamp 1.0 s, sample_len
        n_text_ctx // 2). None without the table, or for a vocabulary its tokenizer cannot number
        (more languages than it has, or none)."""
        table = self.generation
        if table is None:
            return None
        vocab, audio, text = (int(data[name]) for name in ("n_vocab", "n_audio_ctx", "n_text_ctx"))
        multilingual = vocab >= table["multilingual_vocab"]
        count = vocab - table["language_base"] - int(multilingual)  # Whisper.num_languages
        if not 1 <= count <= len(table["languages"]):
            return None
        eot = table["end_of_text"]["multilingual" if multilingual else "english"]
        sot = eot + 1
        first = sot + 1 + count  # after the start of transcript and the languages
        special = {name: first + i for i, name in enumerate(table["after_languages"])}
        suppress = set(table["non_speech"]["multilingual" if multilingual else "english"])
        suppress |= {special["transcribe"], special["translate"], sot, special["startofprev"], special["startoflm"],
                     special["nospeech"]}
        note = {"decoder_start_token_id": sot, "bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot,
                "is_multilingual": multilingual, "no_timestamps_token_id": special["notimestamps"],
                "prev_sot_token_id": special["startofprev"], "suppress_tokens": sorted(suppress),
                "begin_suppress_tokens": list(table["blank"]) + [eot], "return_timestamps": bool(table["timestamps"]),
                "max_initial_timestamp_index": round(table["max_initial_timestamp"] / (table["chunk_length"] / audio)),
                "max_new_tokens": text // 2, "forced_decoder_ids": []}
        if multilingual:  # the language detected, then the task (an English-only prompt is the start alone)
            note["lang_to_id"] = {f"<|{code}|>": sot + 1 + i for i, code in enumerate(table["languages"][:count])}
            note["task_to_id"] = {"transcribe": special["transcribe"], "translate": special["translate"]}
            note["forced_decoder_ids"] = [[1, None], [2, special["transcribe"]]]
        return note

    def write(self, config: ModelConfig, where: str) -> dict[str, int]:
        """The config entry of `config`; refuses what the system cannot express (a d_ff other than
        ffn_ratio * d_model, a pad_id other than the one its vocabulary implies)."""
        if self.ffn_ratio is not None and config.d_ff != self.ffn_ratio * config.d_model:
            raise ConfigError("d_ff", f"{where} has d_ff = {self.ffn_ratio} x d_model = {self.ffn_ratio * config.d_model}, "
                              f"this config {config.d_ff}")
        if self.pad_ids:
            # The file holds no pad_id: the system's tokenizer implies it from the vocabulary, so a
            # vocabulary without that id cannot be written as one (no --set can add it).
            self.pad_id(config.tgt_vocab_size, where, advice=(
                "its file holds no pad_id of its own, so a checkpoint of this vocabulary cannot be written as one "
                "(nothing to --set): keep it a rosetta checkpoint"))
        out: dict[str, int] = {}
        for spec in self.fields:
            out[spec.hf] = _to_theirs(spec, spec.to[0], _value_of(config, spec.to[0]))
        back = self.read(out, where)
        for name, value in back.items():
            if _value_of(config, name) != value:
                raise ConfigError(name, f"{where} gives {name}={value!r} for this config, which has "
                                  f"{name}={getattr(config, name)!r}: that system cannot express it")
        return out


def parse_bundle_table(table: Any, where: str) -> BundleTable:
    """Validate a layout's raw `[bundle]` table; `LayoutError` names the first problem."""
    where = f"{where} [bundle]"
    if not isinstance(table, dict):
        raise LayoutError(where, "must be a table")
    unknown = sorted(set(table) - _TABLE_KEYS)
    if unknown:
        raise LayoutError(where, f"unknown key(s) {unknown}; expected some of {sorted(_TABLE_KEYS)}")
    for key in ("config", "weights"):
        if not isinstance(table.get(key), str) or not table[key]:
            raise LayoutError(where, f"{key} must name the file's entry that holds the {key}")
    ratio = table.get("ffn_ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, int) or ratio <= 0):
        raise LayoutError(where, f"ffn_ratio must be a positive integer, got {ratio!r}")
    pads = table.get("pad_id", [])
    if not isinstance(pads, list) or not all(isinstance(p, list) and len(p) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in p) for p in pads):
        raise LayoutError(where, f"pad_id must be a list of [least vocabulary, pad_id] pairs, got {pads!r}")
    raw = table.get("fields")
    if not isinstance(raw, dict) or not raw:
        raise LayoutError(where, "[bundle.fields] must be a table of config entry = { to = ... }")
    specs = tuple(_field_spec(name, spec, where) for name, spec in raw.items())
    generation = table.get("generation")
    if generation is not None:
        if not isinstance(generation, dict):
            raise LayoutError(where, "[bundle.generation] must be a table")
        wrong = sorted(set(generation) ^ _GENERATION_KEYS)
        if wrong:
            raise LayoutError(where, f"[bundle.generation] must have exactly the keys {sorted(_GENERATION_KEYS)}; "
                                     f"these differ: {wrong}")
    return BundleTable(table["config"], table["weights"], specs, ratio, tuple(tuple(p) for p in pads), generation)
