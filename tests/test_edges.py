"""Edges of the API and the CLI: each bad input or fault is one clear line (or one GGUFSpecError),
with nothing lost. Tiny models; processes of their own where the fault is the process's (closed
standard streams, signals)."""

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ggufspec import Engine, GGUFSpecError
from ggufspec.cli.main import cli

TIMEOUT = 120
# How a Ctrl-C'd run ends: exit 130, or (rarely, after the same one line) ended by the SIGINT itself, which a
# shell also reports as 130.
INTERRUPTED = (130, -signal.SIGINT)


def run(*args, **kw):
    return CliRunner().invoke(cli, [str(a) for a in args], **kw)


def one_line(result, *needles):
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


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine(tiny["target"], tiny["close"], n_ctx=512) as e:
        yield e


# --- the Engine as an API --------------------------------------------------------------------


def test_one_engine_shared_by_threads_runs_one_generation_at_a_time(engine):
    expected = {p: engine.generate(p, max_tokens=40, ignore_eos=True, mode="draft").tokens
                for p in ("hello world", "def f(x):", "zzz zzz")}
    results, errors = {}, []

    def worker(i, prompt):
        try:
            for _ in range(3):
                results[(i, prompt)] = engine.generate(prompt, max_tokens=40, ignore_eos=True, mode="draft").tokens
        except Exception as e:  # noqa: BLE001 - the test reports whatever went wrong
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, p)) for i in range(2) for p in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert not errors, errors
    assert all(results[(i, p)] == expected[p] for i in range(2) for p in expected)


def test_a_stream_superseded_by_a_later_generation_says_so(engine):
    stream = engine.stream("hello world", max_tokens=30, ignore_eos=True)
    next(stream)
    engine.generate("def f(x):", max_tokens=5)
    with pytest.raises(GGUFSpecError, match="superseded by a later generation"):
        next(stream)
    assert len(engine.generate("hello world", max_tokens=30, ignore_eos=True).tokens) == 30  # and the engine works


def test_prompt_arguments_are_checked(engine):
    with pytest.raises(GGUFSpecError, match="not a token id of this model"):
        engine.generate(prompt_tokens=[1, 2**31])
    with pytest.raises(GGUFSpecError, match="not a token id"):
        engine.generate(prompt_tokens=[1, -5])
    with pytest.raises(GGUFSpecError, match="exactly one of a prompt, chat messages or prompt_tokens"):
        engine.generate("hello", prompt_tokens=[1, 5])
    with pytest.raises(GGUFSpecError, match="exactly one"):
        list(engine.stream("hello", prompt_tokens=[1, 5]))


@pytest.mark.parametrize("messages", [["hi"], [1, 2], "hi", [{"content": "hi"}], [{"role": "user"}], []])
def test_chat_messages_of_the_wrong_shape(engine, messages):
    with pytest.raises(GGUFSpecError, match="messages"):
        engine.generate(messages=messages, max_tokens=4)


def test_stop_none_and_empty_stop(engine):
    reference = engine.generate("hello", max_tokens=12, ignore_eos=True)
    assert engine.generate("hello", max_tokens=12, ignore_eos=True, stop=None).tokens == reference.tokens
    with pytest.raises(GGUFSpecError, match="non-empty"):
        engine.generate("hello", max_tokens=12, stop=[""])


def test_a_closed_engine_says_so(tiny):
    e = Engine(tiny["target"], n_ctx=64)
    e.close()
    with pytest.raises(GGUFSpecError, match="this Engine is closed"):
        e.generate("hi", max_tokens=2)
    with pytest.raises(GGUFSpecError, match="this Engine is closed"):
        e.tokenize_prompt("hi")


