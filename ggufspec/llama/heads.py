"""The drafting heads a model ships: its multi-token-prediction (MTP, "NextN") blocks, driven as llama.cpp's
`common/speculative.cpp` (draft-mtp) drives them, through llama.cpp's staging API (`src/llama-ext.h`, bound
by llama-cpp-python's `llama_cpp_ext`: not a stable API, pinned with the release).

An `MtpHead` is the block on a llama.cpp context of its own (`LLAMA_CONTEXT_TYPE_MTP`, `ctx_other` = the
target's) that *follows* a target `Context`: every batch the target decodes it decodes too, each token paired
with the target's hidden state of the position before (the first position with zeros), and every rewind of
the target it follows; so between rounds it holds what llama.cpp's draft-mtp holds. A draft runs the block
forward from the last token (`begin`, then `step` per drafted token, each fed the block's own hidden state),
and `end` forgets the drafted positions. Misuses abort the process inside llama.cpp (an MTP context on a model
loaded without its MTP layers, a batch past n_batch), so each is checked here before the call.
"""

from __future__ import annotations

import numpy as np

from ..errors import GGUFSpecError
from .draft_fit import is_mtp_file  # noqa: F401 (where the engine and models.resolve look for it)
from .rows import RowBatch, decode_asks, run
from .runtime import C, Closing, buffers, create_context

# The target's hidden-state rows kept for rewinds: a rewind goes back at most into the last round's batches
# (a verify batch, a near-tie's re-decode, a recurrent target's replay); prompt reuse cuts at whole batches,
# whose last rows are kept besides.
ROW_WINDOW = 160


def ext():
    """llama-cpp-python's bindings of llama.cpp's staging API (ImportError where this release lacks them)."""
    from llama_cpp import llama_cpp_ext

    return llama_cpp_ext


def check_mtp_file(path) -> int:
    """The MTP blocks a GGUF carries (read from its header), or one clear line saying it has none."""
    from .gguf_info import read_info

    return _mtp_blocks(path, read_info(path))


def check_mtp(model) -> int:
    """The MTP blocks of a loaded backend.Model, or one clear line why it has none to draft with."""
    n = _mtp_blocks(model.path, model.info)
    if not model.mtp_loaded:
        raise GGUFSpecError(f"{model.path}: its MTP layers were not loaded (load it with mtp=True)")
    return n


def _mtp_blocks(path, info) -> int:
    if not info.n_nextn:
        raise GGUFSpecError(f"{path}: this model has no MTP (NextN) layers to draft with; "
                            f"use --mode draft with a draft model (-md), lookup or auto")
    return info.n_nextn


def all_followers(target) -> list:
    """Every head following the llama.cpp context of `target` (a Context, or a Sequence of one): those of each of
    its sequences too (what the context outputs is the same for all of them)."""
    ctx = getattr(target, "ctx", target)
    return list(ctx.followers) + [f for seq in ctx.sequences for f in seq.followers]


def read_by_others(follower) -> set[int]:
    """The target layers (their ids; the target's n_layer: its final hidden state) another active head reads, on
    any sequence: what must stay extracted when this one stops following."""
    return {lid for f in all_followers(follower.target) if f is not follower and f.active for lid in f.layer_ids}


