"""What the heads that follow a target decode (`heads`, `hidden`, `dflash`): a `RowBatch` of tokens and/or rows of
hidden states, and how the heads of several sequences on one llama.cpp context decode theirs in one batch.

A head decodes through `run`: alone, its batch goes to llama.cpp at once and the outputs are read where llama.cpp
left them; inside `sequences.together` (a server's round plans, or the heads' catch-up on a target batch of several
sequences) it *asks*, as a `Sequence` asks for its decodes, and `decode_asks` packs every head's rows asked on that
context into one llama_batch (each row with its head's sequence id), decodes it once, and hands each head copies
of its own outputs (the next decode there overwrites llama.cpp's). So N sequences drafting with MTP or EAGLE-3
cost one decode per drafted position instead of N, as llama.cpp's server drafts.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np

from ..errors import GGUFSpecError
from .runtime import C, decode_failed, llama_decode, llama_encode
from .sequences import planning


class RowBatch:
    """A llama_batch with numpy views: tokens (ours, where it pairs them with rows) and rows (width 0: tokens alone,
    llama_batch_init's own), every row on sequence `seq_id` unless set otherwise (`on`)."""

    def __init__(self, n: int, width: int, *, tokens: bool, seq_id: int = 0):
        self.n, self.width, self.has_tokens = n, width, tokens
        self.batch = C.llama_batch_init(n, width, 1)
        self.tokens = (C.llama_token * n)() if tokens and width else None
        if self.tokens is not None:
            self.batch.token = self.tokens  # llama_batch_init made room for rows only: the tokens are ours
        for i in range(n):
            self.batch.n_seq_id[i] = 1
        self.on(0, n, seq_id)
        self.token = np.ctypeslib.as_array(self.batch.token, shape=(n,)) if tokens else None
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(n,))
        self.out = np.ctypeslib.as_array(self.batch.logits, shape=(n,))
        self.rows = np.ctypeslib.as_array(self.batch.embd, shape=(n, width)) if width else None

    def on(self, start: int, n: int, seq_id: int) -> None:
        """Rows start..start + n belong to sequence seq_id."""
        for i in range(start, start + n):
            self.batch.seq_id[i][0] = seq_id

    def free(self) -> None:
        if self.batch is not None:
            if self.tokens is not None:
                self.batch.token = ctypes.POINTER(C.llama_token)()  # ours, not llama_batch_free's
            C.llama_batch_free(self.batch)
            self.batch = None


class Ask:
    """A head's first n rows of `batch` to decode (or encode), asked of `sequences.together` (its length: n)."""

    def __init__(self, head, batch: RowBatch, n: int, encode: bool):
        self.head, self.batch, self.n, self.encode = head, batch, n, encode

    def __len__(self) -> int:
        return self.n


def run(head, batch: RowBatch, n: int, kind: str, *, encode: bool = False):
    """Decode (encode) the first n rows of `batch` on `head`'s context: (logits of its output rows, their nextn rows;
    each None where the context gives none). Inside `sequences.together`, with other heads sharing the context,
    asked and decoded with theirs (copies); else at once (views on llama.cpp's buffers, valid until its next
    decode there). The seconds go to head.seconds[kind]."""
    began = time.perf_counter()
    current = planning()
    try:
        if current is not None and len(head.ctx.sharing) > 1:
            return current.ask((head, Ask(head, batch, n, encode)))
        return decode_now(head, batch, n, encode)
    finally:
        head.seconds[kind] += time.perf_counter() - began


def decode_now(head, batch: RowBatch, n: int, encode: bool):
    """`run` at once: (logits, nextn) views of the output rows (every row for an encoder)."""
    batch.batch.n_tokens = n
    if encode:
        if llama_encode(head._ctx, batch.batch) != 0:
            raise GGUFSpecError(f"{head.draft_model.path}: llama.cpp's {head.name} encoder failed on {n} rows")
        n_out = n
    else:
        decode_failed(llama_decode(head._ctx, batch.batch), n, int(batch.pos[0]), head.target.n_ctx)
        n_out = int(np.count_nonzero(batch.out[:n]))
    if not n_out:
        return None, None
    logits = None if encode else _view(C.llama_get_logits(head._ctx), n_out, head.n_vocab)
    nextn = _view(head.X.llama_get_embeddings_nextn(head._ctx), n_out, head.n_embd)
    return logits, nextn


def _view(pointer, rows: int, width: int) -> np.ndarray:
    view = np.ctypeslib.as_array(pointer, shape=(rows, width))
    view.flags.writeable = False
    return view


def decode_asks(owner, parts: list[tuple[object, Ask]]) -> list[tuple]:
    """Every part's rows decoded on the context `owner` makes (heads of one kind: one layout of rows) in as few
    batches as they fill; each part's (logits, nextn) of its own output rows, as copies."""
    out: list[tuple] = [None] * len(parts)
    limit = owner.n_ubatch if parts[0][1].encode else owner.n_batch
    group: list[int] = []
    for i, (_, ask) in enumerate(parts):
        if group and sum(parts[j][1].n for j in group) + ask.n > limit:
            _decode_group(owner, parts, group, out)
            group = []
        group.append(i)
    _decode_group(owner, parts, group, out)
    return out


def _decode_group(owner, parts, group: list[int], out: list) -> None:
    first = parts[group[0]][1]
    if len(group) == 1:
        got = decode_now(first.head, first.batch, first.n, first.encode)
        out[group[0]] = tuple(None if x is None else x.copy() for x in got)
        return
    shape = (first.batch.width, first.batch.has_tokens)
    together = owner.together_batches.get(shape)
    if together is None:
        together = owner.together_batches[shape] = RowBatch(max(owner.n_batch, owner.n_ubatch), *shape[:1],
                                                            tokens=shape[1])
    at, spans = 0, []
    for i in group:
        ask = parts[i][1]
        n, src = ask.n, ask.batch
        together.pos[at:at + n], together.out[at:at + n] = src.pos[:n], src.out[:n]
        if together.token is not None:
            together.token[at:at + n] = src.token[:n]
        if together.rows is not None:
            together.rows[at:at + n] = src.rows[:n]
        together.on(at, n, ask.head.seq_id)
        n_out = n if ask.encode else int(np.count_nonzero(src.out[:n]))
        spans.append((i, n_out))
        at += n
    logits, nextn = decode_now(owner, together, at, first.encode)
    k = 0
    for i, n_out in spans:
        out[i] = (None if logits is None or not n_out else logits[k:k + n_out].copy(),
                  None if nextn is None or not n_out else nextn[k:k + n_out].copy())
        k += n_out
