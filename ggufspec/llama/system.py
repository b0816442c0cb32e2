"""What machine this is, and what is known to go wrong on it. Pure: no llama_cpp import.

`backend` hands in what llama.cpp reports (its system info string, its devices, its CPU
buffer types); the CPU's own flags come from /proc/cpuinfo. Every decision here is a function
of those strings, so it is tested on strings from machines we do not have.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from pathlib import Path

# Weight types llama.cpp's AMX kernels take (ggml-cpu/amx/common.h, qtype_has_amx_kernels).
AMX_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
GPU_FEATURES = ("CUDA", "METAL", "VULKAN", "HIP", "SYCL", "OPENCL", "CANN", "MUSA")


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """llama_print_system_info() ("CPU : SSE3 = 1 | AVX = 1 | ... | CUDA : ARCHS = 890 | ...")
    to {backend: {feature: value}}."""
    out: dict[str, dict[str, str]] = {}
    current = None
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        m = re.match(r"^(\S+)\s*:\s*(.*)$", part)
        if m and "=" in m.group(2):  # "CPU : SSE3 = 1": a new backend and its first feature
            current = out.setdefault(m.group(1), {})
            part = m.group(2)
        if current is None or "=" not in part:
            continue
        key, _, value = part.partition("=")
        current[key.strip()] = value.strip()
    return out


def build_features(info: dict[str, dict[str, str]]) -> list[str]:
    """The features a build was compiled with, flattened: ['AVX2', 'AVX512', 'AMX_INT8', 'CUDA', ...]."""
    names = []
    for backend, features in info.items():
        if backend != "CPU":
            names.append(backend.upper())
        names += [k for k, v in features.items() if v == "1"]
    return list(dict.fromkeys(names))


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's name; where it names no model (a cloud host's "AMD EPYC", "Intel(R) Xeon(R) Processor"), with
    its family and model numbers and the core they mean, where known: a Zen 4 and a Zen 5 EPYC both call
    themselves "AMD EPYC", and a Q8_0 verify batch of 4 cost 1.9 target steps on one and 3.7 on the other."""
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    name = m.group(1).strip() if m else (platform.processor() or platform.machine() or "unknown CPU")
    family, model = (re.search(rf"^{key}\s*:\s*(\d+)$", text, re.MULTILINE) for key in ("cpu family", "model"))
    if re.search(r"\d", name) or not (family and model):
        return name
    family, model = int(family.group(1)), int(model.group(1))
    by_family = _CORES.get(family) if "AMD" in name else None  # AMD's families name a core; Intel's 6 does not
    core = _CORES.get((family, model)) or by_family
    return f"{name} ({core + ': ' if core else ''}family {family}, model {model})"


# Cores by (family, model) or family, for names that say none. AMD family 25: Zen 4 at models 0x10-0x1f, 0x60-0x7f
# and 0xa0-0xaf, Zen 3 below and between.
_CORES = {23: "Zen or Zen 2", 26: "Zen 5", **{(25, m): "Zen 4" for r in ((0x10, 0x20), (0x60, 0x80), (0xA0, 0xB0))
                                               for m in range(*r)},
          **{(25, m): "Zen 3" for m in range(0x60) if not 0x10 <= m < 0x20},
          (6, 0x55): "Skylake-SP or Cascade Lake", (6, 0x6A): "Ice Lake-SP", (6, 0x6C): "Ice Lake-SP",
          (6, 0x8F): "Sapphire Rapids", (6, 0xCF): "Emerald Rapids", (6, 0xAD): "Granite Rapids"}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    text = cpuinfo if cpuinfo is not None else _read("/proc/cpuinfo")
    m = re.search(r"^(flags|Features)\s*:\s*(.+)$", text, re.MULTILINE)
    return set(m.group(2).split()) if m else set()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def amx_active(features: list[str], cpu_buffer_types: list[str]) -> bool:
    """Whether llama.cpp will put weights into its AMX buffer: the build has AMX kernels and the
    CPU device offers the AMX buffer type (which it does only where the CPU and kernel allow AMX)."""
    return "AMX_INT8" in features and any(b.upper() == "AMX" for b in cpu_buffer_types)


