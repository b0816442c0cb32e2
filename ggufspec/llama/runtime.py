"""llama.cpp in this process: the top-level `llama_cpp` module and its ggml, typed (the llama package is the only
one that imports llama_cpp; quantize reaches its quantizer too), its backend started once, its log
routed through ggufspec (shown with --verbose), and model loads that a Ctrl-C can stop.

llama.cpp's log callback and backend are process-wide, so the little state they need lives in one
object, `RUNTIME`, whose fields say what each is for.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import sys
import threading
import time

import llama_cpp as C
from llama_cpp.llama_speculative import LlamaDraftModel  # noqa: F401 (ggufspec.llama_draft's base class)

from . import system
from ..errors import ContextFullError, GGUFSpecError


class Runtime:
    """What llama.cpp's process-wide callbacks read: whether to show its log, the lines of a load
    being captured, and whether a signal asked the running load to stop."""

    def __init__(self):
        self.verbose = False
        self.started = False
        self.warned: set[str] = set()  # warnings said once a process
        self.capture: list[str] | None = None  # log lines of the model load under way
        self.interrupted = False  # a signal came during a load: the progress callback stops it
        self.abandoned = False  # a signal came while another thread loaded (`on_a_passing_thread`): stop that load too
        self.lock = threading.Lock()  # one model load (one capture) at a time

    @property
    def stopping(self) -> bool:
        """Whether the load under way must stop (a signal came, on its thread or while another thread loaded)."""
        return self.interrupted or self.abandoned


RUNTIME = Runtime()


@C.llama_log_callback
def _log_callback(level, text, user_data):
    # llama.cpp talks a lot while loading; we show it only with --verbose (and read what we need).
    line = text.decode("utf-8", errors="replace")
    if RUNTIME.capture is not None:
        RUNTIME.capture.append(line)
    if RUNTIME.verbose:
        sys.stderr.write(line)


@C.llama_progress_callback
def _load_progress(progress, user_data):
    """Returning False aborts llama.cpp's model load (see `interruptible`)."""
    return not RUNTIME.stopping


@contextlib.contextmanager
def interruptible():
    """Ctrl-C (or SIGTERM, SIGHUP) during a model load or a context's creation. Python runs a signal handler at the next bytecode,
    which during a load is inside one of llama.cpp's callbacks, where a KeyboardInterrupt would be
    printed and lost ("Exception ignored") and the load would go on. So while loading, the signal
    only sets a flag; the progress callback then stops the load, and once llama.cpp has returned the
    signal is raised again for the handler it was meant for. (Outside the main thread signals cannot
    be handled here: the usual handlers stay.)"""
    RUNTIME.interrupted = False
    came: list[int] = []

    def note(signum, frame):
        came.append(signum)
        RUNTIME.interrupted = True

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                previous[sig] = signal.signal(sig, note)
    except ValueError:
        pass
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        RUNTIME.interrupted = False
        if came:
            signal.raise_signal(came[0])


class Closing:
    """`with` and garbage collection both end in `close()`, which must be safe to call twice."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()


# What llama.cpp allocated where, as its log says: "load_tensors: CPU_REPACK model buffer size = 1.2 MiB",
# "llama_kv_cache: Vulkan0 KV buffer size = 1.00 MiB", "sched_reserve: Vulkan0 compute buffer size = 5.01 MiB".
_BUFFER_LINE = re.compile(r"^\w+:\s+(\S+)\s+(model|KV|RS|compute|output) buffer size =\s+([0-9.]+) MiB")


def buffers(log: list[str]) -> dict[str, dict[str, float]]:
    """{"model" | "KV" | "RS" | "compute" | "output": {buffer name: MiB}} from llama.cpp's log lines."""
    out: dict[str, dict[str, float]] = {}
    for m in filter(None, map(_BUFFER_LINE.match, log)):
        kind = out.setdefault(m.group(2), {})
        kind[m.group(1)] = kind.get(m.group(1), 0.0) + float(m.group(3))
    return out


@contextlib.contextmanager
def _captured():
    """llama.cpp's log lines while the block runs (one capture at a time), a signal meanwhile raised on leaving."""
    init()
    with RUNTIME.lock:
        RUNTIME.capture = []
        try:
            with interruptible():  # a signal inside the log callback would be lost: held until the block ends
                yield RUNTIME.capture
        finally:
            RUNTIME.capture = None


