"""Several sequences in one llama.cpp context: each a `Target` of its own (its tokens, its positions, its
rewinds), and one batch that decodes rows of many at once (`decode_together`), as llama.cpp's server fills one
batch from every slot. Each sequence has a KV stream of its own (n_ctx // N tokens), laid out as in a context of
its own, so where the backend computes batch rows bit-identically to one-token decoding a sequence's text is
what it would be alone; llama.cpp then computes the rows of several sequences in one ubatch where each brings
as many (its split_equal), else in one ubatch per distinct count. With `kv_unified` one cache holds them all.
"""

from __future__ import annotations

import contextlib
from typing import Sequence as Tokens

import numpy as np

from ..errors import ContextFullError, GGUFSpecError
from .runtime import C, decode_failed


def set_sequence(batch, n_rows: int, seq_id: int) -> None:
    for i in range(n_rows):
        batch.seq_id[i][0] = seq_id


def sequences_of(ctx, n_seq: int) -> list["Sequence"]:
    """The context's sequences 0..n_seq - 1, each with an even share of its cache."""
    share = ctx.n_ctx_total // n_seq
    return [Sequence(ctx, i, share) for i in range(n_seq)]


class Sequence:
    """One sequence of a Context of several: the `Target` protocol, decoding alone or in `decode_together`."""

    def __init__(self, ctx, seq_id: int, n_ctx: int):
        self.ctx, self.seq_id, self.n_ctx = ctx, seq_id, n_ctx
        self.model, self.n_batch, self.n_vocab = ctx.model, ctx.n_batch, ctx.n_vocab
        self.tokens: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def no_rewind(self):
        return contextlib.nullcontext()

    def start(self, prompt_tokens: list[int], reuse: bool = False) -> int:
        """A new prompt: this sequence's cache emptied, whatever decoded into it (sequence 0 is also the context's
        own); nothing is reused."""
        C.llama_memory_seq_rm(self.ctx._mem, self.seq_id, 0, -1)
        self.tokens.clear()
        return 0

    def decode(self, tokens: Tokens[int], logits: str = "last") -> np.ndarray | None:
        return decode_together(self.ctx, [(self, tokens, logits)])[0]

    def truncate(self, n_keep: int) -> None:
        if n_keep >= self.n_past:
            return
        if not C.llama_memory_seq_rm(self.ctx._mem, self.seq_id, n_keep, -1):
            raise GGUFSpecError(f"llama.cpp could not rewind sequence {self.seq_id} to position {n_keep}")
        del self.tokens[n_keep:]


def decode_together(ctx, parts: list[tuple[Sequence, Tokens[int], str]]) -> list[np.ndarray | None]:
    """Decode every part's tokens after its sequence's cache, in as few batches of n_batch rows as they fill
    (parts are not split across batches unless one alone is longer), and return each part's logits: "all" (a row
    per token), "last" (one) or "none" (None). Rows are copies (the next decode reuses llama.cpp's buffer).
    On an error no sequence keeps a row of this call."""
    for seq, tokens, _ in parts:
        if not len(tokens):
            raise GGUFSpecError("nothing to decode: no tokens were given")
        if seq.n_past + len(tokens) > seq.n_ctx:
            raise ContextFullError(f"the context is full: {seq.n_past} + {len(tokens)} tokens do not fit in this "
                                   f"sequence's n_ctx={seq.n_ctx}; raise -c or lower -n")
    before = {seq.seq_id: (seq, seq.n_past) for seq, _, _ in parts}
    batch = _Batch(ctx, len(parts))
    try:
        for index, (seq, tokens, logits) in enumerate(parts):
            batch.add(index, seq, [int(t) for t in tokens], logits)
        batch.flush()
    except BaseException:
        for seq, n_past in before.values():
            C.llama_memory_seq_rm(ctx._mem, seq.seq_id, n_past, -1)
            del seq.tokens[n_past:]
        raise
    return [None if logits == "none" else (o[0] if len(o) == 1 else np.concatenate(o))
            for o, (_, _, logits) in zip(batch.out, parts)]


class _Batch:
    """The context's llama_batch, filled with rows of several sequences and decoded when full."""

    def __init__(self, ctx, n_parts: int):
        self.ctx, self.batch = ctx, ctx._batch
        self.out: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
        self.rows: list[tuple[int, int]] = []  # (part, its output rows) in this batch, in order
        self.m = 0

    def add(self, index: int, seq: Sequence, tokens: list[int], logits: str) -> None:
        n_batch, batch = self.ctx.n_batch, self.batch
        if self.m and self.m + len(tokens) > n_batch:
            self.flush()
        start = 0
        while start < len(tokens):
            take = min(len(tokens) - start, n_batch - self.m)
            n_out = 0
            for k in range(take):
                i = self.m + k
                batch.token[i], batch.pos[i] = tokens[start + k], seq.n_past + k
                batch.seq_id[i][0] = seq.seq_id
                wanted = logits == "all" or (logits == "last" and start + k == len(tokens) - 1)
                batch.logits[i] = wanted
                n_out += wanted
            seq.tokens.extend(tokens[start:start + take])
            self.rows.append((index, n_out))
            self.m += take
            start += take
            if self.m == n_batch:
                self.flush()

    def flush(self) -> None:
        if not self.m:
            return
        ctx = self.ctx
        self.batch.n_tokens = self.m
        decode_failed(C.llama_decode(ctx._ctx, self.batch), self.m, 0, ctx.n_ctx)
        n_out = sum(n for _, n in self.rows)
        if n_out:
            view = np.ctypeslib.as_array(C.llama_get_logits(ctx._ctx), shape=(n_out, ctx.n_vocab))
            at = 0
            for part, n in self.rows:
                if n:
                    self.out[part].append(view[at:at + n].copy())
                    at += n
        self.m, self.rows = 0, []
