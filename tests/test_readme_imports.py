"""Every import the README and docs/porting.md show a user still works: the public names are a
contract, whatever moves inside the packages."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/porting.md"]
IMPORT = re.compile(r"^(?:from \S+ import [^#\n]+|import [^#\n]+)", re.M)


def shown_imports(doc: str) -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / doc).read_text(), re.S)
    return sorted({m.group(0).strip() for block in blocks for m in IMPORT.finditer(block)})


@pytest.mark.parametrize("doc", DOCS)
def test_every_import_a_doc_shows_works(doc):
    lines = shown_imports(doc)
    assert lines, f"{doc} shows no import: the parser is broken"
    script = "\n".join(lines) + "\nprint('ok')\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), f"{doc}: {lines}\n{done.stderr}"
