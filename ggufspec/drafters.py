"""Candidate generators: where draft tokens come from, behind one small interface.

A drafter answers `propose(history, draft_max, params, rng, ...) -> Draft`. `history` is every token
so far (prompt + output, ending with the last accepted token, which no model has seen yet).
After the target has verified a draft, the loop calls `observe(round)`: the round carries the
`Draft` the drafter returned and how many of its tokens were accepted, so whatever a drafter
wants to learn travels with its own proposal. `reset(prompt_tokens)` starts a generation.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Callable, Mapping

import numpy as np

from .core import Draft, Round, Target
from .sampling import Picker, PositionNoise, SamplingParams, max_prob, probs_from_logits, sample

# The draft mode's draft length when --draft-max is not given (auto then drafts with the model as far as
# the measured costs say pays, up to the largest measured batch).
DRAFT_MAX = 4


class Drafter:
    """The interface, with no-op defaults: a drafter that never proposes anything."""

    name = "target"
    # One of several sequences sharing a batch (a server): a drafter with a draft model lets the model catch up on
    # a prompt only when a batch lets it draft, not with the prompt (the engine sets it; others ignore it).
    lazy_model = False
    # The heads reading the target's hidden states (MTP, EAGLE-3, DFlash) it may draft with, by name: the engine keeps
    # those following the target's decodes for this generation (AutoDrafter weighs them; others have none).
    heads: Mapping = MappingProxyType({})
    # The generation's max_tokens, where the engine knows it: auto spreads a draft model's catch-up over what is left.
    max_tokens: int | None = None

    def reset(self, prompt_tokens: list[int], *, reuse: bool = False) -> None:
        """A new generation starts from these prompt tokens (reuse: a drafter with a KV cache may keep
        what it holds of them, as far as a cold start would compute it alike)."""

    def propose(self, history: list[int], draft_max: int, params: SamplingParams, rng: np.random.Generator,
                *, noise: PositionNoise | None = None) -> Draft:
        """Up to draft_max tokens that may follow `history`. noise: sampled rounds verify by the coupled
        rule (the target keeps a draft token only if it equals its own argmax(log p + G_t)): a drafter
        that samples proposes argmax(log q + G_t) with the same noise."""
        return Draft(tokens=[])

    def observe(self, round_: Round) -> None:
        """The target verified this drafter's proposal: `round_.draft` and `round_.n_accepted`."""


