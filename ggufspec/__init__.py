"""ggufspec: speculative decoding for GGUF models over llama.cpp, with an honest benchmark."""

from .engine import Chunk, Engine, GenerationSettings, Result, Stats
from .errors import ContextFullError, GGUFSpecError
from .llama_draft import GGUFDraftModel

__version__ = "0.1.0"
__all__ = ["Engine", "GGUFDraftModel", "GenerationSettings", "Result", "Chunk", "Stats", "GGUFSpecError", "ContextFullError", "__version__"]
