"""Pure numpy: logits to probabilities, sampling, and speculative verification.

Notation follows Leviathan et al. (2023): `p` is the target's distribution, `q` the draft's,
`p_prime` the residual max(0, p - q) that a rejected position is resampled from. The random
source is always an explicit `numpy.random.Generator`, so a seed reproduces a run.
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .errors import GGUFSpecError


@dataclass(frozen=True)
class SamplingParams:
    """How logits become a distribution; the same shaping is applied to p and to q."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def apply_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits (others become -inf). k <= 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    out = np.full_like(logits, -np.inf)
    keep = np.argpartition(logits, -k)[-k:]  # a partial sort: O(n), not O(n log n)
    out[keep] = logits[keep]
    return out


def not_finite(whose: str) -> GGUFSpecError:
    """The one line for a row of logits holding NaN or infinity (weights that are NaN: a damaged file)."""
    return GGUFSpecError(f"{whose} logits are not finite numbers (NaN or infinity): its weights are damaged or overflow "
                         "on this build; download the file again, or try another quantisation")


def softmax(logits: np.ndarray, whose: str = "the model's") -> np.ndarray:
    x = logits.astype(np.float64, copy=True)
    top = x.max()
    if not np.isfinite(top):  # any NaN makes the max NaN: the check costs no pass of its own
        raise not_finite(whose)
    x -= top
    np.exp(x, out=x)
    x /= x.sum()
    return x


def apply_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose mass reaches top_p, renormalised."""
    if top_p >= 1.0:
        return probs
    candidates = np.flatnonzero(probs)
    order = candidates[np.argsort(-probs[candidates], kind="stable")]
    cumulative = np.cumsum(probs[order])
    n_keep = int(np.searchsorted(cumulative, top_p, side="left")) + 1
    out = np.zeros_like(probs)
    kept = order[:n_keep]
    out[kept] = probs[kept]
    return out / out.sum()


def apply_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens less likely than min_p times the most likely one, renormalised."""
    if min_p <= 0.0:
        return probs
    out = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return out / out.sum()


def tempered_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """log p up to a constant (float64): filters in llama.cpp's order (top-k, top-p, min-p on the
    untempered distribution; dropped tokens -inf), then the temperature over the survivors. The
    maximum is subtracted before dividing, so a tiny temperature gives -inf, never inf - inf."""
    x = _shaped(logits, params).astype(np.float64, copy=True)
    with np.errstate(over="ignore", invalid="ignore"):  # a row holding NaN or inf turns all -inf: softmax names it
        x -= x.max()
        x /= params.temperature
    x[np.isnan(x)] = -np.inf  # -inf / tiny
    return x


def probs_from_logits(logits: np.ndarray, params: SamplingParams, whose: str = "the target's") -> np.ndarray:
    """The distribution a sampler draws from, over the whole vocabulary (float64, sums to 1).

    Filters run in llama.cpp's order: top-k, top-p, min-p on the untempered distribution,
    then temperature over the survivors. Greedy params give a one-hot vector.
    """
    logits = np.asarray(logits)
    if params.greedy:
        out = np.zeros(logits.shape[-1])
        top = int(np.argmax(logits))  # the first NaN where there is one
        if not np.isfinite(logits[top]):
            raise not_finite(whose)
        out[top] = 1.0
        return out
    return softmax(tempered_logits(logits, params), whose)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a probability vector (inverse CDF; one uniform per draw)."""
    cumulative = np.cumsum(probs)
    u = rng.random() * cumulative[-1]
    return int(min(np.searchsorted(cumulative, u, side="right"), len(probs) - 1))


def verify(draft_tokens, q: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1).

    draft_tokens: the k tokens the draft proposed; q: (k, V) the draft's distributions they were
    drawn from; p: (k+1, V) the target's distributions at the same positions plus one.
    Returns (n_accepted, next_token): the first n_accepted drafts stand, then next_token, drawn
    from the residual p_prime = normalise(max(0, p - q)) at a rejection, or from p[k] (the bonus
    token) when every draft was accepted. The output then follows p exactly.
    """
    for i, x in enumerate(draft_tokens):
        if q[i, x] <= 0.0 or rng.random() * q[i, x] >= p[i, x]:  # reject with prob 1 - min(1, p/q)
            p_prime = np.maximum(p[i] - q[i], 0.0)
            total = p_prime.sum()
            if total <= 0.0:  # p == q up to rounding: the residual is empty, p itself is the answer
                return i, sample(p[i], rng)
            return i, sample(p_prime / total, rng)
    k = len(draft_tokens)
    return k, sample(p[k], rng)


