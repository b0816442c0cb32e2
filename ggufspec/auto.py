"""Cost-aware drafting: each round, speculate only as far as it pays on this machine.

Leviathan et al. (2023), section 3.4: with acceptance rate a, a draft of n tokens yields
E(a, n) = (1 - a^(n+1)) / (1 - a) tokens per target pass. Dividing by what the round costs here (n draft steps plus the
verify batch, from the measured cost table, in bit-exact batches cut short at the first rejection when verification is
exact; see `costs`) gives expected tokens per second; no draft is plain decoding at 1 / (one target step). The drafter
with the best rate wins the round: no draft, a prompt-lookup draft (each copied token's alpha tracked by how far back
the copy agrees by then, apart for a copy resumed past a token the text changed), or the draft model. Estimates learn
from every round, so the choice follows the text; each carries an exploration bonus (UCB: `Estimate.planned`), so a kind
of match, the draft model or a head is tried before it is written off (those two again now and then). Costs keep the
shape measured at load (what a batch of n costs relative to one step, what a draft step costs); every round rescales
them by how fast the machine runs now. Each observation moves the scale by at most a bounded step, so one stall (a page
fault, another process) cannot make drafting look cheap, and the scale of the target is updated by every round,
whichever drafter won it, so a wrong estimate cannot lock itself in. Beside the table's prediction a `watch.RateWatch`
times what each source's rounds deliver against plain rounds and pauses a source that loses, whatever the table says,
and a `watch.Credit` weighs copies up by what their rounds delivered over the table's forecast.
"""

from __future__ import annotations

import time

import numpy as np

from .core import DRAFTING_MODES, HEAD_MODES, Draft, Round
from .corrections import CostCorrections
from .costs import MARGIN, MAX_BATCH, Costs, expected_tokens
from .drafters import DRAFT_MAX, Drafter, LookupDrafter, ModelDrafter
from .errors import GGUFSpecError
from .estimates import LOOKUP_PRIORS, RESUMED_PRIOR, Estimate, lookup_bucket, monotone
from .sampling import SamplingParams
from .verification import Verification
from .watch import Credit, RateWatch


CONTINUED = "lookup+draft"  # the source of a copy continued by the draft model past its end
# The most tokens a draft model's catch-up is spread over: a budget is an upper bound, and an answer often ends sooner.
HORIZON = 256


