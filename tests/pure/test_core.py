"""The loop, the sampling rules, auto and the Llama adapter's bookkeeping on a numpy target (tests/fake.py):
no llama.cpp, milliseconds a test. What needs llama.cpp itself is tested on tiny GGUF models elsewhere."""

import numpy as np
import pytest
from fake import FakeTarget, NoCopies, on_clock
from stats import chi2, chi2_critical

from ggufspec.auto import AutoDrafter
from ggufspec.core import Round, Stats
from ggufspec.costs import Costs, batch_drift
from ggufspec.drafters import LookupDrafter, ModelDrafter
from ggufspec.sampling import PositionNoise, SamplingParams, probs_from_logits
from ggufspec.speculative import prefill, rounds
from ggufspec.verification import DEFAULT_TIE_MARGIN, Verification, margin_for

GREEDY = SamplingParams()
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]


def generate(target, drafter=None, *, n=60, draft_max=4, params=GREEDY, seed=0, verification=Verification(),
             noise=None, prompt=PROMPT):
    logits, _ = prefill(target, prompt)
    if drafter is not None:
        drafter.reset(prompt)
    out, stats = [], Stats()
    for r in rounds(target, drafter, prompt, logits, params, np.random.default_rng(seed), max_tokens=n,
                    draft_max=draft_max if drafter is not None else 0, verification=verification, noise=noise):
        out += r.tokens
        stats.add(r)
    assert target.tokens == prompt + out[:-1]  # the cache holds exactly the text but its last token
    return out, stats


@pytest.mark.parametrize("closeness", [0.0, 0.3, 3.0])
@pytest.mark.parametrize("draft_max", [1, 4, 9])
def test_greedy_output_is_the_targets_with_a_draft_model(closeness, draft_max):
    target = FakeTarget(seed=1)
    ref, _ = generate(target)
    out, stats = generate(target, ModelDrafter(target.like(7, closeness)), draft_max=draft_max)
    assert out == ref and stats.n_drafted > 0
    if closeness == 0.0:  # the model as its own draft accepts every draft (mlx-lm's check)
        assert stats.n_accepted == stats.n_drafted


def test_greedy_output_is_the_targets_with_lookup_and_a_rejecting_draft():
    target = FakeTarget(seed=2, scale=0.5)
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 24, 200)]  # n-grams recur with other continuations
    ref, _ = generate(target, n=120, prompt=prompt)
    out, stats = generate(target, LookupDrafter(), n=120, draft_max=6, prompt=prompt)
    assert out == ref and stats.n_drafted > stats.n_accepted > 0


def test_exact_verification_decodes_in_chunks_and_stops_at_the_first_rejected_one():
    target = FakeTarget(seed=1)
    draft = ModelDrafter(target.like(7, 0.0))
    v = Verification(exact_batch=3, exact=True, chunk=3)
    target.batches.clear()
    generate(target, draft, draft_max=8, verification=v)
    assert max(target.batches[1:]) <= 3  # the prompt's batch aside
    target.batches.clear()
    wrong = ModelDrafter(target.like(7, 50.0))  # a draft that is nearly always wrong
    generate(target, wrong, draft_max=8, verification=v)
    assert sum(target.batches[1:]) < 4 * 60  # about one chunk of 3 a round, not 9 rows: later chunks never ran


def test_past_exact_kv_verification_is_one_batch():
    v = Verification(exact_batch=3, exact=True, exact_kv=20, chunk=3)
    assert v.batch_limit(20) == 3 and v.batch_limit(21) is None
    assert v.one_call(5, 30) and not v.one_call(5, 10)
    target = FakeTarget(seed=1)
    generate(target, ModelDrafter(target.like(7, 0.0)), draft_max=6, verification=v)
    assert max(target.batches[1:]) == 7  # [last] + 6 drafts, once the cache is past 20 tokens


