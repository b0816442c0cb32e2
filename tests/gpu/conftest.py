"""The GPU tier: tests that need a GPU llama.cpp can place layers on (CUDA, ROCm, Metal, or Vulkan, Mesa's
software llvmpipe included: `python scripts/install.py test --vulkan`, then GGML_VK_VISIBLE_DEVICES=0).
Without one they skip; GGUFSPEC_REQUIRE_GPU=1 (CI's Vulkan step) makes that a failure."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))
from tiny import write_tiny_moe  # noqa: E402


@pytest.fixture(scope="session")
def gpu() -> str:
    """The first local GPU's name (Vulkan0, CUDA0, ...)."""
    from ggufspec.llama.devices import local_gpus

    found = list(local_gpus())
    if not found:
        message = ("no GPU device here (build with `python scripts/install.py test --vulkan` and set "
                   "GGML_VK_VISIBLE_DEVICES=0 for Mesa's llvmpipe)")
        if os.environ.get("GGUFSPEC_REQUIRE_GPU") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return found[0]


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    return write_tiny_moe(tmp_path_factory.mktemp("moe") / "moe.gguf", seed=0)
