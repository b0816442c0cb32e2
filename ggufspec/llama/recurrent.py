"""Rewinding a memory that cannot be cut: a recurrent state (mamba2; the recurrent layers of a hybrid)
has no positions to drop, so llama.cpp refuses a partial `llama_memory_seq_rm` there. The state is saved
before each decode (its recurrent part only: `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`) and a rewind restores
the one saved at the latest position up to the cut; the context then cuts the attention part there and
decodes the kept tokens after it again."""

from __future__ import annotations

import ctypes

from .runtime import C

PARTIAL = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def cannot_be_cut(model_ptr) -> bool:
    """Whether a llama.cpp model keeps a recurrent state (recurrent or hybrid)."""
    return bool(model_ptr) and bool(C.llama_model_is_recurrent(model_ptr) or C.llama_model_is_hybrid(model_ptr))


class Checkpoints:
    """The recurrent state of sequence 0 at recent positions, oldest first (at most `limit`)."""

    def __init__(self, limit: int = 32):
        self.limit = limit
        self.saved: list[tuple[int, ctypes.Array]] = []

    def save(self, ctx, position: int) -> None:
        if self.saved and self.saved[-1][0] == position:
            return
        size = C.llama_state_seq_get_size_ext(ctx, 0, PARTIAL)
        state = (ctypes.c_uint8 * size)()
        C.llama_state_seq_get_data_ext(ctx, state, size, 0, PARTIAL)
        self.saved.append((position, state))
        del self.saved[:-self.limit]

    def restore(self, ctx, n_keep: int) -> int | None:
        """Restore the state saved at the latest position up to n_keep and return that position (None: no
        such state; the caller starts over). Later states are dropped."""
        while self.saved and self.saved[-1][0] > n_keep:
            self.saved.pop()
        if not self.saved:
            return None
        position, state = self.saved[-1]
        C.llama_state_seq_set_data_ext(ctx, state, len(state), 0, PARTIAL)
        return position

    def clear(self) -> None:
        self.saved.clear()
