"""Running ``netoptim`` commands from tests: in this process through the CLI's ``main`` (a process
per call costs seconds of imports), or as a process of their own where the console path itself, or
a terminal-less stdin, is what a test is about."""

from __future__ import annotations

import contextlib
import io
import logging
import subprocess
import sys

from netoptim.console import main


def run_netoptim(*args: str, in_process: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """``netoptim ARGS``: its exit status, stdout and stderr as a finished process would give them."""
    if not in_process:
        return subprocess.run([sys.executable, "-m", "netoptim", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    out, err = io.StringIO(), io.StringIO()
    # what the command logs goes to its stderr, as in a process of its own (here logging is set up
    # already, so the command's own logging.basicConfig does nothing)
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's refusals, and commands that exit (with a message: printed, status 1)
                code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                if not isinstance(exc.code, int) and exc.code is not None:
                    print(exc.code, file=sys.stderr)
    finally:
        logging.getLogger().removeHandler(handler)
    return subprocess.CompletedProcess(["netoptim", *args], code, out.getvalue(), err.getvalue())
