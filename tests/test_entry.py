"""The `ggufspec` process (cli/entry.py, cli/main.py): closed or full standard streams, Ctrl-C and SIGTERM at
any moment (imports, model loads, context creation) are one line and the right exit status."""

import os
import signal
import subprocess
import sys
import time

import pytest

from clirun import INTERRUPTED, TIMEOUT, stderr_lines


def _closed(fd):
    return lambda: os.close(fd)


@pytest.mark.parametrize("args", [["--json"], []])
def test_standard_output_closed(tiny, args):
    r = subprocess.run([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-p", "hi", "-n", "4",
                        *args], stderr=subprocess.PIPE, text=True, preexec_fn=_closed(1), timeout=TIMEOUT)
    assert r.returncode == 1 and stderr_lines(r.stderr) == [
        "Error: standard output is closed; redirect it to a file or /dev/null instead"]


@pytest.mark.parametrize("command", [["generate", "-p", "hi", "-n", "4", "--json"], ["generate", "-p", "hi", "-n", "4"],
                                     ["bench", "-n", "4", "--suite", "code", "--limit", "1", "--json"]])
def test_standard_output_on_a_full_disk(tiny, command):
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "ggufspec", command[0], "-m", str(tiny["target"]), *command[1:]],
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT)
    lines = stderr_lines(r.stderr)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "could not write the output (No space left on device)" in lines[-1] and len(lines) <= 2, r.stderr


def test_a_reader_that_goes_away_is_exit_141_and_nothing_said(tiny):
    """`ggufspec generate ... | head -c 10`: the reader has what it wanted; a shell reads 141 as SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-p", "hi",
                             "-n", "2000", "--ignore-eos", "-c", "4096"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.read(10)
    proc.stdout.close()  # as head does once it has its bytes
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=TIMEOUT) == 141 and "Traceback" not in err and "Error" not in err, err


def test_standard_input_closed(tiny):
    r = subprocess.run([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-f", "-"],
                       capture_output=True, text=True, preexec_fn=_closed(0), timeout=TIMEOUT)
    assert r.returncode == 1 and stderr_lines(r.stderr) == [
        "Error: -f -: standard input is closed; pipe the prompt in, or give -p PROMPT or -f FILE"]


class Stopped(Exception):
    pass


def _stop(signum, frame):
    raise Stopped(signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_inside_llama_cpps_load_stops_it(tiny, monkeypatch, signum):
    """Ctrl-C, SIGTERM or SIGHUP arrives while llama.cpp is loading (sent from inside its log callback, where Python
    runs signal handlers during a load): the load stops and the signal's own handler's exception comes out of
    Model(), nothing is printed as ignored (a SIGHUP was swallowed and the load went on)."""
    from ggufspec.llama import backend, runtime

    class Trap(list):
        def append(self, line):
            if not self:
                os.kill(os.getpid(), signum)
            super().append(line)

    class TrappedRuntime(runtime.Runtime):
        def __setattr__(self, key, value):
            super().__setattr__(key, Trap() if key == "capture" and type(value) is list else value)

    runtime.init()  # llama.cpp's log goes through ggufspec's callback from here on
    trapped = TrappedRuntime()
    trapped.started = True
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(runtime, "RUNTIME", trapped)
    previous = signal.signal(signum, _stop)
    try:
        with pytest.raises(Stopped):
            backend.Model(tiny["target"])
    finally:
        signal.signal(signum, previous)
    assert unraisable == []
    monkeypatch.undo()
    backend.Model(tiny["target"]).close()  # and the next load is not affected


def test_ctrl_c_while_a_context_is_created_is_not_lost(tiny, monkeypatch):
    """llama.cpp logs while it allocates a context's KV cache; a signal handled inside that log callback
    would be printed as ignored and lost (a generation of -n 100000 then runs on). It must come out."""
    from ggufspec.llama import backend, runtime

    class Trap:  # stands for stderr, which the log callback writes to with --verbose: the signal comes from inside it
        fired = False

        def write(self, line):
            if not self.fired:
                self.fired = True
                os.kill(os.getpid(), signal.SIGINT)

        def flush(self):
            pass

    runtime.init()
    unraisable = []
    with backend.Model(tiny["target"]) as model:
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        monkeypatch.setattr(runtime.RUNTIME, "verbose", True)
        monkeypatch.setattr(sys, "stderr", Trap())
        with pytest.raises(KeyboardInterrupt):
            backend.Context(model, n_ctx=256)
        monkeypatch.undo()
    assert unraisable == []


@pytest.mark.slow
def test_ctrl_c_while_the_real_target_loads_is_one_line():
    from conftest import real_model

    target = real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    for delay in (0.2, 0.5, 1.0):
        proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "generate", "-m", str(target), "-p", "hi", "-n", "4",
                                 "--mode", "target"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=TIMEOUT)
        finally:
            proc.kill()  # a run that missed its Ctrl-C must not go on beside the rest of the suite
        assert proc.returncode in INTERRUPTED and stderr_lines(err) == ["interrupted"], (delay, err)


def test_ctrl_c_at_start_up_is_one_line(tiny):
    """Ctrl-C while the command imports its modules (llama.cpp's included) and loads. (The interpreter's
    own first tens of milliseconds, before any of ggufspec's code runs, are Python's: not tested.)"""
    for delay in (0.25, 0.5):
        proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-p", "hi",
                                 "-n", "100000", "-c", "200000", "--ignore-eos"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(delay)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=TIMEOUT)
        finally:
            proc.kill()  # a run that missed its Ctrl-C (-n 100000) must not go on beside the rest of the suite
        assert proc.returncode in INTERRUPTED, err
        assert stderr_lines(err) == ["interrupted"], err
