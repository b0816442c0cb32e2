"""ggufspec: speculative decoding for GGUF models over llama.cpp, with an honest benchmark.

The names below are imported on first use, so that the `ggufspec` command starts without loading
llama.cpp for commands that do not need it (and a Ctrl-C at start-up is one line, not a traceback).
"""

from .errors import ContextFullError, GGUFSpecError

__version__ = "0.1.0"
__all__ = ["Engine", "GGUFDraftModel", "GenerationSettings", "Result", "Chunk", "Stats", "GGUFSpecError", "ContextFullError", "__version__"]

_LAZY = {"Engine": "engine", "GenerationSettings": "engine", "Result": "engine", "Chunk": "engine", "Stats": "engine",
         "GGUFDraftModel": "llama_draft"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ggufspec' has no attribute {name!r}")
