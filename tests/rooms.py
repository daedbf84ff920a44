"""The test tree's rooms, and what a process needs on its path to import any test module by name.

tests/ mirrors the project's rooms (tests/README.md): tests/core/, tests/convert/, ...,
tests/backends/{numpy,torch,jax}/, each a plain folder (no __init__.py, pytest's default
"prepend" import mode), so every test module is imported by its bare basename, and basenames are
unique across the tree. The shared helpers (batches.py, breaks.py, sharding_common.py, systems/,
...) stay here, at the top, beside tests/conftest.py.

Some test modules read another's builders (`from test_hf_marian import marian`, a tiny random
MarianMTModel that the generation tests decode too); tests/conftest.py puts every room's folder on
sys.path so that such an import works whichever files a run selects, and a subprocess that imports
a test module by name gets the same path from `pythonpath()`.
"""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Folders under tests/ that hold data or helper packages, not test modules.
NOT_ROOMS = ("fixtures", "systems")


def room_folders() -> list[Path]:
    """Every folder under tests/ that holds test modules, tests/ itself excluded."""
    found = {path.parent for path in TESTS.rglob("test_*.py")
             if path.parent != TESTS and path.relative_to(TESTS).parts[0] not in NOT_ROOMS}
    return sorted(found)


def pythonpath(*first: str | os.PathLike) -> str:
    """A PYTHONPATH for a subprocess: `first`, the checkout, tests/ and every room, then the
    caller's own PYTHONPATH."""
    own = filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))
    return os.pathsep.join([*map(str, first), str(ROOT), str(TESTS), *map(str, room_folders()), *own])
