"""Can this draft serve this target? The checks llama.cpp's common/speculative.cpp makes."""

from __future__ import annotations

from .backend import Model
from ..errors import GGUFSpecError

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


def incompatibility(target: Model, draft: Model) -> str | None:
    """None if the pair can be used together, else the failed check in one sentence."""
    if target.vocab_type != draft.vocab_type:
        return f"vocabulary types differ (target {target.vocab_type}, draft {draft.vocab_type})"
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        return f"BOS handling differs (target add_bos={target.add_bos} bos={target.bos}, draft add_bos={draft.add_bos} bos={draft.bos})"
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        return f"EOS handling differs (target add_eos={target.add_eos} eos={target.eos}, draft add_eos={draft.add_eos} eos={draft.eos})"
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"vocabulary sizes differ by {diff} (target {target.n_vocab}, draft {draft.n_vocab}; at most {VOCAB_MAX_SIZE_DIFFERENCE})"
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            return f"token {i} differs (target {a.decode('utf-8', 'replace')!r}, draft {b.decode('utf-8', 'replace')!r})"
    return None


def check_compatible(target: Model, draft: Model) -> None:
    reason = incompatibility(target, draft)
    if reason:
        raise GGUFSpecError(f"{draft.path} cannot draft for {target.path}: {reason}; pick a draft from the same model family")