def verify_greedy(draft_tokens, target_choice) -> tuple[int, int]:
    """Greedy verification: accept drafts while they equal the target's argmax, then take the target's."""
    for i, x in enumerate(draft_tokens):
        if int(target_choice[i]) != int(x):
            return i, int(target_choice[i])
    k = len(draft_tokens)
    return k, int(target_choice[k])


def top2_gap(logits: np.ndarray) -> float:
    """The logit gap between the best and second-best token of one row."""
    two = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]
    return float(two[1] - two[0])


# Logits this far below the top add at most n * e^-30 (1.4e-8 for 151,936 tokens) to softmax's sum.
NEGLIGIBLE = 30.0


def max_prob(logits: np.ndarray) -> float:
    """Probability of the most likely token under softmax(logits), without building the vector: only
    the logits within NEGLIGIBLE of the top are summed (a relative error below n * e^-30)."""
    x = np.asarray(logits)
    top = x.max()
    near = x[x > top - NEGLIGIBLE].astype(np.float64)
    return float(1.0 / np.exp(near - top).sum())


# -- seeded sampling that does not depend on the drafter --------------------------------------

# How sampled drafts are verified: "coupled" (PositionNoise below: a seed gives the target's own text
# whatever was drafted) or "rejection" (Leviathan's rule, `verify` above).
SAMPLING_RULES = ("coupled", "rejection")


class PositionNoise:
    """Gumbel noise G_t over the vocabulary that depends on (seed, t) alone, t the token's position
    in the sequence. argmax(log p_t + G_t) is an exact sample of p_t (the Gumbel-max trick), so a
    target that picks its tokens this way writes the same text whoever proposed the drafts: the
    drafter-invariant coupling of Daliri, Musco and Suresh (2024). A draft that proposes
    argmax(log q_t + G_t) with the same noise is accepted at least (1 - d) / (1 + d) of the time,
    d the total variation distance between p_t and q_t."""

    def __init__(self, seed: int, n_vocab: int, keep: int = 64, ahead: bool = False):
        self.seed, self.n_vocab, self.keep = int(seed), int(n_vocab), keep
        self._cache: dict[int, np.ndarray] = {}
        self._uniform = np.empty(self.n_vocab)  # scratch: a fresh 1.2 MB array each time costs its page faults
        # ahead: positions asked for by `prefetch` are made on a worker thread while llama.cpp decodes
        # (both release the GIL): for a target on a GPU, where the CPU waits meanwhile
        self.ahead = ahead
        self._pending: dict[int, Future] = {}

    def at(self, t: int) -> np.ndarray:
        """G_t (float32): -log(E) for E = -log(U) ~ Exp(1), U uniform in float64, so the tail near U = 1
        that decides the largest G keeps float64's resolution; a vocabulary of 151,936 costs about 0.5 ms."""
        g = self._cache.get(t)
        if g is None:
            future = self._pending.pop(t, None)
            g = future.result() if future is not None else self._make(t, self._uniform)
            if len(self._cache) >= self.keep:
                del self._cache[min(self._cache)]
            self._cache[t] = g
        return g

    def prefetch(self, positions) -> None:
        """Start making G_t for these positions on the worker thread (with ahead=True; else nothing)."""
        if not self.ahead:
            return
        for t in positions:
            if t not in self._cache and t not in self._pending:
                self._pending[t] = _worker().submit(self._make, t, None)

    def close(self) -> None:
        """Drop what was prefetched and not used (a generation's end)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    def _make(self, t: int, scratch: np.ndarray | None) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(t)])
        u = rng.random(self.n_vocab) if scratch is None else rng.random(out=scratch)
        with np.errstate(divide="ignore"):
            np.log(u, out=u)
            np.negative(u, out=u)  # E
            g = u.astype(np.float32)
            np.log(g, out=g)
            np.negative(g, out=g)  # G
        return g


_WORKER: list[ThreadPoolExecutor] = []


def _worker() -> ThreadPoolExecutor:
    """One thread for every generation's prefetched noise, made when first needed."""
    if not _WORKER:
        _WORKER.append(ThreadPoolExecutor(1, thread_name_prefix="ggufspec-noise"))
    return _WORKER[0]


