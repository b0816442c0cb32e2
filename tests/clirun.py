"""Running the command line in tests: in-process through click's CliRunner, or as a process of its own where
the fault is the process's (closed standard streams, signals); and the one-clear-line check for bad input."""

import signal
import socket
import subprocess
import sys

from click.testing import CliRunner

from ggufspec.cli.main import cli

TIMEOUT = 120
# How a Ctrl-C'd run ends: exit 130, or (rarely, after the same one line) ended by the SIGINT itself, which a
# shell also reports as 130.
INTERRUPTED = (130, -signal.SIGINT)


def run(*args, **kw):
    return CliRunner().invoke(cli, [str(a) for a in args], **kw)


def one_line(result, *needles):
    """A failed command said one line on stderr holding each needle, and raised no traceback."""
    assert result.exit_code != 0, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def ggufspec(*args, **kw):
    kw.setdefault("timeout", TIMEOUT)
    return subprocess.run([sys.executable, "-m", "ggufspec", *map(str, args)], capture_output=True, text=True, **kw)


def stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stderr_until(proc, marker: bytes, timeout: float = TIMEOUT) -> bytes:
    """What a running process wrote to stderr up to `marker` (asserted seen within `timeout`): a progress line
    that says the point to send a signal at has come."""
    import os
    import time

    seen, deadline = b"", time.monotonic() + timeout
    while marker not in seen and time.monotonic() < deadline:
        chunk = os.read(proc.stderr.fileno(), 256)
        if not chunk:
            break
        seen += chunk
    assert marker in seen, seen.decode()
    return seen
