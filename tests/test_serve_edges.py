"""The server's edges: who may use it (the API key, an address beyond this machine said aloud), a client that
leaves while sending, and how it stops: each request in flight answered that the server stopped, the exit status a
shell expects."""

import json
import signal
import socket
import threading
import urllib.error
import urllib.request

import pytest
from clirun import run
from serverrun import get, metric, post, start_server, stop

from ggufspec.server import is_loopback

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def status_of_get(port, path, headers=None):
    try:
        get(port, path, headers)
        return 200, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_events(port, body, out: list):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json", **AUTH})
    with urllib.request.urlopen(req, timeout=60) as r:
        out += [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]


def test_a_stop_answers_every_request_in_flight_and_the_key_guards_every_endpoint_but_health(tiny):
    """With --api-key, every endpoint but /health needs the key (401 in OpenAI's shape otherwise); a client that
    leaves while sending its body leaves no traceback; SIGTERM with a streamed and a whole request running: after
    --grace the stream ends with an error event that says the server stopped and [DONE], the whole request gets a
    503 saying so, the log says it in one line, and the exit status is 143 (128 + SIGTERM)."""
    proc, port = start_server("-m", tiny["target"], "-np", "2", "-c", "8192", "-ngl", "0", "--grace", "0.3",
                              "--api-key", KEY)
    try:
        assert status_of_get(port, "/health") == (200, None)
        for path in ("/v1/models", "/metrics"):
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                code, body = status_of_get(port, path, headers)
                assert code == 401 and body["error"]["type"] == "authentication_error", (path, headers, body)
            assert status_of_get(port, path, AUTH)[0] == 200
        code, body, _ = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert code == 401 and "Bearer" in body["error"]["message"]
        assert post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=AUTH)[0] == 200
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # leaves in the middle of its body
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"prompt": "h')
        long = {"prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "mode": "target"}
        events, whole = [], []
        clients = [threading.Thread(target=stream_events, args=(port, long, events)),
                   threading.Thread(target=lambda: whole.append(post(port, "/v1/completions", long, headers=AUTH)))]
        for c in clients:
            c.start()
        while metric(port, "requests_processing", AUTH) < 2:
            pass
        proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(60)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        stop(proc)
    assert events[-1] == "[DONE]" and "the server stopped" in json.loads(events[-2])["error"]["message"], events[-3:]
    code, body, _ = whole[0]
    assert code == 503 and "the server stopped" in body["error"]["message"], body
    err = proc.stderr.read()
    lines = [line for line in err.splitlines() if line.startswith("ggufspec serve:")]  # (not a busy CPU's notes)
    assert len(lines) == 3, err  # listening; the requests ended; stopped by SIGTERM
    assert "2 request(s) still running" in lines[1] and lines[2] == "ggufspec serve: stopped by SIGTERM", err
    for needle in ("Traceback", "Exception", "Error", "Cancel"):  # uvicorn's "Cancel 2 running task(s)" among them
        assert needle not in err, err


def test_ctrl_c_from_a_shell_that_ignores_it_exits_130(tiny):
    """A server started in the background of a script (SIGINT ignored, as a non-interactive shell leaves it) and
    stopped with `kill -INT` ends as Ctrl-C ends it: exit 130."""
    proc, _ = start_server("-m", tiny["target"], "-np", "1", "-ngl", "0",
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, proc.stderr.read()
    finally:
        stop(proc)
    assert "Traceback" not in proc.stderr.read()


def test_an_address_beyond_this_machine_is_said_aloud(tiny, monkeypatch):
    """--host 0.0.0.0 says in one line that anyone who can reach the port can use the server (nothing listens here:
    the address check is stubbed and -c stops the run before a model loads)."""
    monkeypatch.setattr("ggufspec.server.check_address", lambda host, port: None)
    result = run("serve", "-m", tiny["target"], "--host", "0.0.0.0", "-c", "16", "-np", "4")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "anyone who can reach port 8080 can use it (no --api-key given)" in lines[0], result.stderr
    result = run("serve", "-m", tiny["target"], "--host", "0.0.0.0", "-c", "16", "-np", "4", "--api-key", KEY)
    assert "and has the API key can use it" in result.stderr.splitlines()[0]
    assert "anyone" not in run("serve", "-m", tiny["target"], "-c", "16", "-np", "4").stderr  # 127.0.0.1: nothing


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("::", False),
                                            ("192.168.1.5", False), ("myhost", False)])
def test_which_addresses_are_this_machine_alone(host, loopback):
    assert is_loopback(host) is loopback


OPENMP_WORKERS = """
import os, sys
from ggufspec import Engine
from ggufspec.llama.runtime import on_a_passing_thread

def loaded():  # an Engine that has decoded (a server's Engine measures its costs while it loads)
    engine = Engine(sys.argv[1], n_ctx=256, n_threads=2, measure=False)
    engine.generate("def f(x):", max_tokens=4, mode="target", ignore_eos=True)
    return engine

threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
on_a_passing_thread(loaded, close=lambda e: e.close()).close()  # returns once the thread and its pool are gone
passing = threads()
loaded().close()
print(before, passing, threads())
"""


def test_a_servers_engine_loads_on_a_thread_that_takes_its_openmp_workers_with_it(tiny):
    """`ggufspec serve` and `bench --concurrency` load their Engine on a thread that ends (`on_a_passing_thread`):
    libgomp keeps a pool of workers for every thread that decoded, as long as it lives, and throttles them all
    once they outnumber the CPUs, so a main thread's pool made the scheduler's decodes a third slower on 2 vCPUs.
    After a load and a decode there, the process has the threads it had; after the same on the main thread, its
    OpenMP worker stays."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", OPENMP_WORKERS, str(tiny["target"])], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, passing, after = map(int, out.stdout.split())
    assert passing == before and after > before, (before, passing, after)


def test_decoding_from_two_living_threads_is_said_once_and_a_passing_one_is_not(tiny, monkeypatch, capsys):
    """What `on_a_passing_thread` avoids for ggufspec's own server, a user of the Python API meets when they decode
    from two threads that both live on (an Engine loaded and tried on the main thread, then served from another):
    every llama_decode notes its thread (`llama.runtime.Decoders`), and once the OpenMP pools of the threads still
    running outnumber the CPUs, one line says what it costs and what to do. A thread that has ended counts no more."""
    import threading

    from ggufspec import Engine
    from ggufspec.llama import runtime, system

    if "OPENMP" not in runtime.build_features():
        pytest.skip("this llama.cpp build runs its threads without OpenMP: no pools to outnumber the CPUs")
    monkeypatch.setattr(runtime, "DECODERS", runtime.Decoders())
    monkeypatch.setattr(runtime.RUNTIME, "warned", set())
    with Engine(str(tiny["target"]), n_ctx=256, n_threads=system.usable_cpus(), measure=False) as engine:
        def write():
            return engine.generate("def f(x):", max_tokens=3, mode="target", ignore_eos=True).text

        runtime.on_a_passing_thread(write)
        alone = write()  # the main thread, after the passing one ended
        assert capsys.readouterr().err == ""
        go_on, done = threading.Event(), threading.Event()

        def serve():
            write()
            done.set()
            go_on.wait(60)

        server = threading.Thread(target=serve, name="a-server")
        server.start()
        try:
            assert done.wait(60)
            assert write() == alone and write() == alone
        finally:
            go_on.set()
            server.join()
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(said) == 1 and "decoded on 2 threads of this process that still run (MainThread, a-server)" in said[0], said
