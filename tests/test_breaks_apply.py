"""Every planted break still applies to today's code.

A break is an edit `(old, new)` of a backend's model.py (or `(file, old, new)` of a side file);
`broken_copy` refuses one whose `old` text is gone, but only when the test that plants it runs,
which may be a minute into a slow file. When a refactor moves a line, this says which break lost
its anchor, in a second. (`edited_module` replaces every occurrence: the pre/post-LN swap edits the
encoder's and the decoder's layer alike.)"""
from __future__ import annotations

import pytest

from breaks import (BREAKS, CORE_FILES, CORE_IMPORTERS, FLOAT32_PROPERTY_BREAKS, PROPERTY_BREAKS, REALISTIC_BREAKS, ROOT, SIDE_FILES,
                    side_path)


def _edits():
    for name, (backend, edits, _patches) in BREAKS.items():
        yield name, backend, edits
    for name, (_module, plants) in {**PROPERTY_BREAKS, **FLOAT32_PROPERTY_BREAKS}.items():
        for backend, edits, _patches in plants:
            yield name, backend, edits
    for name, (backend, _dtype, edits, _patches, _tame) in REALISTIC_BREAKS.items():
        yield name, backend, edits


def _with_imports(edits):
    """The edits, and for an edit of a core file the ones `broken_copy` adds to its importers
    (`CORE_IMPORTERS`: pipeline.py's copy is imported by a copy of device.py, whose copy the
    copied decode room imports), each redirecting an import to the edited copy."""
    added, core = [], sorted({edit[0] for edit in edits if len(edit) == 3 and edit[0] in CORE_FILES})
    while core:
        file = core.pop(0)
        importer = CORE_IMPORTERS[file]
        added.append((importer, f"from {CORE_FILES[file][1]} import", ""))
        if importer in CORE_FILES and importer not in core and not any(e[0] == importer for e in added[:-1]):
            core.append(importer)
    return [*edits, *dict.fromkeys(added)]


EDITS = [(name, backend, edit) for name, backend, edits in _edits() for edit in _with_imports(edits)]


def test_there_are_edits_to_check():
    assert len(EDITS) >= 10


@pytest.mark.parametrize("name,backend,edit", EDITS, ids=[f"{n}:{i}" for i, (n, _, _) in enumerate(EDITS)])
def test_each_break_edits_text_that_still_occurs(name, backend, edit):
    file, old = ("model.py", edit[0]) if len(edit) == 2 else (edit[0], edit[1])
    assert file == "model.py" or file in SIDE_FILES or file in CORE_FILES, f"break {name!r}: unknown file {file!r}"
    path = side_path(backend, file)
    assert old in path.read_text(), f"break {name!r}: {old!r} no longer occurs in {path.relative_to(ROOT)}"
