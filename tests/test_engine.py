"""The loop on tiny real GGUF models: the two guarantees, drafters, stops, KV state, memory."""

import numpy as np
import psutil
import pytest

import ggufspec.speculative as speculative
from ggufspec import Engine
from ggufspec.llama.backend import Context, Model
from ggufspec.sampling import SamplingParams, probs_from_logits, sample
from stats import assert_follows_p_not_q, chi2, chi2_critical

PROMPTS = ["hello world", "def f(x):", "The quick brown fox", "a", "12345 67890", "{[()]}", "zzz zzz zzz zzz", "Once upon a time"]


@pytest.fixture(scope="module")
def pairs(tiny):
    engines = {name: Engine(tiny["target"], tiny[name], n_ctx=512) for name in ("same", "close", "far")}
    yield engines
    for e in engines.values():
        e.close()


@pytest.mark.parametrize("draft", ["close", "far"])
@pytest.mark.parametrize("exact", [True, False])
def test_greedy_speculative_equals_target_only(pairs, draft, exact):
    engine = pairs[draft]
    for prompt in PROMPTS:
        reference = engine.generate(prompt, max_tokens=40, mode="target", ignore_eos=True).tokens
        assert len(reference) == 40
        for gamma in (1, 2, 3, 4, 6, 8):
            for mode in ("draft", "lookup"):
                out = engine.generate(prompt, max_tokens=40, mode=mode, draft_max=gamma, ignore_eos=True, exact=exact)
                assert out.tokens == reference, (prompt, gamma, mode)


def test_drafts_are_really_accepted_and_rejected(pairs):
    close = pairs["close"].generate("hello world", max_tokens=60, draft_max=4, ignore_eos=True, exact=False, mode="draft").stats
    far = pairs["far"].generate("hello world", max_tokens=60, draft_max=4, ignore_eos=True, exact=False, mode="draft").stats
    assert close.n_drafted > 0 and far.n_drafted > 0
    assert 0 < far.acceptance_rate < close.acceptance_rate < 1
    undrafted = close.rounds_by_source.get("target", 0)
    assert undrafted <= 2  # only the prompt's token and a last round with a single token left go without a draft
    assert sum(close.accepted_histogram) == close.rounds - undrafted
    assert close.tokens_per_round > 1


@pytest.mark.parametrize("exact", [True, False])
def test_identical_draft_accepts_everything_greedy(pairs, exact):
    for prompt in PROMPTS[:4]:
        s = pairs["same"].generate(prompt, max_tokens=50, draft_max=5, ignore_eos=True, exact=exact, mode="draft").stats
        assert s.n_drafted > 0
        assert s.n_accepted == s.n_drafted
        undrafted = s.rounds_by_source.get("target", 0)
        assert undrafted <= 2  # the prompt's token, and a last round with one token left
        assert s.full_accepts == s.rounds - undrafted


def test_draft_p_min_stops_drafting_early(pairs):
    loose = pairs["far"].generate("hello world", max_tokens=40, draft_max=8, ignore_eos=True, mode="draft").stats
    strict = pairs["far"].generate("hello world", max_tokens=40, draft_max=8, draft_p_min=0.9, ignore_eos=True, mode="draft").stats
    assert strict.n_drafted < loose.n_drafted


def test_a_draft_cut_by_p_min_takes_the_unsure_token_only_where_it_verifies_free(pairs):
    import copy

    from ggufspec.sampling import max_prob

    engine, greedy, rng = pairs["far"], SamplingParams(), np.random.default_rng(0)
    history = engine.tokenize_prompt("hello world")
    drafter = copy.copy(engine.model_drafter)
    drafter.reset(history)
    full = drafter.propose(history, 12, greedy, rng).tokens
    sure = []  # the draft's own confidence in each token it drafted
    for k in range(len(full)):
        drafter.ctx.clear()
        sure.append(max_prob(drafter.ctx.decode(history + full[:k], logits="last")[0]))
    k = next(i for i in range(1, len(full)) if sure[i] < min(sure[:i]))  # the first token less sure than all before
    drafter.reset(history)
    p_min = (sure[k] + min(sure[:k])) / 2
    assert drafter.propose(history, 12, greedy, rng, p_min=p_min).tokens == full[:k]
    drafter.p_min = p_min  # the drafter's own default, where propose is given none
    assert drafter.propose(history, 12, greedy, rng).tokens == full[:k]
    asked = []
    free = lambda n: asked.append(n) or True  # noqa: E731  (a batch of k + 2 costs no more than k + 1)
    assert drafter.propose(history, 12, greedy, rng, may_extend=free).tokens == full[:k + 1]  # the unsure token, no further
    assert asked == [k]
    assert drafter.propose(history, 12, greedy, rng, may_extend=lambda n: False).tokens == full[:k]


