"""Checkpoint files that bundle their config with their weights: openai-whisper's
`{"dims": asdict(ModelDimensions), "model_state_dict": state_dict}`, which `whisper.load_model(path)` reads.

    from conformance.convert.bundles import read_bundle, convert_bundle, write_bundle, from_openai_whisper
    result = convert_bundle(*read_bundle("tiny.pt"))      # a Conversion: no --set, the sizes from "dims"
    write_bundle("out.pt", config, params)                # what whisper.load_model("out.pt") loads
    config, params = from_openai_whisper(model)           # a live whisper.model.Whisper

A layout with a `[bundle]` table (`openai-whisper`; `conformance.convert.bundle_table`)
describes such a file: the entry that holds the config, the entry that holds the state dict, and
which config entry gives which ModelConfig field. A file is recognised by those two entries at its
top level, never by its key names. It is read through PyTorch's weights-only unpickler (a dict of
ints and a state dict of tensors is all it needs), and what is written is read back and checked.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from conformance.convert.layout import Layout, load_layout
from conformance.core.config import ModelConfig
from conformance.core.errors import CheckpointError, ConfigError

TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def read_bundle(path: str | Path) -> tuple[Layout, Mapping[str, Any], str] | None:
    """(the layout, the loaded file, its name) when `path` is a PyTorch file bundling a config with its
    weights (`system_files.bundle_layout`: by its two entries), else None. Read by
    `torch.load(weights_only=True)`."""
    from conformance.convert.readers import _torch_file
    from conformance.convert.system_files import bundle_layout

    path = Path(path)
    if path.suffix.lower() not in TORCH_SUFFIXES or not path.is_file():
        return None
    obj = _torch_file(path)
    layout = bundle_layout(obj)
    return None if layout is None else (layout, obj, path.name)


def convert_bundle(layout: Layout | str, obj: Mapping[str, Any], source: str = "a checkpoint", *, dtype: str | None = None,
                   **overrides: Any):
    """The `Conversion` of a bundled checkpoint (`obj`: the loaded file, `layout`'s system's): every
    size and the padding from its config entry, the tensors through the layout; `overrides` may add
    switches but not contradict the file. The one reading of such a file,
    `conformance.convert.system_files` (`rosetta convert` reads it so too)."""
    from conformance.convert.system_files import bundle_file, convert_system_file

    layout = load_layout(layout)
    system = bundle_file(obj, Path(source))
    if system is None or system.layout.name != layout.name:
        raise CheckpointError(source, f"is not a {layout.name} checkpoint: its top level lacks the {layout.bundle.config!r} "
                              f"and {layout.bundle.weights!r} entries")
    notes = {"source": f"{layout.name} checkpoint", "source_file": source}
    return convert_system_file(system, dtype=dtype, notes=notes, **overrides)


def bundle_of(config: ModelConfig, params: Mapping[str, np.ndarray], layout: Layout | str = "openai-whisper") -> dict:
    """The bundled checkpoint of `(config, params)` in `layout`'s system, as torch tensors and plain ints."""
    from conformance.convert.arrays import as_torch
    from conformance.convert.engine import export_state_dict

    layout = load_layout(layout)
    if layout.bundle is None:
        raise ConfigError("layout", f"layout {layout.name} has no [bundle] table: it describes no bundled file")
    dims = layout.bundle.write(config, f"the {layout.name} system")
    state = export_state_dict(config, params, layout)
    return {layout.bundle.config: dims,
            layout.bundle.weights: {key: as_torch(np.array(value)) for key, value in state.items()}}


def write_bundle(path: str | Path, config: ModelConfig, params: Mapping[str, np.ndarray],
                 layout: Layout | str = "openai-whisper") -> None:
    """Write the bundled checkpoint that `layout`'s system loads (openai-whisper: `whisper.load_model(path)`),
    atomically, then read it back as `rosetta convert` would and check that it gives `config` and
    `params` again, bit for bit (a CheckpointError otherwise)."""
    import torch

    from conformance.core.checkpoint import atomic_write

    path = Path(path)
    buffer = io.BytesIO()
    torch.save(bundle_of(config, params, layout), buffer)
    atomic_write(path, [buffer.getvalue()])
    found = read_bundle(path)
    if found is None:
        raise CheckpointError(path, "was written, but is not recognised when read back")
    back = convert_bundle(found[0], found[1], path.name, pad_id=config.pad_id)
    same_config = back.config.canonical() == config.canonical()
    if not same_config or any(not np.array_equal(back.params[k], np.asarray(v)) for k, v in params.items()):
        raise CheckpointError(path, "was written, but reading it back gives another model")


def from_openai_whisper(model, **overrides: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Import a live `whisper.model.Whisper` (openai-whisper): its `dims` and `state_dict()`, as the
    checkpoint file `whisper.load_model` reads would give them."""
    import torch

    dims = getattr(model, "dims", None)
    if dims is None or not dataclasses.is_dataclass(dims) or not hasattr(model, "state_dict"):
        raise TypeError(f"expected an openai-whisper whisper.model.Whisper, got {type(model).__name__}")
    with torch.no_grad():
        obj = {"dims": dataclasses.asdict(dims), "model_state_dict": model.state_dict()}
    result = convert_bundle("openai-whisper", obj, f"{type(model).__name__}", **overrides)
    return result.config, result.params
