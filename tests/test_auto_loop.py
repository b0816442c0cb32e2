"""Cost-aware drafting in the loop, on tiny models (the math on hand-made tables: tests/pure/test_auto.py)."""

import pytest

from ggufspec import Engine
from tables import cpu_q8_like


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine(tiny["target"], tiny["close"], n_ctx=512) as e:
        yield e


def test_auto_is_greedy_identical_and_reports_its_choices(engine):
    for prompt in ["hello world hello world hello", "abcabcabcabc", "x"]:
        ref = engine.generate(prompt, max_tokens=40, mode="target", ignore_eos=True)
        out = engine.generate(prompt, max_tokens=40, mode="auto", ignore_eos=True)
        assert out.tokens == ref.tokens
        assert sum(out.stats.rounds_by_source.values()) == out.stats.rounds


def test_auto_is_the_default_mode(engine):
    assert engine.generate("hi", max_tokens=5).stats.mode == "auto"


def test_lookup_drafts_may_run_past_draft_max_where_a_copy_pays(tiny):
    """Lookup (and auto's lookup) drafts up to --lookup-max, sized by the costs; the draft model's stay
    within --draft-max; greedy text stays the target's own."""
    with Engine(tiny["target"], tiny["close"], n_ctx=512) as e:
        e.costs = cpu_q8_like()
        prompt = list(range(40, 70)) * 4  # a block the answer can copy, once the model starts repeating
        ref = e.generate(prompt_tokens=prompt, max_tokens=80, mode="target", ignore_eos=True).tokens
        for mode in ("lookup", "auto"):
            chunks = list(e.stream(prompt_tokens=prompt, max_tokens=80, mode=mode, draft_max=2, lookup_max=12,
                                   ignore_eos=True))
            assert [t for c in chunks for t in c.tokens] == ref, mode
            lookup = [c.n_drafted for c in chunks if c.source == "lookup"]
            assert lookup and 2 < max(lookup) <= 12, (mode, lookup)
            assert max([c.n_drafted for c in chunks if c.source == "draft"] or [0]) <= 2
        # without --draft-max the round's budget is the longest measured batch; lookup drafts keep --lookup-max
        for mode in ("lookup", "auto"):
            chunks = list(e.stream(prompt_tokens=prompt, max_tokens=80, mode=mode, lookup_max=3, ignore_eos=True))
            assert [t for c in chunks for t in c.tokens] == ref, mode
            assert 0 < max(c.n_drafted for c in chunks if c.source == "lookup") <= 3, mode