def test_draft_min_skips_short_drafts(pairs):
    kw = dict(max_tokens=60, draft_max=3, draft_p_min=0.6, ignore_eos=True, mode="draft")
    loose = pairs["far"].generate("hello world", **kw).stats
    strict = pairs["far"].generate("hello world", draft_min=3, **kw).stats
    assert loose.n_drafted != 3 * sum(loose.accepted_histogram)  # p_min cut some drafts short...
    assert strict.n_drafted == 3 * sum(strict.accepted_histogram)  # ...and draft_min threw those away


def test_seed_reproduces_sampled_text(pairs):
    e = pairs["close"]
    a = e.generate("hello", max_tokens=30, temperature=0.9, seed=42, ignore_eos=True, mode="draft")
    b = e.generate("hello", max_tokens=30, temperature=0.9, seed=42, ignore_eos=True, mode="draft")
    c = e.generate("hello", max_tokens=30, temperature=0.9, seed=43, ignore_eos=True, mode="draft")
    assert a.tokens == b.tokens and a.text == b.text
    assert a.tokens != c.tokens


def test_generations_do_not_leak_state(pairs):
    e = pairs["far"]
    first = e.generate("abc", max_tokens=30, ignore_eos=True, mode="draft").tokens
    e.generate("something else entirely", max_tokens=50, draft_max=6, ignore_eos=True, mode="draft")
    assert e.generate("abc", max_tokens=30, ignore_eos=True, mode="draft").tokens == first


def test_kv_rewind_gives_the_state_of_a_fresh_run(tiny):
    with Model(tiny["target"]) as m:
        with Context(m, n_ctx=128) as rewound, Context(m, n_ctx=128) as fresh:
            prefix = [1, 80, 81, 82, 83]
            rewound.decode(prefix, logits="none")
            rewound.decode([90, 91, 92, 93], logits="all")  # rejected drafts
            rewound.truncate(len(prefix))
            assert rewound.n_past == len(prefix)
            after_rewind = rewound.decode([100]).copy()
            fresh.decode(prefix, logits="none")
            np.testing.assert_array_equal(after_rewind, fresh.decode([100]))


def test_stop_conditions(tiny):
    with Engine(tiny["target"], n_ctx=256) as e:
        out = e.generate("hello", max_tokens=25, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.tokens) == 25
        stop = out.text[5:7]
        if stop:
            cut = e.generate("hello", max_tokens=25, ignore_eos=True, stop=(stop,))
            assert cut.finish_reason == "stop_string"
            assert cut.text == out.text[: out.text.index(stop)]
    with Engine(tiny["letters"], n_ctx=256) as e:  # 16 tokens: end-of-generation comes up when sampling
        reasons = set()
        for seed in range(40):
            r = e.generate(prompt_tokens=[1, 5], max_tokens=30, temperature=1.5, seed=seed)
            assert 2 not in r.tokens  # the EOS itself is not output
            reasons.add(r.finish_reason)
            if r.finish_reason == "stop":
                assert len(r.tokens) < 30
        assert reasons == {"stop", "length"}
        ignored = e.generate(prompt_tokens=[1, 5], max_tokens=30, temperature=1.5, seed=0, ignore_eos=True)
        assert len(ignored.tokens) == 30


def test_chat_messages_use_the_gguf_template(tiny):
    with Engine(tiny["target"], n_ctx=256) as e:
        tokens = e.tokenize_prompt(messages=[{"role": "user", "content": "hi"}])
        text = e.target_model.detokenize(tokens, special=True)
        assert "user:hi" in text.replace("\u2581", " ") and text.endswith("assistant:")
        assert tokens.count(1) == 1  # the template's <s>, not a second BOS


def test_stream_yields_text_incrementally(pairs):
    chunks = list(pairs["close"].stream("hello", max_tokens=20, ignore_eos=True, mode="draft"))
    assert len(chunks) > 1 and chunks[-1].finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert sum(len(c.tokens) for c in chunks) == 20


# --- the second guarantee: sampled output follows the target's distribution ---------------------


def _joint_two_tokens(ctx: Context, prompt, params) -> np.ndarray:
    """Exact distribution of the 2nd and 3rd sampled tokens (the first ones speculation produces: the
    1st comes from the prompt's own batch), computed from the model's own logits."""
    ctx.clear()
    p1 = probs_from_logits(ctx.decode(prompt)[0], params)
    n = len(p1)
    joint = np.zeros((n, n))
    for t1 in range(n):
        if p1[t1] == 0:
            continue
        ctx.truncate(len(prompt))
        p2 = probs_from_logits(ctx.decode([t1])[0], params)
        for t2 in range(n):
            if p2[t2] == 0:
                continue
            ctx.truncate(len(prompt) + 1)
            joint[t2] += p1[t1] * p2[t2] * probs_from_logits(ctx.decode([t2])[0], params)
    ctx.clear()
    return joint.ravel()


