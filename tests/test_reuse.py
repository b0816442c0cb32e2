"""Prompt reuse: a generation keeps what the KV caches hold of its prompt, in whole aligned batches
of n_batch tokens, so the rest is computed exactly as a cold start computes it (tiny models; the
real pair's second chat turn is in the slow tier)."""

import numpy as np
import pytest

from ggufspec import Engine
from ggufspec.llama.backend import Context, Model
from ggufspec.speculative import prefill

N_BATCH = 8


def test_only_whole_aligned_batches_count_as_reusable(tiny):
    with Model(tiny["target"]) as m, Context(m, n_ctx=128, n_batch=N_BATCH) as ctx:
        prompt = list(range(10, 30))  # 20 tokens: batches [0, 8), [8, 16) and a partial [16, 20)
        ctx.decode(prompt, logits="none")
        assert ctx.tokens == prompt and ctx.canonical == 16
        assert ctx.reusable(prompt + [5, 6]) == 16
        assert ctx.reusable(prompt[:13] + [99] * 9) == 8  # differs at 13: the batch [8, 16) is not whole
        assert ctx.reusable(prompt[:17]) == 16 and ctx.reusable(prompt[:16]) == 8  # the last token is evaluated again
        ctx.decode([1, 2, 3])  # generated tokens never become canonical
        ctx.truncate(12)
        assert ctx.tokens == prompt[:12] and ctx.reusable(prompt) == 8
        ctx.decode(list(range(40, 52)), logits="none")  # 12 tokens from 12: no batch starts aligned
        assert ctx.reusable(prompt[:12] + list(range(40, 52)) + [7]) == 8
        ctx.clear()
        assert ctx.canonical == 0 and ctx.tokens == [] and ctx.reusable(prompt) == 0


def test_a_reused_prefill_is_bit_identical_to_a_cold_one(tiny):
    with Model(tiny["target"]) as m, Context(m, n_ctx=128, n_batch=N_BATCH) as ctx:
        first = list(range(10, 31))
        second = first + [int(t) for t in np.arange(50, 63)]
        cold, reused = prefill(ctx, second)
        assert reused == 0
        prefill(ctx, first)
        for t in (3, 4, 5):  # a first turn's answer, decoded one token at a time
            ctx.decode([t])
        warm, reused = prefill(ctx, second, reuse=True)
        assert reused == 16
        np.testing.assert_array_equal(warm, cold)


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine(tiny["target"], tiny["close"], n_ctx=256, n_batch=N_BATCH) as e:
        yield e


def chat(engine, **kw):
    """Two turns: the second prompt holds the first and its answer."""
    turn1 = [{"role": "user", "content": "hello there, how are the caches today?"}]
    first = engine.generate(messages=turn1, max_tokens=12, ignore_eos=True, **kw)
    turn2 = turn1 + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and tomorrow?"}]
    return engine.generate(messages=turn2, max_tokens=24, ignore_eos=True, **kw)


@pytest.mark.parametrize("mode,settings", [("target", {}), ("draft", {}), ("auto", {}), ("lookup", {}),
                                           ("draft", {"temperature": 0.9, "seed": 3}), ("draft-alone", {})])
def test_a_chats_second_turn_is_the_cold_text(engine, mode, settings):
    warm = chat(engine, mode=mode, **settings)
    cold = chat(engine, mode=mode, reuse_prompt=False, **settings)
    assert warm.stats.n_reused >= N_BATCH and cold.stats.n_reused == 0
    assert warm.stats.n_reused % N_BATCH == 0
    assert warm.tokens == cold.tokens
    if mode not in ("auto", "lookup"):  # cost-aware planners learn across generations: what they draft may differ, never the text
        assert (warm.stats.n_drafted, warm.stats.n_accepted) == (cold.stats.n_drafted, cold.stats.n_accepted)


def test_the_draft_keeps_its_batches_too(engine, monkeypatch):
    chat(engine, mode="draft", reuse_prompt=False)  # the draft's cache now holds the second turn
    draft = engine.draft_ctx
    turn1 = [{"role": "user", "content": "hello there, how are the caches today?"}]
    tokens = engine.tokenize_prompt(messages=turn1)
    keep = draft.reusable(tokens)
    assert keep >= N_BATCH
    starts = []
    decode = draft.decode
    monkeypatch.setattr(draft, "decode", lambda t, **kw: (starts.append(draft.n_past), decode(t, **kw))[1])
    engine.model_drafter.reset(tokens, reuse=True)
    assert starts == [keep] and draft.tokens == tokens[:-1]  # only what was not kept is evaluated


def test_benchmark_runs_measure_cold_prefill_unless_asked(engine):
    from ggufspec.bench.runs import BenchSettings, run_one, Config

    tokens = engine.tokenize_prompt("hello there, how are the caches today? " * 3)
    for reuse, expected in ((False, 0), (True, len(tokens) - 1 - (len(tokens) - 1) % N_BATCH)):
        settings = BenchSettings(("target",), (2,), 4, 1, 0, True, {}, reuse)
        run_one(engine, Config("target"), tokens, settings)
        assert run_one(engine, Config("target"), tokens, settings).stats.n_reused == expected
