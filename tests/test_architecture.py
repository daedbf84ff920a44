"""The architecture, enforced: rooms by role and the direction of every import.

    core  <-  backends (impl_numpy, impl_torch, impl_jax)  <-  check  <-  suite  <-  cli
    core  <-  convert  <-  check                               (beside the backends)
    check  <-  formats  <-  cli                                (beside the suite)

No two modules import each other, however indirectly (a circle makes the import order decide what
exists when), and nothing outside a backend imports one of its modules: a backend is used through
its package's surface (`conformance.core.surface.BACKEND_API`), never a file inside it.

Every `import` statement is read from the source (including the lazy ones inside functions and
`importlib.import_module("...")` with a literal name), so a forbidden import fails here even when
no test happens to execute it. The core is also imported for real in a fresh interpreter in which
torch, jax, flax, hypothesis and pytest cannot be imported at all.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.core import __all__ as CORE_NAMES  # the core's public names, listed once

ROOT = Path(__file__).resolve().parents[1]

# Which first-party packages each room may import (besides the standard library and itself).
FIRST_PARTY = ("conformance", "impl_numpy", "impl_torch", "impl_jax")
ALLOWED = {
    "conformance.core": {"conformance.core"},
    "conformance.convert": {"conformance.core", "conformance.convert"},
    "impl_numpy": {"conformance.core", "impl_numpy"},
    "impl_torch": {"conformance.core", "impl_torch"},
    "impl_jax": {"conformance.core", "impl_jax"},
    # convert sits beside the backends, below check: conformance.compare converts a user's weights.
    "conformance.check": {"conformance.core", "conformance.check", "conformance.convert", "impl_numpy", "impl_torch",
                          "impl_jax"},
    "conformance.suite": {"conformance.core", "conformance.check", "conformance.suite",
                          "impl_numpy", "impl_torch", "impl_jax"},
    # formats verify what they write with the oracle and the runtimes: above check, beside the suite.
    "conformance.formats": {"conformance.core", "conformance.convert", "conformance.check", "conformance.formats",
                            "impl_numpy", "impl_torch", "impl_jax"},
    "conformance.cli": {"conformance", "impl_numpy", "impl_torch", "impl_jax"},
}
# Third-party imports each room may make; None = any. The core is NumPy, ml_dtypes and the stdlib.
THIRD_PARTY = {
    "conformance.core": {"numpy", "ml_dtypes"},
    "impl_numpy": {"numpy"},
    "impl_torch": {"numpy", "torch", "ml_dtypes"},
    # orbax: the JAX ecosystem's checkpoint library, for impl_jax.save_state / load_state (its own
    # state format beside our interchange file), imported only when those are called.
    # optax: the paper's Adam in impl_jax/train.py (issue 13 asks for optax, not a re-derivation).
    "impl_jax": {"numpy", "jax", "flax", "ml_dtypes", "orbax", "optax"},
}
STDLIB = set(sys.stdlib_module_names)
# The package root re-exports the core; besides, its PEP 562 `__getattr__` may import these check
# tools when their name is first used (`conformance.compare`), never at import time.
ROOT_LAZY = {"conformance.check.foreign.side_by_side"}


def lazy_imports_of_root(path: Path) -> set[int]:
    """Lines of the imports inside the root's module-level `__getattr__`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    lines = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            lines |= {n.lineno for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return lines


def room_of(module: str) -> str | None:
    for room in sorted(ALLOWED, key=len, reverse=True):
        if module == room or module.startswith(room + "."):
            return room
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, however deeply nested."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            # `from conformance import checkpoint` imports conformance.checkpoint: name the submodule.
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
              and node.args and isinstance(node.args[0], ast.JoinedStr) and node.args[0].values
              and isinstance(node.args[0].values[0], ast.Constant)
              and str(node.args[0].values[0].value).startswith("impl_")):
            # `import_module(f"impl_{kind}.model")`: a backend's module by a computed name; the
            # constant text after the name stands for the module (`impl_*.model`).
            rest = "".join(part.value if isinstance(part, ast.Constant) else "*" for part in node.args[0].values)
            found += [(node.lineno, rest.replace("impl_*", backend, 1)) for backend in sorted(BACKENDS)]
    return found