def test_near_ties_in_a_drifting_batch_are_settled_one_token_at_a_time():
    """Batched rows carry a small error (as llama.cpp's do); re-deciding near-ties one token at a time
    keeps the text the target's. Negative control: with no tie margin the drift shows."""
    target = FakeTarget(seed=3, scale=0.3, batch_drift=0.2, exact_batch=1)
    draft = target.like(7, 0.0)
    ref, _ = generate(target, n=150)
    out, stats = generate(target, ModelDrafter(draft), n=150, draft_max=4, verification=Verification(tie_margin=2.0))
    assert out == ref and stats.ties_settled > 0
    bent = [generate(FakeTarget(seed=s, scale=0.3, batch_drift=0.2, exact_batch=1), n=150)[0] !=
            generate(FakeTarget(seed=s, scale=0.3, batch_drift=0.2, exact_batch=1),
                     ModelDrafter(FakeTarget(seed=s, scale=0.3).like(7, 0.0)), n=150,
                     verification=Verification(tie_margin=0.0))[0] for s in range(3, 8)]
    assert any(bent), "the drift never changed a greedy choice: the test has no power"


def test_a_near_tie_costs_a_long_round_one_or_two_steps_not_its_length():
    """A near-tie ends the round at its row, re-decoded by itself (and, where that confirms the draft, the
    drafts after it verified as a round of their own), not the whole round redone one token at a time."""
    target = FakeTarget(seed=3, scale=0.3, batch_drift=0.2, exact_batch=1)
    ref, _ = generate(target, n=150)
    target.batches.clear()
    out, stats = generate(target, ModelDrafter(target.like(7, 0.0)), n=150, draft_max=16,
                          verification=Verification(tie_margin=2.0))
    assert out == ref and stats.ties_settled > 0
    singles = target.batches[1:].count(1)  # the prompt's batch aside; a right draft of 16 leaves no round of 1
    assert singles <= 2 * stats.ties_settled + 1, (singles, stats.ties_settled)


def _first_two_exact(target, prompt, params):
    """The exact joint distribution of the first three generated tokens given the prompt, from the
    target's own rows (the first is drawn from the prompt's row, the next two by speculation)."""
    target.start(prompt)
    first = target.decode(prompt, logits="last")[0]
    p1 = probs_from_logits(first, params)
    joint = np.zeros((target.n_vocab,) * 3)
    for a in range(target.n_vocab):
        if p1[a] < 1e-12:
            continue
        target.truncate(len(prompt))
        p2 = probs_from_logits(target.decode([a], logits="last")[0], params)
        for b in np.flatnonzero(p2 > 1e-12):
            target.truncate(len(prompt) + 1)
            p3 = probs_from_logits(target.decode([b], logits="last")[0], params)
            joint[a, b] = p1[a] * p2[b] * p3
    return joint


def _sample_three(target, draft_model, params, n, rule):
    counts = np.zeros(target.n_vocab ** 3)
    draft = ModelDrafter(draft_model)
    for seed in range(n):
        noise = PositionNoise(seed, target.n_vocab) if rule == "coupled" else None
        out, _ = generate(target, draft, n=3, draft_max=2, params=params, seed=seed, prompt=[1, 2], noise=noise)
        counts[np.ravel_multi_index(out[:3], (target.n_vocab,) * 3)] += 1
    return counts


def _letters():
    target = FakeTarget(n_vocab=6, seed=4, scale=1.0)
    return target, target.like(9, 1.0)


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5, top_p=0.9)])
def test_sampled_output_follows_the_targets_distribution(params, rule):
    """With a draft that disagrees often, the first three tokens follow p (chi-square), under
    Leviathan's rule and the coupled one. Negative control: the draft's own distribution is told apart."""
    target, draft_model = _letters()
    p = _first_two_exact(target, [1, 2], params).ravel()
    q = _first_two_exact(draft_model, [1, 2], params).ravel()
    counts = _sample_three(target, draft_model, params, 4000, rule)
    stat, df = chi2(counts, p)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} on {df} df"
    stat_q, df_q = chi2(counts, q)
    assert stat_q > chi2_critical(df_q), "the test cannot tell p from q: it has no power"


