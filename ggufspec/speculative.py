"""The speculative decoding loop: one step function and a generator of rounds.

A round: the drafter proposes up to draft_max tokens; the target runs once over [last] + draft
with a logits row per position; verification keeps a prefix and adds one token of the target's
own; the target's KV cache is rewound past the kept tokens (in `finally`: an exception never
leaves rejected tokens behind). A round without a draft is plain target decoding through the
same code, so baselines are like for like. Notation: p target, q draft (Leviathan et al. 2023).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .backend import Context
from .drafters import Draft, Drafter
from .errors import ContextFullError
from .sampling import PositionNoise, Picker, SamplingParams, probs_from_logits, sample, verify, verify_greedy

# On CPU, llama.cpp's repacked Q4_K kernels compute batches of >= 4 rows with a GEMM whose
# rounding moves the top-1/top-2 logit gap by up to 0.32 on the Qwen2.5-Coder pair (and past 256
# cached tokens one-token flash attention splits the keys over threads, so there no batch is exact:
# scripts/measure_batch_drift.py). A batched argmax this close to the runner-up is re-checked by
# one-token decoding.
DEFAULT_TIE_MARGIN = 0.5


@dataclass
class Round:
    """What one step produced."""

    tokens: list[int]  # accepted drafts + the target's token
    n_drafted: int
    n_accepted: int
    draft_seconds: float
    target_seconds: float
    draft: Draft = field(default_factory=lambda: Draft([]))  # what the drafter proposed (before --draft-min)
    ties_settled: int = 0
    tie_gaps: list[float] = field(default_factory=list)

    @property
    def source(self) -> str:
        """Which drafter this round's verified tokens came from ("target": none)."""
        return self.draft.source if self.n_drafted else "target"


@dataclass(frozen=True)
class Verification:
    """How greedy rounds are checked. exact_batch: the largest batch this backend computes
    bit-identically to one-token decoding. exact: verify in batches of at most that size (identity by
    construction); otherwise one batch, with near-ties (top-2 gap < tie_margin) re-decoded."""

    exact_batch: int = 1
    exact: bool = False
    tie_margin: float = DEFAULT_TIE_MARGIN
    exact_kv: int | None = None  # exact_batch holds while the KV cache holds at most this many tokens
    chunk: int | None = None  # the batch size rounds longer than exact_batch are cut into (Costs.chunk; default exact_batch)

    def exact_here(self, n_kv: int) -> int:
        """The bit-exact batch size with n_kv tokens in the cache after the batch (1: none)."""
        return self.exact_batch if self.exact_kv is None or n_kv <= self.exact_kv else 1


def _verify_rows(target: Context, inputs: list[int], chunk: int, draft_tokens: list[int], picker: Picker,
                 t0: int) -> np.ndarray:
    """Target rows for `inputs`, decoded in batches of `chunk` tokens (bit-exact ones).

    Stops after the first batch holding a rejection: later rows could not be used anyway.
    """
    rows = []
    for start in range(0, len(inputs), chunk):
        part = target.decode(inputs[start:start + chunk], logits="all")
        rows.append(part.copy())  # the view dies with the next decode
        drafts = draft_tokens[start:start + len(part)]
        if len(drafts) < len(part) or picker.picks(part, t0 + start)[: len(drafts)] != drafts:
            break
    return np.concatenate(rows)


def settle_tie(target: Context, inputs: list[int], draft_tokens: list[int], n_past: int, j: int,
               picker: Picker | None = None) -> tuple[int, int]:
    """Redo a round whose batched row j was a near-tie as target-only decoding would: the inputs
    up to row j one token at a time (neither the row nor the K/V before it from the batch), then
    one token at a time while the drafts keep matching. Returns (n_accepted, next_token)."""
    picker = picker or Picker(SamplingParams())
    t0 = n_past + 1  # the position row 0 predicts
    target.truncate(n_past)
    for x in inputs[: j + 1]:
        row = target.decode([x], logits="last")[0]
    i = j
    while i < len(draft_tokens) and picker.pick(row, t0 + i) == draft_tokens[i]:
        row = target.decode([draft_tokens[i]], logits="last")[0]
        i += 1
    return i, picker.pick(row, t0 + i)


def _verify_picks(target: Context, inputs: list[int], draft_tokens: list[int], n_past: int, picker: Picker,
                  v: Verification) -> tuple[int, int, list[float]]:
    """Greedy or coupled verification: keep drafts while they equal the target's picks. Exact: in
    bit-exact batches (identity by construction); otherwise one batch, and a near-tie among the
    rows used is re-decoded one token at a time. Returns (n_accepted, next_token, tie gaps)."""
    t0 = n_past + 1
    exact_batch = v.exact_here(n_past + len(inputs))  # past exact_kv no batch is exact
    exact = v.exact and exact_batch > 1
    if exact and len(inputs) > exact_batch:
        logits = _verify_rows(target, inputs, min(v.chunk or exact_batch, exact_batch), draft_tokens, picker, t0)
    else:
        logits = target.decode(inputs, logits="all")
    n_accepted, next_token = verify_greedy(draft_tokens, picker.picks(logits, t0))
    if exact or len(inputs) <= exact_batch:
        return n_accepted, next_token, []
    tied = np.flatnonzero(picker.near_ties(logits[: n_accepted + 1], t0, v.tie_margin))
    if not len(tied):
        return n_accepted, next_token, []
    j = int(tied[0])
    gap = picker.gap(logits[j], t0 + j)
    n_accepted, next_token = settle_tie(target, inputs, draft_tokens, n_past, j, picker)
    return n_accepted, next_token, [gap]


