"""`ggufspec doctor`: what this machine is, what this build can do, and what is wrong here."""

from __future__ import annotations

import os
import sys

from ..llama import backend, devices, runtime, system
from ..costs import Costs
from ..llama.cost_cache import bad_entries, cache_problem, is_choice_key, is_step_key, load_cache
from ..llama.measure import is_current
from ..verification import Verification
from ..paths import costs_file, models_dir

SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
              "amx_bf16", "asimd", "sve")


def _quant(path: str) -> str | None:
    from ..errors import GGUFSpecError
    from ..llama.gguf_info import read_info

    try:
        return read_info(path).file_type
    except GGUFSpecError:  # unreadable as GGUF metadata (it ran, so llama.cpp read it): the figures still stand
        return None


def _costs(machine_id: str) -> tuple[list[dict], list[dict], list[str]]:
    """(this machine's cached target costs, the machines of the other entries, keys of damaged entries)."""
    mine, others = [], {}
    cache = load_cache()
    damaged = bad_entries(cache)
    for key, entry in cache.items():
        if key in damaged or is_step_key(key) or is_choice_key(key):
            continue
        if key.endswith(f"machine {machine_id}"):
            if not is_current(key):
                continue  # an older version's measurement, or of a file since changed or gone: never read again
            c = Costs(entry["target_batch_seconds"], entry["exact_batch"], exact_kv=entry.get("exact_kv"))
            parts = key.split("|")  # path|size|mtime|tN|nglN|devices|exact@...|bN|machine id
            mine.append({"model": parts[0], "threads": parts[3][1:], "n_gpu_layers": parts[4][3:],
                         "placement": parts[5] if len(parts) > 6 else "default", "target_step_seconds": c.target_token_seconds,
                         "exact_batch": c.exact_batch, "exact_kv": c.exact_kv,
                         "ceiling_speedup": c.ceiling(Verification.of(c).batch_limit())[0],
                         "mtp_step_seconds": (cache.get(key + "|mtp") or {}).get("token_seconds"),
                         "draft_heads": {k[len(key) + 1:]: v.get("token_seconds") for k, v in cache.items()
                                         if k.startswith(key + "|") and k not in damaged and ":" in k[len(key):]},
                         "why": c.why(_quant(parts[0]))})
        else:
            m = entry.get("machine") if isinstance(entry, dict) else None
            cpu = m.get("cpu") if isinstance(m, dict) else None
            cpu = cpu if isinstance(cpu, str) else "a machine this version cannot name"  # an entry edited by hand
            others[cpu] = {**m, "cpu": cpu} if isinstance(m, dict) else {"cpu": cpu}
    return mine, list(others.values()), damaged


def device_problems(features: list[str], found: list[dict]) -> list[dict]:
    """A GPU backend that found no device, and a GPU that is only emulated on the CPU."""
    gpus = [d for d in found if devices.is_local_gpu(d)]
    if "VULKAN" in features and not any(d["name"].startswith("Vulkan") for d in gpus):
        return [{"severity": "warning", "problem": "this build has llama.cpp's Vulkan backend but it found no Vulkan "
                 "device, so every layer stays on the CPU", "fix": "install your GPU's Vulkan driver (`vulkaninfo "
                 "--summary` lists the devices); ggml skips a device of type CPU, such as Mesa's llvmpipe, unless "
                 "GGML_VK_VISIBLE_DEVICES names it (GGML_VK_VISIBLE_DEVICES=0)"}]
    if gpus and all(d.get("software") for d in gpus):
        names = ", ".join(f"{d['name']} ({d['description']})" for d in gpus)
        return [{"severity": "warning", "problem": f"the only GPU here is a software one, emulated on the CPU ({names}): "
                 "layers placed there run correctly but far slower than on the CPU backend; speeds measured there "
                 "mean nothing", "fix": "none needed for tests; for speed keep layers on the CPU (-ngl 0) or install "
                 "a hardware GPU's driver"}]
    return []