def test_the_distribution_test_catches_a_wrong_acceptance_rule(monkeypatch):
    """Accepting every draft (a classic bug) fails the same test: it has power."""
    import ggufspec.speculative as speculative
    from ggufspec.sampling import sample

    monkeypatch.setattr(speculative, "verify", lambda drafts, q, p, rng: (len(drafts), sample(p[len(drafts)], rng)))
    target, draft_model = _letters()
    params = SamplingParams(temperature=1.0)
    stat, df = chi2(_sample_three(target, draft_model, params, 4000, "rejection"),
                     _first_two_exact(target, [1, 2], params).ravel())
    assert stat > chi2_critical(df)


def test_the_distribution_test_catches_noise_that_is_not_gumbel(monkeypatch):
    """argmax(log p + noise) is a sample of p only for Gumbel noise: uniform noise must fail."""
    monkeypatch.setattr(PositionNoise, "at", lambda self, t: np.random.default_rng([self.seed, t]).random(self.n_vocab))
    target, draft_model = _letters()
    params = SamplingParams(temperature=1.0)
    stat, df = chi2(_sample_three(target, draft_model, params, 4000, "coupled"),
                     _first_two_exact(target, [1, 2], params).ravel())
    assert stat > chi2_critical(df)


def test_with_a_seed_the_coupled_rule_writes_the_targets_own_text():
    params = SamplingParams(temperature=0.9)
    target = FakeTarget(seed=5, scale=1.0)
    noise = PositionNoise(42, target.n_vocab)
    plain, _ = generate(target, params=params, noise=noise, n=80)
    for drafter in (ModelDrafter(target.like(7, 0.5)), LookupDrafter()):
        out, stats = generate(target, drafter, params=params, noise=PositionNoise(42, target.n_vocab), n=80)
        assert out == plain
    ahead = PositionNoise(42, target.n_vocab, ahead=True)  # noise made on a worker thread while the target decodes
    assert generate(target, ModelDrafter(target.like(7, 0.5)), params=params, noise=ahead, n=80)[0] == plain
    ahead.close()
    assert not ahead._pending
    assert plain != generate(target, params=params, noise=PositionNoise(43, target.n_vocab), n=80)[0]


def _auto(costs, target, closeness=0.0, lookup=None):
    model = ModelDrafter(target.like(7, closeness))
    return AutoDrafter(Verification.of(costs), costs, lookup=lookup or LookupDrafter(), model=model)


@pytest.fixture
def untimed(monkeypatch):
    """Rounds on a clock that nothing moves: the cost table alone decides (auto's guard judges timed rounds only,
    and Python's speed on a numpy table is nothing to judge)."""
    on_clock(monkeypatch)


def test_auto_drafts_with_the_model_where_verification_is_cheap_and_never_where_it_cannot_pay(untimed):
    target = FakeTarget(seed=1)
    ref, _ = generate(target, n=80)
    cheap = Costs([0.040 + 0.001 * i for i in range(9)], 1, 0.004)  # a GPU: a verify batch is nearly free
    out, stats = generate(target, _auto(cheap, target, lookup=NoCopies()), n=80, draft_max=4)
    assert out == ref and stats.rounds_by_source.get("draft", 0) > 10
    dear = Costs([0.043 * (i + 1) for i in range(9)], 3, 0.025)  # each verified row costs a whole step
    out, stats = generate(target, _auto(dear, target), n=80, draft_max=4)
    assert out == ref and "draft" not in stats.rounds_by_source


# This AMD EPYC's Q8_0 Qwen target (seconds for a batch of 1..9): odd batches dear, 8 the cheapest per token.
SAWTOOTH = [0.092, 0.118, 0.198, 0.164, 0.250, 0.221, 0.310, 0.268, 0.356]