def _verify_rejection(target: Context, inputs: list[int], draft: Draft, draft_tokens: list[int],
                      params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Leviathan's rejection rule: the output follows p whatever q is."""
    p = np.stack([probs_from_logits(row, params) for row in target.decode(inputs, logits="all")])
    if not draft_tokens:
        return 0, sample(p[0], rng)
    q = _one_hot(draft_tokens, target.n_vocab) if draft.q is None else np.stack(draft.q[: len(draft_tokens)])
    return verify(draft_tokens, q, p, rng)


def speculative_step(target: Context, drafter: Drafter | None, history: list[int], draft_max: int,
                     params: SamplingParams, rng: np.random.Generator, *, draft_min: int = 0,
                     verification: Verification = Verification(), noise: PositionNoise | None = None) -> Round:
    """Run one round from `history` (whose last token the target has not seen yet): draft, verify,
    truncate. Greedy rounds keep drafts equal to the argmax; sampled rounds with `noise` (the
    coupled rule) keep drafts equal to the target's coupled sample; other sampled rounds follow
    Leviathan's rejection rule with `rng`.

    On return the target's KV cache holds history[:-1] + the round's tokens but the last; on an
    exception, history[:-1] as before.
    """
    n_past = len(history) - 1
    assert target.n_past == n_past, (target.n_past, n_past)
    draft_max = min(draft_max, target.n_ctx - n_past - 1, target.n_batch - 1)
    if draft_max < 0:
        raise ContextFullError(f"the context is full after {len(history)} tokens (n_ctx={target.n_ctx}); raise -c or lower -n")
    picker = Picker(params, noise) if params.greedy or noise is not None else None
    draft = Draft([])
    if drafter is not None and draft_max > 0:
        coupled = {"noise": picker.noise} if picker is not None and picker.noise is not None else {}
        draft = drafter.propose(history, draft_max, params, rng, **coupled)
    draft_tokens = draft.tokens[:draft_max]
    if len(draft_tokens) < draft_min:  # too short to be worth a batch (llama.cpp's --draft-min)
        draft_tokens = []
    inputs = [history[-1]] + draft_tokens
    t0, n_keep, gaps = time.perf_counter(), n_past, []
    try:
        if picker is not None:
            n_accepted, next_token, gaps = _verify_picks(target, inputs, draft_tokens, n_past, picker, verification)
        else:
            n_accepted, next_token = _verify_rejection(target, inputs, draft, draft_tokens, params, rng)
        n_keep = n_past + n_accepted + 1
    finally:
        target.truncate(n_keep)
    return Round(draft_tokens[:n_accepted] + [next_token], len(draft_tokens), n_accepted, draft.seconds,
                 time.perf_counter() - t0, draft, len(gaps), gaps)


def _one_hot(tokens: list[int], n_vocab: int) -> np.ndarray:
    q = np.zeros((len(tokens), n_vocab))
    q[np.arange(len(tokens)), tokens] = 1.0
    return q


def prefill(target: Context, prompt_tokens: list[int], reuse: bool = False) -> tuple[np.ndarray, int]:
    """Evaluate the prompt in one batch, its last token included, as llama.cpp's own programs and
    `Llama` do (the numerics of a batch differ slightly from one-token steps, and at a near-tie so
    would the text). Returns the last position's logits, from which the first token is drawn, and
    how many prompt tokens were reused from the KV cache.

    reuse: keep what the cache already holds of this prompt, as far as it was computed exactly as a
    cold start computes it (`Context.reusable`: whole aligned batches), so the result is bit-identical.
    """
    keep = target.start(prompt_tokens, reuse=reuse)
    return target.decode(prompt_tokens[keep:], logits="last")[0].copy(), keep


def first_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, t: int = 0,
                noise: PositionNoise | None = None) -> int:
    """The token the prompt's last row gives (position t): the argmax, the coupled sample, or a sample of p."""
    if params.greedy or noise is not None:
        return Picker(params, noise).pick(logits, t)
    return sample(probs_from_logits(logits, params), rng)


def rounds(target: Context, drafter: Drafter | None, prompt_tokens: list[int], logits: np.ndarray,
           params: SamplingParams, rng: np.random.Generator, *, max_tokens: int, draft_max: int = 0,
           draft_min: int = 0, verification: Verification = Verification(),
           noise: PositionNoise | None = None) -> Iterator[Round]:
    """Rounds from a prefilled target (`logits`: what `prefill` returned) until the caller stops or
    max_tokens are out.

    The first round is the token drawn from the prompt's last row (no decode: its time is the
    prompt's). Each later round ends with one token of the target's own, so a round drafts at most
    one token fewer than remain. The drafter hears of every verified round through `observe`.
    """
    if max_tokens <= 0:
        return
    history = list(prompt_tokens) + [first_token(logits, params, rng, len(prompt_tokens), noise)]
    n_out = 1
    yield Round(history[-1:], 0, 0, 0.0, 0.0)
    while n_out < max_tokens:
        if len(history) > target.n_ctx:  # the last token sits at position len - 1, which must exist
            raise ContextFullError(
                f"the context filled up after {n_out} generated tokens (prompt {len(prompt_tokens)}, "
                f"n_ctx={target.n_ctx}); raise -c or lower -n", history[len(prompt_tokens):])
        r = speculative_step(target, drafter, history, min(draft_max, max_tokens - n_out - 1), params, rng,
                             draft_min=draft_min, verification=verification, noise=noise)
        if drafter is not None:
            drafter.observe(r)
        history.extend(r.tokens)
        n_out += len(r.tokens)
        yield r
