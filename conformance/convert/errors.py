"""The errors the weight converters raise. All are `ValueError`s, like the rest of the project's.

| type                   | raised for                                                  | names           |
| ---------------------- | ----------------------------------------------------------- | --------------- |
| `LayoutError`          | a layout file that is not valid                             | the layout      |
| `KeyMismatchError`     | a state dict whose keys do not fit the layout               | missing and unexpected keys |
| `NoMatchingLayoutError`| auto-detection found no built-in layout that fits           | the closest layouts |
| `AmbiguousLayoutError` | several built-in layouts fit, computing different models    | those layouts, what differs |
| `TensorError`          | a tensor that a transform or the config cannot accept       | the foreign key |

A config field that is missing or contradicts the tensors raises the project's `ConfigError`
(naming the field); an unreadable or unsafe file raises `CheckpointError` (naming the file).
"""

from __future__ import annotations

from typing import Any, Sequence


def listing(names: Sequence[str], limit: int = 6) -> str:
    """'a, b, c and 4 more': a readable, bounded list for error messages."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# A ModelConfig field's type, as a sentence says what it expects.
KIND_WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}


def a_type(value: Any) -> str:
    """'an int', 'a list': a value's type name with the article English gives it."""
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def setting(value: Any) -> str:
    """A value as `--set` spells it: true/false, 1e-05, -inf, relu."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def overrides_note(names: Sequence[str], overrides) -> str:
    """What to tell a user whose overrides changed the key set a layout expects ('' for none)."""
    if not names:
        return ""
    given = ", ".join(f"--set {name}={setting(overrides[name])}" for name in names)
    verb, it = ("changes", "it") if len(names) == 1 else ("change", "them")
    return f"{given} {verb} which parameters the layout expects; leave {it} out unless the model was changed that way"


class LayoutError(ValueError):
    """A layout (a TOML file describing a foreign key space) is not valid. `.layout` names it."""

    def __init__(self, layout: str, problem: str):
        self.layout = layout
        self.problem = problem
        super().__init__(f"layout {layout}: {problem}")


class KeyMismatchError(LayoutError):
    """The keys of a state dict do not fit a layout: some are missing, some are unexpected."""

    def __init__(self, layout: str, missing: Sequence[str], unexpected: Sequence[str], summary: str = "", note: str = ""):
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        parts = []
        if missing:
            parts.append(f"{len(self.missing)} missing key(s): {summary or listing(self.missing)}")
        if unexpected:
            parts.append(f"{len(self.unexpected)} unexpected key(s): {listing(self.unexpected)}")
        if note:
            parts.append(note)
        super().__init__(layout, "the state dict does not fit: " + "; ".join(parts))


class NoMatchingLayoutError(ValueError):
    """Auto-detection found no built-in layout whose key set matches exactly.

    `.candidates` holds `(layout name, missing keys, unexpected keys)`, closest first.
    """

    def __init__(self, candidates: Sequence[tuple[str, list[str], list[str]]], n_keys: int, limit: int = 3, note: str = ""):
        self.candidates = list(candidates)
        lines = [
            f"no built-in layout matches these {n_keys} keys exactly; pass --layout NAME or a layout "
            f"file of your own (see docs/porting.md). Closest:"
        ]
        for name, missing, unexpected in self.candidates[:limit]:
            lines.append(f"  {name}: {len(missing)} missing, {len(unexpected)} unexpected")
            if missing:
                lines.append(f"    missing: {listing(missing, 4)}")
            if unexpected:
                lines.append(f"    unexpected: {listing(unexpected, 4)}")
        if note:
            lines.append(f"  ({note})")
        super().__init__("\n".join(lines))


class AmbiguousLayoutError(ValueError):
    """More than one built-in layout fits the key set exactly, and they would compute different
    models from it: auto-detection refuses to guess.

    `.names` lists the candidates; `.candidates` holds `(name, description, {switch: value})` with
    the switches whose values differ between them (what tells the systems apart, which no key
    shows); `.detectable` the candidates auto-detection may pick on their own.
    """

    def __init__(self, names: Sequence[str], candidates: Sequence[tuple[str, str, dict[str, Any]]] = (),
                 detectable: Sequence[str] | None = None):
        self.names = list(names)
        self.candidates = list(candidates)
        self.detectable = list(self.names if detectable is None else detectable)
        differing = sorted({switch for _, _, values in self.candidates for switch in values})
        if differing:
            lines = [f"the keys fit {len(self.names)} built-in layouts ({', '.join(self.names)}), which compute different "
                     f"models from them ({', '.join(differing)} differ); nothing is guessed. Pick the system the file "
                     "comes from:"]
        else:
            lines = [f"the keys fit only {', '.join(self.names)}, which auto-detection never picks on its own (its keys "
                     "are another system's); pick it by name:"]
        for name, description, values in self.candidates:
            told = ", ".join(f"{switch}={setting(value)}" for switch, value in sorted(values.items()))
            lines.append(f"  --layout {name}: {description}" + (f" ({told})" if told else ""))
        if differing:
            lines.append("  The key names cannot tell these systems apart, so a trial forward pass cannot catch a wrong "
                         "pick either: each runs and gives finite logits, only other ones. A Hugging Face folder "
                         "(config.json's model_type) needs no --layout.")
        if not self.candidates:
            lines = [f"the keys match several built-in layouts exactly ({', '.join(self.names)}); pass --layout NAME"]
        super().__init__("\n".join(lines))


class TensorError(ValueError):
    """A tensor cannot be converted. `.key` names it as the foreign state dict spells it."""

    def __init__(self, key: str, problem: str):
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")
