"""Tokens to text as a generation streams: incremental UTF-8, stop strings, end of generation; and
which chat roles reach a prompt.

Pure Python, no model: `TextAssembler` is fed each round's tokens and says what text may be shown
now (text that could still become the start of a stop string is held back) and why generation ends.
"""

from __future__ import annotations

import codecs
from typing import Callable

import numpy as np

from .errors import GGUFSpecError

def plural(n, noun: str) -> str:
    """'1 thread', '2 threads' (n may be the count or its text)."""
    return f"{n} {noun}" if str(n) == "1" else f"{n} {noun}s"


# The roles chat templates render (OpenAI's, which GGUF templates follow); a template drops or refuses others.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def find_stop(text: str, stops: tuple[str, ...], since: int) -> int:
    """Index of the earliest stop string that ends after position `since`, or -1."""
    hits = [i for x in stops if (i := text.find(x, max(0, since - len(x) + 1))) >= 0]
    return min(hits, default=-1)


class TextAssembler:
    """The text of one generation, built token by token.

    piece: token -> its bytes; eog: a mask of end-of-generation tokens (ignored with ignore_eos).
    `add(tokens)` returns (the tokens kept, the text that may be shown now, finish reason or None).
    """

    def __init__(self, piece: Callable[[int], bytes], eog: np.ndarray, *, stop: tuple[str, ...] = (),
                 max_tokens: int, ignore_eos: bool = False):
        self.piece, self.eog, self.stop = piece, eog, stop
        self.max_tokens, self.ignore_eos = max_tokens, ignore_eos
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text, self.emitted, self.n_tokens = "", 0, 0
        self.hold = max((len(x) for x in stop), default=1) - 1  # text that may still become a stop string

    def add(self, tokens: list[int]) -> tuple[list[int], str, str | None]:
        kept, finish = [], None
        for t in tokens:
            if self.eog[t] and not self.ignore_eos:
                finish = "stop"
                break
            kept.append(t)
            before = len(self.text)
            self.text += self.decoder.decode(self.piece(t))
            cut = find_stop(self.text, self.stop, before)
            if cut >= 0:
                self.text, finish = self.text[:cut], "stop_string"
                break
            if self.n_tokens + len(kept) >= self.max_tokens:
                finish = "length"
                break
        self.n_tokens += len(kept)
        if finish is None:
            upto = max(self.emitted, len(self.text) - self.hold)
        else:
            if finish != "stop_string":
                self.text += self.decoder.decode(b"", final=True)
            upto = len(self.text)
        shown, self.emitted = self.text[self.emitted:upto], upto
        return kept, shown, finish


def check_chat_roles(messages: list[dict], where: str = "messages") -> list[dict]:
    """Chat messages whose roles a chat template renders; one line naming the first other role (a
    misspelled role's content would silently drop out of the prompt). Returns the messages."""
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise GGUFSpecError(f"{where}[{i}]: role {m.get('role')!r} is not one chat templates render; use "
                                f"{', '.join(CHAT_ROLES)} (a template drops the content of any other)")
    return messages
