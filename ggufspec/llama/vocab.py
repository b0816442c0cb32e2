"""What ggufspec reads of a model's vocabulary (type, size, BOS/EOS, token texts: what the pair checks in `compat`
compare), for a model of its own (`backend.Model`) and for the model of a llama-cpp-python `Llama` it borrows."""

from __future__ import annotations

from pathlib import Path

from .gguf_info import file_stamp
from .runtime import C

VOCAB_TYPES = {0: "none", 1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2", 7: "test"}


class VocabFacts:
    """What the vocabulary checks (`compat`) read of a model: type, size, BOS/EOS handling, token texts."""

    def _read_vocab(self, vocab) -> None:
        self._vocab = vocab
        self.n_vocab = C.llama_vocab_n_tokens(vocab)
        self.vocab_type = VOCAB_TYPES.get(C.llama_vocab_type(vocab), "unknown")
        self.bos = C.llama_vocab_bos(vocab)
        self.eos = C.llama_vocab_eos(vocab)
        self.add_bos = bool(C.llama_vocab_get_add_bos(vocab))
        self.add_eos = bool(C.llama_vocab_get_add_eos(vocab))

    def token_text(self, token: int) -> bytes:
        """The raw vocabulary entry (what llama.cpp compares between draft and target)."""
        return C.llama_vocab_get_text(self._vocab, token) or b""


class LlamaModel(VocabFacts):
    """The model of a `llama_cpp.Llama`, borrowed (freed with the Llama): its vocabulary for GGUFDraftModel's
    checks, and what names its costs in the cache (file, offload, the context settings that change them)."""

    def __init__(self, llama):
        self.path = Path(getattr(llama, "model_path", "the Llama's model"))
        self.stamp = file_stamp(self.path)
        self._model = llama._model.model  # borrowed: the Llama frees it
        self._read_vocab(llama._model.vocab)
        self.n_gpu_layers = int(llama.model_params.n_gpu_layers)
        cp = llama.context_params
        self.devices_key = (f"Llama fa{getattr(cp, 'flash_attn_type', '?')} ub{cp.n_ubatch} "
                            f"tb{cp.n_threads_batch} kqv{int(cp.offload_kqv)}")
