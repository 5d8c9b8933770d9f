"""Running a ``netoptim`` command in the test's own process, for commands refused before they start
anything: a fresh interpreter costs 2-4 s of imports a case."""

from __future__ import annotations

import pytest

from netoptim import console


def in_process(args: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> tuple[int, str]:
    """``netoptim ARGS`` run in this process: its exit status and what it wrote to stderr or logged
    (in a process of its own the log goes to stderr)."""
    said = ""
    try:
        code = console.main(args)
    except SystemExit as exc:  # a message for SystemExit is what the interpreter prints to stderr, with status 1
        code, said = (exc.code, "") if isinstance(exc.code, int) else (1, str(exc.code))
    return code, capsys.readouterr().err + caplog.text + said
