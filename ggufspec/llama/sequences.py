"""Several sequences in one llama.cpp context: each a `Target` of its own (its tokens, its positions, its
rewinds), and one batch that decodes rows of many at once (`decode_together`), as llama.cpp's server fills one
batch from every slot. Each sequence has a KV stream of its own (n_ctx // N tokens), laid out as in a context of
its own, so where the backend computes batch rows bit-identically to one-token decoding a sequence's text is
what it would be alone; llama.cpp then computes the rows of several sequences in one ubatch where each brings
as many (its split_equal), else in one ubatch per distinct count. With `kv_unified` one cache holds them all.

`together` runs several rounds' plans as coroutines (greenlets): a draft model's steps for every sequence that
drafts are decoded in one batch of its context, as llama.cpp's server drafts, instead of one decode each.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Callable, Sequence as Tokens

import greenlet
import numpy as np

from ..errors import ContextFullError, GGUFSpecError
from .recurrent import Checkpoints
from .runtime import C, decode_failed, llama_decode


def set_sequence(batch, n_rows: int, seq_id: int) -> None:
    for i in range(n_rows):
        batch.seq_id[i][0] = seq_id


def reusable_prefix(held: list[int], canonical: int, prompt_tokens: list[int], chunk: int) -> int:
    """How many leading tokens of `prompt_tokens` a new generation may keep of a cache that holds `held`, of which
    the first `canonical` were computed in whole aligned chunks: their common prefix within `canonical`, rounded
    down to a whole chunk, so the rest is computed as a cold start computes it; the prompt's last token is always
    evaluated again (its logits are needed)."""
    limit = min(canonical, len(prompt_tokens) - 1)
    common = 0
    while common < limit and held[common] == prompt_tokens[common]:
        common += 1
    return common - common % chunk


def aligned_pieces(n_past: int, n: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of n tokens decoded after n_past, cut where a position is a multiple of `chunk` (the pieces a
    prompt is evaluated in, so a later prompt that begins the same keeps whole chunks)."""
    out, start = [], 0
    while start < n:
        end = min(n, start + chunk - (n_past + start) % chunk)
        out.append((start, end))
        start = end
    return out


class Reusing:
    """A cache a new prompt may keep part of (Context, Sequence): `reusable(prompt_tokens)`, `truncate`, `clear`."""

    def start(self, prompt_tokens: list[int], *, reuse: bool = False) -> int:
        """Rewind for a new prompt: keep its `reusable` part (reuse) or nothing; return how many tokens were kept."""
        keep = self.reusable(prompt_tokens) if reuse else 0
        if keep:
            self.truncate(keep)
        else:
            self.clear()
        return keep


def sequences_of(ctx, n_seq: int) -> list["Sequence"]:
    """The context's sequences 0..n_seq - 1, each with an even share of its cache."""
    share = ctx.n_ctx_total // n_seq
    return [Sequence(ctx, i, share) for i in range(n_seq)]


