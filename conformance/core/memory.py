"""How much memory this process can ever hold, and byte counts as messages say them.

A refusal made from `memory_limit` is never a guess: less may be free at the moment, but more
than it can never be allocated, so only a need beyond it is refused (`sizes.check_fits`, and
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


# Where Linux says what memory there is; module attributes, so that a test can point them at a copy.
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# A cgroup v1 limit at or above this is "no limit" (v1 writes its unlimited as 2**63 rounded to a page).
_UNLIMITED = 2**60


def memory_limit() -> tuple[int | None, str]:
    """(bytes, what they are) of the most memory this process can ever hold: the smallest of the
    physical memory and swap, its memory cgroup's limit (a container's, with the swap the cgroup
    may use) and the address-space rlimit; (None, "unknown") where none can be read. Less may be
    free now, but more can never be allocated, so only a need beyond it is refused: a refusal is
    never a guess (a process may hold more than the physical memory, by swapping)."""
    found: list[tuple[int, str]] = []
    swap = swap_total()
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        found.append((physical + swap, "physical memory and swap" if swap else "physical memory"))
    except (ValueError, OSError, AttributeError):
        pass
    cgroup = _cgroup_limit(swap)
    if cgroup is not None:
        found.append((cgroup, "the memory cgroup's limit"))
    if resource is not None:
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY and soft > 0:
            found.append((soft, "the address-space limit (ulimit -v)"))
    return min(found) if found else (None, "unknown")


def swap_total() -> int:
    """The machine's swap in bytes (SwapTotal in /proc/meminfo); 0 where there is none or it cannot be read."""
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(":")
        words = value.split()
        if name.strip() == "SwapTotal" and words and words[0].isdigit():
            return int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return 0


def _cgroup_limit(swap: int) -> int | None:
    """The memory and swap this process's cgroup lets it use, in bytes, or None for no limit.

    v2: memory.max plus memory.swap.max (no swap.max, or "max": the machine's `swap`, all of
    which it may use). v1: memory.memsw.limit_in_bytes (memory and swap together) where swap is
    accounted, else memory.limit_in_bytes plus `swap`. A line of /proc/self/cgroup that is not
    "id:controllers:path" is skipped."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    candidates: list[tuple[str, Path]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, where = parts
        if controllers == "":
            candidates += [("v2", CGROUP_ROOT / where.lstrip("/")), ("v2", CGROUP_ROOT)]
        elif "memory" in controllers.split(","):
            root = CGROUP_ROOT / "memory"
            candidates += [("v1", root / where.lstrip("/")), ("v1", root)]
    for version, directory in candidates:
        found, memory = _read_limit(directory / ("memory.max" if version == "v2" else "memory.limit_in_bytes"))
        if not found:
            continue  # no such file here: the next candidate
        if memory is None:
            return None  # "max" (v2), or v1's page-rounded 2**63: no limit
        if version == "v2":
            found, swap_max = _read_limit(directory / "memory.swap.max")
            return memory + (min(swap_max, swap) if found and swap_max is not None else swap)
        found, both = _read_limit(directory / "memory.memsw.limit_in_bytes")
        return min(both, memory + swap) if found and both is not None else memory + swap
    return None


def _read_limit(path: Path) -> tuple[bool, int | None]:
    """(whether `path` holds a limit, its bytes or None for no limit: "max", or v1's huge value)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return False, None
    if text == "max":
        return True, None
    if not text.isdigit():
        return False, None
    return True, (int(text) if int(text) < _UNLIMITED else None)


def size_words(nbytes: int) -> str:
    """"1.2 TB", "340 MB", "512 bytes": a byte count as a message says it (powers of 1000)."""
    for unit, scale in (("EB", 10**18), ("PB", 10**15), ("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} bytes"