def load_model(path: str, params) -> tuple[int | None, list[str]]:
    """llama_model_load_from_file, stoppable by a signal; (the model handle or None, llama.cpp's log lines)."""
    params.progress_callback = _load_progress
    with _captured() as log:
        model = C.llama_model_load_from_file(os.fsencode(path), params)  # any bytes Linux allows
        if RUNTIME.stopping and model:
            C.llama_model_free(model)
            model = None
    return model, log


def on_a_passing_thread(load, close=lambda value: None):
    """load() run on a thread that ends when it returns: its value, or its exception raised here. For what another
    long-lived thread then decodes with (a server's scheduler). libgomp, the OpenMP of llama.cpp's CPU builds,
    keeps a pool of worker threads for every thread that ran a parallel region (a decode), for as long as that
    thread lives; once the pools together hold more threads than the machine has CPUs it throttles every worker to
    100 spins before it sleeps at a barrier, and each of a decode's hundreds of barriers then costs a sleep and a
    wake-up. An Engine loaded (its costs measured) on the main thread and decoding on a server's thread decoded a
    third slower on 2 vCPUs (docs/serve.md). A signal meanwhile (Ctrl-C) stops the load where llama.cpp can
    stop (`_load_progress`), waits for the thread, closes what it made (`close(value)`), and comes out here."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = load()
        except BaseException as e:  # noqa: BLE001 (raised again on the caller's thread)
            box["error"] = e

    before = _tasks()
    thread = threading.Thread(target=run, name="ggufspec-load", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.05)  # a signal's handler runs on this (the main) thread in between
    except BaseException:
        RUNTIME.abandoned = True
        thread.join()
        RUNTIME.abandoned = False
        _ended(before)
        if "value" in box:
            close(box["value"])
        raise
    _ended(before)
    if "error" in box:
        raise box["error"]
    return box["value"]


class Decoders:
    """The threads that have decoded in this process, with the most threads llama.cpp ran for each (`llama_decode`).
    libgomp, the OpenMP of llama.cpp's CPU builds, keeps a pool of workers for every thread that ran a decode for as
    long as that thread lives, and once the pools together outnumber the CPUs it throttles every worker (see
    `on_a_passing_thread`): decodes from two long-lived threads on 2 vCPUs ran a third slower. That is said once."""

    def __init__(self):
        self.threads: dict[threading.Thread, int] = {}

    def note(self, ctx) -> None:
        thread = threading.current_thread()
        if thread in self.threads:
            return
        self.threads = {t: n for t, n in self.threads.items() if t.is_alive()}
        self.threads[thread] = max(C.llama_n_threads(ctx), C.llama_n_threads_batch(ctx))
        workers, cpus = sum(self.threads.values()), system.usable_cpus()
        if len(self.threads) > 1 and workers > cpus and "OPENMP" in build_features():
            names = ", ".join(t.name for t in self.threads)
            warn_once(f"ggufspec: llama.cpp has decoded on {len(self.threads)} threads of this process that still "
                      f"run ({names}); its OpenMP runtime keeps {workers} threads for them on {cpus} CPUs, which slows "
                      "every decode on the CPU (a third on 2 vCPUs): decode from one thread, or load on a thread "
                      "that ends (ggufspec.llama.runtime.on_a_passing_thread; docs/api.md)")


DECODERS = Decoders()


def llama_decode(ctx, batch) -> int:
    """C.llama_decode(ctx, batch): its return code, the thread noted (`Decoders`)."""
    DECODERS.note(ctx)
    return C.llama_decode(ctx, batch)


def llama_encode(ctx, batch) -> int:
    """C.llama_encode(ctx, batch): its return code, the thread noted (`Decoders`)."""
    DECODERS.note(ctx)
    return C.llama_encode(ctx, batch)


def _tasks() -> set[str]:
    """This process's threads (Linux; elsewhere none are seen)."""
    try:
        return set(os.listdir("/proc/self/task"))
    except OSError:
        return set()


def _ended(before: set[str], seconds: float = 2.0) -> None:
    """Wait until the threads started since `before` are gone: a thread's OS-level end (libgomp ends its pool's
    workers as it exits) follows its return, and a process exiting meanwhile (a Ctrl-C just after a load) crashed."""
    deadline = time.monotonic() + seconds
    while _tasks() - before and time.monotonic() < deadline:
        time.sleep(0.005)