class Sequence(Reusing):
    """One sequence of a Context of several: the `Target` protocol, decoding alone or in `decode_together`. Where
    the memory cannot be cut (a recurrent state), it saves its own state before each decode it may rewind into and
    rewinds from those (`recurrent.Checkpoints`), as a context of one sequence does."""

    def __init__(self, ctx, seq_id: int, n_ctx: int):
        self.ctx, self.seq_id, self.n_ctx = ctx, seq_id, n_ctx
        self.model, self.n_batch, self.n_vocab, self.chunk = ctx.model, ctx.n_batch, ctx.n_vocab, ctx.chunk
        self.tokens: list[int] = []
        self.canonical = 0  # leading positions decoded alone in whole aligned chunks (Context.canonical)
        self.checkpoints = None if ctx.cuttable else Checkpoints(seq_id=seq_id)
        self.followers: list = []  # this sequence's heads (Context.followers): told of its batches and cuts

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def _ctx(self):  # the llama_context, for Checkpoints
        return self.ctx._ctx

    def no_rewind(self):
        """A `with` block whose decodes will not be rewound into: a recurrent state saves nothing for them."""
        return contextlib.nullcontext() if self.checkpoints is None else self.checkpoints.paused()

    def reusable(self, prompt_tokens: list[int]) -> int:
        """What of `prompt_tokens` a new generation may keep of this sequence's cache (`reusable_prefix`); nothing
        where a recurrent state holds it (it cannot be cut back within a prompt)."""
        if self.checkpoints is not None:
            return 0
        return reusable_prefix(self.tokens, self.canonical, prompt_tokens, self.chunk)

    def clear(self) -> None:
        C.llama_memory_seq_rm(self.ctx._mem, self.seq_id, 0, -1)
        for follower in self.followers:
            follower.cut(0)
        self.tokens.clear()
        self.canonical = 0
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def cut(self, n_keep: int) -> bool:
        """Drop positions from n_keep on, if llama.cpp can (a recurrent state: not within it); whether it did."""
        if not C.llama_memory_seq_rm(self.ctx._mem, self.seq_id, n_keep, -1):
            return False
        for follower in self.followers:
            follower.cut(n_keep)
        del self.tokens[n_keep:]
        self.canonical = min(self.canonical, n_keep)
        return True

    def decode(self, tokens: Tokens[int], logits: str = "last") -> np.ndarray | None:
        """Decode after this sequence's cache; inside `together`, with the other plans' decodes of this context.
        Alone, tokens without a row each ("last", "none": a prompt) go in aligned chunks (`aligned_pieces`), and
        each whole one decoded after canonical positions becomes canonical too."""
        current = greenlet.getcurrent()
        if isinstance(current, _Planning):
            return current.ask((self, tokens, logits))
        if logits == "all" or len(tokens) == 1:
            return decode_together(self.ctx, [(self, tokens, logits)])[0]
        out = None
        for start, end in aligned_pieces(self.n_past, len(tokens), self.chunk):
            at = self.n_past
            out = decode_together(self.ctx, [(self, tokens[start:end], logits if end == len(tokens) else "none")])[0]
            if end - start == self.chunk and self.canonical == at:
                self.canonical += self.chunk
        return out

    def truncate(self, n_keep: int) -> None:
        if n_keep >= self.n_past:
            return
        if self.checkpoints is not None:
            self.checkpoints.rewind(self, n_keep)
        elif not self.cut(n_keep):
            raise GGUFSpecError(f"llama.cpp could not rewind sequence {self.seq_id} to position {n_keep}")


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
    for seq, n_past in before.values():
        if seq.checkpoints is not None:
            seq.checkpoints.save(ctx._ctx, n_past)
    batch = _Batch(ctx, len(parts))
    try:
        for index, (seq, tokens, logits) in enumerate(parts):
            batch.add(index, seq, [int(t) for t in tokens], logits)
        batch.flush()
    except BaseException:
        for seq, n_past in before.values():
            if seq.checkpoints is None:
                C.llama_memory_seq_rm(ctx._mem, seq.seq_id, n_past, -1)
                for follower in seq.followers:
                    follower.cut(n_past)
                del seq.tokens[n_past:]
            else:
                seq.truncate(n_past)
        raise
    return [None if logits == "none" else (o[0] if len(o) == 1 else np.concatenate(o))
            for o, (_, _, logits) in zip(batch.out, parts)]


class _Batch:
    """The context's llama_batch, filled with rows of several sequences and decoded when full."""

    def __init__(self, ctx, n_parts: int):
        self.ctx, self.batch = ctx, ctx._batch
        self.out: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
        self.rows: list[tuple[int, int]] = []  # (part, its output rows) in this batch, in order
        self.heard: list[tuple[Sequence, int, list[int], int]] = []  # (followed sequence, start, tokens, first row)
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
            if seq.followers:
                self.heard.append((seq, seq.n_past, tokens[start:start + take], self.m))
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
        decode_failed(llama_decode(ctx._ctx, self.batch), self.m, 0, ctx.n_ctx)
        heard, self.heard = self.heard, []
        follow(heard)
        n_out = sum(n for _, n in self.rows)
        if n_out:
            view = ctx.logits(n_out)
            at = 0
            for part, n in self.rows:
                if n:
                    self.out[part].append(view[at:at + n].copy())
                    at += n
        self.m, self.rows = 0, []