@pytest.mark.parametrize("temp", ["1e-38", "1e-320"])
def test_a_tiny_temperature_is_greedy_without_warnings(tiny, temp):
    greedy = run("generate", "-m", tiny["target"], "-p", "hello", "-n", 20, "--ignore-eos", "--json")
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hello", "-n", 20, "--ignore-eos", "--json",
            "--temp", temp, "-s", 1)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == json.loads(greedy.stdout)["tokens"]
    assert "overflow" not in r.stderr and "invalid value" not in r.stderr


@pytest.mark.parametrize("temp", ["nan", "inf"])
def test_a_temperature_that_is_not_a_number(tiny, temp):
    one_line(run("generate", "-m", tiny["target"], "-p", "hello", "--temp", temp), "--temp must be a finite number")


# --- flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [0, 100000, 5000])
def test_thread_counts_are_bounded(tiny, threads):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "-n", 4, "-t", threads), "-t/--threads must be between 1 and")


def test_a_seed_out_of_range_names_the_range(tiny):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "-s", 2**63), "between 0 and 2**63-1")


def test_an_empty_stop_string_is_refused(tiny):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--stop", ""), "--stop", "non-empty")


def test_llama_cpps_current_flag_names(tiny):
    def tokens(*args):
        r = run("generate", "-m", tiny["target"], "-p", "hello world", "-n", 30, "--ignore-eos", "--json", *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    ours = tokens("-md", tiny["close"], "--mode", "draft", "--draft-max", 3, "--draft-min", 1)
    theirs = tokens("--spec-draft-model", tiny["close"], "--spec-type", "draft-simple", "--spec-draft-n-max", 3,
                    "--spec-draft-n-min", 1)
    assert theirs["tokens"] == ours["tokens"] and theirs["stats"]["mode"] == "draft"
    assert tokens("--spec-type", "ngram-simple")["stats"]["mode"] == "lookup"
    assert tokens("--spec-type", "none")["stats"]["mode"] == "target"
    assert tokens("-md", tiny["close"], "--spec-type", "draft-simple,ngram-simple")["stats"]["mode"] == "auto"
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--spec-type", "ngram-mod"), "ngram-mod",
             "does not have", "--mode lookup")
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--spec-type", "magic"), "'magic'")
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--spec-type", "draft-simple", "--mode", "lookup"),
             "means --mode draft")
    help_text = run("generate", "--help").output
    for flag in ("--draft-max", "--spec-draft-n-max", "--spec-type", "--spec-draft-model", "--sampling-rule"):
        assert flag in help_text


def test_a_symlink_loop_names_the_cause(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    one_line(run("generate", "-m", "loop1", "-p", "hi"), "loop1", "symbolic links")
    os.symlink(tmp_path / "nowhere.gguf", "dangling")
    one_line(run("generate", "-m", "dangling", "-p", "hi"), "dangling")


@pytest.mark.parametrize("port", [70000, -1, 0])
def test_rpc_server_port_out_of_range(port):
    one_line(run("rpc-server", "--port", port), "range")


def test_rpc_server_threads_out_of_range():
    one_line(run("rpc-server", "-t", 100000), "-t/--threads")


# --- the cost cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["a string", "missing key", "list", "zeros", "null exact"])
def test_a_damaged_cost_entry_is_measured_again_and_doctor_names_the_file(tiny, damage):
    from ggufspec.paths import costs_file

    assert run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 4).exit_code == 0
    cache = json.loads(costs_file().read_text())
    for key in list(cache):
        if damage == "a string":
            cache[key] = "oops"
        elif damage == "missing key":
            cache[key] = {k: v for k, v in cache[key].items() if k not in ("exact_batch", "token_seconds")}
        elif damage == "list":
            cache[key] = []
        elif damage == "zeros":
            cache[key] = {**cache[key], "target_batch_seconds": [0.0] * 9, "token_seconds": 0}
        else:
            cache[key] = {**cache[key], "exact_batch": None, "token_seconds": None}
    costs_file().write_text(json.dumps(cache))
    doctor = run("doctor")
    assert str(costs_file()) in doctor.output and "damaged entr" in doctor.output
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 4, "--mode", "auto")
    assert r.exit_code == 0, r.output
    assert "damaged entr" not in run("doctor").output  # measured again and rewritten