class Follower(Closing):
    """What every head shares as a follower of a target `Context`, or of one `Sequence` of a context of several
    (see the module): its context's length, following on and off (`_follow`: what the target must output while
    followed), and freeing its batches (named in `_batches`) and context, the target told first.

    The heads of a context of several sequences are one head per sequence, on one llama.cpp context of as many
    sequences (llama.cpp's server drafts so): the first one's (`share` None) owns it, the others' (`share` = the
    first) decode their own sequence id there (`seq_id`, the target sequence's) and keep their own state."""

    _batches: tuple[str, ...] = ()
    seq_id = 0
    _owner = True

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    def _attach(self, target, share) -> None:
        """Follow `target` (a Context or a Sequence) on its sequence id; `share`: the head whose context this one
        uses (None: this one makes and owns its own)."""
        self.target, self.seq_id = target, getattr(target, "seq_id", 0)
        self._owner = share is None
        self.ctx = share or self  # what `sequences.together` gathers this head's asks by: the context's owner
        if self._owner:
            self.sharing, self.together_batches = [], {}  # the heads on this context; batches of several's rows
        self.ctx.sharing.append(self)
        self.n_batch, self.n_ubatch = int(C.llama_n_batch(self._ctx)), int(C.llama_n_ubatch(self._ctx))
        target.followers.append(self)

    def decode_asks(self, parts: list) -> list:
        """The rows several heads on this context asked to decode, in one batch (`rows.decode_asks`)."""
        return decode_asks(self, parts)

    def _forget(self, start: int) -> None:
        """Forget this head's positions from `start` on (0: all of them) in its context."""
        if start == 0 and len(self.ctx.sharing) == 1:
            C.llama_memory_clear(self._mem, True)  # a context of its own
        else:
            C.llama_memory_seq_rm(self._mem, self.seq_id, start, -1)

    def _rows_kept(self, rows: dict, top: int) -> None:
        """Drop rows (by position) older than a window below `top`, but those ending a prompt chunk (a later
        prompt that begins the same keeps whole chunks: the row before is the one a head resumes from)."""
        low, chunk = top - ROW_WINDOW, self.target.chunk
        for p in [p for p in rows if p < low and (p + 1) % chunk]:
            del rows[p]

    def activate(self, on: bool) -> None:
        """Follow the target's decodes (on) or not: the target outputs what this head reads only while followed."""
        if on != self.active:
            self._follow(on)
            self.active = on

    def _follow(self, on: bool) -> None:
        raise NotImplementedError

    def close(self) -> None:
        for name in self._batches:
            batch = getattr(self, name, None)
            if batch is not None:
                batch.free()
        for batch in getattr(self, "together_batches", {}).values():
            batch.free()
        self.together_batches = {}
        target = getattr(self, "target", None)
        if target is not None and self in target.followers:
            if target._ctx and self.active:
                self._follow(False)
            target.followers.remove(self)
        if getattr(self, "_ctx", None):
            if self._owner:
                C.llama_free(self._ctx)
            self._ctx = None


