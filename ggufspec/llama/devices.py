"""ggml's devices, which llama-cpp-python does not wrap: what is here, the CPU's weight buffer types,
device handles for a model's -dev list, and the RPC backend's two entry points (add a server, run one); through
runtime.ggml(), the typed library llama-cpp-python loaded."""

from __future__ import annotations

import ctypes
import functools

from ..errors import GGUFSpecError
from .runtime import ggml

DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "iGPU", 3: "accelerator", 4: "meta"}
SOFTWARE_GPUS = ("llvmpipe", "lavapipe", "swiftshader", "softpipe")


@functools.cache
def software_vulkan() -> bool:
    """Whether llama.cpp sees a software Vulkan device (Mesa's llvmpipe). Contexts there run without flash
    attention: Mesa 22.3's llvmpipe (Debian 12) crashes inside its own shader threads in llama.cpp's flash
    attention after batches of 1, 2 and then 3 tokens (llama-cpp-python's own `Llama(flash_attn=True)` alike;
    not with flash_attn=False); and without op offload (llama.cpp copies weights kept on the CPU, a MoE's experts
    under --n-cpu-moe, to the device for batches of 32 or more: lavapipe segfaulted there in 2 runs of 3). A
    software device's speed means nothing anyway."""
    return any(d["name"].startswith("Vulkan") and d["software"] for d in devices())


def _proc(reg, name: bytes, restype, *argtypes):
    """A function a backend registry exports by name (None where this build lacks it)."""
    address = ggml().ggml_backend_reg_get_proc_address(reg, name) if reg else None
    return ctypes.CFUNCTYPE(restype, *argtypes)(address) if address else None


def devices() -> list[dict]:
    """Every ggml device llama.cpp can place layers on, with memory as it reports it."""
    lib, out = ggml(), []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        name = lib.ggml_backend_dev_name(dev).decode()
        description = lib.ggml_backend_dev_description(dev).decode()
        kind = "RPC" if name.startswith("RPC") else DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "other")
        found = {"name": name, "description": description, "type": kind, "free_bytes": free.value,
                 "total_bytes": total.value}
        out.append(found | {"software": is_local_gpu(found) and is_software(description)})
    return out


def is_local_gpu(device: dict) -> bool:
    """A GPU or accelerator of this machine (a `devices()` entry that is neither the CPU nor an RPC server's)."""
    return device["type"] not in ("CPU", "RPC")


def share_elsewhere(buffers: dict[str, float]) -> float:
    """The share of these weights ({buffer: MiB}, as llama.cpp reported them) on a hardware GPU or an RPC server:
    while those layers run, this machine's CPU waits. Read from the buffers' names alone (CPU, CPU_Mapped,
    CUDA_Host and the like are this machine's memory; a software Vulkan device runs on the CPU), so loading a
    model asks ggml nothing more of its devices."""
    def elsewhere(name: str) -> bool:
        return not (name.startswith("CPU") or name.endswith("_Host") or on_software_device(name))
    total = sum(buffers.values())
    return sum(mib for name, mib in buffers.items() if elsewhere(name)) / total if total else 0.0


def on_software_device(buffer: str) -> bool:
    """Whether a buffer llama.cpp named (Vulkan0, Vulkan_Host, CPU_Mapped, ...) holds weights on a software Vulkan
    device (`software_vulkan`): Vulkan's host buffers are this machine's memory on any device."""
    return buffer.startswith("Vulkan") and not buffer.endswith("_Host") and software_vulkan()


def is_software(description: str) -> bool:
    """Whether a device is a GPU emulated on the CPU (Mesa's llvmpipe, SwiftShader): real buffers, no speed."""
    return any(name in description.lower() for name in SOFTWARE_GPUS)


def local_gpus() -> dict[str, int]:
    """This machine's own GPUs and accelerators (not the CPU, not RPC servers): name -> free bytes, as ggml
    reports them (CUDA, ROCm, Vulkan, Metal, SYCL alike), in llama.cpp's device order."""
    return {d["name"]: d["free_bytes"] for d in devices() if is_local_gpu(d)}


def supports_gpu_offload() -> bool:
    """Whether layers can leave the CPU: a GPU, accelerator or RPC device is there. (llama.cpp's own
    llama_supports_gpu_offload is true for any build with the RPC backend, devices or not.)"""
    return any(d["type"] != "CPU" for d in devices())


def descriptions() -> dict[str, str]:
    return {d["name"]: d["description"] for d in devices()}


def cpu_device():
    """The CPU's ggml device handle (None on a build without one)."""
    return ggml().ggml_backend_dev_by_type(0)


def cpu_extra_bufts() -> list[tuple[str, int]]:
    """(name, handle) of the CPU device's extra weight buffer types, in the order llama.cpp tries them."""
    lib, dev = ggml(), cpu_device()
    get = _proc(lib.ggml_backend_dev_backend_reg(dev), b"ggml_backend_dev_get_extra_bufts",
                ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p) if dev else None
    if get is None:
        return []
    bufts, out = get(dev), []
    for j in range(16):  # NULL-terminated
        if not bufts[j]:
            break
        out.append((lib.ggml_backend_buft_name(bufts[j]).decode(), bufts[j]))
    return out


def cpu_buffer_types() -> list[str]:
    """The CPU device's extra weight buffer types (AMX, CPU_REPACK, ...)."""
    return [name for name, _ in cpu_extra_bufts()]


def device_array(names: list[str]):
    """The NULL-terminated device list llama_model_params.devices takes (llama.cpp's -dev)."""
    lib = ggml()
    handles = []
    for name in names:
        dev = lib.ggml_backend_dev_by_name(name.encode())
        if not dev:
            known = ", ".join(d["name"] for d in devices())
            raise GGUFSpecError(f"no device named {name!r} here (llama.cpp sees: {known})")
        handles.append(dev)
    return (ctypes.c_void_p * (len(handles) + 1))(*handles, None)


def rpc_add_server(endpoint: str) -> list[str] | None:
    """Register an RPC server's devices with llama.cpp; their names (None: this build has no RPC backend)."""
    lib = ggml()
    add = _proc(lib.ggml_backend_reg_by_name(b"RPC"), b"ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
    if add is None:
        return None
    reg = add(endpoint.encode())
    if not reg:
        return []
    lib.ggml_backend_register(reg)
    return [lib.ggml_backend_dev_name(lib.ggml_backend_reg_dev_get(reg, i)).decode()
            for i in range(lib.ggml_backend_reg_dev_count(reg))]


def rpc_server_entry():
    """llama.cpp's ggml_backend_rpc_start_server serving the CPU device, as (start, devices), or None."""
    cpu = cpu_device()
    start = _proc(ggml().ggml_backend_reg_by_name(b"RPC"), b"ggml_backend_rpc_start_server", None, ctypes.c_char_p,
                  ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
    if not cpu or start is None:
        return None
    return start, (ctypes.c_void_p * 2)(cpu, None)
