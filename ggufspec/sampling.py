"""Pure numpy: logits to probabilities, sampling, and speculative verification.

Notation follows Leviathan et al. (2023): `p` is the target's distribution, `q` the draft's,
`p_prime` the residual max(0, p - q) that a rejected position is resampled from. The random
source is always an explicit `numpy.random.Generator`, so a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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


def softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64, copy=True)
    x -= x.max()
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


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampler draws from, over the whole vocabulary (float64, sums to 1).

    Filters run in llama.cpp's order: top-k, top-p, min-p on the untempered distribution,
    then temperature over the survivors. Greedy params give a one-hot vector.
    """
    logits = np.asarray(logits)
    if params.greedy:
        out = np.zeros(logits.shape[-1])
        out[int(np.argmax(logits))] = 1.0
        return out
    shaped = apply_top_k(logits, params.top_k)
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = softmax(shaped)
        probs = apply_top_p(probs, params.top_p)
        probs = apply_min_p(probs, params.min_p)
        shaped = np.where(probs > 0, shaped, -np.inf)
    return softmax(shaped / params.temperature)


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


def near_ties(logits: np.ndarray, margin: float) -> np.ndarray:
    """Per row: is some other token within `margin` of the top logit? One pass, no sort."""
    top = logits.max(axis=-1, keepdims=True)
    return np.count_nonzero(logits >= top - margin, axis=-1) > 1


def top2_gap(logits: np.ndarray) -> float:
    """The logit gap between the best and second-best token of one row."""
    two = np.partition(np.asarray(logits, dtype=np.float64), -2)[-2:]
    return float(two[1] - two[0])


def max_prob(logits: np.ndarray) -> float:
    """Probability of the most likely token under softmax(logits), without building the vector."""
    x = np.asarray(logits, dtype=np.float64)
    return float(1.0 / np.exp(x - x.max()).sum())