def resolves_to(imported: str) -> str:
    """The first-party room an imported name lands in (`conformance.checkpoint` is the core's)."""
    if imported in ("conformance", "conformance.checkpoint") or imported.startswith("conformance.checkpoint."):
        return "conformance.core"
    if imported.startswith("conformance.") and imported.split(".")[1] in CORE_NAMES:
        return "conformance.core"  # the package's top-level names are the core's, re-exported
    return room_of(imported) or imported


SOURCES = sorted(p for package in FIRST_PARTY for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_inwards(path):
    room = room_of(module_name(path))
    lazy: set[int] = set()
    if room is None:
        assert module_name(path) == "conformance", f"{path} lies in no room of the architecture"
        room = "conformance.core"  # the package's own __init__ re-exports the core (and ROOT_LAZY, lazily)
        lazy = lazy_imports_of_root(path)
    for line, imported in imports_of(path):
        top = imported.split(".")[0]
        if line in lazy and any(imported == name or imported.startswith(name + ".") for name in ROOT_LAZY):
            continue
        where = f"{path.relative_to(ROOT)}:{line} imports {imported}"
        if top in FIRST_PARTY:
            target = resolves_to(imported)
            assert any(target == allowed or target.startswith(allowed + ".") for allowed in ALLOWED[room]), (
                f"{where}: the {room} room may import only {sorted(ALLOWED[room])}")
        elif top not in STDLIB and room in THIRD_PARTY:
            assert top in THIRD_PARTY[room], f"{where}: the {room} room may use only {sorted(THIRD_PARTY[room])}"


PACKAGES = sorted({module_name(p) for p in (ROOT / "conformance").rglob("__init__.py")})


@pytest.mark.parametrize("package", PACKAGES)
def test_every_room_says_what_it_holds_and_may_import(package):
    init = ROOT / Path(*package.split(".")) / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc, f"{init} has no docstring"
    if package != "conformance":
        assert "May import" in doc or "may import" in doc or "Imports" in doc, f"{init}: say what the room may import"


# The check room's own modules (the report, comparison, tolerances, plans, pictures, the default
# model) are what its rooms build on, never the other way: none of them imports a room of
# check, except `backends`, which builds the targets registered in check.targets.
CHECK_ROOMS = sorted(module_name(p.parent) for p in (ROOT / "conformance" / "check").glob("*/__init__.py"))
CHECK_BASE = sorted(p for p in (ROOT / "conformance" / "check").glob("*.py") if p.name != "__init__.py")
CHECK_BASE_MAY = {"conformance.check.backends": {"conformance.check.targets"}}


def check_base_reach_ins(paths) -> list[str]:
    """`file:line imports room` for every import of a check room from check's own modules."""
    found = []
    for path in paths:
        allowed = CHECK_BASE_MAY.get(module_name(path), set())
        for line, imported in imports_of(path):
            room = next((r for r in CHECK_ROOMS if imported == r or imported.startswith(r + ".")), None)
            if room is not None and room not in allowed:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    return found


def test_the_check_rooms_build_on_checks_own_modules_never_the_reverse():
    assert set(CHECK_ROOMS) >= {"conformance.check.targets", "conformance.check.foreign", "conformance.check.onnx",
                                "conformance.check.ctranslate2", "conformance.check.scale"}
    assert not check_base_reach_ins(CHECK_BASE)


def test_a_planted_reach_into_a_check_room_is_caught(tmp_path, monkeypatch):
    planted = ROOT / "conformance" / "check" / "report.py"
    copy = tmp_path / "conformance" / "check" / "report.py"
    copy.parent.mkdir(parents=True)
    copy.write_text(planted.read_text() + "\nfrom conformance.check.foreign.taps import capture\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert check_base_reach_ins([copy]) == [f"conformance/check/report.py:{len(copy.read_text().splitlines())} imports "
                                              "conformance.check.foreign.taps.capture"]


def test_the_core_imports_with_no_framework_and_no_test_tools():
    """`import conformance` and every core module work where torch, jax, flax, hypothesis and
    pytest cannot be imported, and none of them is pulled in."""
    blocked = ["torch", "jax", "jaxlib", "flax", "optax", "orbax", "hypothesis", "pytest", "transformers", "matplotlib"]
    core = sorted(module_name(p) for p in (ROOT / "conformance" / "core").rglob("*.py"))
    script = textwrap.dedent(f"""
        import importlib, sys
        BLOCKED = {blocked!r}

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is blocked for this test")

        sys.meta_path.insert(0, Block())
        import conformance
        for name in {core!r}:
            importlib.import_module(name)
        from conformance import ModelConfig, checkpoint, init_params, preset
        config = preset("paper", src_vocab_size=11, tgt_vocab_size=11, d_model=8, n_heads=2, d_ff=16,
                         n_encoder_layers=1, n_decoder_layers=1, max_len=8)
        assert set(init_params(config)) and ModelConfig.from_json(config.to_json()) == config
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not leaked, leaked
        assert "conformance.check.foreign.side_by_side" not in sys.modules  # conformance.compare loads on first use
        assert callable(conformance.compare) and not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_forbidden_import_is_caught(tmp_path, monkeypatch):
    """The checker itself has teeth: a backend that imports another backend, or the core that
    imports the suite, is refused with the line named."""
    fake_root = tmp_path
    (fake_root / "impl_numpy").mkdir()
    bad = fake_root / "impl_numpy" / "bad.py"
    bad.write_text("def f():\n    import impl_torch\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    with pytest.raises(AssertionError, match=r"bad.py:2 imports impl_torch"):
        test_imports_point_inwards(bad)
    (fake_root / "conformance" / "core").mkdir(parents=True)
    core = fake_root / "conformance" / "core" / "bad.py"
    core.write_text("from conformance.suite import runner\n")
    with pytest.raises(AssertionError, match="conformance.core room may import only"):
        test_imports_point_inwards(core)
    core.write_text("import torch\n")
    with pytest.raises(AssertionError, match="may use only"):
        test_imports_point_inwards(core)


# -- Circles and reach-ins ----------------------------------------------------------------------

# Knots carried knowingly, each with its reason (none today: the NumPy backward pass reads an
# explicit tape, so it no longer imports the model, and check builds through the surface). Each
# entry must still be needed: once untied, the tests below fail until it is removed here.
KNOWN_CIRCLES: list[list[str]] = []
KNOWN_REACH_INS: set[tuple[str, str]] = set()
BACKENDS = ("impl_numpy", "impl_torch", "impl_jax")
# Code outside the packages that drives the backends (tests/ may test a backend's insides).
USERS = ("benchmarks", "examples", "docs")


def import_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports (lazy imports included; a name imported from
    a module, `from a.b import f`, is an edge to `a.b`)."""
    modules = {module_name(p): p for p in sorted(p for package in FIRST_PARTY for p in (ROOT / package).rglob("*.py"))}

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {name: {m for _, imported in imports_of(path) if (m := module_of(imported)) not in (None, name)}
            for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other, directly or through others (Tarjan's
    strongly connected components of more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def reach_ins() -> set[tuple[str, str]]:
    """(file, imported name) for every import of a module inside a backend from outside it."""
    paths = [p for package in (*FIRST_PARTY, *USERS) if (ROOT / package).is_dir() for p in (ROOT / package).rglob("*.py")]
    found = set()
    for path in sorted(paths):
        inside = module_name(path).split(".")[0]
        for _, imported in imports_of(path):
            backend, _, rest = imported.partition(".")
            if backend in BACKENDS and backend != inside and rest:
                first = rest.split(".")[0]
                if (ROOT / backend / f"{first}.py").is_file() or (ROOT / backend / first).is_dir():
                    found.add((str(path.relative_to(ROOT)), imported))
    return found


def test_no_module_imports_itself_through_others():
    found = circles(import_graph())
    new = [c for c in found if c not in KNOWN_CIRCLES]
    assert not new, f"import circles (each: modules that import each other): {new}"
    assert all(c in found for c in KNOWN_CIRCLES), f"untied, remove from KNOWN_CIRCLES: {[c for c in KNOWN_CIRCLES if c not in found]}"


def test_nothing_outside_a_backend_imports_a_module_inside_it():
    found = reach_ins()
    new = sorted(found - KNOWN_REACH_INS)
    assert not new, f"imports past a backend's surface (use `impl_x.<name>` from conformance.core.surface): {new}"
    assert KNOWN_REACH_INS <= found, f"gone, remove from KNOWN_REACH_INS: {sorted(KNOWN_REACH_INS - found)}"


def test_a_planted_circle_and_a_planted_reach_in_are_caught(tmp_path, monkeypatch):
    """The two checks have teeth: a lazy import back (convert's readers -> hf_folder -> readers,
    as it was), a three-module loop, and a tool importing a backend's model.py are each found."""
    (tmp_path / "conformance" / "convert").mkdir(parents=True)
    (tmp_path / "conformance" / "__init__.py").write_text("")
    (tmp_path / "conformance" / "convert" / "readers.py").write_text(
        "def read(folder):\n    from conformance.convert.hf_folder import read_weights\n")
    (tmp_path / "conformance" / "convert" / "hf_folder.py").write_text("from conformance.convert.readers import read\n")
    (tmp_path / "conformance" / "check").mkdir()
    (tmp_path / "conformance" / "check" / "a.py").write_text("from conformance.check import b\n")
    (tmp_path / "conformance" / "check" / "b.py").write_text("import conformance.check.c\n")
    (tmp_path / "conformance" / "check" / "c.py").write_text("from conformance.check.a import f\n")
    (tmp_path / "conformance" / "check" / "d.py").write_text("from impl_torch.model import Model\nimport impl_torch\n")
    (tmp_path / "conformance" / "check" / "e.py").write_text(
        "import importlib\ndef f(kind):\n    return importlib.import_module(f\"impl_{kind}.model\")\n")
    for backend in BACKENDS:
        (tmp_path / backend).mkdir()
        (tmp_path / backend / "model.py").write_text("")
    (tmp_path / "impl_torch" / "__init__.py").write_text("from impl_torch.model import Model\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert circles(import_graph()) == [["conformance.check.a", "conformance.check.b", "conformance.check.c"],
                                       ["conformance.convert.hf_folder", "conformance.convert.readers"]]
    assert reach_ins() == {("conformance/check/d.py", "impl_torch.model.Model"),
                           *{("conformance/check/e.py", f"{backend}.model") for backend in BACKENDS}}
    with pytest.raises(AssertionError, match="import circles"):
        test_no_module_imports_itself_through_others()
    with pytest.raises(AssertionError, match="past a backend's surface"):
        test_nothing_outside_a_backend_imports_a_module_inside_it()


def test_the_public_names_are_listed_once():
    """`conformance.__all__` is the core's list itself, not a copy of it to keep in step, plus the one
    name the check tools lend it (`compare`, imported on first use)."""
    import conformance
    import conformance.core

    assert conformance.__all__ == conformance.core.__all__ + ["compare"]
    core_names = conformance.core.__all__
    assert all(getattr(conformance, name) is getattr(conformance.core, name) for name in core_names)
    text = (ROOT / "conformance" / "__init__.py").read_text()
    assert not any(f'"{name}",' in text for name in conformance.core.__all__), "conformance/__init__.py retypes the list"
