"""How greedy (and coupled) rounds are verified: one policy that the loop, auto's planner, the `Llama`
draft, the bench footer and `doctor` all ask. What verifying costs is `Costs`'s to say, asked with this
policy's batch limit (`batch_limit`).

llama.cpp's batched kernels are not bit-identical to one-token decoding everywhere. Where this
backend has batches that are (measured at load: `Costs.exact_batch`, up to `Costs.exact_kv`
cached tokens), greedy verification decodes in such batches by default, so the text is the
target's by construction; elsewhere it verifies in one batch and re-decodes a near-tie's row by itself
(`settle_tie`). Batches are cut in the exact size with the least cost per token (`Costs.chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .core import Target
from .costs import Costs
from .sampling import Picker, SamplingParams, verify_greedy

# A batched row whose top-2 gap is under the tie margin is re-checked by one-token decoding. The drift measured at
# load (`Costs.drift`: how far a batch that is not bit-exact moved a near-top token against the pick) raises the
# margin to TIE_SAFETY times it where that is more than DEFAULT_TIE_MARGIN (Q4_K_M's repacked GEMM on CPU: 0.31,
# so 0.63). It never lowers it: on Vulkan (llvmpipe) a margin of twice the probe's drift let a tiny model's draft
# mode leave target-only's text, so a short probe does not bound a device's drift from above. On CPU the
# Qwen2.5-Coder pair's gaps moved by up to 0.32 (and past 256 cached tokens one-token flash attention splits the
# keys over threads: dev/measure_batch_drift.py).
DEFAULT_TIE_MARGIN = 0.5
TIE_SAFETY = 2.0


def margin_for(costs: Costs | None) -> float:
    """The tie margin for this target here: DEFAULT_TIE_MARGIN, or TIE_SAFETY x its measured drift where larger."""
    if costs is None or costs.drift is None:
        return DEFAULT_TIE_MARGIN
    return max(DEFAULT_TIE_MARGIN, TIE_SAFETY * costs.drift)


@dataclass(frozen=True)
class Verification:
    """The verification policy. exact_batch: the largest batch this backend computes bit-identically
    to one-token decoding, while the KV cache holds at most exact_kv tokens (None: at every length
    measured). exact: verify in batches of at most that size (identity by construction); otherwise
    one batch, with near-ties (top-2 gap < tie_margin) re-decoded."""

    exact_batch: int = 1
    exact: bool = False
    tie_margin: float = DEFAULT_TIE_MARGIN
    exact_kv: int | None = None
    chunk: int | None = None  # the batch size rounds longer than exact_batch are cut into (default exact_batch)
    # exact by default (not asked for): a round whose draft says so (`Draft.one_batch`: a long copy, planned by auto
    # where one batch costs less than its exact chunks) is verified as past exact_kv, in one batch with near-ties
    # re-checked; --exact keeps every round in exact chunks
    may_batch: bool = False

    @classmethod
    def of(cls, costs: Costs | None, exact: bool | None = None, tie_margin: float | None = None) -> "Verification":
        """The policy for these measured costs. exact None: exact wherever this backend has bit-identical
        batches of 2 tokens or more (the default everywhere in ggufspec); tie_margin None: `margin_for` these
        costs."""
        tie_margin = margin_for(costs) if tie_margin is None else tie_margin
        if costs is None:  # nothing measured: no batch is known to be exact
            return cls(1, False, tie_margin)
        asked, exact = exact, costs.exact_batch >= 2 if exact is None else exact
        return cls(costs.exact_batch, exact, tie_margin, costs.exact_kv, costs.chunk(),
                   may_batch=exact and asked is None)

    # -- which batches are exact --------------------------------------------------------------

    def exact_here(self, n_kv: int) -> int:
        """The bit-exact batch size with n_kv tokens in the cache after the batch (1: none)."""
        return self.exact_batch if self.exact_kv is None or n_kv <= self.exact_kv else 1

    def batch_limit(self, n_kv: int | None = None) -> int | None:
        """The largest batch verification decodes with n_kv tokens cached after it (None: the short
        lengths where exactness was measured); None means one batch per round."""
        if not self.exact or self.exact_batch < 2:
            return None
        limit = self.exact_here(n_kv) if n_kv is not None else self.exact_batch
        return limit if limit > 1 else None

    def round_limit(self, n_kv: int, one_batch: bool = False) -> int | None:
        """batch_limit for a round whose draft asks for one batch or not (`Draft.one_batch`, allowed by may_batch):
        None where the round is one batch judged with the margin."""
        return None if one_batch and self.may_batch else self.batch_limit(n_kv)

    def one_call(self, n_rows: int, n_past: int, one_batch: bool = False) -> bool:
        """Whether a round of n_rows from n_past cached tokens is verified in one decode."""
        limit = self.round_limit(n_past + n_rows, one_batch)
        return limit is None or n_rows <= limit

    def exact_draft_max(self, n_history: int, wanted: int) -> int:
        """For a caller that verifies [last] + draft in one batch (llama-cpp-python's `Llama`): the
        longest draft keeping that batch bit-exact when exact (0 past exact_kv), else `wanted`."""
        if not self.exact:
            return wanted
        if self.exact_kv is not None and n_history + wanted > self.exact_kv:
            return 0
        return min(wanted, self.exact_batch - 1)

    # -- verifying ----------------------------------------------------------------------------

    def verify(self, target: Target, inputs: list[int], draft_tokens: list[int], n_past: int,
               picker: Picker, one_batch: bool = False) -> tuple[int, int, list[float]]:
        """Greedy or coupled verification: keep drafts while they equal the target's picks. Exact: in
        bit-exact batches (identity by construction); otherwise (or where one_batch is asked and the policy
        allows it) one batch, and the first near-tie among the rows used is re-decoded by itself: where that
        rejects the draft the round ends there, where it confirms it the drafts after it are verified the same
        way. Returns (n_accepted, next_token, tie gaps)."""
        done, gaps = 0, []  # drafts confirmed by settled ties, and those ties' gaps
        while True:
            part, drafts, at = inputs[done:], draft_tokens[done:], n_past + done
            picks, ties = self._judged(target, part, drafts, at, picker, one_batch)
            n_accepted, next_token = verify_greedy(drafts, picks)
            j = next((i for i, gap in enumerate(ties[: n_accepted + 1]) if gap is not None), None)
            if j is None:
                return done + n_accepted, next_token, gaps
            gaps.append(ties[j])
            settled = settle_tie(target, part, drafts, at, j, picker)
            if settled is not None:
                return done + settled[0], settled[1], gaps
            done += j + 1  # the tie confirmed the draft at row j: the cache holds it, verify the rest

    def _judged(self, target: Target, inputs: list[int], draft_tokens: list[int], n_past: int,
                picker: Picker, one_batch: bool = False) -> tuple[list[int], list[float | None]]:
        """The target's picks for a round, and its near-ties' gaps where the batch was not exact: in exact
        chunks where the policy says so (stopping after the chunk that rejects a draft), else in one batch."""
        n_kv = n_past + len(inputs)
        limit = self.round_limit(n_kv, one_batch)
        if limit is None or len(inputs) <= limit:
            exact = limit is not None or len(inputs) <= self.exact_here(n_kv)
            return picker.judge(target.decode(inputs, logits="all"), n_past + 1, None if exact else self.tie_margin)
        chunk, picks = min(self.chunk or limit, limit), []
        for start in range(0, len(inputs), chunk):
            picks += picker.judge(target.decode(inputs[start:start + chunk], logits="all"), n_past + 1 + start)[0]
            drafts = draft_tokens[start:len(picks)]
            if picks[start:start + len(drafts)] != drafts or len(picks) > len(draft_tokens):
                break
        return picks, [None] * len(picks)


def settle_tie(target: Target, inputs: list[int], draft_tokens: list[int], n_past: int, j: int,
               picker: Picker | None = None) -> tuple[int, int] | None:
    """Decide a round's near-tie at batched row j as target-only decoding would: the drafts before row
    j are kept (their rows were not ties, so the batch's picks stand) and row j is re-decoded by itself,
    with one-token decoding's numerics. Returns (n_accepted, next_token) = (j, its pick) where that
    pick is not the draft there (or there is none); None where it is: the draft at j is accepted, the
    cache holds the rows up to j, and the drafts after it still need verifying.

    (Redoing the rows before j one token at a time as well, as this once did, and the rows after it,
    bought nothing: past exact_kv the rounds before this one were kept from batches anyway; and it cost
    a 64-token copy 64 steps.)
    """
    picker = picker or Picker(SamplingParams())
    target.truncate(n_past + j)
    pick = picker.pick(target.decode([inputs[j]], logits="last")[0], n_past + 1 + j)
    if j < len(draft_tokens) and pick == draft_tokens[j]:
        return None
    return j, pick
