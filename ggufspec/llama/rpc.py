"""Layers on other machines through llama.cpp's own RPC backend (`ggml-rpc`), nothing home-made.

`add_servers` registers servers with llama.cpp as its `--rpc` does (common/arg.cpp,
add_rpc_devices): each server's devices (RPC0, RPC1, ...) then take layers like a GPU. `serve`
runs llama.cpp's RPC server on this machine's CPU. llama.cpp's RPC client ends the process on a
connection it cannot make or loses, so every endpoint is checked here first, with a timeout, by
the protocol's own HELLO; the CLI runs RPC work in a child process to report a server lost in the
middle of a run in one line. llama.cpp's RPC has no authentication or encryption: bind servers to
127.0.0.1 unless the network is yours alone.
"""

from __future__ import annotations

import re
import socket
import struct

from . import devices as ggml_devices
from .backend import default_threads
from .runtime import llama_cpp_version, supports_rpc
from ..errors import GGUFSpecError

DEFAULT_PORT = 50052
RPC_CMD_HELLO = 14  # ggml-rpc.cpp: "RPC_CMD_HELLO must be always 14"
CONN_CAPS_SIZE = 24  # ggml-rpc transport.h, RPC_CONN_CAPS_SIZE
PROTO_MAJOR = 7  # ggml-rpc.h, RPC_PROTO_MAJOR_VERSION of the llama.cpp this release vendors
NO_RPC_BUILD = ("this llama-cpp-python was built without llama.cpp's RPC backend; rebuild it with "
                "`python scripts/install.py` (it sets -DGGML_RPC=ON), or CMAKE_ARGS=\"-DGGML_RPC=ON\" "
                "pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python")
WARNING = ("WARNING: Host ('{host}') is != '127.0.0.1'\n"
           "         Never expose the RPC server to an open network!\n"
           "         This is an experimental feature and is not secure!")  # llama.cpp's rpc-server says so
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_added: dict[str, list[str]] = {}  # endpoint -> its device names, for this process


def parse_endpoints(value) -> list[str]:
    """'host:port,host:port' (or a list) -> endpoints; one line naming a malformed one."""
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    out = []
    for item in (str(x).strip() for x in items):
        m = _ENDPOINT.match(item)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise GGUFSpecError(f"--rpc {item!r} is not HOST:PORT (for example 127.0.0.1:{DEFAULT_PORT})")
        out.append(item)
    if not out:
        raise GGUFSpecError(f"--rpc needs at least one HOST:PORT (for example 127.0.0.1:{DEFAULT_PORT})")
    return list(dict.fromkeys(out))


def probe(endpoint: str, timeout: float = 5.0) -> tuple[int, int, int]:
    """The HELLO handshake llama.cpp's client makes, here with a timeout: the server's protocol
    version, or one line saying what is wrong."""
    host, port = endpoint.rsplit(":", 1)
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack("<BQ", RPC_CMD_HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
            head = _recv(s, 8)
            (size,) = struct.unpack("<Q", head)
            body = _recv(s, size) if 0 < size <= 1024 else b""
    except ConnectionRefusedError:
        raise GGUFSpecError(f"--rpc {endpoint}: nothing is listening there; start `ggufspec rpc-server --port {port}` "
                            "(or llama.cpp's rpc-server) on that machine") from None
    except (socket.timeout, TimeoutError):
        raise GGUFSpecError(f"--rpc {endpoint}: no answer within {timeout:.0f} s (a busy server serves one client at "
                            "a time; or a firewall drops the connection)") from None
    except OSError as e:
        raise GGUFSpecError(f"--rpc {endpoint}: cannot connect ({e.strerror or e})") from None
    if len(body) < 3:
        raise GGUFSpecError(f"--rpc {endpoint}: what answers there is not a llama.cpp RPC server")
    major, minor, patch = body[0], body[1], body[2]
    if major != PROTO_MAJOR:
        raise GGUFSpecError(f"--rpc {endpoint}: the server speaks RPC protocol {major}.{minor}.{patch}, this build "
                            f"{PROTO_MAJOR}.x; run a server from the same llama.cpp release (llama-cpp-python "
                            f"{llama_cpp_version()})")
    return major, minor, patch


def _recv(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = s.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def add_servers(endpoints) -> list[str]:
    """Probe and register RPC servers with llama.cpp (once per process each); their device names, in order."""
    if not supports_rpc():
        raise GGUFSpecError(NO_RPC_BUILD)
    names = []
    for endpoint in parse_endpoints(endpoints):
        if endpoint not in _added:
            probe(endpoint)
            added = ggml_devices.rpc_add_server(endpoint)
            if added is None:
                raise GGUFSpecError(NO_RPC_BUILD)
            if not added:
                raise GGUFSpecError(f"--rpc {endpoint}: the server offers no device")
            _added[endpoint] = added
        names += _added[endpoint]
    return names


def local_accelerators() -> list[str]:
    """This machine's own GPUs and accelerators (not the CPU, not RPC devices): where a draft may go."""
    return list(ggml_devices.local_gpus())


def serve(host: str = "127.0.0.1", port: int = DEFAULT_PORT, threads: int | None = None,
          cache_dir: str | None = None) -> None:
    """Run llama.cpp's RPC server on this machine's CPU until the process ends."""
    entry = ggml_devices.rpc_server_entry() if supports_rpc() else None
    if entry is None:
        raise GGUFSpecError(NO_RPC_BUILD)
    start, cpu_only = entry
    with socket.socket() as s:  # fail in one line where llama.cpp would print and return
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise GGUFSpecError(f"rpc-server: cannot listen on {host}:{port} ({e.strerror or e})") from None
    start(f"{host}:{port}".encode(), cache_dir.encode() if cache_dir else None, threads or default_threads(), 1, cpu_only)


def parse_devices(value) -> list[str]:
    """llama.cpp's -dev: 'RPC0,CUDA0' (or a list); 'none' for the CPU alone."""
    items = value if isinstance(value, (list, tuple)) else [x.strip() for x in str(value).split(",") if x.strip()]
    return [] if list(items) in (["none"], []) else list(items)


def choose_devices(remote: list[str], local: list[str], devices=None, draft_devices=None,
                   ) -> tuple[list[str] | None, list[str] | None]:
    """(target's devices, draft's devices) from the registered RPC servers' devices (`add_servers`) and
    this machine's accelerators; None is llama.cpp's default (every device).

    With RPC servers, by default the target spreads over them (and this machine's GPUs, as
    llama.cpp's --rpc does) while the draft stays on this machine: a draft step is latency-bound,
    and over the network every step pays round trips."""
    target = parse_devices(devices) if devices is not None else (remote + local if remote else None)
    draft = parse_devices(draft_devices) if draft_devices is not None else (local if remote else None)
    return target, draft


def devices_for(rpc=None, devices=None, draft_devices=None) -> tuple[list[str] | None, list[str] | None]:
    """Register the RPC servers named (`add_servers`), then `choose_devices` for target and draft."""
    remote = add_servers(rpc) if rpc else []
    return choose_devices(remote, local_accelerators() if rpc else [], devices, draft_devices)


def free_memory(names: list[str]) -> dict[str, int]:
    """Free bytes of each named device, as llama.cpp reports it."""
    by_name = {d["name"]: d["free_bytes"] for d in ggml_devices.devices()}
    return {n: by_name.get(n, 0) for n in names}


def budgets(target_devices: list[str], draft_devices: list[str] | None) -> tuple[dict[str, int], int]:
    """The planner's budgets for these devices: free bytes by target device, and the draft's devices' together."""
    return free_memory(target_devices), sum(free_memory(draft_devices or []).values())
