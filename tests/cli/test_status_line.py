"""The status line of the long `rosetta` commands (conformance/cli/progress.py) on a terminal: another
line on stderr (the JAX compile notice, a warning) gets a line of its own instead of sharing it, a
redraw waits for a half-written line, writing nothing leaves the status shown, and a pipe is left
alone (issue 45)."""

from __future__ import annotations

import io
import sys


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_printed_to_stderr_during_a_status_gets_a_line_of_its_own(monkeypatch):
    from conformance.cli.progress import Status

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Status("rosetta generate") as status:
        status("decoding 1 row(s) on jax")
        print("impl_jax: tracing and compiling decode, a new shape: this takes seconds", file=sys.stderr)
        status("still decoding")
    shown = terminal.getvalue()
    # The notice starts on a cleared line of its own, ends with its newline, and the status comes back after it.
    assert "s)impl_jax" not in shown, repr(shown)
    assert "\r\x1b[Kimpl_jax: tracing and compiling decode, a new shape: this takes seconds\n" in shown, repr(shown)
    after = shown.split("seconds\n", 1)[1]
    assert after.startswith("\r\x1b[Krosetta generate: decoding 1 row(s) on jax"), repr(after)
    assert shown.endswith("\r\x1b[K") and sys.stderr is terminal


def test_the_status_leaves_a_pipe_alone(monkeypatch):
    from conformance.cli.progress import Status

    piped = io.StringIO()
    monkeypatch.setattr(sys, "stderr", piped)
    with Status("rosetta generate") as status:
        status("decoding")
        print("a notice", file=sys.stderr)
    assert piped.getvalue() == "a notice\n" and sys.stderr is piped


def test_a_status_redraw_waits_for_a_half_written_line(monkeypatch):
    from conformance.cli.progress import Status

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Status("rosetta x") as status:
        status("first")
        sys.stderr.write("a notice")  # print's text; its newline comes in a second write
        status("second")  # another thread's redraw in between
        sys.stderr.write("\n")
        assert terminal.getvalue().endswith("rosetta x: second (0 s)"), terminal.getvalue()
    assert "a notice\n" in terminal.getvalue(), repr(terminal.getvalue())


def test_writing_nothing_leaves_the_status_shown(monkeypatch):
    from conformance.cli.progress import Status

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with Status("rosetta x") as status:
        status("working")
        sys.stderr.write("")
        assert terminal.getvalue().endswith("rosetta x: working (0 s)"), repr(terminal.getvalue())
