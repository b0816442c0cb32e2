"""Can this draft serve this target? The checks llama.cpp's common/speculative.cpp makes."""

from __future__ import annotations

from .backend import Model
from ..errors import GGUFSpecError

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


def _types_differ(target: str, draft: str) -> str | None:
    return f"vocabulary types differ (target {target}, draft {draft})" if target != draft else None


def _sizes_differ(target: int, draft: int) -> str | None:
    diff = abs(target - draft)
    if diff > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"vocabulary sizes differ by {diff} (target {target}, draft {draft}; at most {VOCAB_MAX_SIZE_DIFFERENCE})"
    return None


def header_incompatibility(target, draft) -> str | None:
    """What two GGUF headers (gguf_info.GGUFInfo) already show of the rule below, before any vocabulary loads (the
    tokenizer model's name, the token count); None where only `incompatibility` on the loaded vocabularies can tell."""
    return _types_differ(target.vocab_type, draft.vocab_type) or _sizes_differ(target.n_vocab, draft.n_vocab)


def incompatibility(target: Model, draft: Model) -> str | None:
    """None if the pair can be used together, else the failed check in one sentence."""
    if _types_differ(target.vocab_type, draft.vocab_type):
        return _types_differ(target.vocab_type, draft.vocab_type)
    if target.add_bos != draft.add_bos or (target.add_bos and target.bos != draft.bos):
        return f"BOS handling differs (target add_bos={target.add_bos} bos={target.bos}, draft add_bos={draft.add_bos} bos={draft.bos})"
    if target.add_eos != draft.add_eos or (target.add_eos and target.eos != draft.eos):
        return f"EOS handling differs (target add_eos={target.add_eos} eos={target.eos}, draft add_eos={draft.add_eos} eos={draft.eos})"
    if _sizes_differ(target.n_vocab, draft.n_vocab):
        return _sizes_differ(target.n_vocab, draft.n_vocab)
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(target.n_vocab, draft.n_vocab)):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            return f"token {i} differs (target {a.decode('utf-8', 'replace')!r}, draft {b.decode('utf-8', 'replace')!r})"
    return None


def check_compatible(target: Model, draft: Model) -> None:
    reason = incompatibility(target, draft)
    if reason:
        raise GGUFSpecError(f"{draft.path} cannot draft for {target.path}: {reason}; pick a draft from the same model family")
