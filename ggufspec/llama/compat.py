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


def byte_level_chars() -> list[str]:
    """GPT-2's byte-to-character map (llama.cpp's unicode_byte_to_utf8): the text a byte-level BPE token has for
    each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def cannot_write_every_text(model) -> str | None:
    """Why llama.cpp's tokenizer of this vocabulary would abort on some text (None: it writes any bytes). A text it
    has no token for goes out as byte tokens, looked up with `unordered_map::at` (llama_vocab::byte_to_token): a
    vocabulary without them throws there, inside C code."""
    texts = {model.token_text(t) for t in range(model.n_vocab)}
    if model.vocab_type in ("spm", "ugm"):
        missing = [b for b in range(256) if f"<0x{b:02X}>".encode() not in texts and not (b < 0x80 and bytes([b]) in texts)]
    elif model.vocab_type in ("bpe", "wpm"):
        missing = [b for b, c in enumerate(byte_level_chars()) if c.encode() not in texts]
    else:
        return f"its {model.vocab_type} vocabulary is not one ggufspec tokenizes text for"
    if missing:
        return (f"its {model.vocab_type} vocabulary has no token for {len(missing)} of the 256 bytes (byte 0x{missing[0]:02X} "
                "first), and llama.cpp's tokenizer aborts on text that needs one")
    return None


def text_drafting_problem(target: Model, draft: Model) -> str | None:
    """Why a draft of another vocabulary cannot draft through text for this target (None: it can): a tokenizer of
    either that would abort on some text (see cannot_write_every_text)."""
    for role, model in (("draft", draft), ("target", target)):
        problem = cannot_write_every_text(model)
        if problem:
            return f"the {role} cannot: {problem}"
    return None


def text_pairing(target: Model, draft: Model) -> str | None:
    """How the draft's vocabulary differs from the target's (None: the same, or padded within llama.cpp's rule),
    where it can draft through text (textdraft); one GGUFSpecError line where it cannot."""
    difference = incompatibility(target, draft)
    problem = text_drafting_problem(target, draft) if difference else None
    if problem:
        raise GGUFSpecError(f"{draft.path} cannot draft for {target.path}: {difference}, and across tokenizers "
                            f"{problem}; pick a draft with byte tokens (most GGUF models have them)")
    return difference
