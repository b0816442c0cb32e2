"""Layers on llama.cpp RPC servers, on 127.0.0.1 only, every wait bounded.

Each run is its own process (`python -m ggufspec`, as a user runs it): llama.cpp's RPC client
keeps one connection per server for the life of a process, a server serves one client at a
time, and a process whose server goes away is ended by llama.cpp, so the test process itself
never registers a server.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clirun import free_port
from click.testing import CliRunner

from ggufspec.llama import backend, rpc
from ggufspec.cli.main import cli

TIMEOUT = 120  # any one command; faults must end within 30 s


def start_server(argv=None, port=None):
    """An RPC server on 127.0.0.1 (ours unless argv says otherwise); returns (process, endpoint)."""
    port = port or free_port()
    cmd = argv(port) if argv else [sys.executable, "-m", "ggufspec", "rpc-server", "--port", str(port), "-t", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    endpoint = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the RPC server exited: {proc.stderr.read().decode()}")
        try:
            rpc.probe(endpoint, timeout=1)
            return proc, endpoint
        except Exception:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the RPC server did not start within 30 s")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _env():
    env = dict(os.environ)
    env.pop("GGUFSPEC_RPC", None)
    return env


def ggufspec(*args, timeout=TIMEOUT, **kw):
    return subprocess.run([sys.executable, "-m", "ggufspec", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=_env(), **kw)


@pytest.fixture
def server():
    proc, endpoint = start_server()
    yield endpoint
    stop(proc)


@pytest.fixture
def two_servers():
    a, b = start_server(), start_server()
    yield a[1], b[1]
    stop(a[0])
    stop(b[0])


def one_line(result):
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def generate_json(tiny, *extra):
    r = ggufspec("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hello world", "-n", 24,
                 "--ignore-eos", "--mode", "draft", "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_target_on_a_server_draft_at_home_same_text(tiny, server):
    local = generate_json(tiny)
    remote = generate_json(tiny, "--rpc", server, "-ngl", "all")
    assert remote["tokens"] == local["tokens"] and remote["text"] == local["text"]
    target, draft = remote["placement"]["target"], remote["placement"]["draft"]
    on_rpc = {k: v for k, v in target.items() if k.startswith("RPC")}
    assert list(on_rpc) == [f"RPC0[{server}]"] and on_rpc[f"RPC0[{server}]"] > 0
    assert not any(k.startswith("RPC") for k in draft)
    assert not any(k.startswith("RPC") for k in local["placement"]["target"])
    assert remote["stats"]["n_drafted"] > 0


def test_hidden_state_drafts_follow_a_target_on_a_server(tmp_path, server):
    """EAGLE-3 and DFlash drafts read the target's layer inputs where its layers are on an RPC server: greedy and
    seeded text the target's own, and drafts kept (a process of its own: a server gone after the test leaves
    ggml's RPC device behind in the process that used it)."""
    from tiny_hidden import identity_in_a_process, read_target, write_tiny_dflash, write_tiny_eagle3, write_tiny_target

    target = write_tiny_target(tmp_path / "target.gguf")
    for kind, write in (("eagle3", write_tiny_eagle3), ("dflash", write_tiny_dflash)):
        draft = write(tmp_path / f"{kind}.gguf", read_target(target))
        accepted = identity_in_a_process(target, draft, kind, "RPC0", env=_env(), timeout=TIMEOUT, n_gpu_layers=-1,
                                         draft_n_gpu_layers=0, rpc=server)
        assert all(n > 0 for n in accepted), (kind, accepted)


NOISE_CHILD = """
import json, sys, threading
from ggufspec.engine import Engine
from ggufspec.sampling import PositionNoise
made, make = [], PositionNoise._make
def spy(self, t, scratch):
    made.append(threading.current_thread().name)
    return make(self, t, scratch)
PositionNoise._make = spy
target, draft, endpoint = sys.argv[1:4]
with Engine(target, draft, rpc=endpoint, n_gpu_layers=-1, n_ctx=512) as engine:
    out = engine.generate("hello world", max_tokens=24, ignore_eos=True, mode="draft", temperature=0.9, seed=5)
    print(json.dumps({"waits": [engine.target_model.cpu_waits, engine.draft_model.cpu_waits], "made": made,
                      "tokens": out.tokens}))
"""


