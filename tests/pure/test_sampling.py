"""The acceptance math on hand-made vectors: no model involved."""

import numpy as np
import pytest

from ggufspec.errors import GGUFSpecError
from ggufspec.sampling import (Picker, SamplingParams, apply_min_p, apply_top_k, apply_top_p, max_prob,
                               probs_from_logits, sample, top2_gap, verify, verify_greedy)


def test_greedy_params_give_one_hot_on_argmax():
    p = probs_from_logits(np.array([0.1, 2.0, 1.9]), SamplingParams(temperature=0))
    assert p.tolist() == [0.0, 1.0, 0.0]


def test_temperature_softmax_matches_formula():
    logits = np.array([1.0, 2.0, 3.0])
    p = probs_from_logits(logits, SamplingParams(temperature=0.5))
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(p, expected)


def test_top_k_keeps_k_largest():
    out = apply_top_k(np.array([0.0, 5.0, 1.0, 4.0, 3.0]), 2)
    assert np.isfinite(out).tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(apply_top_p(probs, 0.8), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    np.testing.assert_allclose(apply_top_p(probs, 0.81), np.array([0.5, 0.3, 0.15, 0]) / 0.95)


def test_min_p_drops_tokens_below_fraction_of_top():
    probs = np.array([0.6, 0.3, 0.1])
    np.testing.assert_allclose(apply_min_p(probs, 0.4), [2 / 3, 1 / 3, 0])


def test_filters_then_temperature_like_llama_cpp():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.8))
    kept = np.exp(logits[:2] / 2.0)
    np.testing.assert_allclose(p, np.r_[kept / kept.sum(), 0, 0])


def test_sample_follows_probabilities():
    rng = np.random.default_rng(0)
    probs = np.array([0.2, 0.0, 0.5, 0.3])
    counts = np.bincount([sample(probs, rng) for _ in range(20000)], minlength=4) / 20000
    np.testing.assert_allclose(counts, probs, atol=0.015)
    assert counts[1] == 0


def test_verify_accepts_when_target_likes_the_draft_more():
    q = np.array([[0.5, 0.5, 0.0]])
    p = np.array([[0.9, 0.1, 0.0], [0.0, 0.0, 1.0]])
    rng = np.random.default_rng(1)
    for _ in range(200):  # p(x)/q(x) = 1.8 >= 1: always accepted, then the bonus token from p[1]
        assert verify([0], q, p, rng) == (1, 2)


def test_verify_rejects_at_rate_one_minus_p_over_q_and_resamples_residual():
    q = np.array([[1.0, 0.0, 0.0]])
    p = np.array([[0.25, 0.75, 0.0], [1.0, 0.0, 0.0]])
    rng = np.random.default_rng(2)
    results = [verify([0], q, p, rng) for _ in range(20000)]
    accepted = sum(n for n, _ in results) / len(results)
    assert abs(accepted - 0.25) < 0.015
    # On rejection the residual max(p - q, 0) = [0, 0.75, 0] leaves only token 1.
    assert {t for n, t in results if n == 0} == {1}
    assert {t for n, t in results if n == 1} == {0}  # the bonus token, from p[1]


def test_verify_stops_at_first_rejection():
    q = np.array([[1.0, 0.0], [1.0, 0.0]])
    p = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert verify([0, 0], q, p, np.random.default_rng(0)) == (1, 1)


def test_verify_output_follows_p_not_q():
    """The whole point: draw x ~ q, verify, and the emitted first token is distributed as p."""
    rng = np.random.default_rng(3)
    V = 5
    p = rng.dirichlet(np.ones(V), size=2)
    q = rng.dirichlet(np.ones(V) * 0.3, size=1)
    counts = np.zeros(V)
    n = 40000
    for _ in range(n):
        x = sample(q[0], rng)
        n_acc, nxt = verify([x], q, p, rng)
        counts[x if n_acc == 1 else nxt] += 1
    np.testing.assert_allclose(counts / n, p[0], atol=0.01)
    assert np.abs(counts / n - q[0]).max() > 0.05  # and it is not q's


def test_verify_greedy():
    assert verify_greedy([3, 4, 5], [3, 4, 9, 1]) == (2, 9)
    assert verify_greedy([3, 4], [3, 4, 7]) == (2, 7)
    assert verify_greedy([], [6]) == (0, 6)


