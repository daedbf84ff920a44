"""One line of progress on stderr for the long commands, shown only on a terminal.

    with Status("rosetta check") as status:
        status("oracle (numpy/cpu/float64)")   # rewrites the line in place

When stderr is not a terminal (a pipe, a file, a CI log) nothing is written at all: the output
a script reads stays exactly what it was. The line is cleared when the work ends, so the report
that follows starts on a clean line.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Status:
    def __init__(self, command: str, stream: TextIO | None = None):
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.shown = False

    def __call__(self, message: str) -> None:
        if not self.live:
            return
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r\x1b[K{self.command}: {message} ({elapsed:.0f} s)")
        self.stream.flush()
        self.shown = True

    def __enter__(self) -> Status:
        return self

    def __exit__(self, *exc) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