class Picker:
    """How a row of logits becomes a token when that is a function of the row: the argmax (greedy),
    or with `noise` the coupled sample argmax(log p_t + G_t) = argmax(l / T + G_t) over the shaped logits
    l (the filters' survivors; the rest -inf), computed in float32 as argmax(l + T * G_t) where T < 1 and
    as argmax(l / T + G_t) otherwise (neither can overflow). Row i of a batch whose first row predicts
    position t0 predicts position t0 + i. Verification compares these picks with the draft; a batched
    row whose best two are within `margin` logits is a near-tie."""

    def __init__(self, params: SamplingParams, noise: PositionNoise | None = None, whose: str = "the target's"):
        self.params, self.whose = params, whose
        self.noise = None if params.greedy else noise
        self._shaped = params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0
        t = params.temperature
        self._unit = 1.0 if self.noise is None or t < 1.0 else 1.0 / t  # scores per logit
        self._noise_scale = t if t < 1.0 else 1.0
        self._scratch = np.empty(0, dtype=np.float32)

    def scores(self, row: np.ndarray, t: int) -> np.ndarray:
        """The row's scores: the row itself, or the coupled scores in a scratch buffer that the next call
        overwrites (about 0.1 ms for 151,936 tokens once G_t is made)."""
        if self.noise is None:
            return row
        if len(self._scratch) < len(row):
            self._scratch = np.empty(len(row), dtype=np.float32)
        out = self._scratch[: len(row)]
        shaped = _shaped(row, self.params) if self._shaped else row
        np.multiply(self.noise.at(t)[: len(row)], self._noise_scale, out=out)
        out += shaped if self._unit == 1.0 else np.multiply(shaped, self._unit, dtype=np.float32)
        return out

    def pick(self, row: np.ndarray, t: int) -> int:
        s = self.scores(row, t)
        pick = int(np.argmax(s))
        self._check(s[pick])
        return pick

    def gap(self, row: np.ndarray, t: int) -> float:
        """The row's top-2 gap in logits: of the logits, or of the coupled scores (what a tie margin is held to)."""
        return top2_gap(self.scores(row, t)) / self._unit

    def _check(self, score) -> None:
        """argmax picks a row's first NaN (a NaN in the row makes the coupled score NaN too), so the picked score alone
        tells a row that is not finite: one number, not another pass over the vocabulary."""
        if not math.isfinite(score):  # a float's own test: numpy's ufunc on one number costs a microsecond
            raise not_finite(self.whose)

    def judge(self, rows: np.ndarray, t0: int, margin: float | None = None) -> tuple[list[int], list[float | None]]:
        """Each row's pick, and (with a margin) the top-2 gap in logits of each row whose runner-up is within
        `margin` logits of its pick (None for the others, and for every row without a margin): one set of
        scores a row."""
        picks: list[int] = []
        gaps: list[float | None] = []
        for i, row in enumerate(rows):
            s = self.scores(row, t0 + i)
            pick = int(np.argmax(s))
            self._check(s[pick])
            picks.append(pick)
            tied = margin is not None and (np.count_nonzero(s >= s[pick] - margin * self._unit) > 1
                                           or self._shaped and self._edge_tie(row, s, pick, t0 + i, margin))
            gaps.append(top2_gap(s) / self._unit if tied else None)
        return picks, gaps

    def _edge_tie(self, row: np.ndarray, s: np.ndarray, pick: int, t: int, margin: float) -> bool:
        """Whether a filter's edge (top-k, top-p, min-p) decides this coupled pick within `margin` logits of drift:
        the pick is a token the filters might drop, or a token they dropped but might keep scores within the
        margin of the pick (its noise can outscore the pick by far more than the row's top-2 gap says)."""
        x, p = np.asarray(row), self.params
        dropped = np.isneginf(s)
        raw = x * self._unit + self.noise.at(t)[: len(x)] * self._noise_scale  # every token's score, were it kept
        reach = s[pick] - margin * self._unit
        if np.max(raw, where=dropped, initial=-np.inf) < reach and p.top_p >= 1.0 and \
                x[pick] >= np.max(x, where=dropped, initial=-np.inf) + 2 * margin and \
                (p.min_p <= 0.0 or x[pick] >= x.max() + math.log(p.min_p) + margin):
            return False  # the common row, in a few passes: no dropped token could win, the pick stays kept
        surely, maybe = filter_edges(x, p, margin)
        return bool(x[pick] < surely or np.any(dropped & (raw >= reach) & (x >= maybe)))


