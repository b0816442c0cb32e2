"""A draft model of another vocabulary (textdraft) on numpy targets: the guarantees, and that the text bridge drafts
what the target writes where the draft is the target in another vocabulary."""

import numpy as np
import pytest
from fake import FakeBridge, FakeTarget
from stats import chi2, chi2_critical
from test_core import _first_two_exact, generate

from ggufspec.sampling import PositionNoise, SamplingParams
from ggufspec.textdraft import TextDrafter, complete_utf8

LETTERS = [chr(ord("A") + i) for i in range(24)]


def permuted_draft(target: FakeTarget, seed: int = 3):
    """The target itself in another vocabulary: the same letters at other ids (id 0 kept: the fake's row before the
    first token), its table moved with them, so in text it is the target and every greedy draft is accepted."""
    perm = np.concatenate([[0], 1 + np.random.default_rng(seed).permutation(target.n_vocab - 1)])  # draft id -> target id
    table = target.table[np.ix_(perm, perm, perm)]
    return FakeTarget(target.n_vocab, table=table, n_ctx=target.n_ctx), [LETTERS[t] for t in perm]


@pytest.mark.parametrize("draft_max", [1, 4, 9])
def test_the_target_in_another_vocabulary_has_every_greedy_draft_accepted(draft_max):
    target = FakeTarget(seed=1)
    ref, _ = generate(target)
    draft, texts = permuted_draft(target)
    out, stats = generate(target, TextDrafter(draft, FakeBridge(LETTERS, texts), target_n_vocab=24), draft_max=draft_max)
    assert out == ref and stats.n_drafted > 0 and stats.n_accepted == stats.n_drafted


def merged_vocabulary(seed: int, missing: str = "Q") -> list[str]:
    """Another tokenizer: the letters at other ids, some pairs merged into one token, a control token, and a letter
    missing (the draft cannot write it: its tokenization loses text, and the drafter tokenizes all of it anew)."""
    rng = np.random.default_rng(seed)
    singles = [c for c in LETTERS if c != missing]
    pairs = ["".join(rng.choice(LETTERS, 2)) for _ in range(10)]
    texts = singles + pairs
    rng.shuffle(texts)
    return [""] + texts  # id 0: a control token (a draft that proposes it stops there)


@pytest.mark.parametrize("closeness", [0.3, 3.0])
def test_greedy_output_is_the_targets_across_tokenizers(closeness):
    target = FakeTarget(seed=2)
    ref, _ = generate(target, n=80)
    texts = merged_vocabulary(5)
    draft = FakeTarget(len(texts), seed=int(closeness * 10))
    bridge = FakeBridge(LETTERS, texts)
    out, stats = generate(target, TextDrafter(draft, bridge, target_n_vocab=24), n=80, draft_max=5)
    assert out == ref and stats.n_drafted > 0


@pytest.mark.parametrize("rule", ["shared", "text", None])
def test_a_seed_writes_the_targets_own_text_across_tokenizers(rule):
    params = SamplingParams(temperature=0.9)
    target = FakeTarget(seed=5, scale=1.0)
    plain, _ = generate(target, params=params, noise=PositionNoise(42, 24), n=80)
    draft, texts = permuted_draft(target)
    drafter = TextDrafter(draft, FakeBridge(LETTERS, texts), target_n_vocab=24, sampled_rule=rule)
    out, stats = generate(target, drafter, params=params, noise=PositionNoise(42, 24), n=80)
    assert out == plain and stats.n_drafted > 0
    if rule == "shared":  # the target in other ids, picking with the target's own noise: every draft kept
        assert stats.n_accepted == stats.n_drafted
    if rule is None:  # tried both, and found the shared tokens keep more here
        assert drafter.choice.kept["shared"] > drafter.choice.kept["text"]