class ModelDrafter(Drafter):
    """Drafts with a small model whose KV cache follows the accepted history (never re-evaluated).

    target_n_vocab: the target's vocabulary size, which may differ from the draft's (llama.cpp allows
    128 tokens either way; the shared ids are the same tokens). Proposals and q cover the shared ids
    only (q is 0 beyond the draft's vocabulary); a target token the draft does not have is fed to
    the draft as token 0 (it only makes the draft's guesses worse there, never the output).
    """

    name = "draft"
    continues_copies = True  # propose(after=...) drafts on past tokens proposed before its own (a copy)

    def __init__(self, ctx: Target, *, p_min: float = 0.0, target_n_vocab: int | None = None):
        self.ctx = ctx
        self.p_min = p_min  # a draft stops at a token it is less sure of than this (--draft-p-min), unless told otherwise
        self.target_n_vocab = target_n_vocab or ctx.n_vocab
        self.n_shared = min(ctx.n_vocab, self.target_n_vocab)
        self._committed = 0  # a prefix of the KV cache known to agree with every later history
        self._lazy_end = 0  # a lazy reset: the prompt's tokens but its last (in the draft's ids), left to the first draft
        self._seen = 0  # how much of the history (in the target's ids) the KV cache holds, as of the last draft

    def _own(self, token: int) -> int:
        """The draft's id for a target token (0 for one beyond the draft's vocabulary)."""
        return token if token < self.ctx.n_vocab else 0

    @property
    def kv_tokens(self) -> list[int]:
        """Exactly what sits in the draft's KV cache, position by position."""
        return self.ctx.tokens

    def reset(self, prompt_tokens: list[int], *, reuse: bool = False, lazy: bool = False) -> None:
        """Start a new generation: the prompt but its last token goes into the KV cache now (lazy:
        when the draft is first used). reuse: keep the cache's whole aligned batches of this prompt."""
        n_prompt, prompt_tokens = len(prompt_tokens), self._own_history(prompt_tokens)
        keep = self._committed = self.ctx.start(prompt_tokens, reuse=reuse)
        self._lazy_end = len(prompt_tokens) - 1 if lazy else 0
        self._seen = min(keep, n_prompt - 1) if lazy else n_prompt - 1
        if not lazy and len(prompt_tokens) - 1 > keep:
            with self.ctx.no_rewind():  # drafts are rewound to the history, never into the prompt
                self.ctx.decode(prompt_tokens[keep:-1], logits="none")
            self._committed = len(prompt_tokens) - 1

    def follow(self) -> None:
        """The next history may not extend the last one (a new prompt, a retry, a chat's next turn):
        the next sync keeps whatever prefix of the KV cache it shares and rewinds the rest."""
        self._committed = 0

    def _own_history(self, history: list[int]) -> list[int]:
        """The history in the draft's own ids (the same list where every target id is the draft's too)."""
        return history if self.target_n_vocab <= self.ctx.n_vocab else [self._own(t) for t in history]

    def _sync(self, history: list[int]) -> list[int]:
        """Drop rejected drafts from the KV cache; return the history tokens it has not seen (in the draft's ids)."""
        return self._sync_own(self._own_history(history))

    def backlog(self, history: list[int]) -> int:
        """How many tokens of `history` the draft decodes before its next draft beyond a round's own (the target's
        token and the last drafted one): a lazy reset's prompt, or the rounds it sat out, at most."""
        return max(0, len(history) - 2 - self._seen)

    def _caught_up(self, n_history: int, pending: list[int]) -> int:
        """How many of the tokens pending before a draft of a history this long (in the draft's ids) are a lazy
        reset's prompt, decoded at the draft's first use."""
        return max(0, self._lazy_end - (n_history - len(pending)))

    def _sync_own(self, history: list[int]) -> list[int]:
        """`_sync` of a history already in the draft's ids."""
        i = self._committed
        n = min(len(self.kv_tokens), len(history))
        kv = self.kv_tokens
        while i < n and kv[i] == history[i]:
            i += 1
        if i == len(history):  # nothing new: step back one token so there are logits to draft from
            i -= 1
        self.ctx.truncate(i)
        return history[i:]

    def propose(self, history: list[int], draft_max: int, params: SamplingParams, rng: np.random.Generator,
                *, noise: PositionNoise | None = None, p_min: float | None = None,
                may_extend: Callable[[int], bool] | None = None, after: list[int] = ()) -> Draft:
        """As `Drafter.propose`; the draft stops at the first token it is less sure of than p_min (default:
        the drafter's own), unless may_extend(k) says a draft of k + 1 tokens verifies no dearer than one of
        k (CPU kernels take rows 2 or 4 at a time, so a batch of 4 can cost less than one of 3): then the
        unsure token goes too, and the draft stops after it. after: tokens proposed already (a copy the lookup
        found): decoded with what the history adds, and up to draft_max tokens of the model's drafted past them
        (the draft's tokens are `after` and the model's, its q one-hot on `after`'s)."""
        start = time.perf_counter()
        p_min = self.p_min if p_min is None else p_min
        after = list(after)
        draft_max = min(draft_max, self.ctx.n_ctx - len(history) - len(after))
        if draft_max <= 0:
            return Draft(tokens=after, source=self.name, copied=len(after))
        pending = self._sync(history)
        caught_up = self._caught_up(len(history), pending)
        logits = self.ctx.decode(pending + self._own_history(after), logits="last")[0][: self.n_shared]
        self._committed = len(self.kv_tokens) - len(after)  # the whole history: later histories extend it
        tokens, qs = draft_tokens(logits, lambda x: self.ctx.decode([x], logits="last")[0][: self.n_shared],
                                  len(history) + len(after), draft_max, params, rng, noise=noise, p_min=p_min,
                                  may_extend=may_extend, n_vocab=self.target_n_vocab)
        if after and qs is not None:
            qs = [np.eye(1, self.target_n_vocab, t)[0] for t in after] + qs
        self._seen = len(history) + len(after) + len(tokens) - 1  # all but the last drafted token went into the cache
        return Draft(tokens=after + tokens, q=qs, seconds=time.perf_counter() - start, source=self.name,
                     copied=len(after), caught_up=caught_up)


