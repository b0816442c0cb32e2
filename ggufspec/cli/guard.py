"""Guards around a run: SIGTERM and SIGHUP stopping it as Ctrl-C does (so what finished is kept), and a command that
talks to RPC servers run in a child process.

llama.cpp's RPC client ends the whole process (GGML_ABORT) when a server's connection breaks in
the middle of a run; nothing in-process can catch that. The child does the work with the same
arguments; its output passes through as it comes; llama.cpp's abort message is held back and a
child that died of it becomes one line and exit status 1.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

# ggml's abort format: "path/file.cpp:LINE: message"; and what comes after it.
_GGML_LINE = re.compile(rb"^\S+\.(c|cpp|h):\d+: ")
_NOISE = re.compile(rb"^(GGML_ABORT|\[New LWP|#\d+ +0x)")


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM (what `timeout` and service managers send) and SIGHUP (a closed terminal or ssh session)
    stop a run the way Ctrl-C does, so the finished runs are still reported and saved; yields a list
    that holds the signal once one came."""
    came: list[int] = []

    def handler(signum, frame):
        came.append(signum)
        raise KeyboardInterrupt

    def unraisable(hook_args):  # our KeyboardInterrupt, lost in one of llama.cpp's callbacks: see raise_if_stopped
        if not (came and issubclass(hook_args.exc_type, KeyboardInterrupt)):
            previous_hook(hook_args)

    stopping = [s for s in (signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None]
    try:
        previous = {s: signal.signal(s, handler) for s in stopping}
    except ValueError:  # not the main thread: leave signals alone
        yield came
        return
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield came
    finally:
        sys.unraisablehook = previous_hook
        for s, old in previous.items():
            signal.signal(s, old)


def raise_if_stopped(signals: list[int]) -> None:
    """Raise the KeyboardInterrupt a stopping signal meant where it was lost: raised inside one of llama.cpp's
    callbacks (its log, while a model loads), ctypes swallows it and the run goes on. Call it where stopping is
    safe (between runs)."""
    if signals:
        raise KeyboardInterrupt


def stopped_by(signals: list[int]) -> tuple[str, int]:
    """What to say of a run stopped by these signals (none: Ctrl-C), and the exit status a shell expects."""
    if not signals:
        return "interrupted", 130
    return ("hung up" if signals[0] == getattr(signal, "SIGHUP", None) else "terminated"), 128 + signals[0]


def run_guarded(args: list[str]) -> int:
    env = dict(os.environ, GGUFSPEC_CHILD="1", GGML_NO_BACKTRACE="1")
    if sys.stderr.isatty():
        env["GGUFSPEC_STDERR_TTY"] = "1"  # the child's stderr is a pipe: let it show progress anyway
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", *args], stderr=subprocess.PIPE, env=env)
    held = []
    try:
        buffer = b""
        while True:
            data = os.read(proc.stderr.fileno(), 4096)
            if not data:
                break
            *lines, buffer = re.split(rb"(?<=[\r\n])", buffer + data)  # whole lines; "\r" ends a progress line
            for line in lines:
                if _GGML_LINE.match(line) or _NOISE.match(line):
                    held.append(line)
                else:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()
        if buffer:
            sys.stderr.buffer.write(buffer)
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        return 130
    if code >= 0 and not (code and held):
        return code
    what = b" ".join(h.strip() for h in held).decode("utf-8", "replace")
    servers = os.environ.get("GGUFSPEC_RPC") or _rpc_arg(args) or "the RPC servers"
    reason = "an RPC server stopped answering in the middle of the run" if "RPC" in what or "rpc" in what else \
        f"llama.cpp ended the process ({what or 'signal ' + str(-code)})"
    print(f"Error: {reason} ({servers}); llama.cpp ends the process when an RPC connection breaks: check that "
          "`ggufspec rpc-server` still runs there, then run the command again", file=sys.stderr)
    return 1


def _rpc_arg(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a == "--rpc" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--rpc="):
            return a.split("=", 1)[1]
    return None