class AutoDrafter(Drafter):
    """Chooses, per round, no draft / lookup / draft model, and the draft length."""

    name = "auto"
    margin = MARGIN
    # How far one round's timing may move a cost scale: observations are clipped to this factor.
    clip = 1.5
    # Exploration bonus on lookup's estimates (0.11 untried, 0.02 after ~50 observations), and on a draft model's or
    # head's until tried: without it a source whose prior says "does not pay" never learns that in this text it does.
    explore = 0.15
    # A copy goes in one batch where exact chunks exist (its later rows then follow batched rows, so the text is the
    # target's up to near-ties, as past exact_kv) only where that beats the best exact round by this much: on the
    # Q4_K_M pair a 3-token draft in one batch of 4 (cheaper than chunks of 3 + 1) bent a chat answer at a gap of
    # 0.006 for no gain, while 15-token copies in one batch of 16 cost 4.9 steps against 12 in chunks.
    one_batch_gain = 1.2
    one_batch_agreement = 8  # and only for a copy agreeing this far back (kept 88-100% of the time, see estimates)

    def __init__(self, verification: Verification, costs: Costs, *, lookup: LookupDrafter,
                 model: ModelDrafter | None = None, model_max: int | None = None, lookup_max: int | None = None,
                 draft_cost: float | None = None, model_p_min: float | None = None, heads: dict | None = None):
        self.verification = verification  # how rounds are verified (which batches, up to which cache length)
        # what decoding costs here: measured at load, and as the rounds show it now (`costs`, `copy_costs`)
        self.corrections = CostCorrections(costs, margin=verification.tie_margin > 0)
        self.lookup, self.model = lookup, model
        self.model_max = model_max  # the draft model's longest draft (--draft-max); None: the round's budget
        self.lookup_max = lookup_max  # a lookup draft's longest (--lookup-max); None: the round's budget
        self.model_p_min = model_p_min  # --draft-p-min; None: where another drafted token stops paying (p_min_for)
        # the heads reading the target's hidden states (MTP, EAGLE-3, DFlash: HeadDrafters by name), where an
        # always-right one would pay here (its step + catch-up per drafted token; a DFlash block over its longest draft)
        self.heads = {name: h for name, h in (heads or {}).items()
                      if self._pays(self._head_step(name, self._longest(h)), self._longest(h))}
        self.head_alpha = {name: Estimate(0.7, 2.0) for name in self.heads}
        self._draft_cost = draft_cost if draft_cost is not None else self.costs.draft_token_seconds
        self._draft_round = 0.0 if draft_cost is not None else costs.draft_round_seconds  # see _draft_seconds
        self.target_scale = self.draft_scale = 1.0  # now / at load, tracked online
        # A lookup draft is as good as the copy it continues: alpha is tracked by how far back the match agrees
        self.lookup_alpha = {m: Estimate(prior, 2.0) for m, prior in LOOKUP_PRIORS}
        self.resumed_alpha = Estimate(RESUMED_PRIOR, 2.0)
        # A draft of the same family agrees often; a light prior, so that a few rounds decide the length.
        self.model_alpha = Estimate(0.8, 2.0)
        self.watch = RateWatch()  # what each source's rounds deliver, whatever the table predicts
        self.credit = Credit(credited=("lookup", CONTINUED))  # what copies delivered over the table's forecast
        self._end: int | None = None  # the history's length where the generation's budget runs out (None: unknown)

    def model_may_pay(self) -> bool:
        """Whether an always-right draft model would beat plain decoding here (else it is never used)."""
        longest = min(self.model_max or MAX_BATCH, len(self.costs.target_batch_seconds) - 1)
        return self.model is not None and bool(self._draft_cost) and self._pays(self._draft_seconds(longest))

    def _pays(self, step: float | None, longest: int | None = None) -> bool:
        """Whether an always-right drafter at `step` seconds a drafted token, drafting up to `longest`, would beat
        plain decoding here."""
        longest = min(longest or MAX_BATCH, self.model_max or MAX_BATCH, len(self.costs.target_batch_seconds) - 1)
        if not step or longest < 1:
            return False
        best, _ = self.costs.best_length(1.0, step, self.verification.batch_limit(), longest)
        return best > self.margin

    def _longest(self, head) -> int:
        """The longest draft a head makes (a DFlash block's size less one), and the model's longest (--draft-max)."""
        return min(getattr(head.head, "max_draft", None) or MAX_BATCH, self.model_max or MAX_BATCH,
                   len(self.costs.target_batch_seconds) - 1)

    def _head_step(self, name: str, n: int) -> float | None:
        """Seconds per drafted token of a head in a draft of n tokens (None: that head not measured)."""
        return self.costs.head_step(name, n)

    def reset(self, prompt_tokens: list[int], *, reuse: bool = False) -> None:
        self.lookup.reset(prompt_tokens)
        self.corrections.at_least_floor(len(prompt_tokens))  # a long prompt's rows
        self._end = len(prompt_tokens) + self.max_tokens if self.max_tokens else None
        if self.model is not None:
            # With the prompt, as in draft mode, where the model may pay (the prompt's time, not the first
            # round's); elsewhere lazily: the draft catches up only if and when it is used.
            self.model.reset(prompt_tokens, reuse=reuse, lazy=self.lazy_model or not self.model_may_pay())

    # -- costs --------------------------------------------------------------------------------

    @property
    def costs(self) -> Costs:
        """The table planned with now: the measured one corrected by what the rounds showed (`corrections`)."""
        return self.corrections.costs

    @property
    def draft_cost(self) -> float | None:
        """Seconds per drafted token now (the catch-up of the draft's KV cache included)."""
        return None if self._draft_cost is None else self._draft_cost * self.draft_scale

    def _draft_seconds(self, n: int) -> float:
        """Seconds per drafted token at load's speed in a draft model's draft of n tokens: a step each, and what its
        round costs beyond them (the first decode takes 2 rows, after the target's batch) spread over them."""
        return self._draft_cost + self._draft_round / max(1, n)

    def draft_step(self, n: int) -> float | None:
        """Seconds per drafted token now in a draft model's draft of n tokens (`_draft_seconds` at today's speed)."""
        return None if self._draft_cost is None else self._draft_seconds(n) * self.draft_scale

    @property
    def step_cost(self) -> float:
        """Seconds of one plain decoding step now."""
        return self.costs.batch_seconds(1) * self.target_scale

    def catch_up(self, history: list[int]) -> float:
        """Seconds per token left that the draft model's catch-up (`ModelDrafter.backlog`: a lazy reset's prompt, the
        rounds it sat out) adds to a round of its own now, a one-off spread over the tokens the generation has left
        (at most HORIZON): the draft decodes them in one batch, each at what a row of the target's longest measured
        batch costs in steps, times a draft step (unpriced, a server's lazy draft spent 1.9 s of a 64-token answer's
        5.5 catching up on a 268-token prompt, for one round of its own)."""
        backlog = self.model.backlog(history)
        if not backlog or not self.draft_cost:
            return 0.0
        n = len(self.costs.target_batch_seconds)
        row = self.costs.batch_seconds(n) / n / self.costs.batch_seconds(1)
        left = HORIZON if self._end is None else max(1, min(HORIZON, self._end - len(history)))
        return backlog * row * self.draft_cost / left

    @staticmethod
    def _after(rate: float, extra: float) -> float:
        """A rate of tokens per second with `extra` seconds more per token."""
        return 1.0 / (1.0 / rate + extra) if extra and rate > 0 else rate

    def _rescale(self, scale: float, observed: float, expected: float) -> float:
        ratio = min(self.clip, max(1 / self.clip, observed / (expected * scale)))
        return scale * (0.9 + 0.1 * ratio)

    # The cost table's speed-ups hold at the shape measured at load; the target now runs at
    # target_scale times that, which is the same as a draft step target_scale times cheaper.
    def rate(self, a: float, n_draft: int, draft_step: float, n_past: int) -> float:
        """Expected tokens per second of a round drafting n_draft tokens now, from n_past cached tokens."""
        limit = self.verification.batch_limit(n_past + n_draft + 1)
        return self.costs.speedup(a, n_draft, draft_step / self.target_scale, limit) / self.step_cost

    # -- the choice ---------------------------------------------------------------------------

    def propose(self, history: list[int], draft_max: int, params: SamplingParams, rng: np.random.Generator,
                *, noise=None) -> Draft:
        start = time.perf_counter()
        n_past = len(history) - 1  # exactness ends at exact_kv, so what a batch costs depends on it
        # (source, length, rate as corrected by what the source's rounds delivered, the table's rate)
        plain = 1 / self.step_cost
        best = ("target", 0, self.margin * plain, plain)
        allows = self.watch.allows

        def weigh(source: str, lengths: range, rate_of) -> None:
            nonlocal best
            delivered = self.credit.of(source)
            for n in lengths:
                r = rate_of(n)
                if r * delivered > best[2]:
                    best = (source, n, r * delivered, r)

        longest_copy = min(draft_max, self.lookup_max or draft_max) if allows("lookup") else 0
        match, agreement, resumed = self.lookup.match(history, longest_copy) if longest_copy > 0 else ([], 0, False)
        a_copy = self.lookup_estimate(agreement, resumed=resumed) if match else 0.0
        copy_rate = (self.copy_rates(self.copy_alphas(agreement, resumed, len(match)), n_past, 0 if resumed else agreement)
                     if match else None)
        if match:
            weigh("lookup", range(1, len(match) + 1), copy_rate)
        for name, head in self.heads.items():
            if allows(name) and head.head.ready(n_past):
                a = self.head_alpha[name].planned(self.explore)
                weigh(name, range(1, min(draft_max, self._longest(head)) + 1),
                      lambda n, name=name, a=a: self.rate(a, n, self._head_step(name, n), n_past))
        if self.model is not None and self.draft_cost and allows("draft"):
            a, extra = self.model_alpha.planned(self.explore), self.catch_up(history)
            weigh("draft", range(1, min(draft_max, self.model_max or draft_max) + 1),
                  lambda n: self._after(self.rate(a, n, self.draft_step(n), n_past), extra))
            if match and len(match) < draft_max and self.model.continues_copies and allows(CONTINUED):
                copied = len(match)
                weigh(CONTINUED, range(copied + 1, min(draft_max, copied + (self.model_max or draft_max)) + 1),
                      lambda n: self._after(self.continued_rate(a_copy, copied, n - copied, n_past), extra))
        source, n, rate, table_rate = best
        if source == "lookup":  # judged by the estimate without the exploration bonus (which overshoots by design)
            alphas = self.copy_alphas(agreement, resumed, n, 0.0)  # verified as planned: in one batch or in chunks
            table_rate = self.copy_rates(alphas, n_past, 0 if resumed else agreement)(n)
            draft = Draft(tokens=match[:n], seconds=time.perf_counter() - start, source="lookup", agreement=agreement,
                          resumed=resumed, one_batch=n in copy_rate.one_batch)
        elif source == CONTINUED:
            table_rate = self.continued_rate(self.lookup_estimate(agreement, 0.0, resumed), len(match), n - len(match), n_past)
            p_min = self.model_p_min if self.model_p_min is not None else self.p_min_for(n, n_past)
            draft = self.model.propose(history, n - len(match), params, rng, noise=noise, p_min=p_min, after=match,
                                       may_extend=lambda k: self.one_more_is_free(len(match) + k, n_past))
            draft.source, draft.agreement, draft.resumed = CONTINUED, agreement, resumed
        elif source in self.heads:
            draft = self.heads[source].propose(history, n, params, rng, noise=noise, p_min=self.model_p_min or 0.0)
        elif source == "draft":
            p_min = self.model_p_min if self.model_p_min is not None else self.p_min_for(n, n_past)
            draft = self.model.propose(history, n, params, rng, noise=noise, p_min=p_min,
                                       may_extend=lambda k: self.one_more_is_free(k, n_past))
        else:
            draft = Draft(tokens=[], seconds=time.perf_counter() - start, source="target")
            rate, table_rate = plain, plain
        draft.predicted_rate, draft.table_rate = rate, table_rate
        return draft

    # -- copies ---------------------------------------------------------------------------------

    def continued_rate(self, a_copy: float, copied: int, k: int, n_past: int) -> float:
        """Expected tokens per second of a round drafting a copy of `copied` tokens (each kept at about a_copy) and
        k of the draft model's past its end (the draft decodes the copy with its catch-up, about a step)."""
        expected = expected_tokens(a_copy, copied) + a_copy ** copied * (expected_tokens(self.model_alpha.value, k) - 1)
        limit = self.verification.batch_limit(n_past + copied + k + 1)
        draft_seconds = (k + 1) * self.draft_cost / self.target_scale
        return self.costs.round_speedup(expected, copied + k, draft_seconds, limit, a_copy) / self.step_cost

    def lookup_estimate(self, agreement: int, explore: float | None = None, resumed: bool = False) -> float:
        """The acceptance a lookup draft of this agreement is planned with: the buckets' estimates made non-decreasing
        in agreement (`monotone`: a copy agreeing further back is never the worse bet, so copies kept at a shorter
        agreement speak for longer ones, and long ones failing pull shorter ones down), its bucket's with the
        exploration bonus but no higher than any longer one's. A resumed copy: no higher than resumed copies' own."""
        bucket, explore = lookup_bucket(agreement), self.explore if explore is None else explore
        bounds = [e.optimistic(explore, v) for (m, e), v in zip(self.lookup_alpha.items(), monotone(
            list(self.lookup_alpha.values()))) if m >= bucket]
        return min(bounds + ([self.resumed_alpha.optimistic(explore)] if resumed else []))

    def copy_alphas(self, agreement: int, resumed: bool, n: int, explore: float | None = None) -> list[float]:
        """Each token's acceptance in an n-token copy, given the ones before kept: the i-th (from 0) continues a copy
        agreeing over agreement + i tokens by then, so it has that agreement's estimate. Resumed copies: their own."""
        if resumed:
            return [self.lookup_estimate(agreement, explore, resumed=True)] * n
        by_bucket = {m: self.lookup_estimate(m, explore) for m in self.lookup_alpha}
        return [by_bucket[lookup_bucket(agreement + i)] for i in range(n)]

    def copy_rates(self, alphas: list[float], n_past: int, agreement: int = 0):
        """rate(n): expected tokens per second of a round drafting a copy's first n tokens, kept at `alphas`: in
        exact chunks, or in one batch with its near-ties re-checked where the policy allows it
        (`Verification.may_batch`), the copy agrees over `one_batch_agreement` tokens or more, and one batch beats
        the best exact round by `one_batch_gain` (rate.one_batch: the lengths planned so). Such a batch's rows are
        not one-token decoding's: the text holds up to near-ties."""
        expected, survive = [1.0], [1.0]
        for a in alphas:
            survive.append(survive[-1] * a)
            expected.append(expected[-1] + survive[-1])

        def of(n: int, one_batch: bool) -> float:  # at the per-token alpha of the same survival (which chunks run)
            exact = self.verification.batch_limit(n_past + n + 1)
            costs = self.corrections.copy_costs if self._copy_priced(agreement, exact) else self.costs
            return costs.round_speedup(expected[n], n, 0.0, None if one_batch else exact, round(survive[n] ** (1.0 / n), 3))

        lengths = range(1, len(alphas) + 1)
        may = self.verification.may_batch and agreement >= self.one_batch_agreement and any(
            self.verification.batch_limit(n_past + n + 1) for n in lengths)
        exact_best = max((of(n, False) for n in lengths), default=0.0) if may else 0.0

        def rate(n: int) -> float:
            limit, best = self.verification.batch_limit(n_past + n + 1), of(n, False)
            if may and limit is not None and n + 1 > limit and (one := of(n, True)) > self.one_batch_gain * exact_best:
                best = one
                rate.one_batch.add(n)
            return best / self.step_cost
        rate.one_batch = set()
        return rate

    def _copy_priced(self, agreement: int, exact: int | None) -> bool:
        """Whether a copy's round is planned with the copies' near-tie rate, and teaches it: past exact_kv (`exact`,
        the round's batch_limit, None), where every round is one batch, a copy agreeing over `one_batch_agreement`
        tokens (a resumed one agrees over none). A copy taken out of exact chunks into one batch, or a short-agreement one, is priced and
        learnt as other rounds are: each batch writes rows one-token decoding would not, and a later step's near-tie
        (not re-checked) can turn on them (fix-3 on Zen 3 left the target's text at token 37 after a 1-token copy,
        rejected, that the copies' price let through at 260 cached tokens)."""
        return agreement >= self.one_batch_agreement and exact is None

    def _learn_copy(self, draft: Draft, accepted: int, drafted: int) -> None:
        """Each token of a copy up to the first rejected one teaches the estimate it was planned with (copy_alphas)."""
        if draft.resumed:
            return self.resumed_alpha.update(accepted, drafted)
        for i in range(min(drafted, accepted + 1)):
            self.lookup_alpha[lookup_bucket(draft.agreement + i)].update(int(i < accepted), 1)

    def p_min_for(self, n: int, n_past: int) -> float:
        """The draft confidence below which a draft of up to n tokens stops: what one more drafted token costs,
        in target steps (a draft step, and the verify batch's cost per row at n), against the one step it
        saves when accepted, which is about as likely as the draft is sure of it (a draft of the same family)."""
        rows = (self._verify_seconds(n + 1, n_past) - self._verify_seconds(1, n_past)) / n * self.target_scale
        return min(0.9, (self.draft_cost + rows) / self.step_cost)

    def _verify_seconds(self, rows: int, n_past: int) -> float:
        """Seconds (at load's speed) to verify a round of this many rows from n_past, as the loop decodes it."""
        return self.costs.verify_seconds(rows, self.verification.batch_limit(n_past + rows))

    def one_more_is_free(self, k: int, n_past: int) -> bool:
        """Whether a draft of k + 1 tokens verifies no dearer than one of k, from n_past cached tokens."""
        return self._verify_seconds(k + 2, n_past) <= self._verify_seconds(k + 1, n_past)

    def observe(self, r: Round) -> None:
        """Learn from a finished round: acceptance by source, and how fast the machine runs now."""
        source = r.draft.source
        for e in [self.model_alpha] * (source != "draft") + [e for h, e in self.head_alpha.items() if h != source]:
            e.unused()  # a while unused: tried again (a round it drafts in resets the count: `update`)
        if r.n_drafted:
            if source == "lookup":
                self._learn_copy(r.draft, r.n_accepted, r.n_drafted)
            elif source in self.head_alpha:
                self.head_alpha[source].update(r.n_accepted, r.n_drafted)
            elif source == "draft":
                self.model_alpha.update(r.n_accepted, r.n_drafted)
                # per drafted token, so the catch-up of the draft's cache counts (not a lazy draft's of the prompt)
                if self._draft_cost and not r.draft.caught_up:
                    self.draft_scale = self._rescale(self.draft_scale, r.draft_seconds / r.n_drafted,
                                                     self._draft_seconds(r.n_drafted))
            elif source == CONTINUED:  # the copy's tokens teach the copy's estimate, the model's the model's
                copied = min(r.draft.copied, r.n_drafted)
                self._learn_copy(r.draft, min(r.n_accepted, copied), copied)
                if r.n_accepted >= copied < r.n_drafted:
                    self.model_alpha.update(r.n_accepted - copied, r.n_drafted - copied)
        self.watch.observe(r, 1 / self.step_cost)
        self.credit.observe(r)
        rows = r.n_drafted + 1
        one_batch = r.draft.one_batch  # a copy planned in one batch is verified as past exact_kv is
        if r.n_drafted and r.target_seconds > 0 and self.verification.round_limit(r.n_past + rows, one_batch) is None:
            # one batch judged with a margin: its rows used, a copy's apart where it was priced apart
            copy = source == "lookup" and self._copy_priced(0 if r.draft.resumed else r.draft.agreement,
                                                            self.verification.batch_limit(r.n_past + rows))
            self.corrections.learn_ties(r.ties_settled, r.n_accepted + 1, copy=copy)
        # a round timed as one decode teaches the target's speed (a Llama's rounds are not timed)
        # (a batch shared with other sequences times them all: it says nothing of this stream's own rows)
        if r.target_seconds > 0 and self.verification.one_call(rows, r.n_past, one_batch) and not r.ties_settled \
                and not r.shared:
            self.target_scale = self._rescale(self.target_scale, r.target_seconds, self.costs.batch_seconds(rows))
            if rows > 1:
                self.corrections.learn_rows(r.target_seconds, rows, self.target_scale)
            else:
                self.corrections.fade(r.n_past)