def create_context(model, params) -> tuple[int | None, list[str]]:
    """llama_init_from_model; (the context handle or None, llama.cpp's log lines: what it allocated where)."""
    with _captured() as log:
        ctx = C.llama_init_from_model(model, params)
    return ctx, log


def warn(message: str) -> None:
    """One line on stderr about something the user should know (the CLI's errors are its own)."""
    print(message, file=sys.stderr)


def warn_once(message: str) -> None:
    if message not in RUNTIME.warned:
        RUNTIME.warned.add(message)
        warn(message)


def set_verbose(verbose: bool) -> None:
    """Show (True) or hide (False) llama.cpp's own log output."""
    RUNTIME.verbose = bool(verbose)


def init() -> None:
    """Start llama.cpp's backend once, its log routed through ggufspec's (shown with --verbose)."""
    with RUNTIME.lock:
        if not RUNTIME.started:
            C.llama_log_set(_log_callback, ctypes.c_void_p(0))
            C.llama_backend_init()
            RUNTIME.started = True


def llama_cpp_version() -> str:
    return getattr(C, "__version__", "unknown")


def system_info() -> str:
    """llama.cpp's own account of the build: "CPU : SSE3 = 1 | AVX = 1 | ..." per backend."""
    init()
    return C.llama_print_system_info().decode("utf-8", errors="replace")


def supports_rpc() -> bool:
    return bool(C.llama_supports_rpc())


@functools.cache
def _lib():
    from llama_cpp._ggml import libggml as lib

    p, s = ctypes.c_void_p, ctypes.c_size_t
    for name, args, res in [("ggml_backend_dev_count", [], s), ("ggml_backend_dev_get", [s], p),
                            ("ggml_backend_dev_name", [p], ctypes.c_char_p),
                            ("ggml_backend_dev_description", [p], ctypes.c_char_p),
                            ("ggml_backend_dev_memory", [p, ctypes.POINTER(s), ctypes.POINTER(s)], None),
                            ("ggml_backend_dev_type", [p], ctypes.c_int), ("ggml_backend_dev_backend_reg", [p], p),
                            ("ggml_backend_reg_get_proc_address", [p, ctypes.c_char_p], p),
                            ("ggml_backend_buft_name", [p], ctypes.c_char_p),
                            ("ggml_backend_reg_by_name", [ctypes.c_char_p], p), ("ggml_backend_register", [p], None),
                            ("ggml_backend_reg_dev_count", [p], s), ("ggml_backend_reg_dev_get", [p, s], p),
                            ("ggml_backend_dev_by_name", [ctypes.c_char_p], p), ("ggml_backend_dev_by_type", [ctypes.c_int], p),
                            ("ggml_backend_reg_count", [], s), ("ggml_backend_reg_get", [s], p),
                            ("ggml_backend_reg_name", [p], ctypes.c_char_p), ("ggml_backend_dev_buffer_type", [p], p)]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def ggml():
    """ggml's device and backend-registry functions, typed (the library llama-cpp-python loaded)."""
    init()
    return _lib()


def backends() -> list[str]:
    """The backends this build registered (CPU, Vulkan, CUDA, Metal, RPC, ...), devices or not."""
    lib = ggml()
    return [lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)).decode() for i in range(lib.ggml_backend_reg_count())]


def build_features() -> list[str]:
    """What this build has: the CPU's features from llama.cpp's system info, then every other backend
    registered (VULKAN, CUDA, METAL, RPC, ...: a GPU backend with no device found says nothing there)."""
    features = system.build_features(system.parse_system_info(system_info()))
    features += [b.upper() for b in backends() if b != "CPU" and b.upper() not in features]
    if supports_rpc() and "RPC" not in features:
        features.append("RPC")
    return features


def decode_failed(rc: int, m: int, n_past: int, n_ctx: int) -> None:
    """Raise the one clear error for llama_decode's return code rc (0: nothing) on a batch of m tokens at n_past."""
    if rc == 0:
        return
    if rc == 1:
        raise ContextFullError(
            f"the context is full: no KV slot for {m} tokens at position {n_past} (n_ctx={n_ctx}); raise -c or lower -n")
    if rc == 2:
        raise GGUFSpecError("llama_decode was aborted")
    if rc == -1:
        raise GGUFSpecError("llama_decode rejected the batch as invalid (a token id outside the vocabulary?)")
    raise GGUFSpecError(f"llama_decode failed with code {rc} (out of memory or a backend error; --verbose shows more)")