def test_auto_drafts_with_the_model_as_far_as_the_costs_say_and_no_further_than_a_cap(untimed):
    target = FakeTarget(seed=1)
    ref, _ = generate(target, n=120)
    costs = Costs(SAWTOOTH, 9, 0.019)
    longest = {}
    for cap in (8, 4):  # 8: no cap within the measured batches (the Engine's default); 4: --draft-max 4
        auto = AutoDrafter(Verification.of(costs), costs, lookup=LookupDrafter(), model=ModelDrafter(target.like(7, 0.0)),
                           model_max=cap)
        out, stats = generate(target, auto, n=120, draft_max=cap)
        assert out == ref and stats.n_accepted == stats.n_drafted  # the model as its own draft
        longest[cap] = len(stats.accepted_histogram) - 1
    # a draft of 7 fills the batch of 8; with the cap, 3 (a batch of 4: one of 5 costs more than 4+1 tokens pay)
    assert longest[8] == 7 and longest[4] == 3


def test_auto_reads_the_prompt_into_the_draft_with_the_prompt_where_the_model_may_pay():
    target = FakeTarget(seed=1)
    for costs, eager in ((Costs(SAWTOOTH, 9, 0.019), True), (Costs([0.043 * (i + 1) for i in range(9)], 3, 0.025), False)):
        draft = target.like(7, 0.0)
        auto = AutoDrafter(Verification.of(costs), costs, lookup=LookupDrafter(), model=ModelDrafter(draft))
        auto.reset(PROMPT)
        assert auto.model_may_pay() is eager
        assert draft.tokens == (PROMPT[:-1] if eager else [])  # lazily: only when first used, which it never is


def test_stats_merge_is_the_sum_of_its_parts():
    a, b = Stats(mode="auto"), Stats(mode="auto")
    for s, rounds_ in ((a, [(3, 2), (4, 4)]), (b, [(0, 0), (4, 1)])):
        for drafted, accepted in rounds_:
            s.add(Round(tokens=[1] * (accepted + 1), n_drafted=drafted, n_accepted=accepted, draft_seconds=0.01,
                        target_seconds=0.02, seconds=0.05))
    m = Stats.merge([a, b])
    assert (m.n_drafted, m.n_accepted, m.rounds, m.n_generated) == (11, 7, 4, 11)
    assert m.acceptance_rate == pytest.approx(7 / 11) and m.accepted_histogram == [0, 1, 1, 0, 1]
    assert m.generation_seconds == pytest.approx(0.2) and m.n_timed == a.n_timed + b.n_timed == 9
    assert m.rounds_by_source == {"target": 4}  # Round's default draft names no source


def test_a_long_copy_in_one_batch_keeps_the_targets_text_by_re_checking_near_ties():
    """On a target whose batches over 3 rows drift (llama.cpp's repacked kernels, here numpy noise), lookup on the
    Q4_K_M-shaped table verifies a copy of the prompt in batches over 3 rows, and the near-ties it re-checks keep the
    text the target's; with exact=True (--exact) every batch stays within 3. Negative control: without the margin
    the drift changes the text, so the re-check is what keeps it."""
    from tables import cpu_q4km_like

    from ggufspec.auto import make_drafter

    def run(target, prompt, exact=None, margin=0.5):
        table = cpu_q4km_like()
        v = Verification.of(table, exact, tie_margin=margin)
        drafter, draft_max = make_drafter("lookup", v, table)
        target.batches.clear()
        out, stats = generate(target, drafter, n=120, draft_max=draft_max, verification=v, prompt=prompt)
        return out, stats, max(target.batches[1:])

    bent = 0
    for seed in range(3):
        target = FakeTarget(seed=seed, batch_drift=0.1, exact_batch=3, n_ctx=1024)
        first, _ = generate(target, n=120)
        prompt = PROMPT + first + PROMPT[-2:]  # the answer to this prompt is `first` again: a copy of the prompt
        ref, _ = generate(target, n=120, prompt=prompt)
        out, stats, longest = run(target, prompt)
        assert out == ref and longest > 3 and stats.n_accepted > 60
        out, _, longest = run(target, prompt, exact=True)
        assert out == ref and longest <= 3
        bent += run(target, prompt, margin=0.0)[0] != ref
    assert bent, "the drift never changed a greedy choice: the test has no power"


