"""Where single weights go, whatever -ngl says: llama.cpp's tensor buffer overrides (its `-ot PATTERN=BUFFER`).

Two users: a mixture-of-experts model's expert tensors kept on the CPU while the rest of its layers go
to a GPU (llama.cpp's `--cpu-moe` and `--n-cpu-moe N`, the way people run Qwen3-30B-A3B or gpt-oss on
a consumer GPU), and the AMX route's weights put in the CPU_REPACK buffer by hand (amx.py). llama.cpp
takes the first pattern that matches a tensor's name."""

from __future__ import annotations

import ctypes

from .devices import cpu_device
from .runtime import ggml
from .gguf_info import EXPERT_TENSORS


def expert_pattern(cpu_moe: int, n_layers: int) -> str | None:
    """The pattern that keeps the experts of the first `cpu_moe` layers on the CPU (-1 or more than the
    model has: every layer's, as --cpu-moe); None for 0."""
    if cpu_moe == 0:
        return None
    if cpu_moe < 0 or cpu_moe >= n_layers:
        return EXPERT_TENSORS
    return rf"^blk\.({'|'.join(str(i) for i in range(cpu_moe))}){EXPERT_TENSORS}"  # llama.cpp's llm_ffn_exps_block_regex


def cpu_buffer_type():
    """The CPU device's plain buffer type (what llama.cpp's `=CPU` names)."""
    return ggml().ggml_backend_dev_buffer_type(cpu_device())


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class BuftOverrides:
    """The NULL-terminated array llama_model_params.tensor_buft_overrides takes, from (pattern, buffer type)
    pairs in the order llama.cpp should try them (keep this object alive as long as the params are used)."""

    def __init__(self, pairs: list[tuple[str, int]]):
        self._encoded = [p.encode() for p, _ in pairs]
        self.array = (_BuftOverride * (len(pairs) + 1))()
        for i, (p, (_, buft)) in enumerate(zip(self._encoded, pairs)):
            self.array[i].pattern, self.array[i].buft = p, buft

    @property
    def pointer(self) -> ctypes.c_void_p:
        return ctypes.cast(self.array, ctypes.c_void_p)