def test_a_target_on_a_server_has_its_sampling_noise_made_while_it_decodes(tiny, server):
    """With the target's weights on a server this machine's CPU waits while the target decodes, so the coupled
    rule's noise for a round's positions is made on a worker thread meanwhile; the seeded text is unchanged."""
    r = subprocess.run([sys.executable, "-c", NOISE_CHILD, tiny["target"], tiny["close"], server], capture_output=True,
                       text=True, timeout=TIMEOUT, env=_env())
    assert r.returncode == 0, r.stderr[-2000:]
    remote = json.loads(r.stdout.splitlines()[-1])
    assert remote["waits"] == [True, False]
    assert sum(name.startswith("ggufspec-noise") for name in remote["made"]) >= 12, remote["made"]
    assert remote["tokens"] == generate_json(tiny, "--temp", "0.9", "-s", "5")["tokens"]


def test_a_mixture_of_experts_on_a_server_with_its_experts_at_home(server, tmp_path):
    """--n-cpu-moe with the target on a server: the experts stay in this machine's memory, the rest goes to the server,
    and the text is the same as with everything local and everything on the server."""
    from tiny import write_tiny_moe

    moe = write_tiny_moe(tmp_path / "moe.gguf", seed=0)

    def run(*extra):
        r = ggufspec("generate", "-m", moe, "-md", moe, "-p", "hello world", "-n", 16, "--ignore-eos", "--mode", "draft",
                     "--json", "-ngld", 0, *extra)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        where = out["placement"]["target"]
        return out["tokens"], sum(v for k, v in where.items() if k.startswith("RPC")), \
            sum(v for k, v in where.items() if not k.startswith("RPC"))

    local = run()
    remote, remote_all, home_all = run("--rpc", server, "-ngl", "all", "--n-cpu-moe", "0")
    split, remote_split, home_split = run("--rpc", server, "-ngl", "all", "--n-cpu-moe", "all")
    assert local[0] == remote == split
    assert remote_split < remote_all and home_split > home_all  # the experts moved home


def test_two_servers_share_the_target(tiny, two_servers):
    a, b = two_servers
    remote = generate_json(tiny, "--rpc", f"{a},{b}", "-ngl", "all")
    assert remote["tokens"] == generate_json(tiny)["tokens"]
    # llama.cpp names a remote buffer by the server's own device index and the endpoint
    assert {k.split("[")[1].rstrip("]") for k in remote["placement"]["target"] if k.startswith("RPC")} == {a, b}


def test_devices_choose_where_each_model_goes(tiny, server):
    r = generate_json(tiny, "--rpc", server, "-ngl", "all", "-ngld", "all", "-dev", "none", "-devd", "RPC0")
    assert not any(k.startswith("RPC") for k in r["placement"]["target"])
    assert any(k.startswith("RPC0") for k in r["placement"]["draft"])


def test_llama_cpps_own_rpc_server(tiny):
    """llama.cpp's ggml-rpc-server from the reference build, where that build exists here."""
    root = Path(os.environ.get("LLAMA_CPP_REFERENCE_DIR") or Path.home() / ".cache" / "llama-cpp-reference")
    binary = root / backend.llama_cpp_version() / "build" / "bin" / "ggml-rpc-server"
    if not binary.is_file():
        pytest.skip(f"no {binary}: ../shared/tools/llama-cpp-reference builds it")
    proc, endpoint = start_server(lambda port: [str(binary), "-H", "127.0.0.1", "-p", str(port)])
    try:
        remote = generate_json(tiny, "--rpc", endpoint, "-ngl", "all")
        assert remote["tokens"] == generate_json(tiny)["tokens"]
        assert any(k.startswith("RPC0") for k in remote["placement"]["target"])
    finally:
        stop(proc)