def filter_edges(row: np.ndarray, params: SamplingParams, drift: float) -> tuple[float, float]:
    """The filters keep the tokens whose logit is at least some edge. With each logit off by up to `drift` against
    the top one's (a batched row's; two tokens' logits then move up to twice that against each other): (the logit
    from which a token is kept under any such drift, the logit from which it may be kept under some). O(vocabulary)
    but for top-p, which sorts the tokens top-k leaves it, as apply_top_p does."""
    x = np.asarray(row, dtype=np.float64)
    top = float(x.max())
    surely, maybe = -np.inf, -np.inf
    k = params.top_k
    if 0 < k < len(x):
        kth, after = np.partition(x, [len(x) - k - 1, len(x) - k])[[len(x) - k, len(x) - k - 1]]
        surely, maybe = after + 2 * drift + 1e-9, kth - 2 * drift  # ahead of the first dropped by more than a move
    if params.top_p < 1.0:  # the mass of a prefix against the rest moves by up to e^(2 drift) either way
        w, p = math.exp(2 * drift), params.top_p
        xs = -np.sort(-x[x >= maybe]) if np.isfinite(maybe) else -np.sort(-x)
        weights = np.exp(xs - top)

        def edge(below: float, mass: float) -> float:  # apply_top_p's last kept logit among those >= below
            m = int(np.count_nonzero(xs >= below))
            if mass >= 1.0:
                return xs[m - 1]
            cum = np.cumsum(weights[:m]) / weights[:m].sum()
            return xs[min(m, int(np.searchsorted(cum, mass, side="left")) + 1) - 1]
        surely = max(surely, edge(surely, p / w / (1 - p + p / w)))
        maybe = max(maybe, edge(maybe, p * w / (1 - p + p * w)))
    if params.min_p > 0.0:  # a threshold on the logit against the top's
        cut = top + math.log(params.min_p)
        surely, maybe = max(surely, cut + drift), max(maybe, cut - drift)
    return min(surely, top), maybe


def _shaped(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The row's logits with the tokens the filters drop at -inf (the temperature is the caller's)."""
    shaped = apply_top_k(np.asarray(row), params.top_k)
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = apply_min_p(apply_top_p(softmax(shaped), params.top_p), params.min_p)
        shaped = np.where(probs > 0, shaped, -np.inf)
    return shaped
