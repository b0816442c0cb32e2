"""What a head following the target costs (an MTP head, an EAGLE-3 or DFlash draft: `llama.heads`, `llama.hidden`,
`llama.dflash`), measured for `measure.costs_for`, and the key its measurement is cached under."""

from __future__ import annotations

import time
from pathlib import Path


def probe_tokens(ctx, n: int) -> list[int]:
    """n ordinary vocabulary entries to time decodes with, away from the special tokens at either end."""
    lo = min(100, ctx.n_vocab // 4)
    return [lo + (i * 7919) % max(1, ctx.n_vocab // 2) for i in range(n)]


def measure_head_step(head, n: int = 4, repeats: int = 2) -> dict:
    """What a head reading the target's hidden states costs (an MTP head, an EAGLE-3 or DFlash draft): a draft of
    n tokens, and the head's catch-up on the n verified rows (it follows every row the target verifies), after a
    warm-up: {"token": seconds per drafted token}, and for a head that drafts a block at once (max_draft), the
    block's seconds as {"round": ...} with only the catch-up per token."""
    target = head.target
    n = min(n, getattr(head, "max_draft", None) or n)
    tokens = probe_tokens(target, 16 + n)
    was = head.active
    head.activate(True)
    try:
        target.clear()
        target.decode(tokens[:16], logits="none")
        base = target.n_past
        best = (float("inf"), 0.0)
        for _ in range(repeats + 1):  # the first is a warm-up
            start = time.perf_counter()
            logits = head.begin(tokens[15], base, n)
            for x in tokens[16:16 + n - 1]:
                logits = head.step(x)
            head.end()
            drafted = time.perf_counter() - start
            caught = _catch_up(head)
            target.decode(tokens[16:16 + n], logits="all")
            catch_up = _catch_up(head) - caught
            target.truncate(base)
            best = min(best, (drafted + catch_up, catch_up))
        del logits
        total, catch_up = best
        if getattr(head, "max_draft", None):
            return {"token": catch_up / n, "round": total - catch_up}
        return {"token": total / n}
    finally:
        target.clear()
        head.activate(was)


def _catch_up(head) -> float:
    """Seconds a head has spent following the target (every kind of its time but drafting)."""
    return sum(v for k, v in head.seconds.items() if k != "draft")


def head_key(tkey: str, head) -> str:
    """A head's cache entry: the target's, and for a draft file its name and size (the MTP head: the target's own)."""
    model = getattr(head, "draft_model", None)
    if model is None:
        return tkey + "|mtp"
    return f"{tkey}|{head.name}:{Path(model.path).name}:{Path(model.path).stat().st_size}"
