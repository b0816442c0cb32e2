"""DFlash drafts (llama.cpp's `dflash` architecture): a block-diffusion draft that proposes a whole block of
tokens in one forward pass, its attention reading the target's hidden states; driven as llama.cpp's
`common/speculative.cpp` (draft-dflash) drives it, through the staging API (`src/llama-ext.h`).

A `DflashHead` is the draft on a context of its own (`ctx_other` = the target's, non-causal attention) that
*follows* a target `Context`, as `heads.MtpHead` and `hidden.Eagle3Head` do: every batch the target decodes,
the inputs of the draft's target layers are concatenated per position and decoded into the draft's cache at
the target's positions (embedding-only rows, no outputs: the draft's fused projection writes them into its
K/V). A draft is one decode of [last token, mask x n] at the target's next positions; the drafts are the
argmax (or the sampled token) of rows 1..n, at most block size - 1 of them. The block's positions are
forgotten after the draft (the verify batch brings the target's own states there), and every rewind of the
target is followed. Misuses abort the process inside llama.cpp (a layer id past the target's, a non-causal
batch past n_ubatch, a DSpark or DFlash2 draft driven as DFlash), so each is checked here before the call.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import GGUFSpecError
from .heads import Follower, ext, follower_context
from .hidden import check_layer_ids, check_target_on_host, extract_layers, layer_rows, target_layer_ids
from .rows import RowBatch
from .runtime import C, decode_failed, llama_decode

DEFAULT_BLOCK = 16  # llama.cpp's block size where the GGUF names none


def check_dflash(target_model, draft_model) -> tuple[list[int], int, int]:
    """(target layer ids, block size, mask token id) of a DFlash draft for this target, or one clear line why it
    cannot draft for it."""
    arch = draft_model.meta("general.architecture")
    ids = target_layer_ids(draft_model) if arch == "dflash" else []
    if arch != "dflash" or not ids:
        raise GGUFSpecError(f"{draft_model.path}: is not a DFlash draft (architecture {arch}, {len(ids)} target "
                            f"layers read); give a dflash GGUF with -md")
    if any(t.name == "markov_w1.weight" for t in draft_model.info.tensors):
        raise GGUFSpecError(f"{draft_model.path}: is a DSpark draft (a DFlash draft with a Markov head), which "
                            "ggufspec does not drive yet; llama.cpp's `--spec-type draft-dspark` does")
    if int(draft_model.meta("dflash.selector_top_k") or 0) > 0:
        raise GGUFSpecError(f"{draft_model.path}: is a DFlash2 draft (a selector lattice), which ggufspec does not "
                            "drive yet; llama.cpp's `--spec-type draft-dflash` does")
    check_layer_ids(target_model, draft_model, ids, "dflash.target_hidden_size")
    block = int(draft_model.meta("dflash.block_size") or DEFAULT_BLOCK)
    if block < 2:
        raise GGUFSpecError(f"{draft_model.path}: its dflash.block_size is {block}: a block drafts block size - 1 "
                            "tokens, so this draft drafts none")
    mask = int(C.llama_vocab_mask(C.llama_model_get_vocab(draft_model._model)))
    if not 0 <= mask < draft_model.n_vocab:
        named = draft_model.meta("tokenizer.ggml.mask_token_id")  # llama.cpp drops an id past the vocabulary
        if named is not None:
            raise GGUFSpecError(f"{draft_model.path}: its mask token id {named} (tokenizer.ggml.mask_token_id) is past "
                                f"the vocabulary's {draft_model.n_vocab} tokens, so it cannot fill a DFlash block: "
                                "this file is broken; convert the draft again")
        raise GGUFSpecError(f"{draft_model.path}: names no mask token (tokenizer.ggml.mask_token_id), which a "
                            "DFlash draft fills its block with: this file is incomplete")
    return ids, block, mask


class DflashHead(Follower):
    """A DFlash draft on its own context, following the target Context `target` (see the module)."""

    name = "dflash"
    _batches = ("_inject", "_block")

    def __init__(self, target, draft_model, *, n_threads: int | None = None, share: "DflashHead | None" = None):
        self.layer_ids, self.block_size, self.mask_id = check_dflash(target.model, draft_model)
        check_target_on_host(target.model, draft_model, "DFlash")
        self.max_draft = self.block_size - 1  # the block is [last, mask x n]
        self.target, self.draft_model, self.X = target, draft_model, ext()
        self.n_vocab = target.n_vocab
        self.n_embd_target = int(C.llama_model_n_embd(target.model._model))
        self._ctx, self.buffers = (share._ctx, {}) if share else follower_context(
            target, draft_model, "the DFlash draft's context", n_threads=n_threads)
        self._owner = share is None
        self.n_ubatch = int(C.llama_n_ubatch(self._ctx))  # a non-causal batch past it aborts inside llama.cpp
        if self.block_size > self.n_ubatch:
            if self._owner:
                C.llama_free(self._ctx)
            self._ctx = None
            raise GGUFSpecError(f"{draft_model.path}: its block of {self.block_size} tokens is larger than the "
                                f"batch (-b {self.n_ubatch}); use -b {self.block_size} or more")
        self.X.llama_set_embeddings_nextn(self._ctx, True, True)
        C.llama_set_causal_attn(self._ctx, draft_model.meta("dflash.attention.causal") == "true")
        self._mem = C.llama_get_memory(self._ctx)
        seq_id = getattr(target, "seq_id", 0)
        self._inject = RowBatch(self.n_ubatch, len(self.layer_ids) * self.n_embd_target, tokens=False, seq_id=seq_id)
        self._inject.out[:] = 0
        self._block = RowBatch(self.block_size, 0, tokens=True, seq_id=seq_id)
        self.n_past = 0  # the target's positions injected here
        self.synced = True  # it holds exactly the target's positions (lost while inactive; back at a clear)
        self.active = False
        self._drafted = self._next = 0  # the block under way: its rows, and the next row step() returns
        self.seconds = {"inject": 0.0, "draft": 0.0}
        self.rows_fed = 0
        self._attach(target, share)

    # -- following the target -------------------------------------------------------------------

    def _follow(self, on: bool) -> None:
        extract_layers(self, on)  # the inputs of the layers this draft reads

    def ready(self, n_past: int) -> bool:
        """Whether a draft can start at position n_past (this context holds the target's n_past positions)."""
        return self.active and self.synced and self.n_past == n_past and n_past > 0

    def process(self, start: int, tokens: np.ndarray, at: int = 0) -> None:
        """The target decoded `tokens` at start.. (rows at.. of its last batch): inject its layers' rows at those
        positions."""
        if not self.active or not self.synced or start != self.n_past:
            self.synced = False
            return
        m, w = len(tokens), self.n_embd_target
        layers, batch = layer_rows(self, m, at), self._inject
        for i in range(0, m, self.n_ubatch):
            n = min(self.n_ubatch, m - i)
            for k, rows in enumerate(layers):
                batch.rows[:n, k * w : (k + 1) * w] = rows[i : i + n]
            batch.pos[:n] = np.arange(start + i, start + i + n, dtype=np.int32)
            batch.batch.n_tokens = n
            began = time.perf_counter()
            decode_failed(llama_decode(self._ctx, batch.batch), n, start + i, self.target.n_ctx)
            self.seconds["inject"] += time.perf_counter() - began
        self.rows_fed += m
        self.n_past = start + m

    def cut(self, n_keep: int) -> None:
        """The target forgot its positions from n_keep on: so does this context."""
        if n_keep == 0:
            self._forget(0)
            self.n_past, self.synced = 0, True
        elif n_keep < self.n_past:
            self._forget(n_keep)
            self.n_past = n_keep

    # -- drafting ---------------------------------------------------------------------------------

    def begin(self, token: int, position: int, n: int = 1) -> np.ndarray:
        """A draft of up to n tokens (at most block size - 1): one decode of [token, mask x n] at `position` (the
        target's n_past) onwards. Returns the first drafted position's logits (a view, valid until the next call)."""
        n = max(1, min(n, self.max_draft, self.target.n_ctx - position - 1))
        batch = self._block
        batch.token[0], batch.token[1 : n + 1] = token, self.mask_id
        batch.pos[: n + 1] = np.arange(position, position + n + 1, dtype=np.int32)
        batch.out[: n + 1] = 1  # every row, as llama.cpp asks (its graph reads the outputs as the whole block)
        batch.batch.n_tokens = n + 1
        began = time.perf_counter()
        decode_failed(llama_decode(self._ctx, batch.batch), n + 1, position, self.target.n_ctx)
        self.seconds["draft"] += time.perf_counter() - began
        self._drafted, self._next = n, 1
        return self._row(1)

    def step(self, token: int) -> np.ndarray:
        """The next drafted position's logits (the block was decoded at once: `token` does not change them)."""
        self._next += 1
        if self._next > self._drafted:
            raise GGUFSpecError("the DFlash block is used up: begin() was asked for fewer tokens")
        return self._row(self._next)

    def _row(self, i: int) -> np.ndarray:
        view = np.ctypeslib.as_array(C.llama_get_logits_ith(self._ctx, i), shape=(1, self.n_vocab))
        view.flags.writeable = False
        return view[0]

    def end(self) -> None:
        """Forget the block's positions (the verify batch injects the target's own states there)."""
        if self._drafted:
            self._forget(self.n_past)
            self._drafted = self._next = 0
