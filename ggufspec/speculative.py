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
from dataclasses import dataclass
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


@dataclass(kw_only=True)
class Plan:
    """A round drafted and not yet verified: the rows the target must decode (`inputs`: [last] + draft)."""

    n_past: int
    draft: Draft
    draft_tokens: list[int]
    inputs: list[int]
    picker: Picker | None  # greedy or coupled rounds; None: Leviathan's rule

    def cut(self, n: int) -> "Plan":
        """This plan verifying only the first n drafted tokens (a batch of several sequences pays for fewer rows)."""
        return Plan(n_past=self.n_past, draft=self.draft, draft_tokens=self.draft_tokens[:n],
                    inputs=self.inputs[:n + 1], picker=self.picker)


def plan_round(target: Target, drafter: Drafter | None, history: list[int], draft_max: int,
               params: SamplingParams, rng: np.random.Generator, *, draft_min: int = 0,
               noise: PositionNoise | None = None) -> Plan:
    """A round's first half: the drafter's proposal from `history` (whose last token the target has not seen)."""
    n_past = len(history) - 1
    assert target.n_past == n_past, (target.n_past, n_past)
    draft_max = max(0, min(draft_max, target.n_ctx - n_past - 1, target.n_batch - 1))
    picker = Picker(params, noise) if params.greedy or noise is not None else None
    if picker is not None and picker.noise is not None:  # this round's positions, and the next round's first
        picker.noise.prefetch(range(n_past + 1, n_past + 3 + draft_max))
    draft, draft_tokens = _propose(drafter, history, draft_max, draft_min, params, rng, picker)
    return Plan(n_past=n_past, draft=draft, draft_tokens=draft_tokens, inputs=[history[-1]] + draft_tokens,
                picker=picker)


def verify_round(target: Target, plan: Plan, params: SamplingParams, rng: np.random.Generator, *,
                 verification: Verification = Verification(), rows: np.ndarray | None = None,
                 decoded_seconds: float = 0.0) -> Round:
    """A round's second half: the target decodes plan.inputs (or has: `rows`, their logits from a batch shared
    with other sequences, already in its cache, in decoded_seconds), verification keeps a prefix and adds the
    target's own token, and the cache is rewound past the kept tokens (in `finally`: an exception never leaves
    rejected ones)."""
    n_past, draft_tokens = plan.n_past, plan.draft_tokens
    t0, n_keep, gaps = time.perf_counter(), n_past, []
    judged = target if rows is None else Decoded(target, plan.inputs, rows)
    try:
        # without a draft nothing of this decode is rewound: a recurrent target saves no state for it
        with target.no_rewind() if not draft_tokens else contextlib.nullcontext():
            if plan.picker is not None:  # greedy or coupled: keep drafts equal to the target's picks
                n_accepted, next_token, gaps = verification.verify(judged, plan.inputs, draft_tokens, n_past,
                                                                   plan.picker, plan.draft.one_batch)
            else:
                n_accepted, next_token = _verify_rejection(judged, plan.inputs, plan.draft, draft_tokens, params, rng)
        n_keep = n_past + n_accepted + 1
    finally:
        target.truncate(n_keep)
    return Round(tokens=draft_tokens[:n_accepted] + [next_token], n_past=n_past, n_drafted=len(draft_tokens),
                 n_accepted=n_accepted, draft_seconds=plan.draft.seconds,
                 target_seconds=decoded_seconds + time.perf_counter() - t0, draft=plan.draft, ties_settled=len(gaps),
                 tie_gaps=gaps, shared=rows is not None)


class Decoded:
    """A target whose next decode of `inputs` was done already, in a batch of several sequences: that decode
    answers with its rows; any other (a near-tie decoded again by itself) goes to the target."""

    def __init__(self, target: Target, inputs: list[int], rows: np.ndarray):
        self.target, self.pending = target, (list(inputs), rows)

    def decode(self, tokens, logits: str = "last"):
        if self.pending is not None:
            inputs, rows = self.pending
            self.pending = None
            assert list(tokens) == inputs and logits == "all", "a batch decoded together is verified as it was decoded"
            return rows
        return self.target.decode(tokens, logits=logits)

    def __getattr__(self, name):
        return getattr(self.target, name)


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
    plan = plan_round(target, drafter, history, draft_max, params, rng, draft_min=draft_min, noise=noise)
    return verify_round(target, plan, params, rng, verification=verification)


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
    would the text; a prompt longer than the target's prompt chunk goes in aligned chunks, as llama.cpp
    cuts it into batches). Returns the last position's logits, from which the first token is drawn, and
    how many prompt tokens were reused from the KV cache.

    reuse: keep what the cache already holds of this prompt, as far as it was computed exactly as a
    cold start computes it (`Context.reusable`: whole aligned chunks), so the result is bit-identical.
    """
    keep = target.start(prompt_tokens, reuse=reuse)
    return prefill_piece(target, prompt_tokens), keep


def prefill_piece(target: Target, prompt_tokens: list[int], chunk: int | None = None) -> np.ndarray | None:
    """Decode the prompt after what the target holds of it (after `start`): all that is left, or (chunk) only up to
    where the next aligned chunk of that many tokens ends, the piece a cold start decodes there. The last
    position's logits once the prompt is in, else None."""
    at, n = target.n_past, len(prompt_tokens)
    end = n if chunk is None else min(n, at + chunk - at % chunk)
    with target.no_rewind():  # rounds never rewind into the prompt
        out = target.decode(prompt_tokens[at:end], logits="last" if end == n else "none")
    return out[0].copy() if end == n else None


