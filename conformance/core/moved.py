"""Modules that moved: their old import paths keep working for one release, with a warning.

A package that moved some of its modules calls `install(package, {old: new})` from its
`__init__`. An import of `package.old` (or `python -m package.old`) then gives the module
`new` itself (the same module object, never a second copy whose classes would differ) and
warns with a `DeprecationWarning` that names the new path. Nothing is copied or re-exported by
hand, so an old path cannot drift from the module it stands for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module that replaced it."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        return importlib.import_module(self.new)

    def exec_module(self, module) -> None:  # the new module ran when it was imported
        return None

    def get_code(self, name: str):  # `python -m OLD` runs the new module's code as __main__
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _Moved(importlib.abc.MetaPathFinder):
    def __init__(self, package: str, table: dict[str, str]):
        self.table = {f"{package}.{old}": new for old, new in table.items()}

    def find_spec(self, name, path=None, target=None):
        new = self.table.get(name)
        if new is None:
            return None
        warnings.warn(f"{name} moved to {new}; the old path works until the next release", DeprecationWarning,
                      stacklevel=2)
        return importlib.util.spec_from_loader(name, _Alias(new))


def install(package: str, table: dict[str, str]) -> None:
    """Make `package.OLD` import `NEW` for every `OLD: NEW` of `table` (new names are absolute)."""
    if not any(isinstance(f, _Moved) and set(f.table) == {f"{package}.{o}" for o in table} for f in sys.meta_path):
        sys.meta_path.append(_Moved(package, table))
