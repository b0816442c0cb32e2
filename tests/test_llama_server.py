"""llama-cpp-python's own server with a GGUF draft model (`python -m ggufspec.llama_server`), on
127.0.0.1, tiny models: the same text as Llama alone, drafts really made, bad drafts one line."""

from clirun import TIMEOUT, stderr_lines
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from clirun import free_port
from llama_cpp import Llama

pytest.importorskip("fastapi", reason="llama-cpp-python's server extras: pip install 'llama-cpp-python[server]'")


def start(*args):
    port = free_port()
    cmd = [sys.executable, "-m", "ggufspec.llama_server", *map(str, args), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return proc, None
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server did not answer within 60 s")


def complete(port, prompt):
    body = json.dumps({"prompt": prompt, "max_tokens": 60, "temperature": 0, "repeat_penalty": 1.0,  # the server defaults to 1.1
                       "logit_bias": {"2": -1000.0}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())["choices"][0]["text"]


# a draft of the target's vocabulary; the target itself with its letters at other ids (drafting through text)
@pytest.mark.parametrize("target, draft", [("target", "close"), ("lettered", "permuted")])
def test_the_server_drafts_with_a_gguf_and_keeps_llamas_text(tiny, target, draft):
    proc, port = start("--model", tiny[target], "--draft_model", tiny[draft], "--draft_mode", "draft",
                       "--n_ctx", 512, "--draft_model_num_pred_tokens", 3)
    try:
        assert port is not None, proc.stderr.read()
        texts = {p: complete(port, p) for p in ("hello world", "def f(x):")}
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    plain = Llama(model_path=str(tiny[target]), n_ctx=512, verbose=False)
    for prompt, text in texts.items():
        expected = plain.create_completion(prompt, max_tokens=60, temperature=0, logit_bias={2: -1000.0})
        assert text == expected["choices"][0]["text"], prompt
    assert "drafts with" in err and "(mode draft" in err
    drafted, accepted = (int(x) for x in err.split("drafted ")[-1].split(", accepted "))
    assert drafted > 0 and 0 < accepted <= drafted


def test_sigterm_reports_the_drafted_and_accepted_totals_as_ctrl_c_does(tiny):
    """Before: uvicorn raised the SIGTERM again under the default handler, which ended the process before the
    totals were printed (SIGINT printed them)."""
    proc, port = start("--model", tiny["target"], "--draft_model", tiny["close"], "--draft_mode", "draft",
                       "--n_ctx", 512, "--draft_model_num_pred_tokens", 3)
    try:
        assert port is not None, proc.stderr.read()
        complete(port, "hello world")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    drafted, accepted = (int(x) for x in err.split("drafted ")[-1].split(", accepted "))
    assert drafted > 0 and 0 <= accepted <= drafted and "Traceback" not in err


def test_the_server_binds_loopback_unless_told():
    from ggufspec import llama_server

    seen = {}

    def fake_main():
        seen["argv"] = list(sys.argv)

    import llama_cpp.server.__main__ as server_main

    original = server_main.main
    server_main.main = fake_main
    try:
        assert llama_server.main(["--model", "m.gguf"]) == 0
        assert seen["argv"][-2:] == ["--host", "127.0.0.1"]
        assert llama_server.main(["--model", "m.gguf", "--host", "0.0.0.0"]) == 0
        assert seen["argv"].count("--host") == 1
    finally:
        server_main.main = original


def test_a_draft_that_cannot_load_is_one_line(tiny, tmp_path):
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    proc, port = start("--model", tiny["target"], "--draft_model", bad, "--n_ctx", 512)
    assert port is None
    err = proc.stderr.read()
    assert proc.returncode == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("ggufspec.llama_server:")][0].count(str(bad)) == 1


def test_a_fifo_as_the_draft_is_one_line_not_a_hang(tiny, tmp_path):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    proc, port = start("--model", tiny["target"], "--draft_model", fifo, "--n_ctx", 512)
    assert port is None and proc.returncode == 1
    assert f"{fifo}: not a regular file" in proc.stderr.read()


def test_without_the_servers_extras_it_is_one_line(monkeypatch, capsys):
    from ggufspec import llama_server

    monkeypatch.setitem(sys.modules, "llama_cpp.server.__main__", None)  # as if fastapi & co. were missing
    assert llama_server.main(["--model", "m.gguf"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'llama-cpp-python[server]'" in err[0]


def test_llama_server_without_a_model_is_one_line():
    r = subprocess.run([sys.executable, "-m", "ggufspec.llama_server"], capture_output=True, text=True, timeout=TIMEOUT)
    assert r.returncode == 2 and len(stderr_lines(r.stderr)) == 1 and "--model" in r.stderr, r.stderr


def test_llama_server_with_an_incompatible_draft_is_one_line_before_the_target_loads(tiny):
    pytest.importorskip("fastapi")
    r = subprocess.run([sys.executable, "-m", "ggufspec.llama_server", "--model", str(tiny["target"]), "--draft_model",
                        str(tiny["letters"]), "--port", "1"], capture_output=True, text=True, timeout=TIMEOUT)
    lines = stderr_lines(r.stderr)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(lines) <= 2 and "cannot draft for" in lines[-1], r.stderr


def test_a_recurrent_target_is_refused_from_its_header_before_it_loads(tiny, tmp_path):
    """The launcher once loaded the whole target before GGUFDraftModel.attach refused it."""
    from tiny import write_tiny_hybrid

    lfm2 = write_tiny_hybrid(tmp_path / "lfm2.gguf", "lfm2")
    r = subprocess.run([sys.executable, "-m", "ggufspec.llama_server", "--model", str(lfm2), "--draft_model",
                        str(tiny["close"]), "--port", "1", "--verbose", "true"], capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "a recurrent or hybrid model" in stderr_lines(r.stderr)[-1], r.stderr
    assert "Model metadata" not in r.stderr  # what a verbose Llama prints once it has loaded the target