def draft_tokens(logits: np.ndarray, next_logits: Callable[[int], np.ndarray], n_history: int, draft_max: int,
                 params: SamplingParams, rng: np.random.Generator, *, noise: PositionNoise | None, p_min: float,
                 may_extend: Callable[[int], bool] | None, n_vocab: int) -> tuple[list[int], list[np.ndarray] | None]:
    """A model's draft, token by token: from the logits of the first drafted position, pick (greedy or coupled:
    as the target will, `Picker`) or sample a token, then `next_logits(token)` gives the next position's. Stops
    at draft_max, or at the first token the drafter is less sure of than p_min, unless may_extend(k) says a
    draft of k + 1 tokens verifies no dearer than one of k: then the unsure token goes too, and the draft stops
    after it. Returns the tokens and, for sampled drafts, q of each (padded with 0 to the target's n_vocab)."""
    picker = Picker(params, noise, whose="the draft's") if params.greedy or noise is not None else None
    tokens: list[int] = []
    qs: list[np.ndarray] | None = None if picker else []
    while True:
        t = n_history + len(tokens)  # the position this token would take
        q = None if picker is not None else probs_from_logits(logits, params, "the draft's")
        unsure = p_min > 0.0 and confidence(logits, params, q) < p_min
        if unsure and not (tokens and may_extend is not None and may_extend(len(tokens))):
            break
        if picker is not None:
            x = picker.pick(logits, t)
        else:
            x = sample(q, rng)
            qs.append(np.pad(q, (0, n_vocab - len(q))))  # q = 0 where the draft has no token
        tokens.append(x)
        if unsure or len(tokens) >= draft_max:
            break
        logits = next_logits(x)
    return tokens, qs


def confidence(logits: np.ndarray, params: SamplingParams, q: np.ndarray | None = None) -> float:
    """The drafter's probability of its likeliest token (q: the shaped distribution, where already built)."""
    if q is not None:
        return float(q.max())
    return max_prob(logits) if params.greedy else float(probs_from_logits(logits, params, "the draft's").max())


class HeadDrafter(Drafter):
    """Drafts with a head that reads the target's hidden states: the MTP block a model ships (`llama.heads.
    MtpHead`), an EAGLE-3 draft (`llama.hidden.Eagle3Head`), a DFlash draft (`llama.dflash.DflashHead`, a whole
    block at once: `begin` is told the draft's length, capped at its `max_draft`). Each follows the target's
    memory by itself (told of every batch the target decodes), so a draft starts from the last token with
    nothing to catch up here. No head ready (not following, or the context's end): no draft."""

    def __init__(self, head, *, p_min: float = 0.0):
        self.head = head
        self.name = head.name  # the source rounds are counted under: mtp, eagle3, dflash
        self.p_min = p_min

    def propose(self, history: list[int], draft_max: int, params: SamplingParams, rng: np.random.Generator,
                *, noise: PositionNoise | None = None, p_min: float | None = None,
                may_extend: Callable[[int], bool] | None = None) -> Draft:
        start = time.perf_counter()
        n_past = len(history) - 1
        draft_max = min(draft_max, self.head.n_ctx - len(history), getattr(self.head, "max_draft", None) or draft_max)
        if draft_max <= 0 or not self.head.ready(n_past):
            return Draft(tokens=[], source=self.name)
        try:
            tokens, qs = draft_tokens(self.head.begin(history[-1], n_past, draft_max), self.head.step, len(history), draft_max,
                                      params, rng, noise=noise, p_min=self.p_min if p_min is None else p_min,
                                      may_extend=may_extend, n_vocab=self.head.n_vocab)
        finally:
            self.head.end()
        return Draft(tokens=tokens, q=qs, seconds=time.perf_counter() - start, source=self.name)