def test_doctor_shows_only_the_measurements_a_run_would_read(tiny, tmp_path):
    from ggufspec.paths import costs_file

    target = tmp_path / "t.gguf"
    target.write_bytes(Path(tiny["target"]).read_bytes())
    assert run("generate", "-m", target, "-md", tiny["close"], "-p", "hi", "-n", 4).exit_code == 0
    listed = lambda: [c["model"] for c in json.loads(run("doctor", "--json").output)["costs"]]
    assert listed() == [str(target.resolve())]
    cache = json.loads(costs_file().read_text())
    (key,) = [k for k in cache if k.startswith(str(target.resolve())) and not k.endswith("|draft")]
    older = key.replace("|b64|", "|b16|")  # an earlier version's measurement of the same file
    assert older != key
    costs_file().write_text(json.dumps({**cache, older: cache[key]}))
    assert listed() == [str(target.resolve())]
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed since: measured anew when run
    assert listed() == []
    target.unlink()
    assert listed() == [] and "measured costs on this machine: none yet" in run("doctor").output


def test_a_full_disk_leaves_no_temporary_cost_file(tiny, monkeypatch):
    from ggufspec.llama import measure as costs
    from ggufspec.paths import costs_file

    def full(self, data, *a, **kw):
        with open(self, "w") as f:
            f.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    costs._save_cache({"k": {"token_seconds": 1.0}})
    monkeypatch.undo()
    assert not list(costs_file().parent.glob("*.tmp"))


# --- bench ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suite", ["", ",", " , "])
def test_bench_with_no_suite(tiny, suite):
    one_line(run("bench", "-m", tiny["target"], "--suite", suite), "--suite names no suite")


def test_bench_prompts_with_messages_of_the_wrong_shape(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"messages": [1, 2]}\n')
    one_line(run("bench", "-m", tiny["target"], "--prompts", f), "p.jsonl, line 1", "messages[0]")


def test_bench_one_token_is_refused(tiny):
    one_line(run("bench", "-m", tiny["target"], "-n", 1), "-n must be at least 2")


def test_bench_plot_without_matplotlib_is_refused_before_running(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    start = time.monotonic()
    one_line(run("bench", "-m", tiny["target"], "--plot", tmp_path / "x.png"), "matplotlib")
    assert time.monotonic() - start < 5  # nothing was loaded or run


def test_bench_save_outputs_where_nothing_can_be_written(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    one_line(run("bench", "-m", tiny["target"], "-n", 4, "--save-outputs", tmp_path / "file" / "out"),
             "--save-outputs", "cannot write there")


def test_bench_save_outputs_on_a_full_disk_keeps_the_table(tiny, tmp_path, monkeypatch):
    from ggufspec.bench import benchmark as bench

    real = Path.write_text

    def full(self, data, *a, **kw):
        if self.suffix == ".tmp":
            real(self, data[:10], *a, **kw)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "out"
    r = run("bench", "-m", tiny["target"], "-n", 4, "--modes", "target,lookup", "--suite", "code", "--limit", 1,
            "--save-outputs", out)
    assert r.exit_code == 1
    assert "target" in r.stdout and "lookup" in r.stdout  # the table is there
    assert "No space left on device" in stderr_lines(r.stderr)[-1]
    assert list(out.iterdir()) == []  # no empty or partial file
    assert bench  # (imported for the module under test)


def test_sigterm_during_bench_keeps_the_finished_rows(tiny):
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "bench", "-m", str(tiny["target"]), "--modes",
                             "target,lookup", "-n", "16", "--repeats", "2000", "--suite", "code", "--limit", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "GGUFSPEC_STDERR_TTY": "1"})
    seen, deadline = b"", time.monotonic() + TIMEOUT
    while b"bench 6/" not in seen and time.monotonic() < deadline:  # the progress line: counted runs finished
        chunk = os.read(proc.stderr.fileno(), 256)
        if not chunk:
            break
        seen += chunk
    assert b"bench 6/" in seen, seen.decode()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=TIMEOUT)
    err = (seen + err).decode()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated: showing the finished runs" in err
    out = out.decode()
    assert "target" in out and "lookup" in out and "tok/s" in out


