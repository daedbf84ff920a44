"""Moved to `conformance.core.generation` (settings, note, processors, search); this path keeps
working until the next release, with a DeprecationWarning. Every name it had is the new module's."""

import warnings

from conformance.core.generation import note as _note, processors as _processors, search as _search, settings as _settings

warnings.warn("conformance.core.decoding moved to conformance.core.generation (settings, note, processors, search); "
              "the old path works until the next release", DeprecationWarning, stacklevel=2)

_MODULES = (_settings, _note, _processors, _search)


def __getattr__(name: str):
    if name == "_processed":  # its old private name
        return _processors.processed
    for module in _MODULES:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