def _sample_two_tokens(engine, prompt, params, n, mode="draft", gamma=2, rule="rejection"):
    """Counts of the 2nd and 3rd tokens: generating 4, the round after the prompt's token drafts 2."""
    counts = np.zeros(engine.target_model.n_vocab ** 2)
    for seed in range(n):
        out = engine.generate(prompt_tokens=prompt, max_tokens=4, temperature=params.temperature, top_k=params.top_k,
                              seed=seed, draft_max=gamma, mode=mode, ignore_eos=True, sampling_rule=rule)
        assert out.stats.n_drafted > 0 or mode != "draft"
        counts[out.tokens[1] * engine.target_model.n_vocab + out.tokens[2]] += 1
    return counts


@pytest.fixture(scope="module")
def letters_pair(tiny):
    with Engine(tiny["letters"], tiny["letters_sharp"], n_ctx=64) as e:
        yield e


# The rules and their negative controls run in milliseconds on a numpy target (tests/test_core.py);
# here on llama.cpp's own logits, the filtered case and the controls in the slow tier.
@pytest.mark.parametrize("rule", ["rejection", "coupled"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    pytest.param(SamplingParams(temperature=0.8, top_k=8), marks=pytest.mark.slow)])
def test_sampled_speculative_follows_target_distribution(letters_pair, params, rule):
    e = letters_pair
    prompt = [1, 5, 6]
    p = _joint_two_tokens(e.target_ctx, prompt, params)
    q = _joint_two_tokens(e.draft_ctx, prompt, params)
    counts = _sample_two_tokens(e, prompt, params, 4000, rule=rule)
    assert_follows_p_not_q(counts, p, q)


@pytest.mark.slow
def test_distribution_test_catches_a_wrong_acceptance_rule(letters_pair, monkeypatch):
    """Accepting every draft (a classic bug) must fail the same test: it has power."""

    def accept_all(draft_tokens, q, p, rng):
        return len(draft_tokens), sample(p[len(draft_tokens)], rng)

    monkeypatch.setattr(speculative, "verify", accept_all)
    params = SamplingParams(temperature=1.0)
    p = _joint_two_tokens(letters_pair.target_ctx, [1, 5, 6], params)
    counts = _sample_two_tokens(letters_pair, [1, 5, 6], params, 4000)
    stat, df = chi2(counts, p)
    assert stat > chi2_critical(df)


@pytest.mark.slow
def test_distribution_test_catches_noise_that_is_not_gumbel(letters_pair, monkeypatch):
    """The coupled rule's negative control: argmax(log p + noise) is a sample of p only for Gumbel
    noise; with uniform noise (a plausible slip) the same test must fail."""
    from ggufspec.sampling import PositionNoise

    monkeypatch.setattr(PositionNoise, "at", lambda self, t: np.random.default_rng([self.seed, t]).random(self.n_vocab))
    params = SamplingParams(temperature=1.0)
    p = _joint_two_tokens(letters_pair.target_ctx, [1, 5, 6], params)
    counts = _sample_two_tokens(letters_pair, [1, 5, 6], params, 4000, rule="coupled")
    stat, df = chi2(counts, p)
    assert stat > chi2_critical(df)


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
def test_lookup_drafting_also_keeps_the_distribution(letters_pair, rule):
    params = SamplingParams(temperature=1.0)
    prompt = [1, 5, 6, 5, 6, 5]  # repetition gives the n-gram drafter something to propose
    p = _joint_two_tokens(letters_pair.target_ctx, prompt, params)
    counts = _sample_two_tokens(letters_pair, prompt, params, 3000, mode="lookup", rule=rule)
    stat, df = chi2(counts, p)
    assert stat < chi2_critical(df)


# --- resources ---------------------------------------------------------------------------------


def test_memory_stays_flat_over_many_generations(tiny):
    proc = psutil.Process()
    with Engine(tiny["target"], tiny["close"], n_ctx=256) as e:
        for i in range(50):
            e.generate(PROMPTS[i % len(PROMPTS)], max_tokens=30, temperature=0.5 * (i % 2), seed=i, ignore_eos=True,
                       mode=("draft", "auto", "lookup")[i % 3])
        before = proc.memory_info().rss
        for i in range(300):
            e.generate(PROMPTS[i % len(PROMPTS)], max_tokens=30, temperature=0.5 * (i % 2), seed=i, ignore_eos=True,
                       mode=("draft", "auto", "lookup")[i % 3])
        growth = proc.memory_info().rss - before
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 300 generations"


def test_loading_and_closing_engines_frees_memory(tiny):
    proc = psutil.Process()
    for _ in range(5):
        Engine(tiny["target"], tiny["close"], n_ctx=256).close()
    before = proc.memory_info().rss
    for _ in range(40):
        with Engine(tiny["target"], tiny["close"], n_ctx=256) as e:
            e.generate("hi", max_tokens=5)
    growth = proc.memory_info().rss - before
    assert growth < 16 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 40 load/close cycles"