def test_batch_drift_bounds_where_a_batched_pick_can_differ():
    """batch_drift: the largest move of a near-top token against a row's one-token pick; a batch picks another token
    only in a row whose one-token top-2 gap is below it (hand-made rows, then random drifts of random rows)."""
    singles, batch = np.array([[3.0, 1.0, 0.0, -9.0]]), np.array([[2.9, 1.2, 0.0, -8.0]])
    assert batch_drift(batch, singles) == pytest.approx(1.1)  # the last token gained 1.0 and the pick lost 0.1...
    assert batch_drift(batch, singles, near=3) == pytest.approx(0.3)  # ...but it is 12 below: the runner-up's 0.3
    assert batch_drift(singles, singles) == 0.0
    rng = np.random.default_rng(0)
    singles = rng.normal(size=(400, 50))
    batch = singles + rng.normal(scale=0.05, size=singles.shape)
    drift = batch_drift(batch, singles)
    top2 = np.sort(singles, axis=1)[:, -2:]
    flipped = batch.argmax(axis=1) != singles.argmax(axis=1)
    assert flipped.any() and (top2[flipped, 1] - top2[flipped, 0] < drift).all()


def test_the_tie_margin_is_raised_by_a_larger_measured_drift():
    table = [0.04, 0.05, 0.06]
    assert margin_for(None) == margin_for(Costs(table, 1)) == DEFAULT_TIE_MARGIN  # nothing measured: the default
    assert margin_for(Costs(table, 1, drift=0.02)) == DEFAULT_TIE_MARGIN  # a small drift never lowers it
    assert margin_for(Costs(table, 1, drift=0.314)) == pytest.approx(0.628)  # CPU Q4_K_M's repacked GEMM
    assert Verification.of(Costs(table, 1, drift=0.4)).tie_margin == pytest.approx(0.8)
    assert Verification.of(Costs(table, 1, drift=0.4), tie_margin=0.1).tie_margin == 0.1  # asked for: kept


@pytest.mark.parametrize("filters", [dict(top_k=3), dict(top_p=0.6), dict(min_p=0.3)])
def test_a_filters_edge_in_a_drifting_batch_is_a_near_tie_too(filters):
    """Coupled sampling with top-k, top-p or min-p: a drifted batched row can keep a token that one-token decoding
    drops (or drop the pick), and such a token's noise can outscore the pick by far more than the margin. A row
    whose filter edge is within the drift is re-decoded like a near-tie, so the seeded text stays the target's.
    Negative control: the scores' top-2 gap alone (the filters' edges unchecked) lets the drift show."""
    from ggufspec import sampling

    params = SamplingParams(temperature=1.0, **filters)
    texts, tied = {}, 0
    for seed in range(3, 9):
        target = FakeTarget(seed=seed, scale=0.6, batch_drift=0.1, exact_batch=1)
        plain, _ = generate(target, params=params, noise=PositionNoise(seed, target.n_vocab), n=120)
        out, stats = generate(target, ModelDrafter(target.like(7, 0.0)), draft_max=6, params=params,
                              noise=PositionNoise(seed, target.n_vocab), n=120, verification=Verification(tie_margin=0.6))
        assert out == plain, seed
        tied += stats.ties_settled
        texts[seed] = plain
    assert tied > 0
    real_edges = sampling.Picker._edge_tie
    try:
        sampling.Picker._edge_tie = lambda *a: False
        bent = [generate(t := FakeTarget(seed=s, scale=0.6, batch_drift=0.1, exact_batch=1),
                         ModelDrafter(t.like(7, 0.0)), draft_max=6, params=params, n=120,
                         noise=PositionNoise(s, t.n_vocab), verification=Verification(tie_margin=0.6))[0] != texts[s]
                for s in texts]
    finally:
        sampling.Picker._edge_tie = real_edges
    assert any(bent), "no filter edge moved a pick: the test has no power"
