"""The test tree keeps the shape tests/README.md describes (issue 55): every test module sits in a
room the README names (or at the top, named there too), its basename is unique across the tree,
no folder has an `__init__.py` (pytest's default import mode imports a module by its basename),
and no file is named for when it was written (a walk, a review) instead of what it tests."""

from __future__ import annotations

import re
from pathlib import Path

from rooms import NOT_ROOMS, TESTS

WHEN = re.compile(r"(^|_)(walk\d*|review)(_|$)")  # test_cli_walk4_convert, test_own_backend_review


def problems(tests: Path) -> list[str]:
    """What in the tree under `tests` breaks its shape, one line each."""
    readme = (tests / "README.md").read_text()
    found, seen = [], {}
    for path in sorted(tests.rglob("*.py")):
        relative = path.relative_to(tests)
        if relative.parts[0] in NOT_ROOMS:
            continue
        if path.name == "__init__.py":
            found.append(f"{relative}: the test folders have no __init__.py (modules are imported by basename)")
        if not path.name.startswith("test_"):
            continue
        seen.setdefault(path.name, []).append(str(relative))
        room = "/".join(relative.parts[:-1])
        if not room and f"`{path.name}`" not in readme:
            found.append(f"{relative}: a test at the top that tests/README.md does not name; put it in a room")
        if room and f"`{room}/`" not in readme:
            found.append(f"{relative}: room {room}/ is not described in tests/README.md")
        if WHEN.search(path.stem):
            found.append(f"{relative}: named for when it was written, not for what it tests")
    found += [f"{name}: one basename, several files: {', '.join(paths)}" for name, paths in seen.items()
              if len(paths) > 1]
    return found


def test_the_tree_has_the_shape_its_readme_describes():
    assert problems(TESTS) == []


def test_a_file_out_of_place_is_named(tmp_path):
    (tmp_path / "README.md").write_text("| `core/` | the core |\n`test_architecture.py`\n")
    for name in ("test_architecture.py", "test_loose.py", "core/test_config.py", "core/__init__.py",
                 "core/test_cli_walk4_convert.py", "cli/test_config.py", "fixtures/test_data.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("")
    assert problems(tmp_path) == [
        "cli/test_config.py: room cli/ is not described in tests/README.md",
        "core/__init__.py: the test folders have no __init__.py (modules are imported by basename)",
        "core/test_cli_walk4_convert.py: named for when it was written, not for what it tests",
        "test_loose.py: a test at the top that tests/README.md does not name; put it in a room",
        "test_config.py: one basename, several files: cli/test_config.py, core/test_config.py",
    ]
