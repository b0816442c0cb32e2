"""GPU layer offload: how many layers of each model go to the GPU."""

from __future__ import annotations


def resolve_layers(target, draft, ngl, ngld, *, n_ctx: int) -> tuple[int, int]:
    """Turn N / 'all' / 'auto' into the n_gpu_layers llama.cpp gets for target and draft."""
    def one(value):
        if value == "all":
            return -1  # llama.cpp: negative means every layer
        if value == "auto":
            return 0
        return int(value)

    return one(ngl), one(ngld)