# --- the process: standard streams and signals -------------------------------------------------


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


def test_standard_input_closed(tiny):
    r = subprocess.run([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-f", "-"],
                       capture_output=True, text=True, preexec_fn=_closed(0), timeout=TIMEOUT)
    assert r.returncode == 1 and stderr_lines(r.stderr) == [
        "Error: -f -: standard input is closed; pipe the prompt in, or give -p PROMPT or -f FILE"]


def test_ctrl_c_inside_llama_cpps_load_stops_it(tiny, monkeypatch):
    """The signal arrives while llama.cpp is loading (sent from inside its log callback, where Python
    runs signal handlers during a load): the load stops and KeyboardInterrupt comes out of Model(),
    nothing is printed as ignored."""
    from ggufspec.llama import backend, runtime

    class Trap(list):
        def append(self, line):
            if not self:
                os.kill(os.getpid(), signal.SIGINT)
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
    with pytest.raises(KeyboardInterrupt):
        backend.Model(tiny["target"])
    assert unraisable == []
    monkeypatch.undo()
    backend.Model(tiny["target"]).close()  # and the next load is not affected


def test_ctrl_c_while_a_context_is_created_is_not_lost(tiny, monkeypatch):
    """llama.cpp logs while it allocates a context's KV cache; a signal handled inside that log callback
    would be printed as ignored and lost (a generation of -n 100000 then runs on). It must come out."""
    from ggufspec.llama import backend, runtime

    class Trap(list):
        def append(self, line):
            if not self:
                os.kill(os.getpid(), signal.SIGINT)
            super().append(line)

    runtime.init()
    unraisable = []
    with backend.Model(tiny["target"]) as model:
        monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
        monkeypatch.setattr(runtime.RUNTIME, "capture", Trap())
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
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode in INTERRUPTED and stderr_lines(err) == ["interrupted"], (delay, err)


def test_ctrl_c_at_start_up_is_one_line(tiny):
    """Ctrl-C while the command imports its modules (llama.cpp's included) and loads. (The interpreter's
    own first tens of milliseconds, before any of ggufspec's code runs, are Python's: not tested.)"""
    for delay in (0.25, 0.5):
        proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-p", "hi",
                                 "-n", "100000", "-c", "200000", "--ignore-eos"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode in INTERRUPTED, err
        assert stderr_lines(err) == ["interrupted"], err


# --- the server launcher ------------------------------------------------------------------------


def test_llama_server_without_a_model_is_one_line():
    r = subprocess.run([sys.executable, "-m", "ggufspec.llama_server"], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and len(stderr_lines(r.stderr)) == 1 and "--model" in r.stderr, r.stderr


def test_llama_server_with_an_incompatible_draft_is_one_line_before_the_target_loads(tiny):
    pytest.importorskip("fastapi")
    r = subprocess.run([sys.executable, "-m", "ggufspec.llama_server", "--model", str(tiny["target"]), "--draft_model",
                        str(tiny["other_vocab"]), "--port", "1"], capture_output=True, text=True, timeout=TIMEOUT)
    lines = stderr_lines(r.stderr)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(lines) <= 2 and "cannot draft for" in lines[-1], r.stderr


# --- plan ----------------------------------------------------------------------------------------


def test_plan_ram_messages(tiny):
    one_line(run("plan", "-m", tiny["target"], "--ram", "lots"), "--ram 'lots' is not a size")
    one_line(run("plan", "-m", tiny["target"], "--ram", "0"), "needs", "RAM")
    assert np  # numpy imported for the fixtures' sake
