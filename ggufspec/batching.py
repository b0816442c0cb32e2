"""Several generations at once on one target: each on its own sequence of one llama.cpp context, every step ONE
target batch holding each active sequence's [last] + draft rows, each verified from its own rows by the loop's
own two halves (`Steps.plan`, `Steps.finish`). `Batch` steps them; `serving.Scheduler` admits requests into free
sequences between steps (continuous batching) and hands each its chunks.

Speculation under load: a verify row costs little while the batch is small and about a step each once it is
not, so auto's streams share one draft budget per step, chosen from the measured cost of a batch of that many
rows (`batch_budget`): at one stream auto drafts as it does alone; as streams are added it drafts less, and
finally not at all. Fixed modes draft as told.

Exactness under load: where the backend's batches are bit-identical to one-token decoding only up to a few rows
(a Q4_K_M target's repacked CPU kernels: 3), a step of more rows is decoded in groups of the size that costs least
(`exact_size`: four streams' rows as 2 + 2 where 3 rows cost more than 2 + 1). They are not decoded at once with
near-ties re-checked, as one long round past the exact cache is: a row computed in a batch that is not exact
leaves its sequence's KV a little off, and a near-tie some tokens later can then go the other way (one of four
answers at four streams, Q4_K_M on a Zen 3), which no re-check of that later row can see.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from .costs import MARGIN, Costs, expected_tokens
from .generation import Chunk, Generation
from .verification import Verification

# A stream's acceptance before it has drafted: a light prior (Laplace's), so a few rounds decide.
PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0


def ubatches(rows: list[int], unified: bool, ids: list[int] | None = None) -> list[int]:
    """The ubatches llama.cpp computes for one batch holding these rows per sequence (ids: the sequences', in
    increasing order; None: consecutive): one where the KV cache is unified; else (a KV stream per sequence, its
    split_equal(sequential=true)) each ubatch takes a run of sequences of consecutive ids that still have rows, from
    the lowest, and as many rows of each as the fewest of them has left. So sequences of unequal rows take one
    ubatch per distinct length, and sequences 0 and 2 two ubatches where 0 and 1 take one."""
    if unified:
        return [sum(rows)]
    left = {i: r for i, r in zip(range(len(rows)) if ids is None else ids, rows) if r}
    out = []
    while left:
        run = []
        for i in sorted(left):
            if run and i != run[-1] + 1:
                break
            run.append(i)
        m = min(left[i] for i in run)
        out.append(m * len(run))
        for i in run:
            left[i] -= m
            if not left[i]:
                del left[i]
    return out


def runs(ids: set[int]) -> int:
    """How many ubatches a step of one row for each of these sequences takes with a KV stream each: one per run of
    consecutive ids (`ubatches`)."""
    return len(ubatches([1] * len(ids), False, sorted(ids)))


def groups(rows: list[int], limit: int | None, ids: list[int] | None = None) -> list[list[int]]:
    """Which parts (indices) each decode holds: all in one, or (exact verification: limit rows at most, so
    every row is computed as one-token decoding computes it) as many in each as fit, a group never reaching across
    a gap in the sequences' ids (`ids`; llama.cpp would decode it as two anyway, see `ubatches`)."""
    if limit is None:
        return [list(range(len(rows)))]
    ids = list(range(len(rows))) if ids is None else ids
    out, size = [[]], 0
    for i, r in enumerate(rows):
        if out[-1] and (size + r > limit or ids[i] != ids[out[-1][-1]] + 1):
            out.append([])
            size = 0
        out[-1].append(i)
        size += r
    return out


def grouped_seconds(costs: Costs, rows: list[int], size: int | None, unified: bool,
                    ids: list[int] | None = None) -> float:
    """What decoding these rows per sequence (ids: theirs, None: consecutive) costs in groups of at most `size` rows
    (None: one decode)."""
    ids = list(range(len(rows))) if ids is None else ids
    return sum(costs.batch_seconds(u) for g in groups(rows, size, ids)
               for u in ubatches([rows[i] for i in g], unified, [ids[i] for i in g]))


