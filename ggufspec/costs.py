"""What a decode costs, which batch sizes are bit-exact, and what pays: the arithmetic on the
measured table (`measure` measures it on this machine and caches it).

From the table and Leviathan et al. (2023, section 3.4): with acceptance rate a, a draft of
n tokens yields E(a, n) = (1 - a^(n+1)) / (1 - a) tokens per target pass; over what the round
costs here, that is the speed-up over plain decoding that the auto mode plans with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

# Batches up to 16 tokens are timed size by size (on CPUs the kernels work in rows of 4 or 8, so a size
# between those can cost more than the next one up), and beyond, up to 64, at the sizes in LONG_BATCHES:
# prompt-lookup drafts of a copied block run that long (llama.cpp's n-gram drafters draft 48 to 64), and
# on a CPU a Q8_0 batch of 64 costs less per token than one of 16. An unmeasured size is given the time
# of the next measured one up. 40 is among them because a copy is often cut short of 47 (what is left of
# its source, or of -n): with 44 tokens left and 33-48 rows priced as 48, rounds of 5 won, where copies of
# 47 delivered about 15% more tokens a second than they did (a Q8_0 target on a Zen 3: 40 rows cost 957 ms,
# 48 rows 1182, 6 rows 154).
EXACT_MAX = 16  # bit-exactness is checked up to this size: verification cuts longer rounds into such batches
LONG_BATCHES = (24, 32, 40, 48, 64)
MAX_BATCH = LONG_BATCHES[-1]
# Bit-exactness is also checked with the KV cache filled to these lengths (after the batch): on CPU,
# once the cache holds more than 256 tokens, llama.cpp's flash attention splits a one-token step's
# keys over the threads (ggml's split-KV path, n_kv >= 512) while a batch is not split, so batches
# exact at short lengths stop being exact there (seen on the Qwen pair with 2 threads: exact up to 3
# up to 256 tokens, none above; with 1 thread exact at every length).
KV_CHECKPOINTS = (64, 128, 256, 512)
LONG_KV = KV_CHECKPOINTS[-1]
# Speculate only for an expected gain of 3% or more: estimates of alpha are noisy, and a
# draft that merely breaks even costs more in variance than it gives.
MARGIN = 1.03


def expected_tokens(alpha: float, n_draft: int) -> float:
    """Leviathan et al. (2023), eq. 1: expected tokens per target pass from a draft of n_draft."""
    return float(n_draft + 1) if alpha >= 1.0 else (1.0 - alpha ** (n_draft + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, draft_max: int, cost_ratio: float) -> float:
    """Leviathan et al. (2023), eq. 1: expected tokens per round over the round's cost in target
    steps, a verify batch costing one step (the paper's assumption); cost_ratio: a draft step over a target step."""
    return expected_tokens(alpha, draft_max) / (draft_max * cost_ratio + 1)


def best_predicted(alpha: float, cost_ratio: float, draft_max: int = 8) -> tuple[float, int]:
    """(speed-up, draft length) of the best length up to draft_max by `predicted_speedup`."""
    return best_rate([(predicted_speedup(alpha, n, cost_ratio), n) for n in range(1, draft_max + 1)])


def best_rate(rates: list[tuple[float, int]]) -> tuple[float, int]:
    """The (rate, length) pair with the highest rate; among equal rates the shortest length."""
    return max(rates, key=lambda r: (round(r[0], 9), -r[1]))


@dataclass(frozen=True)
class Rollback:
    """What rewinding costs a target whose memory cannot be cut (a recurrent state, as in mamba2 and the hybrids):
    its state is saved before every verify batch, and restored at a rejection, which then decodes the kept tokens
    again (`llama/recurrent.py`). A KV cache's cut costs next to nothing and has no Rollback."""

    state_bytes: int
    save_seconds: float
    restore_seconds: float  # the state set back and the attention part cut (the decode again not included)
    kept: int = 0  # positions whose states llama.cpp keeps itself (n_rs_seq): a round drafting up to this many is cut

    def expected_seconds(self, n_draft: int, alpha: float, batch_seconds) -> float:
        """Expected seconds a round of n_draft drafts spends on rewinding: the save, and with probability
        alpha^j (1 - alpha) a rejection after j accepted drafts, whose j + 1 kept tokens are decoded again;
        where llama.cpp keeps the states of that many positions itself only a rejection of every draft (j = 0)
        decodes again, the rest are cuts."""
        if n_draft <= 0:
            return 0.0
        rejections = range(1 if n_draft <= self.kept else n_draft)
        return self.save_seconds + sum(alpha ** j * (1.0 - alpha) * (self.restore_seconds + batch_seconds(j + 1))
                                       for j in rejections)


@dataclass
class Costs:
    target_batch_seconds: list[float]  # [i] = seconds to decode a batch of i + 1 tokens
    exact_batch: int  # largest batch bit-identical to one-token decoding
    draft_token_seconds: float | None = None  # one draft step (None: no draft model)
    exact_kv: int | None = None  # ... while the KV cache holds at most this many tokens (None: every length checked)
    rollback: Rollback | None = None  # what a rewind costs where the target's memory cannot be cut
    experts: tuple[int, int] | None = None  # a mixture-of-experts target's (experts per token, experts per layer)
    # heads reading the target's hidden states, by name (mtp: its own MTP layers; eagle3, dflash: a trained draft):
    # {"token": seconds per drafted token (a step, and the head's catch-up on one verified row),
    #  "round": seconds per draft whatever its length (a DFlash block, decoded at once)}
    head_seconds: dict = field(default_factory=dict)
    # Where a round is one batch that is not bit-exact (past exact_kv), the chance that a row the round uses is a
    # near-tie, which verification decodes again by itself (and, where that confirms the draft, the rows after it
    # again): learnt per generation by auto (0: the table alone, as measured)
    tie_rate: float = 0.0
    # (cached tokens, extra rows there): a verified row beyond the first, with that many tokens cached, costs this
    # many times what the table says (measured in a nearly empty cache); None: not measured (see rows_at)
    deep_rows: tuple[int, float] | None = None
    # the largest move of a near-top token against the pick seen in a batch that was not bit-exact against one-token
    # decoding (`batch_drift`, measured at load); it raises verification's tie margin where larger; None: not measured
    drift: float | None = None
    # what a draft model's round costs beyond its steps: its first decode takes the round's last drafted token and
    # the target's own together (2 rows, not 1), before it drafts (0: not measured)
    draft_round_seconds: float = 0.0
    _chunks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # limit -> chunk(limit)
    _rounds: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # see round_seconds

    def corrected(self, extra_rows: float, tie_rate: float = 0.0) -> "Costs":
        """This table with every verified row beyond the first costing `extra_rows` times what was measured (a
        batch of n: one step plus extra_rows x (its measured cost - one step)), and near-ties re-checked at
        tie_rate: how auto corrects a table measured in a short cache for a long one, where each row attends to
        every cached token (a batch costs more steps) and rows are judged with a margin."""
        one = self.target_batch_seconds[0]
        scaled = [one + max(0.0, extra_rows * (s - one)) for s in self.target_batch_seconds]
        return replace(self, target_batch_seconds=scaled, tie_rate=tie_rate)

    def rows_at(self, n_kv: int) -> float:
        """What a verified row beyond the first costs over the table's figure with n_kv tokens cached (auto's first
        guess of its extra_rows there): each row attends to every cached token, so its cost grows about linearly
        with the cache, as the measured depth shows; at least 1 (a cache never makes rows cheaper)."""
        if not self.deep_rows:
            return 1.0
        kv, extra = self.deep_rows
        return 1.0 + max(0.0, extra - 1.0) * n_kv / kv

    def tie_seconds(self, n: int, alpha: float) -> float:
        """Expected seconds a round verifying n rows in one batch spends on near-ties: row j is judged where the j
        drafts before it were kept (alpha^j); a tie there is decoded again alone (a step), and where that keeps
        the draft (about alpha) the rows after it are decoded again."""
        return self.tie_rate * sum(alpha ** j * (self.batch_seconds(1) + (alpha * self.batch_seconds(n - 1 - j)
                                                                          if j < n - 1 else 0.0))
                                   for j in range(n))

    def draft_step(self, n: int) -> float | None:
        """Seconds per drafted token of the draft model in a draft of n tokens (None: no draft model)."""
        if self.draft_token_seconds is None:
            return None
        return self.draft_token_seconds + self.draft_round_seconds / max(1, n)

    @property
    def mtp_token_seconds(self) -> float | None:
        """The target's MTP head: seconds per drafted token (None: no head measured)."""
        return self.head_step("mtp", 1)

    def head_step(self, name: str, n: int) -> float | None:
        """Seconds per drafted token of the head `name` in a draft of n tokens (None: that head not measured)."""
        h = self.head_seconds.get(name)
        return None if h is None else h["token"] + h.get("round", 0.0) / max(1, n)

    def batch_seconds(self, n: int) -> float:
        """Seconds to decode a batch of n tokens; beyond what was measured, linear in tokens."""
        t = self.target_batch_seconds
        return t[n - 1] if n <= len(t) else t[-1] / len(t) * n

    def chunk(self, limit: int | None = None) -> int:
        """The batch size exact verification decodes in: of the sizes up to `limit` (default: the
        largest bit-exact one), the one with the least cost per token (ties: the larger). On a CPU
        whose kernels take rows 4 or 8 at a time a batch of 8 can cost less per token than one of 9."""
        limit = min(limit or self.exact_batch, len(self.target_batch_seconds))
        if limit not in self._chunks:  # asked for every draft length the planner weighs, each round
            self._chunks[limit] = min(range(1, limit + 1), key=lambda k: (round(self.batch_seconds(k) / k, 12), -k))
        return self._chunks[limit]

    def verify_seconds(self, n: int, verify_batch: int | None = None, alpha: float = 1.0) -> float:
        """Expected seconds to verify n tokens, in one batch or (exact verification) in batches of
        at most verify_batch (those of `chunk(verify_batch)` tokens, as the loop decodes them).

        A batch starting at row s runs only if the s drafts before it were all accepted
        (probability alpha**s): exact verification stops at the first rejected batch.
        """
        if not verify_batch or n <= verify_batch:
            return self.batch_seconds(n)
        size = self.chunk(verify_batch)
        cost, start = 0.0, 0
        while start < n:
            m = min(size, n - start)
            cost += alpha ** start * self.batch_seconds(m)
            start += m
        return cost

    def ceiling(self, verify_batch: int | None = None) -> tuple[float, int]:
        """(best speed-up any drafter could give, tokens per round that give it): every draft
        accepted and drafting free, so a round of n tokens costs one verify of n rows."""
        t1 = self.batch_seconds(1)
        rates = [(n * t1 / (self.verify_seconds(n, verify_batch) + self.rewind_seconds(n - 1, 1.0)), n)
                 for n in range(1, len(self.target_batch_seconds) + 1)]
        return best_rate(rates)

    def rewind_seconds(self, n_draft: int, alpha: float) -> float:
        """Expected seconds a round of n_draft drafts spends making its rejections undoable (0 where a cut is free)."""
        return self.rollback.expected_seconds(n_draft, alpha, self.batch_seconds) if self.rollback else 0.0

    @property
    def target_token_seconds(self) -> float:
        return self.target_batch_seconds[0]

    def speedup(self, alpha: float, n_draft: int, draft_step: float, verify_batch: int | None = None) -> float:
        """Expected speed-up over plain decoding of rounds drafting n_draft tokens at draft_step
        seconds each, verified in one batch or in batches of at most verify_batch."""
        return self.round_speedup(expected_tokens(alpha, n_draft), n_draft, n_draft * draft_step, verify_batch, alpha)

    def round_speedup(self, expected: float, n_draft: int, draft_seconds: float, verify_batch: int | None,
                      alpha: float) -> float:
        """Expected speed-up over plain decoding of a round of n_draft drafted tokens made in draft_seconds that
        yields `expected` tokens, its drafts accepted at about alpha (which verify chunks run, what rewinds cost)."""
        return expected * self.target_token_seconds / (draft_seconds + self.round_seconds(n_draft, verify_batch, alpha))

    def round_seconds(self, n_draft: int, verify_batch: int | None, alpha: float) -> float:
        """Expected seconds the target spends on a round of n_draft drafts accepted at about alpha: its verify
        batches, its rewinds and (in one batch past the exact cache) its near-ties. Remembered per table: auto
        weighs every length of every source each round, with the same few alphas round after round, and a
        round's planning must stay small beside a GPU's step of a few milliseconds."""
        key = (n_draft, verify_batch, alpha)
        seconds = self._rounds.get(key)
        if seconds is None:
            if len(self._rounds) >= 4096:
                self._rounds.clear()
            seconds = self._rounds[key] = (
                self.verify_seconds(n_draft + 1, verify_batch, alpha) + self.rewind_seconds(n_draft, alpha)
                + (0.0 if verify_batch else self.tie_seconds(n_draft + 1, alpha)))
        return seconds

    def best_length(self, alpha: float, draft_step: float, verify_batch: int | None = None,
                    draft_max: int = 8) -> tuple[float, int]:
        """(speed-up, draft length) of the best round at acceptance rate alpha."""
        return best_rate([(self.speedup(alpha, n, draft_step, verify_batch), n) for n in range(1, draft_max + 1)])

    def break_even(self, draft_step: float, verify_batch: int | None = None, margin: float = MARGIN,
                   draft_max: int = 8) -> float | None:
        """The smallest acceptance rate at which drafting beats plain decoding by `margin`;
        None when even an always-right drafter would not."""
        def pays(a: float) -> bool:
            return self.best_length(a, draft_step, verify_batch, draft_max)[0] > margin

        if not pays(1.0):
            return None
        lo, hi = 0.0, 1.0
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pays(mid) else (mid, hi)
        return hi

    def report(self, verify_batch: int | None, quant: str | None = None) -> dict:
        """The ceiling, and for each kind of drafter where it starts to pay (`ggufspec costs`)."""
        ceiling, ceiling_n = self.ceiling(verify_batch)
        # past exact_kv verification is one batch whatever its size: the ceiling there
        beyond, beyond_n = self.ceiling(None) if verify_batch and self.exact_kv is not None else (ceiling, ceiling_n)
        longest = max(1, len(self.target_batch_seconds) - 1)
        steps = {"lookup": 0.0}
        if self.draft_token_seconds:  # its round's first decode spread over its longest draft, as auto plans it
            steps["draft model"] = self.draft_step(longest)
        reach = {}  # the longest draft each drafter makes (a DFlash block's size less one)
        for name, h in self.head_seconds.items():  # a DFlash block's cost spread over its longest draft
            reach[HEAD_LABELS.get(name, name)] = min(longest, h.get("longest") or longest)
            steps[HEAD_LABELS.get(name, name)] = self.head_step(name, reach[HEAD_LABELS.get(name, name)])
        drafters = {}
        for name, step in steps.items():
            best, n = self.best_length(1.0, step, verify_batch, reach.get(name, longest))
            drafters[name] = {"draft_step_seconds": step,
                              "break_even_alpha": self.break_even(step, verify_batch, MARGIN, reach.get(name, longest)),
                              "speedup_if_always_right": best, "draft_max_if_always_right": n}
        return {"target_batch_seconds": self.target_batch_seconds, "draft_token_seconds": self.draft_token_seconds,
                "draft_round_seconds": self.draft_round_seconds,
                "mtp_token_seconds": self.mtp_token_seconds, "head_seconds": self.head_seconds,
                "exact_batch": self.exact_batch, "exact_kv": self.exact_kv, "ceiling_speedup": ceiling, "ceiling_tokens_per_round": ceiling_n,
                "ceiling_past_exact_kv": beyond, "ceiling_past_exact_kv_tokens_per_round": beyond_n,
                "verify_chunk": self.chunk(verify_batch) if verify_batch else None, "deep_rows": self.deep_rows,
                "drift": self.drift, "drafters": drafters, "why": self.why(quant),
                "rollback": None if self.rollback is None else vars(self.rollback), "routing": self.routing()}

    def routing(self, n: int = 4) -> dict | None:
        """For a mixture-of-experts target: how many distinct experts per layer a batch of n tokens needs against
        one token's, if tokens pick their experts independently and evenly (k of e each: e (1 - (1 - k/e)^n)), and
        what a batch of n was measured to cost in steps. A step reads its k experts' weights; a verify batch reads
        up to that many times more, so where decoding is bound by reading weights (a GPU, a CPU with few threads
        left idle) routing makes a verify batch dearer than a dense model's of the same active size."""
        if not self.experts:
            return None
        k, e = self.experts
        n = min(n, len(self.target_batch_seconds))
        distinct = e * (1.0 - (1.0 - k / e) ** n)
        return {"experts_used": k, "experts": e, "batch": n, "distinct_experts": distinct,
                "batch_steps": self.batch_seconds(n) / self.batch_seconds(1)}

    def why(self, quant: str | None = None) -> str | None:
        """One line where verifying costs most of a step per extra token (speculation gains little
        here), saying what would change it; None where a batch is cheap."""
        n = min(4, len(self.target_batch_seconds))
        steps = self.batch_seconds(n) / self.batch_seconds(1)
        extra = (steps - 1) / max(1, n - 1)  # what each verified token beyond the first costs, in steps
        if extra < SLOW_BATCH:
            return None
        what = f"this {quant} target" if quant else "this target"
        change = "the target's layers on a GPU"
        if (quant or "").upper() != "Q8_0":
            change = ("a Q8_0 build of the target (whose CPU kernels batch cheaply: "
                      "`ggufspec bench qwen2.5-coder-1.5b-q8_0` shows one) or its layers on a GPU")
        return (f"a batch of {n} costs {steps:.2f} target steps: each extra verified token costs {extra:.2f} of a step "
                f"with {what} on this machine, so speculation can gain little here; {change} would change that")


def draft_step_text(c: dict, t1: float) -> str:
    """`costs` and the bench footer on the draft model (c: `Costs.report`'s fields; t1: a target step): its step
    against the target's, and what its round costs beyond its steps, where measured."""
    s, extra = c["draft_token_seconds"], c.get("draft_round_seconds") or 0.0
    more = f", and {1000 * extra:.1f} ms a round more (its first decode: 2 rows, after the target's batch)"
    return f"draft step {1000 * s:.1f} ms ({s / t1:.2f} of a target step){more if extra >= 5e-5 else ''}"


# How `costs` and the bench footer name each head.
HEAD_LABELS = {"mtp": "MTP head", "eagle3": "EAGLE-3 draft", "dflash": "DFlash draft"}

# Each extra verified token costing this much of a target step or more is "most of a step" (`Costs.why`):
# the Q4_K_M Qwen target measured 0.44-0.77 on CPUs, its Q8_0 build 0.26-0.33; a GPU's verify batch is nearly free.
SLOW_BATCH = 0.4


def batch_drift(batch: np.ndarray, singles: np.ndarray, near: int = 8) -> float:
    """How far a batch's logits moved the tokens nearest each row's one-token pick against it: the largest
    |(b[top] - b[j]) - (s[top] - s[j])| over rows and the `near` tokens j ranked highest by one-token decoding
    (top among them). A batched pick differs from one-token decoding's only where such a token's one-token gap to
    the top is below its move; the far tokens, whose gaps are large, move as much but never take the pick."""
    singles = np.asarray(singles, dtype=np.float64)
    moved = np.asarray(batch, dtype=np.float64) - singles
    ranked = np.argsort(-singles, axis=1)[:, :near]  # each row's top first
    near_moves = np.take_along_axis(moved, ranked, axis=1)
    return float(np.max(np.abs(near_moves - near_moves[:, :1])))