def draft_problem() -> dict | None:
    """The default pair's target is here but its draft is not: where to look for one that is."""
    from ..errors import GGUFSpecError
    from ..models.hub import local_path
    from ..models.registry import load_registry

    try:
        reg = load_registry()
        pair = reg.pairs.get(reg.default_pair or "")
        if pair is None or pair.draft is None or local_path(reg.model(pair.target)) is None \
                or local_path(reg.model(pair.draft)) is not None:
            return None
    except GGUFSpecError:  # a registry that does not load says so where it is read
        return None
    return {"problem": f"the default pair {pair.name}'s target is here but its draft {pair.draft} is not",
            "fix": f"ggufspec drafts {pair.target} (the drafts this machine has for it, ranked), or "
                   f"ggufspec models pull {pair.draft}"}


def problems(features: list[str], cpu_buffer_types: list[str], other_machines: list[dict],
             damaged: list[str] = (), found: list[dict] = ()) -> list[dict]:
    """Every known problem here, with its fix; severity 'error' means ggufspec cannot run well."""
    out = device_problems(features, list(found))
    if system.amx_active(features, cpu_buffer_types):
        out.append({"severity": "warning", "problem": "this llama-cpp-python build uses llama.cpp's AMX kernels, which crash "
                    "on Q4_K/Q6_K weights on this CPU (llama.cpp issue 20824); ggufspec places such weights itself "
                    "(repacked, without AMX), but llama_cpp.Llama and other programs on this build will crash",
                    "fix": system.reinstall_command(runtime.llama_cpp_version())})
    gpu = system.gpu_problem(features, system.nvidia_gpu_visible())
    if gpu:
        out.append({"severity": "error", **gpu})
    if other_machines:
        names = "; ".join(m.get("cpu", "?") for m in other_machines)
        out.append({"severity": "warning", "problem": f"the cost cache ({costs_file()}) holds measurements from other "
                    f"machines ({names}); they are never used here", "fix": "none needed; `ggufspec costs` measures this machine"})
    draft = draft_problem()
    if draft:
        out.append({"severity": "warning", **draft})
    cache = cache_problem()
    if cache:
        out.append({"severity": "warning", "problem": cache[0], "fix": cache[1]})
    if damaged:
        out.append({"severity": "warning", "problem": f"the cost cache ({costs_file()}) has {len(damaged)} damaged "
                    f"entr{'y' if len(damaged) == 1 else 'ies'} (wrong shape: edited by hand or written by another "
                    "version); ggufspec ignores them and measures again",
                    "fix": "none needed; `ggufspec costs --refresh` rewrites them, or delete the file"})
    return out


def load_problem(busy: float) -> list[dict]:
    """Other processes keeping so many CPUs busy that the default threads wait on each other."""
    advice = system.shared_cores_advice(backend.default_threads(), busy)
    return [{"severity": "warning", "problem": advice,
             "fix": f"stop what else runs, or pass -t {system.threads_that_fit(busy)}"}] if advice else []


def diagnose(rpc: str | None = None) -> dict:
    """Everything `ggufspec doctor` reports; rpc: servers to register first, so their devices show."""
    if rpc:
        from ..llama.rpc import add_servers

        add_servers(rpc)
    features = runtime.build_features()
    seen = devices.devices()
    bufts = devices.cpu_buffer_types()
    machine = backend.machine()
    flags = system.cpu_flags()
    mine, others, damaged = _costs(machine["id"])
    busy = system.busy_elsewhere()
    folder = models_dir()
    found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    return {
        "python": sys.version.split()[0],
        "llama_cpp_python": runtime.llama_cpp_version(),
        "build_features": features,
        "system_info": runtime.system_info(),
        "cpu": system.cpu_model(),
        "cpu_features": [f for f in SIMD_FLAGS if f in flags],
        "cpu_buffer_types": bufts,
        "threads": backend.default_threads(),
        "logical_cpus": os.cpu_count(),
        "busy_elsewhere": busy,
        "devices": seen,
        "machine_id": machine["id"],
        "models_dir": str(folder),
        "models": [{"file": p.name, "size_bytes": p.stat().st_size} for p in found],
        "costs": mine,
        "problems": problems(features, bufts, others, damaged, seen) + load_problem(busy),
    }