def _exact_sizes(costs: Costs, limit: int) -> set[int]:
    """The group sizes exact decoding weighs: `limit`, and the exact batch size with the least cost per row
    (`Costs.chunk`), often the same."""
    return {limit, costs.chunk(limit)}


def exact_size(costs: Costs, rows: list[int], limit: int | None, unified: bool,
               ids: list[int] | None = None) -> int | None:
    """The group size exact decoding packs these rows in: `limit` or the exact batch size with the least cost per
    row (where 3 rows cost 2.2 steps and 2 rows 1.4, four streams' rows go 2 + 2, not 3 + 1), whichever costs less
    for these rows (None where limit is: one decode)."""
    if limit is None:
        return None
    return min(_exact_sizes(costs, limit), key=lambda size: (grouped_seconds(costs, rows, size, unified, ids), -size))


def step_seconds(costs: Costs, rows: list[int], limit: int | None, unified: bool,
                 ids: list[int] | None = None) -> float:
    """What decoding these rows per sequence (ids: theirs, None: consecutive) costs, as `Batch` decodes them (in
    groups of `exact_size`)."""
    if limit is None:
        return grouped_seconds(costs, rows, None, unified, ids)
    return min(grouped_seconds(costs, rows, size, unified, ids) for size in _exact_sizes(costs, limit))


def gap_tokens(costs: Costs | None) -> float | None:
    """What a step's extra ubatch costs, in prompt tokens, from the measured table: a decode's fixed part (a one-row
    step less what a row adds up to four) over a prompt token's share of a batch of 64. (Qwen2.5-Coder 1.5B on a
    Zen 3: Q8_0 sequences 0 and 2 143 ms against 0 and 1 96; Q4_K_M 0, 2 and 3 128-136 ms against 0, 1 and 2
    110-115.)"""
    if costs is None:
        return None
    one, four, per_token = costs.batch_seconds(1), costs.batch_seconds(4), costs.batch_seconds(64) / 64
    return max(0.0, one - (four - one) / 3) / per_token


def identity_price(costs: Costs | None, n: int, unified: bool = False) -> tuple[int, float, float] | None:
    """What keeping each of n requests' answers the target's own costs a plain step of theirs (one row each), where
    it costs over a tenth more: (the size of the exact groups their rows are decoded in, the step's seconds so, its
    seconds as one decode, as llama-server decodes it). None where nothing was measured, no batch is exact here
    (one decode anyway), one KV cache holds them all (`-kvu`: no identity to keep), or n rows fit one exact decode."""
    if costs is None or unified or costs.exact_batch < 2 or n <= costs.exact_batch:
        return None
    rows = [1] * n
    size = exact_size(costs, rows, costs.exact_batch, unified)
    grouped, one = grouped_seconds(costs, rows, size, unified), grouped_seconds(costs, rows, None, unified)
    return (size, grouped, one) if grouped > 1.1 * one else None


def identity_price_line(costs: Costs | None, n: int, unified: bool = False) -> str | None:
    """`identity_price` for a reader: what n requests' exact groups cost in target steps against one decode, and the
    flag that trades it (None where it costs little or nothing)."""
    price = identity_price(costs, n, unified)
    if price is None:
        return None
    size, grouped, one = price
    step = costs.batch_seconds(1)
    within = f" up to {costs.exact_kv} cached tokens" if costs.exact_kv else ""  # beyond: one decode anyway
    return (f"{n} requests' rows decode in exact groups of {size}{within}, so that each answer is the target's own "
            f"text: {grouped / step:.2f} target steps a step here against {one / step:.2f} in one decode, as llama-server "
            "decodes them (--no-exact: one decode, near-ties decoded again alone, and an answer may leave a lone "
            "request's text)")