def first_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, t: int = 0,
                noise: PositionNoise | None = None) -> int:
    """The token the prompt's last row gives (position t): the argmax, the coupled sample, or a sample of p."""
    if params.greedy or noise is not None:
        return Picker(params, noise).pick(logits, t)
    return sample(probs_from_logits(logits, params), rng)


class Steps:
    """One sequence's rounds from a prefilled target (`logits`: what `prefill` returned), the loop's state kept
    between them, so that a sequence runs alone (`rounds`) or beside others sharing one batch (serving) through
    the same two halves: `plan` (check room, draft) and `finish` (verify, tell the drafter, extend the history).

    The first round is the token drawn from the prompt's last row (no decode: its time is the prompt's). Each
    later round ends with one token of the target's own, so a round drafts at most one token fewer than remain.
    """

    def __init__(self, target: Target, drafter: Drafter | None, prompt_tokens: list[int], logits: np.ndarray,
                 params: SamplingParams, rng: np.random.Generator, *, max_tokens: int, draft_max: int = 0,
                 draft_min: int = 0, verification: Verification = Verification(), noise: PositionNoise | None = None):
        self.target, self.drafter, self.params, self.rng, self.noise = target, drafter, params, rng, noise
        self.n_prompt, self.max_tokens = len(prompt_tokens), max_tokens
        self.draft_max, self.draft_min, self.verification = draft_max, draft_min, verification
        self.history = list(prompt_tokens)
        self.n_out = 0
        self._logits = logits
        self._start = 0.0

    @property
    def done(self) -> bool:
        return self.n_out >= self.max_tokens

    def first(self) -> Round:
        """The round of the prompt's last row: its token."""
        self.history.append(first_token(self._logits, self.params, self.rng, self.n_prompt, self.noise))
        self.n_out, self._logits = 1, None
        return Round(tokens=self.history[-1:], n_past=self.n_prompt)

    def plan(self, budget: int | None = None) -> Plan:
        """Draft the next round, up to `budget` tokens where a batch of several sequences allows fewer."""
        check_room(self.target, self.history, self.n_prompt)
        self._start = time.perf_counter()
        draft_max = min(self.draft_max, self.max_tokens - self.n_out - 1)
        if budget is not None:
            draft_max = min(draft_max, budget)
        return plan_round(self.target, self.drafter, self.history, draft_max, self.params, self.rng,
                          draft_min=self.draft_min, noise=self.noise)

    def finish(self, plan: Plan, rows: np.ndarray | None = None, verification: Verification | None = None,
               decoded_seconds: float = 0.0) -> Round:
        """Verify a planned round (rows: decoded already with other sequences, in decoded_seconds, judged under
        `verification`)."""
        r = verify_round(self.target, plan, self.params, self.rng, verification=verification or self.verification,
                         rows=rows, decoded_seconds=decoded_seconds)
        if self.drafter is not None:
            self.drafter.observe(r)
        r.seconds = time.perf_counter() - self._start
        self.history.extend(r.tokens)
        self.n_out += len(r.tokens)
        return r


def rounds(target: Target, drafter: Drafter | None, prompt_tokens: list[int], logits: np.ndarray,
           params: SamplingParams, rng: np.random.Generator, *, max_tokens: int, draft_max: int = 0,
           draft_min: int = 0, verification: Verification = Verification(),
           noise: PositionNoise | None = None) -> Iterator[Round]:
    """Rounds from a prefilled target until the caller stops or max_tokens are out (see `Steps`); the
    drafter hears of every verified round through `observe`."""
    if max_tokens <= 0:
        return
    steps = Steps(target, drafter, prompt_tokens, logits, params, rng, max_tokens=max_tokens, draft_max=draft_max,
                  draft_min=draft_min, verification=verification, noise=noise)
    yield steps.first()
    while not steps.done:
        yield steps.finish(steps.plan())