def test_the_sampled_rule_is_the_one_that_keeps_more_tried_both_first_and_the_other_now_and_then():
    from ggufspec.textdraft import RuleChoice

    choice = RuleChoice()
    first = [choice.pick(), choice.pick()]
    assert sorted(first) == ["shared", "text"]
    choice.learn("text", 3)
    choice.learn("shared", 1)
    picks = [choice.pick() for _ in range(16)]
    assert picks.count("text") == 14 and picks.count("shared") == 2  # every EXPLORE-th round the other
    for _ in range(30):
        choice.learn("text", 0)
    assert choice.pick() == "shared" or choice.pick() == "shared"  # its average fell below the other's


def test_the_history_is_tokenized_for_the_draft_a_window_at_a_time():
    target = FakeTarget(seed=2, n_ctx=1024)
    bridge = FakeBridge(LETTERS, merged_vocabulary(5, missing=""))
    generate(target, TextDrafter(FakeTarget(len(bridge.draft_texts), seed=4, n_ctx=1024), bridge, target_n_vocab=24),
             n=400, draft_max=3)
    assert bridge.tokenized < 10 * 400  # the whole text again every round would be ~n²/2 characters


@pytest.mark.parametrize("rule", ["shared", "text"])
def test_sampled_output_follows_the_targets_distribution_across_tokenizers(rule):
    """Leviathan's rule on q restricted to the tokens both have, moved to the target's ids (shared), or on the
    draft's greedy text as a one-hot proposal (text): the first three tokens follow p (chi-square); the draft lacks
    one of the target's letters and has a merge and a letter of its own."""
    target = FakeTarget(n_vocab=6, seed=4, scale=1.0)
    texts = ["c", "a", "", "e", "d", "g", "ab", "b"]  # no "f"; "g" and "ab" the target has not got
    draft = FakeTarget(len(texts), seed=9, scale=1.0)
    bridge = FakeBridge(list("abcdef"), texts)
    params = SamplingParams(temperature=1.0)
    counts = np.zeros(6 ** 3)
    n_drafted = n_accepted = 0
    for seed in range(4000):
        out, stats = generate(target, TextDrafter(draft, bridge, target_n_vocab=6, sampled_rule=rule), n=3,
                              draft_max=2, params=params, seed=seed, prompt=[1, 2])
        counts[np.ravel_multi_index(out[:3], (6,) * 3)] += 1
        n_drafted += stats.n_drafted
        n_accepted += stats.n_accepted
    stat, df = chi2(counts, _first_two_exact(target, [1, 2], params).ravel())
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} on {df} df"
    assert n_drafted > 1000 and 0.2 * n_drafted < n_accepted < 0.9 * n_drafted, (n_drafted, n_accepted)


def test_a_draft_cut_inside_a_character_proposes_the_whole_ones_only():
    text = "déjà".encode()
    assert complete_utf8(text[:-1]) == "déj".encode() and complete_utf8(text) == text and complete_utf8(b"") == b""


def test_a_lazy_text_drafts_first_use_says_it_caught_up_on_the_prompt():
    """As a draft of the target's vocabulary: a lazy reset leaves the prompt to the first draft, which says how many
    of its tokens (the draft's) it decoded; later drafts and an eager reset's say none (serving prices drafting without
    that one-off)."""
    target = FakeTarget(seed=1)
    draft, texts = permuted_draft(target)
    drafter = TextDrafter(draft, FakeBridge(LETTERS, texts), target_n_vocab=24)
    prompt, rng = [1, 2, 3, 4, 5, 6, 7, 8] * 3, np.random.default_rng(0)
    drafter.reset(prompt, lazy=True)
    first = drafter.propose(prompt, 2, SamplingParams(), rng)
    assert first.caught_up == len(prompt) - 1 and first.tokens  # one draft token a letter here
    assert drafter.propose(prompt + first.tokens + [0], 2, SamplingParams(), rng).caught_up == 0
    drafter.reset(prompt)
    assert drafter.propose(prompt, 2, SamplingParams(), rng).caught_up == 0
