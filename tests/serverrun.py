"""A `ggufspec serve` process on 127.0.0.1 for the HTTP tests, and the requests they send it."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from clirun import free_port


def start_server(*args, preexec_fn=None):
    """`ggufspec serve ARGS --port P` in a process of its own, once /health answers: (process, port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "serve", *map(str, args), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec_fn)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            get(port, "/health")
            return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError(proc.stderr.read())


def stop(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def post(port, path, body, timeout=60, headers=None):
    """(status, JSON answer, headers) of a POST; body: a JSON value, or bytes sent as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data,
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def get(port, path, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()


def metric(port, name, headers=None):
    return float(next(line.split()[1] for line in get(port, "/metrics", headers).splitlines()
                      if line.startswith(f"ggufspec_{name} ")))