def test_near_ties_and_gap():
    from ggufspec.sampling import Picker

    logits = np.array([[1.0, 0.95, 0.0], [3.0, 1.0, 0.0]])
    picks, gaps = Picker(SamplingParams()).judge(logits, 0, 0.1)
    assert picks == [0, 0] and gaps[0] == pytest.approx(0.05) and gaps[1] is None
    assert Picker(SamplingParams()).judge(logits, 0) == ([0, 0], [None, None])
    assert top2_gap(logits[1]) == pytest.approx(2.0)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_coupled_scores_and_gaps_are_log_p_plus_noise_in_logits(temperature):
    """The coupled pick is argmax(l / T + G_t) at any temperature, and a near-tie's gap is in logits (T times the
    gap of those scores), whichever way the float32 scores are scaled."""
    from ggufspec.sampling import Picker, PositionNoise

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((6, 1000)).astype(np.float32) * 4
    noise = PositionNoise(9, 1000)
    picks, gaps = Picker(SamplingParams(temperature=temperature), noise).judge(rows, 5, margin=1e9)
    for i, row in enumerate(rows):
        exact = row.astype(np.float64) / temperature + noise.at(5 + i)
        assert picks[i] == int(np.argmax(exact))
        assert gaps[i] == pytest.approx(temperature * top2_gap(exact), rel=1e-4)


def test_max_prob_leaves_out_only_what_cannot_count():
    x = np.random.default_rng(0).standard_normal(151_936).astype(np.float32) * 10
    exact = np.exp(x.astype(np.float64) - x.max())
    assert max_prob(x) == pytest.approx(1.0 / exact.sum(), rel=1e-7)


def test_max_prob():
    logits = np.array([0.0, np.log(3.0)])
    assert max_prob(logits) == pytest.approx(0.75)


def test_position_noise_depends_on_seed_and_position_alone():
    from ggufspec.sampling import PositionNoise

    a, b = PositionNoise(3, 50), PositionNoise(3, 50, keep=2)
    for t in (7, 1, 9, 7, 100, 1):
        assert np.array_equal(a.at(t), b.at(t))
    assert not np.array_equal(a.at(1), a.at(2)) and not np.array_equal(a.at(1), PositionNoise(4, 50).at(1))


def test_coupled_picks_are_samples_of_p():
    """argmax(log p + G_t) over many positions draws from p (filters and temperature applied)."""
    from ggufspec.sampling import Picker, PositionNoise

    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)):
        p = probs_from_logits(logits, params)
        picker = Picker(params, PositionNoise(0, len(logits), keep=1))
        n = 20000
        counts = np.bincount([picker.pick(logits, t) for t in range(n)], minlength=len(logits))
        keep = p > 0
        assert counts[~keep].sum() == 0
        chi2 = (((counts - n * p)[keep]) ** 2 / (n * p[keep])).sum()
        assert chi2 < 25, (counts, n * p)


def test_a_tiny_temperature_is_the_argmax_without_nan():
    from ggufspec.sampling import tempered_logits

    logits = np.array([1.0, 3.0, 2.9, -np.inf])
    for t in (1e-38, 1e-320):
        x = tempered_logits(logits, SamplingParams(temperature=t))
        assert not np.isnan(x).any() and int(np.argmax(x)) == 1
        assert probs_from_logits(logits, SamplingParams(temperature=t))[1] == 1.0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_row_that_is_not_finite_is_one_error_naming_whose_it_is(bad):
    """A NaN row's argmax is its first NaN (token 0 for a NaN model): once written forever, or sampled with warnings."""
    row = np.array([0.5, 2.0, bad, 1.0], dtype=np.float32)
    with pytest.raises(GGUFSpecError, match="the target's logits are not finite"):
        Picker(SamplingParams()).pick(row, 0)
    with pytest.raises(GGUFSpecError, match="the draft's logits are not finite"):
        Picker(SamplingParams(), whose="the draft's").judge(np.stack([row, row]), 0)
    for params in (SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.9)):
        with pytest.raises(GGUFSpecError, match="logits are not finite"):
            probs_from_logits(row, params)
    assert Picker(SamplingParams()).pick(np.array([0.0, -np.inf, 3.0]), 0) == 2  # -inf (a filtered token) is fine


@pytest.mark.parametrize("params", [SamplingParams(1.0, top_k=7), SamplingParams(1.0, top_p=0.8),
                                    SamplingParams(1.0, min_p=0.1), SamplingParams(1.0, top_k=30, top_p=0.9, min_p=0.02)])
def test_filter_edges_bracket_what_the_filters_keep(params):
    """With no drift both edges keep what the filters keep; with drift they widen around it."""
    from ggufspec.sampling import _shaped, filter_edges

    row = np.random.default_rng(1).normal(size=500) * 3
    kept = np.isfinite(_shaped(row, params))
    surely, maybe = filter_edges(row, params, 0.0)
    assert np.array_equal(row >= surely, kept) and np.array_equal(row >= maybe, kept)
    for drift, wider in ((0.3, lambda a, b: a <= b), (1.5, lambda a, b: a < b)):
        surely, maybe = filter_edges(row, params, drift)
        assert wider(np.count_nonzero(row >= surely), kept.sum()) and wider(kept.sum(), np.count_nonzero(row >= maybe))
        assert np.all(kept[row >= surely])  # a token kept under any drift is kept now