def reinstall_command(llama_cpp_version: str, extra_cmake: str = "-DGGML_RPC=ON") -> str:
    """The pip command that rebuilds llama-cpp-python for this CPU without AMX kernels."""
    flags = f"-DCMAKE_C_FLAGS='{NO_AMX_FLAGS}' -DCMAKE_CXX_FLAGS='{NO_AMX_FLAGS}'"
    return (f'CMAKE_ARGS="{extra_cmake} {flags}" pip install --force-reinstall --no-cache-dir --no-deps '
            f"llama-cpp-python=={llama_cpp_version}")


# Weights of matrix multiplications that llama.cpp's CPU_REPACK buffer takes on x86 (ggml-cpu/repack.cpp,
# ggml_repack_get_optimal_repack_type): type -> the build feature it needs; rows must come in eights.
X86_REPACK = {"Q4_0": "AVX2", "Q4_K": "AVX2", "IQ4_NL": "AVX2", "MXFP4": "AVX2", "Q2_K": "AVX512"}
MATMUL_WEIGHT = re.compile(r"^blk\.(\d+)\.((attn_(q|k|v|output|qkv)|ffn_(gate|up|down))\.weight)$")


def repack_patterns(tensors, features: list[str], first_gpu_layer: int | None = None) -> list[str]:
    """Regexes naming the weights to put in the CPU_REPACK buffer by hand, for a load with
    llama.cpp's extra buffer types off (which takes AMX out of the way): every matrix weight
    repacking would take, in layers that stay on the CPU (below first_gpu_layer), as llama.cpp
    itself would choose them without AMX. One pattern per kind of weight."""
    layers_by_kind: dict[str, list[str]] = {}
    for t in tensors:
        m = MATMUL_WEIGHT.match(t.name)
        need = X86_REPACK.get(t.type_name)
        if not m or need not in features or len(t.shape) < 2 or t.shape[1] % 8:
            continue
        if first_gpu_layer is not None and int(m.group(1)) >= first_gpu_layer:
            continue  # offloaded: not ours to place
        layers_by_kind.setdefault(m.group(2), []).append(m.group(1))
    return [rf"^blk\.({'|'.join(layers)})\.{re.escape(kind)}$" for kind, layers in sorted(layers_by_kind.items())]


def amx_problem(features: list[str], cpu_buffer_types: list[str], tensor_types, llama_cpp_version: str) -> str | None:
    """None, or why loading a model with these weight types would crash here (llama.cpp issue
    20824: its AMX kernels segfault on Q4_K/Q6_K weights), with the command that fixes it."""
    if not amx_active(features, cpu_buffer_types):
        return None
    hit = sorted(set(tensor_types) & AMX_TYPES)
    if not hit:
        return None
    return (f"this llama-cpp-python was built with llama.cpp's AMX kernels, which crash on {'/'.join(hit)} weights "
            f"on this CPU (llama.cpp issue 20824); rebuild it without them: {reinstall_command(llama_cpp_version)}")


def gpu_problem(features: list[str], gpu_visible: bool) -> dict | None:
    """An NVIDIA GPU that this CPU-only build cannot use: {"problem", "fix"}, or None."""
    if gpu_visible and not any(f in features for f in GPU_FEATURES):
        return {"problem": "an NVIDIA GPU is present but this llama-cpp-python build is CPU-only",
                "fix": "python scripts/install.py (from a ggufspec checkout: it builds for CUDA where nvcc is found; "
                       "--print shows the build first), or CMAKE_ARGS=\"-DGGML_CUDA=on\" pip install --force-reinstall "
                       "--no-cache-dir --no-deps llama-cpp-python"}
    return None


def nvidia_gpu_visible() -> bool:
    return Path("/dev/nvidia0").exists() or Path("/proc/driver/nvidia/gpus").is_dir()


