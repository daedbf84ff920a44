"""The user's own code failing inside `conformance.compare` / `rosetta compare`: the frames of its
traceback that are the user's, not this package's and not an installed library's.

A frame is a library's when its file is under the interpreter's standard library or its
site-packages (`sysconfig`'s stdlib, purelib and platlib paths), ours when it is under this
project's packages. `sys.prefix` is no such root: a system Python's is `/usr`, and the user's
code may well live under `/usr/src/app`.
"""

from __future__ import annotations

import sysconfig
import traceback
from pathlib import Path

# This project's own packages: the check tools and the backends the user's model runs beside.
_OURS = ("conformance", "impl_numpy", "impl_torch", "impl_jax")


def library_roots() -> set[str]:
    """The folders whose frames are not the user's: the interpreter's libraries and our packages."""
    paths = sysconfig.get_paths()
    roots = {str(Path(paths[key]).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    project = Path(__file__).resolve().parents[3]
    return roots | {str(project / name) for name in _OURS}


def user_traceback(exc: BaseException) -> str:
    """The frames of `exc`'s traceback in the user's own code (not this package's, not an
    installed library's), and the innermost frame wherever it is: where the user's code failed."""
    roots = library_roots()
    frames = traceback.extract_tb(exc.__traceback__)

    def theirs(frame) -> bool:
        path = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else frame.filename
        return not any(path.startswith(root + "/") for root in roots)

    shown = [f for f in frames if theirs(f)]
    if frames and (not shown or shown[-1] is not frames[-1]):
        shown.append(frames[-1])
    return "".join(traceback.format_list(shown)).rstrip()


def describe(exc: BaseException) -> str:
    """One line for the exception: its type and message."""
    return f"{type(exc).__name__}: {exc}"