def follow(heard: list[tuple[Sequence, int, list[int], int]]) -> None:
    """Each sequence's heads read its rows of the batch just decoded ((sequence, start, tokens, first row) each):
    as plans of `together`, so heads sharing a context decode what they follow in one batch (llama.rows)."""
    calls = [functools.partial(f.process, start, np.asarray(tokens, dtype=np.int32), at)
             for seq, start, tokens, at in heard for f in seq.followers]
    for result, _ in together(calls) if len(calls) > 1 else [(call(), 0.0) for call in calls]:
        if isinstance(result, BaseException):
            raise result


def planning() -> "_Planning | None":
    """The plan of `together` this code runs in (its decodes are asked, not made), or None."""
    current = greenlet.getcurrent()
    return current if isinstance(current, _Planning) else None


class _Planning(greenlet.greenlet):
    """One call run by `together`: what it asks to decode waits for the others' asks."""

    def __init__(self, call: Callable):
        super().__init__(call)
        self.waited = 0.0  # seconds between asking and going on
        self.share = 0.0  # of which, its rows' share of the decodes

    def ask(self, part: tuple):
        start = time.perf_counter()
        try:
            return self.parent.switch(part)
        finally:
            self.waited += time.perf_counter() - start


def together(calls: list[Callable]) -> list[tuple[object, float]]:
    """Run the calls (each a round's plan) as if one after another, except that a decode one asks of a `Sequence`
    waits until every other call has finished or asked too; those asked are then decoded in one batch per
    context (the first of each as long as it is: a draft catching up; then a row each). Returns each call's
    result, or the exception it raised, and the seconds its own timings counted of the others' work (waiting,
    beyond its rows' share of the decodes)."""
    runs = [_Planning(call) for call in calls]
    results: list[object] = [None] * len(runs)
    answers: dict[int, tuple[bool, object]] = {i: (False, None) for i in range(len(runs))}
    while answers:
        asked = {}
        for i, (failed, value) in answers.items():
            run = runs[i]
            try:
                got = run.throw(value) if failed else run.switch(value) if run else run.switch()
            except Exception as e:  # noqa: BLE001 (that call failed; the others go on)
                got = e
            if run.dead:
                results[i] = got
            else:
                asked[i] = got
        answers = {}
        for ctx in {id(part[0].ctx): part[0].ctx for part in asked.values()}.values():
            members = [i for i, part in asked.items() if part[0].ctx is ctx]
            answers.update(_decode_asked(ctx, members, asked, runs))
    return [(result, run.waited - run.share) for result, run in zip(results, runs)]


def _decode_asked(ctx, members: list[int], asked: dict, runs: list[_Planning]) -> dict[int, tuple[bool, object]]:
    """Decode the members' asks on one context together (each alone if that fails, so one ask's fault is its own)."""
    start = time.perf_counter()
    decode = getattr(ctx, "decode_asks", None) or functools.partial(decode_together, ctx)  # heads: llama.rows
    try:
        out = {i: (False, rows) for i, rows in zip(members, decode([asked[i] for i in members]))}
    except Exception as e:  # noqa: BLE001
        if len(members) == 1:
            return {members[0]: (True, e)}
        out = {}
        for i in members:
            out.update(_decode_asked(ctx, [i], asked, runs))
        return out
    spent, rows = time.perf_counter() - start, sum(len(asked[i][1]) for i in members)
    for i in members:
        runs[i].share += spent * len(asked[i][1]) / rows
    return out