class MtpHead(Follower):
    """A target model's MTP block on its own context, following the target Context `target` (see the module).
    model: where the block is, where not in the target's own file (a sibling MTP GGUF, loaded with mtp=True)."""

    name = "mtp"
    _batches = ("_batch",)

    def __init__(self, target, *, model=None, n_threads: int | None = None, share: "MtpHead | None" = None):
        model = model or target.model
        self.n_layers = check_mtp(model)
        self.target = target
        self.layer_ids = [int(C.llama_model_n_layer(target.model._model))]  # the target's final hidden state
        self.X = ext()
        self.n_embd = _width(model)
        if self.n_embd != _width(target.model):  # llama.cpp asserts it when drafting: said here in one line
            raise GGUFSpecError(f"{model.path}: its MTP layers read hidden states {self.n_embd} wide, the target's "
                                f"are {_width(target.model)}: it is another model's")
        self.n_vocab = target.n_vocab
        self._ctx, self.buffers = (share._ctx, {}) if share else follower_context(
            target, model, "the MTP layers' context", mtp=True, n_threads=n_threads)
        self.X.llama_set_embeddings_nextn(self._ctx, True, True)
        self._mem = C.llama_get_memory(self._ctx)
        self._batch = RowBatch(int(C.llama_n_batch(self._ctx)), self.n_embd, tokens=True,
                               seq_id=getattr(target, "seq_id", 0))
        self.n_past = 0  # positions this context holds: the target's, while in step
        self.synced = True  # it holds exactly what the target holds (lost while inactive; back at a clear)
        self.active = False
        self._rows: dict[int, np.ndarray] = {}  # the target's hidden state by position (a window, see ROW_WINDOW)
        self._zero = np.zeros(self.n_embd, dtype=np.float32)
        self._h = self._zero  # the hidden state the next draft step pairs with
        self._drafting = 0  # positions a draft under way has added
        self.seconds = {"catch_up": 0.0, "draft": 0.0}  # time in this context's decodes, by kind
        self.rows_fed = 0
        self._attach(target, share)

    # -- following the target -------------------------------------------------------------------

    def _follow(self, on: bool) -> None:
        """The target's hidden states, a row per batch token (left on while another head reads them)."""
        if on or self.layer_ids[0] not in read_by_others(self):
            self.X.llama_set_embeddings_nextn(self.target._ctx, bool(on), False)

    def ready(self, n_past: int) -> bool:
        """Whether a draft can start at position n_past (this context holds the target's n_past positions)."""
        return self.active and self.synced and self.n_past == n_past and n_past > 0

    def process(self, start: int, tokens: np.ndarray, at: int = 0) -> None:
        """The target decoded `tokens` at start.. (rows at.. of its last batch): decode them here, each with the
        previous position's state."""
        if not self.active or not self.synced or start != self.n_past:
            self.synced = False
            return
        m = len(tokens)
        rows = np.ctypeslib.as_array(self.X.llama_get_embeddings_nextn(self.target._ctx),
                                     shape=(at + m, self.n_embd))[at:]
        prev = self._row(start - 1)
        if prev is None:
            self.synced = False
            return
        batch = self._batch
        batch.rows[0] = prev
        batch.rows[1:m] = rows[: m - 1]
        batch.token[:m] = tokens
        batch.pos[:m] = np.arange(start, start + m, dtype=np.int32)
        batch.out[:m] = 0
        run(self, batch, m, "catch_up")
        self.rows_fed += m
        for k in range(m):
            self._rows[start + k] = rows[k].copy()
        self.n_past = start + m
        self._rows_kept(self._rows, self.n_past)

    def cut(self, n_keep: int) -> None:
        """The target forgot its positions from n_keep on: so does this context."""
        if n_keep == 0:
            self._forget(0)
            self.n_past, self.synced = 0, True
            self._rows.clear()
            return
        if n_keep < self.n_past:
            self._forget(n_keep)
            self.n_past = n_keep
        if self._row(n_keep - 1) is None:
            self.synced = False

    def _row(self, position: int) -> np.ndarray | None:
        return self._zero if position < 0 else self._rows.get(position)

    # -- drafting ---------------------------------------------------------------------------------

    def begin(self, token: int, position: int, n: int = 1) -> np.ndarray:
        """The first draft step of a draft of up to n tokens: `token` (the last of the history, at `position` =
        the target's n_past) with the target's state of the position before. Returns the logits of the next token (a view, valid until the
        next step)."""
        self._drafting = 0
        self._h = self._row(position - 1)
        return self.step(token)

    def step(self, token: int) -> np.ndarray:
        """The next draft step: `token` after the last one, with the block's own state from that step."""
        if self.n_past + self._drafting >= self.target.n_ctx:
            raise GGUFSpecError("the MTP context is full")
        batch = self._batch
        batch.token[0], batch.pos[0], batch.out[0], batch.rows[0] = token, self.n_past + self._drafting, 1, self._h
        logits, h = run(self, batch, 1, "draft")
        self._drafting += 1
        self._h = np.array(h[0])
        return logits[0]

    def end(self) -> None:
        """Forget the drafted positions (the verify batch decodes them here again, with the target's states)."""
        if self._drafting:
            self._forget(self.n_past)
            self._drafting = 0


def follower_context(target, model, what: str, *, mtp: bool = False, n_threads: int | None = None):
    """A llama.cpp context on `model` beside the target Context `target` (or the Context of the Sequence `target`:
    its n_ctx, sequences, KV layout, batch, threads, flash attention; `ctx_other` = the target's: a draft without
    token_embd or output takes the target's; no recurrent rollback): (context, what llama.cpp allocated where).
    mtp: an MTP context of the target's own model. One line if none."""
    target = getattr(target, "ctx", target)  # a Sequence's Context
    params = C.llama_context_default_params()
    params.n_ctx = int(C.llama_n_ctx(target._ctx))
    params.n_batch = params.n_ubatch = int(target.n_batch)
    params.n_seq_max = max(1, len(target.sequences))
    params.kv_unified = bool(target.kv_unified)
    params.n_threads = params.n_threads_batch = int(n_threads or target.n_threads)
    params.no_perf = True
    if mtp:
        params.ctx_type = C.LLAMA_CONTEXT_TYPE_MTP
    params.ctx_other = target._ctx
    params.n_rs_seq = 0
    params.flash_attn_type = target.flash_attn_type
    params.op_offload = getattr(target, "op_offload", True)
    ctx, log = create_context(model._model, params)
    if not ctx:
        raise GGUFSpecError(f"{model.path}: llama.cpp could not create {what} (out of memory? try a smaller -c)")
    return ctx, buffers(log)


def _width(model) -> int:
    return int(C.llama_model_n_embd_out(model._model)) or int(C.llama_model_n_embd(model._model))
