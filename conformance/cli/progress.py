"""One line of progress on stderr for the long commands, shown only on a terminal.

    with Status("rosetta check") as status:
        status("oracle (numpy/cpu/float64)")   # rewrites the line in place

When stderr is not a terminal (a pipe, a file, a CI log) nothing is written at all: the output
a script reads stays exactly what it was. The line is cleared when the work ends, so the report
that follows starts on a clean line.

Other lines may reach stderr while the status is shown (impl_jax's notice before a long compile,
printed from a timer thread; a warning): while the status is live, `sys.stderr` clears the status
line before such text, so that it starts a line of its own, and draws the status again once that
line has ended. A line is often written in pieces (`print` writes its text, then the newline):
while one is half out, the status is not drawn (a new message waits for the line's end), so
that the redraw's carriage return cannot erase it.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Status:
    def __init__(self, command: str, stream: TextIO | None = None):
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.shown = False
        self.partial = False  # another writer's line is half out: the status waits for its end
        self.message: str | None = None
        self.lock = threading.RLock()  # the status and another thread's line (the JAX notice) take turns
        self._proxy: _GivingWay | None = None

    def __call__(self, message: str) -> None:
        if not self.live:
            return
        with self.lock:
            self.message = message
            if not self.partial:
                self._draw()

    def _draw(self) -> None:
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r\x1b[K{self.command}: {self.message} ({elapsed:.0f} s)")
        self.stream.flush()
        self.shown = True

    def _clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False

    def __enter__(self) -> Status:
        if self.live and sys.stderr is self.stream:
            self._proxy = _GivingWay(self)
            sys.stderr = self._proxy
        return self

    def __exit__(self, *exc) -> None:
        with self.lock:
            if self._proxy is not None and sys.stderr is self._proxy:
                sys.stderr = self.stream
            self._proxy = None
            self.message = None
            self._clear()


class _GivingWay:
    """`sys.stderr` while a status line is live: text written by anyone else clears the status
    line first, and a finished line brings the status back below it."""

    def __init__(self, status: Status):
        self._status = status

    def write(self, text: str) -> int:
        if not text:  # nothing to show: the status stays
            return 0
        status = self._status
        with status.lock:
            status._clear()
            written = status.stream.write(text)
            status.partial = not text.endswith("\n")
            if not status.partial and status.message is not None:
                status._draw()
            return written

    def __getattr__(self, name: str):  # flush, isatty, fileno, encoding ...: the terminal's own
        return getattr(self._status.stream, name)
