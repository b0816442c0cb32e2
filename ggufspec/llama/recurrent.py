"""Rewinding a memory that cannot be cut: a recurrent state (mamba2; the recurrent layers of a hybrid)
has no positions to drop, so llama.cpp refuses a partial `llama_memory_seq_rm` there. The state is saved
before each decode that may be rewound (its recurrent part only: `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`), and a
rewind restores the one saved at the latest position up to the cut; the context then cuts the attention
part there and decodes the kept tokens after it again. A draft that decodes one token at a time has a state
saved at every position, so its rewinds decode nothing again.

Some architectures (lfm2, qwen35, nemotron-h; llama.cpp's `llm_arch_supports_rs_rollback`) can also keep the
states of the last `n_rs_seq` positions themselves: a rewind into the last decoded batch that keeps at least two
of its tokens (an accepted draft) is then a plain cut, nothing decoded again, the kept tokens' state the batch's
own (as a KV cache keeps a batch's rows). A rewind that removes a whole batch is not exact that way (its logits
come out different, though llama.cpp says it succeeded), and one keeping the first token alone (every draft
rejected) would keep that token's state as the batch computed it, which differs from one-token decoding in the
last bits (F32 states, unlike a KV cache's F16 rows, keep them): a draft that never agrees moved the text off
the target's after ~28 tokens (issue 40). Those, and any beyond n_rs_seq positions, go the checkpoint way; the
state is saved before every decode that may be rewound here too."""

from __future__ import annotations

import contextlib
import ctypes

from ..errors import GGUFSpecError
from .runtime import C

PARTIAL = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
# The positions a target's context asks llama.cpp to keep states for (n_rs_seq): a rejection in a verify batch of up
# to this many drafts rewinds by a cut. Each costs a copy of the recurrent state in memory.
ROLLBACK_ROWS = 8


def fitted_rollback(wanted: int, n_ubatch: int) -> int:
    """The rollback rows (n_rs_seq) a context with micro-batches of n_ubatch tokens can keep: llama.cpp holds a
    batch's last n_rs_seq + 1 tokens in one micro-batch and aborts unless n_ubatch > n_rs_seq + 1
    (`split_equal`'s n_keep_tail), on every architecture it rolls back. 0: checkpoints only."""
    return max(0, min(int(wanted), int(n_ubatch) - 2))


def cannot_be_cut(model_ptr) -> bool:
    """Whether a llama.cpp model keeps a recurrent state (recurrent or hybrid)."""
    return bool(model_ptr) and bool(C.llama_model_is_recurrent(model_ptr) or C.llama_model_is_hybrid(model_ptr))


class Checkpoints:
    """The recurrent state of one sequence (seq_id) at recent positions, oldest first (at most `limit`)."""

    def __init__(self, rollback: int = 0, limit: int = 32, seq_id: int = 0):
        self.seq_id = seq_id
        self.rollback = rollback  # llama.cpp's n_rs_seq for this context (0: none)
        self.batch_start = 0  # where the last llama_decode's batch began
        self.limit = limit
        self.saved: list[tuple[int, ctypes.Array]] = []
        self.active = True
        self._spare: list[ctypes.Array] = []  # buffers of dropped states, used again (a state may be megabytes)

    @contextlib.contextmanager
    def paused(self):
        """Save nothing while this lasts (the caller will not rewind into what it decodes now)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    def save(self, ctx, position: int) -> None:
        """Save the state before a decode at `position`, even where llama.cpp's rollback covers a rewind keeping
        one of the decoded tokens: a rewind of the whole batch (a near-tie at its first row) needs this one."""
        if not self.active or (self.saved and self.saved[-1][0] == position):
            return
        size = C.llama_state_seq_get_size_ext(ctx, self.seq_id, PARTIAL)
        state = next((b for b in self._spare if len(b) == size), None)
        if state is None:
            state = (ctypes.c_uint8 * size)()
        else:
            self._spare.remove(state)
        C.llama_state_seq_get_data_ext(ctx, state, size, self.seq_id, PARTIAL)
        self.saved.append((position, state))
        while len(self.saved) > self.limit:
            self._drop(0)

    def restore(self, ctx, n_keep: int) -> int | None:
        """Restore the state saved at the latest position up to n_keep and return that position (None: no
        such state; the caller starts over). Later states are dropped."""
        self._drop_after(n_keep)
        if not self.saved:
            return None
        position, state = self.saved[-1]
        C.llama_state_seq_set_data_ext(ctx, state, len(state), self.seq_id, PARTIAL)
        return position

    def rewind(self, context, n_keep: int) -> None:
        """Rewind a backend.Context (or one of its sequences) to n_keep tokens: restore, cut the attention part,
        decode the rest again."""
        # llama.cpp rolls its state back itself where the rewind keeps a draft of the batch (whose state is the
        # batch's either way); one keeping the batch's first token alone decodes it again by itself, as target-only
        # decoding does: a batch's state differs in the last bits, and at a later near-tie so would the text
        if (self.rollback and context.n_past - n_keep <= self.rollback and n_keep > self.batch_start + 1
                and context.cut(n_keep)):
            self._drop_after(n_keep)
            return
        replay = context.tokens[:n_keep]
        position = self.restore(context._ctx, n_keep)
        if position is None:
            context.clear()
        elif not context.cut(position):
            raise GGUFSpecError(f"llama.cpp could not rewind the memory to position {position}")
        if context.n_past < n_keep:
            context.decode(replay[context.n_past:], logits="none")

    def _drop(self, i: int) -> None:
        self._spare = [self.saved.pop(i)[1]] + self._spare[:1]

    def _drop_after(self, position: int) -> None:
        """Drop the states saved after `position` (-1: all of them)."""
        while self.saved and self.saved[-1][0] > position:
            self._drop(-1)

    def clear(self) -> None:
        self._drop_after(-1)