def batch_budget(costs: Costs, streams: list[tuple[float, float]], longest: int, limit: int | None = None,
                 unified: bool = False, ids: list[int] | None = None) -> int:
    """The most tokens each speculating stream may draft this step: of 0..longest, the length whose expected
    tokens per second over the whole batch are highest, and 0 unless drafting beats none by the margin, also
    (a KV stream per sequence, where unequal drafts cost a ubatch each) where only one stream drafts.
    streams: (acceptance, seconds per drafted token) of each; ids: their sequences' (None: consecutive)."""
    n = len(streams)

    def rate(d: int) -> float:
        tokens = sum(expected_tokens(alpha, d) for alpha, _ in streams)
        return tokens / (step_seconds(costs, [d + 1] * n, limit, unified, ids) + d * sum(step for _, step in streams))

    def one_drafts(d: int) -> float:  # auto's streams draft unequally (a copy here, none there): the worst case
        alpha, step = max(streams)
        tokens = expected_tokens(alpha, d) + n - 1
        return tokens / (step_seconds(costs, [d + 1] + [1] * (n - 1), limit, unified, ids) + d * step)

    base = rate(0)
    best = max(range(1, longest + 1), key=rate, default=0)
    pays = best and rate(best) > base * MARGIN and (unified or one_drafts(best) > base * MARGIN)
    return best if pays else 0


def trimmed(costs: Costs, lengths: list[int], alphas: list[float], auto: list[bool], limit: int | None,
            unified: bool, ids: list[int] | None = None) -> list[int]:
    """The draft lengths to verify once every stream has drafted: auto's drafts cut to the common length (or
    kept as drafted) that gives the batch the most expected tokens a second; other modes' as drafted."""
    best, best_rate = lengths, -1.0
    for cap in [None, *range(max(lengths, default=0) + 1)]:
        cut = [n if cap is None or not a else min(n, cap) for n, a in zip(lengths, auto)]
        tokens = sum(expected_tokens(alpha, n) for alpha, n in zip(alphas, cut))
        rate = tokens / step_seconds(costs, [n + 1 for n in cut], limit, unified, ids)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = cut, rate
    return best


def _ids(generations: list[Generation]) -> list[int] | None:
    """Their sequences' ids, in their order (increasing, as a step lists them), or None (taken as consecutive) where
    a target is not a sequence of a shared context."""
    ids = [getattr(g.ctx, "seq_id", None) for g in generations]
    return None if None in ids else ids


def _alpha(g: Generation) -> float:
    s = g.stats
    return min(0.99, (s.n_accepted + PRIOR_ACCEPTED) / (s.n_drafted + PRIOR_DRAFTED))


def _draft_step(g: Generation, costs: Costs) -> float:
    """Seconds per drafted token of a stream: as seen (leaving out the rounds where a lazy draft model caught up on the
    prompt: a one-off), else (nothing drafted yet) what a draft model step costs where its drafter may draft with one
    (measured at load), else the cheapest of its heads' (measured at load: MTP, EAGLE-3, DFlash), else nothing
    (prompt lookup)."""
    s, model = g.stats, getattr(g.drafter, "model", None)
    if drafted := s.n_drafted - s.caught_up_drafted:
        return (s.draft_seconds - s.caught_up_seconds) / drafted
    if model is not None and g.drafter.model_may_pay():
        return g.drafter.draft_cost or 0.0
    heads = [costs.head_step(name, 4) for name in getattr(g.drafter, "heads", ())]
    return min((h for h in heads if h is not None), default=0.0)


def _exactly(exact: bool, tie_margin: float) -> Verification:
    """How a round decoded in a batch shared with other sequences is judged: exact (every row computed as
    one-token decoding computes it: judged as it is) or not (each near-tie decoded again by itself)."""
    return Verification(exact_batch=1 << 30 if exact else 0, exact=False, tie_margin=tie_margin)


def one_by_one(calls: list[Callable]) -> list[tuple[object, float]]:
    """Each call's result (or the exception it raised), run one after another: `Batch`'s plan_together where
    nothing gathers the drafts' decodes (as llama.sequences.together does)."""
    out = []
    for call in calls:
        try:
            out.append((call(), 0.0))
        except Exception as e:  # noqa: BLE001 (that request fails, the others go on)
            out.append((e, 0.0))
    return out


