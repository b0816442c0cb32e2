"""Statistics for the distribution tests: Pearson's chi-square against expected probabilities, and a
critical value far in the tail (so a correct sampler fails about once in ten thousand runs)."""

import numpy as np


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty); z=3.719 is a 1e-4 tail."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    expected = probs * n
    big = expected >= 5  # pool the rare cells so the approximation holds
    obs = np.r_[counts[big], counts[~big].sum()]
    exp = np.r_[expected[big], expected[~big].sum()]
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum() - 1)


def two_sample_chi2(a: dict, b: dict) -> tuple[float, int]:
    """Chi-square of two samples' counts (dicts of outcome -> count) being drawn from one distribution."""
    keys = [k for k in set(a) | set(b) if a.get(k, 0) + b.get(k, 0) >= 10]
    rest = (sum(v for k, v in a.items() if k not in keys), sum(v for k, v in b.items() if k not in keys))
    rows = [(a.get(k, 0), b.get(k, 0)) for k in keys] + ([rest] if sum(rest) else [])
    na, nb = sum(r[0] for r in rows), sum(r[1] for r in rows)
    stat = 0.0
    for x, y in rows:
        total = x + y
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(rows) - 1


def assert_follows_p_not_q(counts: np.ndarray, p: np.ndarray, q: np.ndarray) -> None:
    """The samples follow the target's p (chi-square below the 1e-4 tail) and not the draft's q (three times
    past it: the draft differs enough from the target for the test to mean anything)."""
    stat_p, df_p = chi2(counts, p)
    stat_q, df_q = chi2(counts, q)
    assert stat_p < chi2_critical(df_p), f"speculative samples do not follow p: chi2 {stat_p:.1f} on {df_p} df"
    assert stat_q > 3 * chi2_critical(df_q), "the draft is too close to the target for this test to mean anything"
