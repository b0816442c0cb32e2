"""Pairs whose vocabularies differ in size (llama.cpp allows 128 tokens either way), as Qwen2.5-7B+
(152,064 tokens) with the 0.5B (151,936): tiny pairs padded both ways, every mode, greedy and sampled."""

import numpy as np
import pytest
from stats import chi2, chi2_critical
from test_engine import _joint_two_tokens, _sample_two_tokens
from tiny import write_tiny_model

from ggufspec import Engine
from ggufspec.sampling import SamplingParams

PROMPTS = ["hello world", "def f(x):", "The quick brown fox", "zzz zzz zzz zzz"]
MODES = ("draft", "lookup", "auto")


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    d = tmp_path_factory.mktemp("padded")
    return {
        "target": write_tiny_model(d / "target.gguf", seed=0),
        "target_pad": write_tiny_model(d / "target_pad.gguf", seed=0, pad=64),  # may write tokens the draft lacks
        "close": write_tiny_model(d / "close.gguf", seed=0, perturb=0.05),
        "close_pad": write_tiny_model(d / "close_pad.gguf", seed=0, perturb=0.05, pad=64),
        "letters": write_tiny_model(d / "letters.gguf", seed=5, vocab="letters", logit_scale=1.5),
        "letters_sharp_pad": write_tiny_model(d / "letters_sharp_pad.gguf", seed=5, vocab="letters", logit_scale=1.5,
                                              sharpen=3.0, pad=8, pad_scale=0.5),
    }


@pytest.fixture(scope="module", params=["larger target", "larger draft"])
def pair(request, padded):
    target, draft = ("target_pad", "close") if request.param == "larger target" else ("target", "close_pad")
    with Engine(padded[target], padded[draft], n_ctx=512) as e:
        assert e.target_model.n_vocab != e.draft_model.n_vocab
        yield e


def test_greedy_output_is_the_targets_in_every_mode(pair):
    drafted = 0
    beyond = 0  # target tokens the draft's vocabulary does not have
    for prompt in PROMPTS:
        reference = pair.generate(prompt, max_tokens=40, mode="target", ignore_eos=True).tokens
        beyond += sum(t >= pair.draft_model.n_vocab for t in reference)
        for mode in MODES:
            for draft_max in (1, 3, 6):
                out = pair.generate(prompt, max_tokens=40, mode=mode, draft_max=draft_max, ignore_eos=True)
                assert out.tokens == reference, (prompt, mode, draft_max)
                drafted += out.stats.n_drafted
                assert all(t < pair.target_model.n_vocab for t in out.tokens)
    assert drafted > 0
    if pair.target_model.n_vocab > pair.draft_model.n_vocab:
        assert beyond > 0, "the larger target never wrote a token the draft lacks: the test would mean less"


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
def test_sampled_runs_complete_and_drafts_stay_in_the_shared_vocabulary(pair, rule):
    n_shared = min(pair.target_model.n_vocab, pair.draft_model.n_vocab)
    for seed in range(6):
        out = pair.generate("hello", max_tokens=30, mode="draft", temperature=1.0, seed=seed, ignore_eos=True,
                            sampling_rule=rule)
        assert len(out.tokens) == 30 and out.stats.n_drafted > 0
    pair.model_drafter.reset([1, 50, 60])
    draft = pair.model_drafter.propose([1, 50, 60], 4, SamplingParams(temperature=1.0), np.random.default_rng(0))
    assert all(t < n_shared for t in draft.tokens)
    assert all(len(q) == pair.target_model.n_vocab and q[n_shared:].sum() == 0 for q in draft.q)


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
def test_padded_pair_keeps_the_targets_distribution(padded, rule):
    """The draft has 8 tokens the target lacks (and a sharper q): samples must still follow p."""
    with Engine(padded["letters"], padded["letters_sharp_pad"], n_ctx=64) as e:
        params = SamplingParams(temperature=1.0)
        prompt = [1, 5, 6]
        p = _joint_two_tokens(e.target_ctx, prompt, params)
        counts = _sample_two_tokens(e, prompt, params, 3000, rule=rule)
        stat, df = chi2(counts, p)
        assert stat < chi2_critical(df), f"chi2 {stat:.1f} on {df} df"


def test_a_draft_that_ignores_the_shared_vocabulary_is_caught(padded, monkeypatch):
    """Negative control: a draft whose q keeps its own extra tokens' mass (q not renormalised over the
    shared ids) proposes ids the target does not have and must fail."""
    from ggufspec import drafters

    monkeypatch.setattr(drafters.ModelDrafter, "_own", lambda self, t: t)
    with Engine(padded["target"], padded["close_pad"], n_ctx=512) as e:
        e.model_drafter.n_shared = e.draft_model.n_vocab  # the bug: drafts over the draft's whole vocabulary
        with pytest.raises(Exception):
            for seed in range(20):
                e.generate("hello", max_tokens=30, mode="draft", temperature=1.5, seed=seed, ignore_eos=True,
                           sampling_rule="rejection")


def test_past_llama_cpps_rule_on_sizes_the_draft_drafts_through_text(padded, tmp_path):
    """More than 128 tokens apart is past llama.cpp's rule: the draft's ids are not taken for the target's, it
    drafts through text (textdraft), and the text is the target's."""
    from ggufspec.textdraft import TextDrafter

    far = write_tiny_model(tmp_path / "far_pad.gguf", seed=0, pad=129)
    with Engine(padded["target"], far, n_ctx=64, measure=False) as e:
        assert "vocabulary sizes differ by 129" in e.vocab_difference and isinstance(e.model_drafter, TextDrafter)
        alone = e.generate("ab cd", max_tokens=20, mode="target", ignore_eos=True)
        assert e.generate("ab cd", max_tokens=20, mode="draft", ignore_eos=True).tokens == alone.tokens
