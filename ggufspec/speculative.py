"""The speculative decoding loop: one step function and a generator of rounds.

A round: the drafter proposes up to draft_max tokens; the target runs once over [last] + draft
with a logits row per position; verification keeps a prefix and adds one token of the target's
own; the target's KV cache is rewound past the kept tokens (in `finally`: an exception never
leaves rejected tokens behind). A round without a draft is plain target decoding through the
same code, so baselines are like for like. Notation: p target, q draft (Leviathan et al. 2023).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import numpy as np

from .core import Draft, Round, Target
from .drafters import Drafter
from .errors import ContextFullError
from .sampling import PositionNoise, Picker, SamplingParams, probs_from_logits, sample, verify
from .verification import Verification


def _propose(drafter: Drafter | None, history: list[int], draft_max: int, draft_min: int, params: SamplingParams,
             rng: np.random.Generator, picker: Picker | None) -> tuple[Draft, list[int]]:
    """The drafter's proposal, and the tokens of it the round verifies."""
    if drafter is None or draft_max <= 0:
        return Draft(tokens=[]), []
    coupled = {"noise": picker.noise} if picker is not None and picker.noise is not None else {}
    draft = drafter.propose(history, draft_max, params, rng, **coupled)
    draft_tokens = draft.tokens[:draft_max]
    # too short to be worth a batch (llama.cpp's --draft-min)
    return draft, draft_tokens if len(draft_tokens) >= draft_min else []


def _verify_rejection(target: Target, inputs: list[int], draft: Draft, draft_tokens: list[int],
                      params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """Leviathan's rejection rule: the output follows p whatever q is."""
    p = np.stack([probs_from_logits(row, params) for row in target.decode(inputs, logits="all")])
    if not draft_tokens:
        return 0, sample(p[0], rng)
    q = _one_hot(draft_tokens, target.n_vocab) if draft.q is None else np.stack(draft.q[: len(draft_tokens)])
    return verify(draft_tokens, q, p, rng)


def speculative_step(target: Target, drafter: Drafter | None, history: list[int], draft_max: int,
                     params: SamplingParams, rng: np.random.Generator, *, draft_min: int = 0,
                     verification: Verification = Verification(), noise: PositionNoise | None = None) -> Round:
    """Run one round from `history` (whose last token the target has not seen yet): draft, verify,
    truncate. Greedy rounds keep drafts equal to the argmax; sampled rounds with `noise` (the
    coupled rule) keep drafts equal to the target's coupled sample; other sampled rounds follow
    Leviathan's rejection rule with `rng`.

    The history must fit the context (`check_room`). On return the target's KV cache holds history[:-1]
    + the round's tokens but the last; on an exception, history[:-1] as before.
    """
    n_past = len(history) - 1
    assert target.n_past == n_past, (target.n_past, n_past)
    draft_max = max(0, min(draft_max, target.n_ctx - n_past - 1, target.n_batch - 1))
    picker = Picker(params, noise) if params.greedy or noise is not None else None
    if picker is not None and picker.noise is not None:  # this round's positions, and the next round's first
        picker.noise.prefetch(range(n_past + 1, n_past + 3 + draft_max))
    draft, draft_tokens = _propose(drafter, history, draft_max, draft_min, params, rng, picker)
    inputs = [history[-1]] + draft_tokens
    t0, n_keep, gaps = time.perf_counter(), n_past, []
    try:
        # without a draft nothing of this decode is rewound: a recurrent target saves no state for it
        with target.no_rewind() if not draft_tokens else contextlib.nullcontext():
            if picker is not None:  # greedy or coupled: keep drafts equal to the target's picks
                n_accepted, next_token, gaps = verification.verify(target, inputs, draft_tokens, n_past, picker)
            else:
                n_accepted, next_token = _verify_rejection(target, inputs, draft, draft_tokens, params, rng)
        n_keep = n_past + n_accepted + 1
    finally:
        target.truncate(n_keep)
    return Round(tokens=draft_tokens[:n_accepted] + [next_token], n_past=n_past, n_drafted=len(draft_tokens),
                 n_accepted=n_accepted, draft_seconds=draft.seconds, target_seconds=time.perf_counter() - t0,
                 draft=draft, ties_settled=len(gaps), tie_gaps=gaps)


def check_room(target: Target, history: list[int], n_prompt: int) -> None:
    """The one context-full check: the history's last token takes position len(history) - 1, which must
    exist. ContextFullError carries the tokens generated so far."""
    if len(history) > target.n_ctx:
        raise ContextFullError(
            f"the context filled up after {len(history) - n_prompt} generated tokens (prompt {n_prompt}, "
            f"n_ctx={target.n_ctx}); raise -c or lower -n", history[n_prompt:])


def _one_hot(tokens: list[int], n_vocab: int) -> np.ndarray:
    q = np.zeros((len(tokens), n_vocab))
    q[np.arange(len(tokens)), tokens] = 1.0
    return q


def prefill(target: Target, prompt_tokens: list[int], reuse: bool = False) -> tuple[np.ndarray, int]:
    """Evaluate the prompt in one batch, its last token included, as llama.cpp's own programs and
    `Llama` do (the numerics of a batch differ slightly from one-token steps, and at a near-tie so
    would the text). Returns the last position's logits, from which the first token is drawn, and
    how many prompt tokens were reused from the KV cache.

    reuse: keep what the cache already holds of this prompt, as far as it was computed exactly as a
    cold start computes it (`Context.reusable`: whole aligned batches), so the result is bit-identical.
    """
    keep = target.start(prompt_tokens, reuse=reuse)
    with target.no_rewind():  # rounds never rewind into the prompt
        return target.decode(prompt_tokens[keep:], logits="last")[0].copy(), keep


def first_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, t: int = 0,
                noise: PositionNoise | None = None) -> int:
    """The token the prompt's last row gives (position t): the argmax, the coupled sample, or a sample of p."""
    if params.greedy or noise is not None:
        return Picker(params, noise).pick(logits, t)
    return sample(probs_from_logits(logits, params), rng)


def rounds(target: Target, drafter: Drafter | None, prompt_tokens: list[int], logits: np.ndarray,
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
    yield Round(tokens=history[-1:], n_past=len(prompt_tokens))
    while n_out < max_tokens:
        check_room(target, history, len(prompt_tokens))
        start = time.perf_counter()
        r = speculative_step(target, drafter, history, min(draft_max, max_tokens - n_out - 1), params, rng,
                             draft_min=draft_min, verification=verification, noise=noise)
        if drafter is not None:
            drafter.observe(r)
        r.seconds = time.perf_counter() - start
        history.extend(r.tokens)
        n_out += len(r.tokens)
        yield r
