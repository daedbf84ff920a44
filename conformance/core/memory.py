"""How much memory this process can ever hold, and byte counts as messages say them.

A refusal made from `memory_limit` is never a guess: less may be free at the moment, but more
than it can never be allocated, so only a need beyond it is refused (`params.check_fits`, and
`checkpoint.read_tensors` before it reads a data section).

This module is framework-free (the standard library only).
"""

from __future__ import annotations

import os
from pathlib import Path

try:
    import resource  # POSIX only
except ImportError:
    resource = None


def memory_limit() -> tuple[int | None, str]:
    """(bytes, what they are) of the most memory this process can ever hold: the smallest of the
    physical memory, its memory cgroup's limit (a container's) and the address-space rlimit;
    (None, "unknown") where none can be read. Less may be free now, but more can never be
    allocated, so only a need beyond it is refused: a refusal is never a guess."""
    found: list[tuple[int, str]] = []
    try:
        found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"))
    except (ValueError, OSError, AttributeError):
        pass
    cgroup = _cgroup_limit()
    if cgroup is not None:
        found.append((cgroup, "the memory cgroup's limit"))
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            found.append((soft, "the address-space limit (ulimit -v)"))
    return min(found) if found else (None, "unknown")


def _cgroup_limit() -> int | None:
    """This process's memory cgroup limit in bytes (v2 memory.max, v1 memory.limit_in_bytes), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, where = line.split(":", 2)
        if controllers == "":
            root = Path("/sys/fs/cgroup")
            candidates += [root / where.lstrip("/") / "memory.max", root / "memory.max"]
        elif "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory")
            candidates += [root / where.lstrip("/") / "memory.limit_in_bytes", root / "memory.limit_in_bytes"]
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        # "max" (v2), or v1's page-rounded 2**63: no limit.
        return int(text) if text.isdigit() and int(text) < 2**60 else None
    return None


def size_words(nbytes: int) -> str:
    """"1.2 TB", "340 MB", "512 bytes": a byte count as a message says it (powers of 1000)."""
    for unit, scale in (("EB", 10**18), ("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"