class Batch:
    """Steps several generations, each on its own sequence, through one target decode per step (several where
    verification is exact: each of at most the bit-exact batch size). decode_together: [(target, tokens, "all")]
    -> rows per part (llama.sequences.decode_together). plan_together: runs every stream's plan (`one_by_one`,
    or llama.sequences.together: a draft model's steps of all streams in one decode each). unified: the KV cache
    is one for all sequences."""

    def __init__(self, decode_together: Callable, costs: Costs | None, *, longest: int = 16, unified: bool = False,
                 plan_together: Callable = one_by_one):
        self.decode_together, self.costs, self.longest, self.unified = decode_together, costs, longest, unified
        self.plan_together = plan_together

    def _limit(self, generations: list[Generation]) -> int | None:
        """The most rows one decode may hold so that each is computed bit-identically to one-token decoding (None:
        no such batch here, or past the cache length where one was seen: one decode, near-ties re-checked)."""
        limits = [g.verification.batch_limit(g.steps.target.n_past + 1 + self.longest) for g in generations]
        return None if None in limits else min(limits)

    def budget(self, generations: list[Generation], limit: int | None) -> int | None:
        """This step's draft cap for auto's streams (None: one stream, no cap)."""
        auto = [g for g in generations if g.settings.mode == "auto"]
        if len(generations) < 2 or not auto or self.costs is None:
            return None
        streams = [(_alpha(g), _draft_step(g, self.costs)) for g in generations]
        return batch_budget(self.costs, streams, self.longest, limit, self.unified, _ids(generations))

    def step(self, generations: list[Generation]) -> list[tuple[Generation, Chunk | BaseException]]:
        """One round for each generation (none finished): its chunk, or the error that ended it."""
        limit = self._limit(generations)
        budget = self.budget(generations, limit)
        out, plans = [], []
        calls = [functools.partial(g.steps.plan, budget if g.settings.mode == "auto" else None) for g in generations]
        for g, (plan, overcount) in zip(generations, self.plan_together(calls)):
            if isinstance(plan, BaseException):
                out.append((g, plan))
                continue
            plan.draft.seconds = max(0.0, plan.draft.seconds - overcount)  # its own cost, not the others' it waited on
            plans.append((g, plan))
        if len(plans) <= 1:  # alone in the batch: verified as one sequence is
            return out + [(g, _finish(g, plan)) for g, plan in plans]
        if self.costs is not None:
            lengths = trimmed(self.costs, [len(p.draft_tokens) for _, p in plans], [_alpha(g) for g, _ in plans],
                              [g.settings.mode == "auto" for g, _ in plans], limit, self.unified,
                              _ids([g for g, _ in plans]))
            plans = [(g, p if len(p.draft_tokens) == n else p.cut(n)) for (g, p), n in zip(plans, lengths)]
        alone = [(g, p) for g, p in plans if limit is not None and len(p.inputs) > limit]  # its own exact chunks
        together = [(g, p) for g, p in plans if limit is None or len(p.inputs) <= limit]
        rows_each, ids = [len(p.inputs) for _, p in together], _ids([g for g, _ in together])
        size = limit if self.costs is None else exact_size(self.costs, rows_each, limit, self.unified, ids)
        for part in groups(rows_each, size, ids):
            members = [together[i] for i in part]
            if len(members) == 1:
                alone += members
                continue
            start = time.perf_counter()
            try:
                rows = self.decode_together([(g.ctx, p.inputs, "all") for g, p in members])
            except Exception as e:  # noqa: BLE001 (decode_together left every sequence as it was)
                out += [(g, e) for g, _ in members]
                continue
            seconds = time.perf_counter() - start
            out += [(g, _finish(g, p, r, _exactly(limit is not None, g.verification.tie_margin), seconds))
                    for (g, p), r in zip(members, rows)]
        return out + [(g, _finish(g, p)) for g, p in alone]


def _finish(g: Generation, plan, rows=None, verification: Verification | None = None,
            seconds: float = 0.0) -> Chunk | BaseException:
    try:
        return g.take(g.steps.finish(plan, rows, verification, seconds))
    except Exception as e:  # noqa: BLE001
        return e