def describe(cpu: str, features: list[str], devices: list[dict], llama_cpp_version: str) -> dict:
    """A machine's identity for the cost cache: what decides what a decode costs here."""
    summary = {"cpu": cpu, "features": sorted(features), "llama_cpp": llama_cpp_version,
               "devices": sorted(f"{d['name']} ({d['description']})" for d in devices)}
    digest = hashlib.sha256(json.dumps(summary, sort_keys=True).encode()).hexdigest()[:16]
    return {"id": digest, "summary": summary}


# llama.cpp's GGML_MAX_N_THREADS; beyond a few threads per CPU a thread pool only slows it down.
GGML_MAX_THREADS = 512


def max_threads() -> int:
    """The most threads ggufspec asks llama.cpp for: 4 per logical CPU, within ggml's limit."""
    return min(GGML_MAX_THREADS, 4 * (os.cpu_count() or 1))


def check_threads(n: int | None, flag: str = "-t/--threads") -> None:
    """One line for a thread count llama.cpp cannot use well (None: the default)."""
    from ..errors import GGUFSpecError

    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int):
        raise GGUFSpecError(f"{flag} must be a whole number (got {n!r}, {type(n).__name__})")
    limit = max_threads()
    if not 1 <= n <= limit:
        raise GGUFSpecError(f"{flag} must be between 1 and {limit} on this machine ({os.cpu_count()} CPUs; got {n})")


def default_threads() -> int:
    """Physical cores: llama.cpp's matmuls gain nothing from hyper-threads."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:
        n = None
    return max(1, n or os.cpu_count() or 1)


def usable_cpus() -> int:
    """The logical CPUs this process may run on (its affinity, as libgomp counts them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call here (macOS, Windows)
        return os.cpu_count() or 1


def busy_elsewhere(seconds: float = 0.5) -> float:
    """How many logical CPUs other processes kept busy over the next `seconds` (this process's own time, its
    threads included, left out): the machine's load as decoding would feel it now."""
    import time

    import psutil

    me = psutil.Process()

    def busy() -> tuple[float, float]:
        t, own = psutil.cpu_times(), me.cpu_times()
        return t.user + t.system + getattr(t, "nice", 0.0), own.user + own.system

    (total0, own0), start = busy(), time.perf_counter()
    time.sleep(seconds)
    (total1, own1), wall = busy(), time.perf_counter() - start
    return max(0.0, ((total1 - total0) - (own1 - own0)) / wall) if wall > 0 else 0.0


def threads_that_fit(busy: float, n_cpus: int | None = None) -> int:
    """The llama.cpp threads that can run at once beside other processes keeping `busy` CPUs busy (one at 80% of a
    core takes that core)."""
    n_cpus = n_cpus or os.cpu_count() or 1
    return max(1, int(n_cpus - busy + 0.25))


def shared_cores_advice(n_threads: int, busy: float, n_cpus: int | None = None) -> str | None:
    """One line where other processes keep enough CPUs busy that `n_threads` llama.cpp threads cannot all run at
    once (a descheduled thread keeps the others waiting at every barrier: decodes turn erratic and tens of times
    slower), naming the -t that fits the CPUs left; None where they fit."""
    n_cpus = n_cpus or os.cpu_count() or 1
    fit = threads_that_fit(busy, n_cpus)
    if busy < 0.5 or n_threads <= fit:
        return None
    return (f"the CPUs are shared: other processes keep {busy:.1f} of {n_cpus} busy, so {n_threads} llama.cpp threads "
            f"wait on each other and decode times are erratic; -t {fit} would fit the CPUs left")


_SAID_SHARED: list[str] = []  # the shared-CPUs line, once said


def say_if_shared(n_threads: int) -> str | None:
    """Where other processes keep too many CPUs busy for `n_threads`: the line saying so and which -t fits, on
    stderr once per process (the load it names moves from call to call); None where the threads fit."""
    import sys

    advice = shared_cores_advice(n_threads, busy_elsewhere(0.3))
    if advice and not _SAID_SHARED:
        _SAID_SHARED.append(advice)
        print(f"ggufspec: {advice}", file=sys.stderr)
    return advice
