"""The speculative decoding loop: one step function and a generator of rounds.

A round: the drafter proposes up to k tokens; the target runs once over [last] + draft with a
logits row per position; verification keeps a prefix and adds one token of the target's own;
the target's KV cache is rewound past the kept tokens. k = 0 is plain target decoding through
the same code, so baselines are like for like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .backend import Context
from .errors import ContextFullError
from .sampling import SamplingParams, near_ties, probs_from_logits, sample, top2_gap, verify, verify_greedy

# On CPU, llama.cpp's repacked Q4_K kernels compute batches of >= 4 rows with a GEMM whose
# rounding moves the top-1/top-2 logit gap by up to 0.32 on the Qwen2.5-Coder pair, while
# batches of 2-3 are bit-identical (scripts/measure_batch_drift.py). A batched argmax this
# close to the runner-up is re-checked by one-token decoding.
DEFAULT_TIE_MARGIN = 0.5


@dataclass
class Round:
    """What one step produced."""

    tokens: list[int]  # accepted drafts + the target's token
    n_drafted: int
    n_accepted: int
    draft_seconds: float
    target_seconds: float
    source: str = "target"  # which drafter proposed ("target" when none did)
    ties_settled: int = 0
    tie_gaps: list[float] = field(default_factory=list)


def _one_hot_rows(tokens: list[int], n_vocab: int) -> np.ndarray:
    q = np.zeros((len(tokens), n_vocab))
    q[np.arange(len(tokens)), tokens] = 1.0
    return q


def _verify_rows(target: Context, inputs: list[int], chunk: int, draft_tokens: list[int]) -> np.ndarray:
    """Greedy target rows for `inputs`, decoded in chunks of at most `chunk` tokens.

    Stops after the first chunk holding a rejection: later rows could not be used anyway.
    """
    rows = []
    for start in range(0, len(inputs), chunk):
        part = target.decode(inputs[start:start + chunk], logits="all")
        choice = part.argmax(axis=1)
        rows.append(part.copy())  # the view dies with the next decode
        drafts = draft_tokens[start:start + len(part)]
        if any(int(c) != int(d) for c, d in zip(choice, drafts)) or len(drafts) < len(part):
            break
    return np.concatenate(rows)


def speculative_step(target: Context, drafter, history: list[int], k: int, params: SamplingParams,
                     rng: np.random.Generator, *, tie_margin: float = DEFAULT_TIE_MARGIN, draft_min: int = 0,
                     exact_batch: int = 1, exact: bool = False) -> Round:
    """Run one round from `history` (whose last token the target has not seen yet).

    exact_batch: the largest batch this backend computes bit-identically to one-token decoding.
    Greedy rounds with larger batches re-check near-ties one token at a time; with exact=True
    they are verified in chunks of exact_batch instead, which makes the output identical by
    construction. On return the target's KV cache holds history[:-1] + the round's tokens but the last.
    """
    n_past = len(history) - 1
    assert target.n_past == n_past, (target.n_past, n_past)
    k = min(k, target.n_ctx - n_past - 1, target.n_batch - 1)
    if k < 0:
        raise ContextFullError(f"the context is full after {len(history)} tokens (n_ctx={target.n_ctx}); raise -c or lower -n")
    draft_tokens, q, draft_seconds, source = [], None, 0.0, "target"
    if drafter is not None and k > 0:
        draft = drafter.propose(history, k, params, rng)
        draft_tokens, q, draft_seconds = draft.tokens[:k], draft.q, draft.seconds
        if len(draft_tokens) < draft_min:  # too short to be worth a batch (llama.cpp's --draft-min)
            draft_tokens = []
        source = draft.source if draft_tokens else "target"

    t0 = time.perf_counter()
    inputs = [history[-1]] + draft_tokens
    ties_settled, gaps = 0, []
    if params.greedy:
        if exact and len(inputs) > exact_batch:
            logits = _verify_rows(target, inputs, max(1, exact_batch), draft_tokens)
        else:
            logits = target.decode(inputs, logits="all")
        choice = logits.argmax(axis=1)
        n_accepted, next_token = verify_greedy(draft_tokens, choice)
        if not exact and len(inputs) > exact_batch:
            tied = np.flatnonzero(near_ties(logits[: n_accepted + 1], tie_margin))
            if len(tied):
                # Settle it as target-only decoding would: this round's inputs up to the tied row,
                # one token at a time, so neither the row nor the K/V before it come from the batch.
                j = int(tied[0])
                gaps.append(top2_gap(logits[j]))
                target.truncate(n_past)
                for x in inputs[: j + 1]:
                    row = target.decode([x], logits="last")[0]
                # From the tie on, verify one token at a time while the drafts keep matching.
                i = j
                while i < len(draft_tokens) and int(np.argmax(row)) == draft_tokens[i]:
                    row = target.decode([draft_tokens[i]], logits="last")[0]
                    i += 1
                n_accepted, next_token, ties_settled = i, int(np.argmax(row)), 1
    else:
        logits = target.decode(inputs, logits="all")
        p = np.stack([probs_from_logits(row, params) for row in logits])
        if draft_tokens:
            q_rows = _one_hot_rows(draft_tokens, target.n_vocab) if q is None else np.stack(q[: len(draft_tokens)])
            n_accepted, next_token = verify(draft_tokens, q_rows, p, rng)
        else:
            n_accepted, next_token = 0, sample(p[0], rng)
    target.truncate(n_past + n_accepted + 1)
    target_seconds = time.perf_counter() - t0
    return Round(draft_tokens[:n_accepted] + [next_token], len(draft_tokens), n_accepted,
                 draft_seconds, target_seconds, source, ties_settled, gaps)


def prefill(target: Context, prompt_tokens: list[int]) -> float:
    """Evaluate all prompt tokens but the last (which the first round feeds); return seconds."""
    start = time.perf_counter()
    target.clear()
    if len(prompt_tokens) > 1:
        target.decode(prompt_tokens[:-1], logits="none")
    return time.perf_counter() - start