def make_drafter(mode: str, verification: Verification, costs: Costs | None, *, model: ModelDrafter | None = None,
                 lookup: LookupDrafter | None = None, draft_max: int | None = None, lookup_max: int | None = None,
                 p_min: float | None = None, heads: dict | None = None) -> tuple[Drafter | None, int]:
    """The one drafter factory (Engine and GGUFDraftModel): a fresh drafter for one generation and its
    round budget. draft: the draft model, draft_max tokens (DRAFT_MAX without one); lookup: with measured
    costs, the cost-aware planner over lookup alone (a copy is drafted as far as it pays, and not at all
    where it does not), without them lookup drafts of draft_max; auto: the planner over lookup and the
    draft model (up to draft_max, or as far as the measured batches reach). Lookup drafts run to
    lookup_max. Modes that do not speculate (the target or the draft alone): no drafter. model, lookup: the drafters
    to use (a ModelDrafter of the generation's own; a LookupDrafter whose index the caller keeps), else fresh ones.
    heads: HeadDrafters by name (mtp, eagle3, dflash: the mode of that name drafts draft_max tokens with it, DRAFT_MAX
    without one, capped at a DFlash block; auto weighs each beside the others)."""
    if mode not in DRAFTING_MODES:
        return None, 0
    if mode in HEAD_MODES:
        head = (heads or {}).get(HEAD_MODES[mode])
        if head is None:
            raise GGUFSpecError(f"mode {mode!r} needs its head: " + ("a target with MTP (NextN) layers" if mode == "mtp"
                                                                   else f"an {mode} draft GGUF given with -md"))
        return head, min(draft_max or DRAFT_MAX, getattr(head.head, "max_draft", None) or MAX_BATCH)
    if mode == "draft":
        if model is None:
            raise GGUFSpecError("mode 'draft' needs a draft model (-md DRAFT)")
        return model, draft_max or DRAFT_MAX
    if mode == "auto" and costs is None:
        raise GGUFSpecError("mode 'auto' needs the measured costs (Engine(measure=True))")
    lookup = lookup or LookupDrafter()
    if mode == "lookup" and costs is None:
        return lookup, draft_max or DRAFT_MAX
    model_max = draft_max or len(costs.target_batch_seconds) - 1
    lookup_max = lookup_max or model_max
    auto = AutoDrafter(verification, costs, lookup=lookup, model=model if mode == "auto" else None,
                       model_max=model_max, lookup_max=lookup_max, model_p_min=p_min,
                       heads=heads if mode == "auto" else None)
    return auto, max(model_max, lookup_max)
