"""The AMX route: llama.cpp's AMX kernels crash on Q4_K/Q6_K weights (llama.cpp issue 20824). Where
a build would use them, the weights are placed by hand instead: extra buffer types off, and every
weight that repacking takes put into the CPU_REPACK buffer, as a build without AMX would place them."""

from __future__ import annotations

from . import system
from .devices import cpu_buffer_types, cpu_extra_bufts, supports_gpu_offload
from .gguf_info import GGUFInfo
from .runtime import build_features, llama_cpp_version


def problem(info: GGUFInfo) -> str | None:
    """Why this model must not meet this build's AMX kernels (None: it may)."""
    return system.amx_problem(build_features(), cpu_buffer_types(), {t.type_name for t in info.tensors},
                              llama_cpp_version())


def repack_overrides(info: GGUFInfo, n_gpu_layers: int) -> list[tuple[str, int]]:
    """(pattern, CPU_REPACK buffer type) for every weight repacking would take in the layers that stay on
    the CPU, for a load with llama.cpp's extra buffer types off (overrides.BuftOverrides takes them)."""
    repack = dict(cpu_extra_bufts()).get("CPU_REPACK")
    first_gpu = None
    if n_gpu_layers and supports_gpu_offload():
        first_gpu = 0 if n_gpu_layers < 0 else max(0, info.n_layers - n_gpu_layers)
    patterns = system.repack_patterns(info.tensors, build_features(), first_gpu) if repack else []
    return [(p, repack) for p in patterns]
