"""What ggufspec reads of a model's vocabulary (type, size, BOS/EOS, token texts: what the pair checks in `compat`
compare), for a model of its own (`backend.Model`) and for the model of a llama-cpp-python `Llama` it borrows."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

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
        self._piece_buf = ctypes.create_string_buffer(256)

    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text to token ids the way llama.cpp's tools do (BOS if the model wants it, special tokens parsed).
        Bytes are tokenized as they are, as llama.cpp does with a prompt file in any encoding."""
        data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")  # argv's bytes, as given
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_special, parse_special)
        return list(buf[:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        n = C.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, special)
            return buf.raw[:n]
        return self._piece_buf.raw[:n]

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


class TextBridge:
    """Text between a target's vocabulary and a draft's of another (textdraft.Bridge): each token's text, each
    tokenizer, and the tokens both share by text. Control tokens (template markers, ends of generation) never
    cross: a target's has no text for the draft, a draft's stops its draft."""

    def __init__(self, target, draft):
        self.target, self.draft = target, draft
        self.draft_prefix = [draft.bos] if draft.add_bos and draft.bos >= 0 else []
        self.draft_stops = self._no_text(draft)
        self._target_none = self._no_text(target)
        self._target_space, self._draft_space = adds_space_prefix(target), adds_space_prefix(draft)
        self._target_pieces: dict[int, bytes] = {}
        self._draft_pieces: dict[int, bytes] = {}
        self._shared = None

    @staticmethod
    def _no_text(model) -> np.ndarray:
        """Tokens with no text of their own to share: control, unknown and unused ones, and ends of generation."""
        vocab = model._vocab
        return np.array([bool(C.llama_vocab_get_attr(vocab, t) & (C.LLAMA_TOKEN_ATTR_UNKNOWN | C.LLAMA_TOKEN_ATTR_UNUSED | C.LLAMA_TOKEN_ATTR_CONTROL))
                         or C.llama_vocab_is_eog(vocab, t) for t in range(model.n_vocab)], dtype=bool)

    def target_piece(self, token: int) -> bytes:
        piece = self._target_pieces.get(token)
        if piece is None:
            piece = self._target_pieces[token] = b"" if self._target_none[token] else self.target.token_to_piece(token)
        return piece

    def draft_piece(self, token: int) -> bytes:
        piece = self._draft_pieces.get(token)
        if piece is None:
            piece = self._draft_pieces[token] = self.draft.token_to_piece(token)
        return piece

    def to_draft(self, text: bytes) -> list[int]:
        return self._tokenize(self.draft, self._draft_space, text)

    def to_target(self, text: bytes) -> list[int]:
        return self._tokenize(self.target, self._target_space, text)

    @staticmethod
    def _tokenize(model, adds_space: bool, text: bytes) -> list[int]:
        """The tokens of `text` as a piece of a longer one. A SentencePiece vocabulary that adds a space before a text
        (add_space_prefix: Llama 2's, Mistral's) is given a text that starts with one without it, which is then
        exact; elsewhere a lone space token it put first is dropped."""
        if adds_space and text.startswith(b" "):
            return model.tokenize(text[1:], add_special=False, parse_special=False)
        tokens = model.tokenize(text, add_special=False, parse_special=False)
        if adds_space and tokens and model.token_to_piece(tokens[0]) == b" ":
            return tokens[1:]
        return tokens

    def shared(self) -> tuple[np.ndarray, np.ndarray]:
        """(draft ids, target ids) of the tokens whose texts are the same, one to one (the first of a text's ids)."""
        if self._shared is None:
            self._shared = shared_tokens(self.target, self.draft, self._target_none, self.draft_stops)
        return self._shared


def text_round_trip(bridge) -> dict:
    """What a round's text conversions cost a draft of another vocabulary (a vocab.TextBridge): the accepted text
    tokenized again for the draft, the draft's text for the target; median of 20, microseconds (not cached)."""
    text = b"    for i in range(2, int(n ** 0.5) + 1):\n        if n % i == 0:\n            return False\n"
    times = []
    for _ in range(20):
        start = time.perf_counter()
        new = b"".join(bridge.target_piece(t) for t in bridge.to_target(text[:24]))  # a round's accepted text
        bridge.to_draft(text[:24] + new)  # the window tokenized again with it
        drafted = b"".join(bridge.draft_piece(t) for t in bridge.to_draft(text[48:72]))
        bridge.to_target(text[40:48] + drafted)  # the draft's text, after the history's last tokens
        times.append(time.perf_counter() - start)
    return {"seconds": float(np.median(times)), "shared_tokens": len(bridge.shared()[1])}


def shared_tokens(target, draft, target_none=None, draft_none=None) -> tuple[np.ndarray, np.ndarray]:
    """(draft ids, target ids) of the tokens two vocabularies share by text, one to one, control tokens left out."""
    target_none = TextBridge._no_text(target) if target_none is None else target_none
    draft_none = TextBridge._no_text(draft) if draft_none is None else draft_none
    by_text: dict[bytes, int] = {}
    for t in _normal_first(target):
        if not target_none[t]:
            by_text.setdefault(target.token_to_piece(int(t)), int(t))
    pairs = []
    for d in _normal_first(draft):
        if not draft_none[d]:
            t = by_text.pop(draft.token_to_piece(int(d)), None)  # popped: one draft id per target id
            if t is not None:
                pairs.append((d, t))
    ids = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return ids[:, 0], ids[:, 1]


def _normal_first(model) -> list[int]:
    """The vocabulary's ids, its byte-fallback tokens last: a text's own token (a letter, a newline) is the one a
    model predicts, not the byte token of the same text."""
    byte = np.array([C.llama_vocab_get_attr(model._vocab, t) & C.LLAMA_TOKEN_ATTR_BYTE for t in range(model.n_vocab)], dtype=bool)
    return [*np.flatnonzero(~byte), *np.flatnonzero(byte)]


def adds_space_prefix(model) -> bool:
    """Whether llama.cpp's tokenizer puts a space before a text (SentencePiece's add_space_prefix)."""
    return b"".join(model.token_to_piece(t) for t in model.tokenize(b"a", add_special=False, parse_special=False)) == b" a"