def test_plan_and_doctor_show_the_rpc_devices(tiny, server):
    r = ggufspec("plan", "-m", tiny["target"], "-md", tiny["close"], "--rpc", server)
    assert r.returncode == 0, r.stderr
    assert "target layers by device: RPC0 3 (output layer included)" in r.stdout and "-ngl all" in r.stdout
    d = ggufspec("doctor", "--json", "--rpc", server)
    assert d.returncode == 0, d.stderr
    devices = {x["name"]: x for x in json.loads(d.stdout)["devices"]}
    assert devices["RPC0"]["description"] == server and devices["RPC0"]["total_bytes"] > 0


def test_rpc_server_binds_loopback_unless_told():
    proc, endpoint = start_server()
    try:
        port = endpoint.rsplit(":", 1)[1]
        listening = Path("/proc/net/tcp").read_text().splitlines()[1:]
        local = {line.split()[1] for line in listening if line.split()[3] == "0A"}  # state 0A: LISTEN
        assert f"0100007F:{int(port):04X}" in local and f"00000000:{int(port):04X}" not in local
    finally:
        stop(proc)
    port = free_port()  # another loopback address: still this machine, but not 127.0.0.1, so it warns
    other = subprocess.Popen([sys.executable, "-m", "ggufspec", "rpc-server", "--host", "127.0.0.2", "--port", str(port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and other.poll() is None:
            try:
                rpc.probe(f"127.0.0.2:{port}", timeout=1)
                break
            except Exception:
                time.sleep(0.2)
    finally:
        stop(other)
    assert "Never expose the RPC server to an open network!" in other.stderr.read().decode()


# --- faults: one line, non-zero, within 30 s ---------------------------------------------------


def test_no_server_listening(tiny):
    start = time.monotonic()
    line = one_line(ggufspec("generate", "-m", tiny["target"], "-p", "hi", "--rpc", f"127.0.0.1:{free_port()}",
                             timeout=30))
    assert "nothing is listening there" in line and time.monotonic() - start < 30


@pytest.mark.parametrize("endpoint", ["localhost", "127.0.0.1:", "127.0.0.1:99999", "a b:1"])
def test_malformed_endpoint(tiny, endpoint):
    line = one_line(ggufspec("generate", "-m", tiny["target"], "-p", "hi", "--rpc", endpoint, timeout=30))
    assert "is not HOST:PORT" in line


def test_not_an_rpc_server(tiny):
    with socket.socket() as s:  # something else listening: it accepts and says nothing
        s.bind(("127.0.0.1", 0))
        s.listen()
        line = one_line(ggufspec("generate", "-m", tiny["target"], "-p", "hi", "--rpc",
                                 f"127.0.0.1:{s.getsockname()[1]}", timeout=30))
    assert "no answer within" in line


@pytest.mark.parametrize("form", ["--rpc HOST:PORT", "--rpc=HOST:PORT"])
def test_a_server_killed_in_the_middle_of_a_generation(tiny, form):
    proc, endpoint = start_server()
    rpc_args = ["--rpc", endpoint] if form == "--rpc HOST:PORT" else [f"--rpc={endpoint}"]
    run = subprocess.Popen([sys.executable, "-m", "ggufspec", "generate", "-m", str(tiny["target"]), "-p", "hello",
                            "-c", "60000", "-n", "59000", "--ignore-eos", "--mode", "target", *rpc_args,
                            "-ngl", "all"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        assert run.stdout.read(20)  # text is coming: the generation is under way
        stop(proc)
        _, err = run.communicate(timeout=30)
    finally:
        run.kill()
        stop(proc)
    # the load's cost measurement may warn first on a busy machine ("the measured decode times do not add up ...:
    # used for this run, not cached"); what the killed server leaves is one line and no traceback
    lines = [line for line in err.decode().splitlines() if line.strip() and "measur" not in line]
    assert run.returncode == 1 and len(lines) == 1, err.decode()
    assert "an RPC server stopped answering in the middle of the run" in lines[0] and endpoint in lines[0]


def test_a_build_without_rpc(tiny, monkeypatch):
    monkeypatch.setattr(rpc, "supports_rpc", lambda: False)
    r = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-p", "hi", "--rpc", "127.0.0.1:50052"])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "built without llama.cpp's RPC backend" in lines[0]
    assert "-DGGML_RPC=ON" in lines[0]


def test_more_layers_than_the_devices_hold(tiny, monkeypatch):
    """The devices' free memory as llama.cpp reports it decides; here made small."""
    from ggufspec.models.offload import resolve_layers

    with pytest.raises(Exception, match=r"-ngl all: the target's devices \(RPC0\) have 0 MiB free, room for 0 of its 3"):
        resolve_layers(tiny["target"], None, "all", 0, n_ctx=256, devices={"RPC0": 1000})
    assert resolve_layers(tiny["target"], None, "auto", 0, n_ctx=256, devices={"RPC0": 1000}) == (0, 0, 0)
    assert resolve_layers(tiny["target"], None, "all", 0, n_ctx=256, devices={"RPC0": 2**30}) == (-1, 0, 0)


def test_a_layer_count_that_fits_the_servers_memory_runs(tiny, server):
    ok = ggufspec("generate", "-m", tiny["target"], "-p", "hi", "--rpc", server, "-ngl", "2", "-n", "2", "--json")
    assert ok.returncode == 0, ok.stderr
    assert any(k.startswith("RPC0") for k in json.loads(ok.stdout)["placement"]["target"])


def test_llama_cpp_reports_the_layers_it_offloaded_to_the_server(tiny, server):
    """A server is a device like a GPU: llama.cpp's own log counts the layers -ngl moved there."""
    r = ggufspec("generate", "-m", tiny["target"], "-p", "hi", "-n", "2", "--rpc", server, "-ngl", "2", "--verbose")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "offloaded 2/3 layers to GPU" in r.stderr


# --- the real pair (slow tier) --------------------------------------------------------------------


@pytest.mark.slow
def test_the_real_pair_over_two_servers():
    """Greedy output over RPC equals local target-only decoding; the target's layers are split over two servers,
    the draft's at home (one server is the tiny models' case above: each run here sends 1 GB and measures its
    costs over RPC)."""
    from conftest import real_model

    target, draft = real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"), real_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    base = ["generate", "-m", target, "--chat", "Write a function to reverse a linked list in C.", "-n", 32, "--json"]
    local = ggufspec(*base, "--mode", "target")
    assert local.returncode == 0, local.stderr
    reference = json.loads(local.stdout)["tokens"]
    servers = [start_server(), start_server()]
    try:
        for endpoints in ([s[1] for s in servers],):
            r = ggufspec(*base, "-md", draft, "--mode", "draft", "--draft-max", 3, "--rpc", ",".join(endpoints),
                         "-ngl", "all", timeout=600)
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout)
            assert out["tokens"] == reference, endpoints
            remote = {k.split("[")[1].rstrip("]") for k in out["placement"]["target"] if k.startswith("RPC")}
            assert remote == set(endpoints)
            assert not any(k.startswith("RPC") for k in out["placement"]["draft"])
            assert out["stats"]["n_accepted"] > 0
    finally:
        for proc, _ in servers:
            stop(proc)


def test_a_port_in_use(tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        line = one_line(ggufspec("rpc-server", "--port", s.getsockname()[1], timeout=30))
    assert "cannot listen on 127.0.0.1:" in line


def test_an_unknown_device_name(tiny):
    r = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-p", "hi", "-dev", "CUDA7"])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1 and "no device named 'CUDA7' here (llama.cpp sees: CPU" in lines[0]