def _run(history: list[int], j: int, last: int, reach: int) -> int:
    """How many tokens ending at j equal those ending at last, up to reach."""
    m = 0
    while m < reach and j - m >= 0 and history[j - m] == history[last - m]:
        m += 1
    return m


class LookupDrafter(Drafter):
    """Prompt lookup: find an earlier occurrence of the history's last n tokens and propose
    what followed it. No second model; costs microseconds. The index is incremental.

    Of the recent occurrences of the matched n-gram, the one whose agreement with the history
    reaches furthest back wins: when an answer copies a block of the prompt, that is the place
    being copied, not merely the latest line that happens to end the same way. `match` reports
    that agreement length, which predicts acceptance far better than the n-gram length alone. But first the places
    just after the one the last copy came from: a text copying its source with edits reads it in order.
    """

    name = "lookup"
    slack = 8  # how much of its source a copy read in order may skip past the history's growth (`_continuing`)

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2, candidates: int = 8, reach: int = 32,
                 ends: np.ndarray | None = None):
        # a 1-gram match predicts little
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.candidates, self.reach = candidates, reach
        # ends[t]: a copy stops before token t (the target's control tokens: a chat template's markers and ends of
        # generation, which an answer copying the prompt's text does not copy; a 15-token draft of
        # `<|im_end|>\n<|im_start|>assistant...` at the end of a copied function cost a batch of 16 for one token)
        self.ends = ends
        self.reset([])

    def reset(self, prompt_tokens: list[int], *, reuse: bool = False) -> None:
        self._index: list[dict[tuple, list[int]]] = [dict() for _ in range(self.ngram_max + 1)]
        self._indexed_to = 0  # n-grams ending before this position are in the index
        # An edit's renames, learned where a long copy broke at one token (`match`): the copied place's token ->
        # the one the text wrote instead. Later copies draft the new one (a rename recurs: `return config` after
        # `config[key] = ...` became `settings[key] = ...`); a wrong guess costs only a rejected draft token.
        self.renames: dict[int, int] = {}
        # Where the last copy came from: (the copied place aligned with the history's end then, the history's length
        # then). A text copying its source goes on through it in order, so the next copy is looked for right after
        # that place first (`_continuing`).
        self._cursor: tuple[int, int] | None = None

    def _extend_index(self, history: list[int]) -> None:
        # Index n-grams ending at positions < len(history) - 1, so the current suffix never finds itself.
        end = len(history) - 1
        for i in range(self._indexed_to, end):
            for n in range(self.ngram_min, self.ngram_max + 1):
                if i - n + 1 >= 0:
                    seen = self._index[n].setdefault(tuple(history[i - n + 1 : i + 1]), [])
                    seen.append(i)
                    if len(seen) > self.candidates:
                        del seen[0]
        self._indexed_to = max(self._indexed_to, end)

    def _agreement(self, history: list[int], j: int, last: int | None = None) -> int:
        """How many tokens ending at j equal the history's ending at `last` (default: its last token), up to
        `reach`, across one substituted token: an edit that renames a word changes one token of a copy, and the
        copy on both sides of it is the evidence that the text goes on copying."""
        last = len(history) - 1 if last is None else last
        m = _run(history, j, last, self.reach)
        if m < self.reach and j - m - 1 >= 0 and j - m != last - m - 1:  # one token differs: count on past it
            after = _run(history, j - m - 1, last - m - 1, self.reach - m - 1)
            if after >= self.ngram_max:  # a substitution inside a copy, not a place that merely ends alike
                return m + after
        return m

    def _continuing(self, history: list[int]) -> tuple[int, int]:
        """(agreement, place) of the best match that continues the last copy's source: a place from the one the last
        copy was aligned with on, no further than the history has grown since (and `slack` more: an answer may drop
        a few of its source's tokens); (0, -1) where none. An answer that edits its source as it goes (type hints, a rename,
        a docstring inserted) meets the same lines elsewhere too (`total = 0` in the function before and after), and
        the latest of equally long agreements is the wrong one: the source is read in order."""
        if self._cursor is None:
            return 0, -1
        at, then = self._cursor
        last = len(history) - 1
        hi = min(last - 1, at + (len(history) - then) + self.slack)
        places = {j for n in range(self.ngram_min, self.ngram_max + 1) if len(history) >= n
                  for j in self._index[n].get(tuple(history[-n:]), ()) if at <= j <= hi}
        if not places:
            return 0, -1
        m, j = max((self._agreement(history, j), -j) for j in places)  # ties: the nearest
        return m, -j

    def match(self, history: list[int], draft_max: int) -> tuple[list[int], int, bool]:
        """(continuation tokens, length of the agreement before it, whether the copy resumes past a changed token);
        ([], 0, False) when nothing matches. Where the history's last token is one the copied place does not have (a
        renamed word), the copy resumes after it: the place that agrees with the history up to that token, continued
        one token further on. Such a copy is a guess (the text may have left its source for good: a summary's own
        words after a quote), right far less often than a copy of the same agreement that nothing broke."""
        self._extend_index(history)
        # (agreement, the copied place's last position): continue at +1. The source read on in order first.
        best: tuple[int, int] = self._continuing(history)
        resumed = False
        for n in range(self.ngram_max, self.ngram_min - 1, -1) if best[1] < 0 else ():
            seen = self._index[n].get(tuple(history[-n:])) if len(history) >= n else None
            if seen:
                best = max((self._agreement(history, j), j) for j in seen)  # ties: the latest
                break
        last = len(history) - 2  # the copy up to the token before the last: does it resume past a substitution?
        seen = self._index[self.ngram_max].get(tuple(history[-self.ngram_max - 1:-1])) if last >= self.ngram_max else None
        for j in seen or ():
            if j < last and history[j + 1] != history[-1]:
                m = _run(history, j, last, self.reach)
                if m >= 2 * self.ngram_max and m > best[0]:  # a long copy, broken by this one token
                    best, resumed = (m, j + 1), True
                    self.renames[history[j + 1]] = history[-1]
        m, j = best
        if j < 0:
            return [], 0, False
        self._cursor = (j, len(history))
        renames, ends, copy = self.renames, self.ends, []
        # A text repeating itself with period d = last - j (the history's last m >= d tokens equal those d before
        # them: a run of one token, a row of a table) goes on repeating: the copy runs on past the history's end
        # into its own tokens, as far as draft_max (else it stopped there, a token or two a round).
        d = len(history) - 1 - j
        for i in range(j + 1, j + 1 + draft_max):
            if i >= len(history):
                if m < d:
                    break
                copy.append(copy[i - len(history)])  # already renamed, past any end token
                continue
            t = history[i]
            if ends is not None and t < len(ends) and ends[t]:
                break
            copy.append(renames.get(t, t))
        return (copy, m, resumed) if copy else ([], 0, False)

    def propose(self, history: list[int], draft_max: int, params: SamplingParams, rng: np.random.Generator,
                *, noise: PositionNoise | None = None) -> Draft:
        start = time.perf_counter()
        tokens, m, resumed = self.match(history, draft_max) if draft_max > 0 else ([], 0, False)
        # A deterministic drafter: q is one-hot on each proposal, which the loop builds (q=None).
        return Draft(tokens=tokens, seconds=time.perf_counter() - start, source=self.name, agreement=m,
                     resumed=resumed)
