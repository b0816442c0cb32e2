"""Prompt reuse: a generation keeps what the KV caches hold of its prompt, in whole aligned chunks
(n_batch tokens, or a smaller prompt_chunk), so the rest is computed exactly as a cold start computes
it; a server's request goes to the sequence that holds most of its prompt (tiny models; the real
pair's second chat turn is in the slow tier)."""

import queue

import numpy as np
import pytest

from ggufspec import Engine
from ggufspec.generation import GenerationSettings
from ggufspec.llama.backend import Context, Model
from ggufspec.llama.runtime import C
from ggufspec.serving import Scheduler, Ticket
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


# -- chunks smaller than a batch, and the sequences of a server ------------------------------------------------------

CHUNK = 8


def test_prompts_go_in_aligned_chunks_smaller_than_a_batch(tiny):
    with Model(tiny["target"]) as m, Context(m, n_ctx=128, n_batch=32, prompt_chunk=CHUNK) as ctx:
        sizes = []
        decode = C.llama_decode
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(C, "llama_decode", lambda c, batch: (sizes.append(batch.n_tokens), decode(c, batch))[1])
            ctx.decode(list(range(10, 30)), logits="none")  # 20 tokens: [0, 8), [8, 16), [16, 20)
            ctx.decode(list(range(40, 50)), logits="last")  # from 20: [20, 24), [24, 30)
            rows = ctx.decode(list(range(60, 70)), logits="all")  # a verify batch is never cut: [30, 40) at once
        assert sizes == [8, 8, 4, 4, 6, 10] and rows.shape[0] == 10
        assert ctx.canonical == 16  # [16, 24) came in two decodes: not as a cold start computes it


def test_a_sequence_keeps_whole_chunks_and_computes_the_rest_as_a_cold_one(tiny):
    with Model(tiny["target"]) as m, Context(m, n_ctx=256, n_batch=32, n_seq=2, prompt_chunk=CHUNK) as ctx:
        cold_seq, warm_seq = ctx.sequences
        first = list(range(10, 31))
        second = first + list(range(50, 63))
        cold, _ = prefill(cold_seq, second)
        assert cold_seq.canonical == 32 and cold_seq.reusable(second) == 32
        prefill(warm_seq, first)
        for t in (3, 4, 5):  # the first turn's answer
            warm_seq.decode([t])
        assert warm_seq.canonical == 16 and warm_seq.reusable(second) == 16
        warm, reused = prefill(warm_seq, second, reuse=True)
        assert reused == 16 and warm_seq.tokens == second
        np.testing.assert_array_equal(warm, cold)
        warm_seq.truncate(20)  # positions [16, 20) stay as a cold start computed them; reused, a chunk is whole
        assert warm_seq.canonical == 20 and warm_seq.reusable(second) == 16
        warm_seq.clear()
        assert warm_seq.canonical == 0 and warm_seq.reusable(second) == 0


@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def served(tiny, request):
    with Engine(tiny["target"], tiny["close"], n_ctx=request.param * 256, n_batch=32, prompt_chunk=CHUNK,
                n_seq=request.param) as e:
        yield e


def submitted(scheduler, engine, requests) -> list:
    """Each (prompt tokens, settings) submitted at once; the last chunk of each."""
    queues = []
    for tokens, settings in requests:
        q = queue.SimpleQueue()
        scheduler.submit(Ticket(tokens, settings, q.put))
        queues.append(q)
    out = []
    for q in queues:
        last = tokens = None
        tokens = []
        while (item := q.get(timeout=120)) is not None:
            assert not isinstance(item, BaseException), item
            tokens, last = tokens + item.tokens, item
        out.append((tokens, last))
    return out


@pytest.mark.parametrize("mode,settings", [("target", {}), ("draft", {}), ("auto", {}),
                                           ("draft", {"temperature": 0.9, "seed": 3})])
def test_a_chats_next_turn_on_a_server_keeps_its_chunks_and_its_text(served, mode, settings):
    """Another request, then a chat's first turn, at once; then its second turn alone: it goes to the sequence that
    holds its first turn (the other is free too), keeps whole chunks of it, and writes what a cold start writes."""
    e = served
    s = GenerationSettings(max_tokens=12, ignore_eos=True, mode=mode, **settings)
    turn1 = [{"role": "user", "content": "hello there, how are the caches today?"}]
    first = e.generate(messages=turn1, settings=s)
    turn2 = e.tokenize_prompt(messages=turn1 + [{"role": "assistant", "content": first.text},
                                                {"role": "user", "content": "and tomorrow?"}])
    cold = e.generate(prompt_tokens=turn2, settings=s, reuse_prompt=False)
    scheduler = Scheduler(e.generation, e.release, e.batch(), e.n_seq, reusable=e.reusable).start()
    try:
        other = e.tokenize_prompt("zzz zzz zzz zzz")
        (_, last0), (tokens1, last1) = submitted(scheduler, e, [(other, s), (e.tokenize_prompt(messages=turn1), s)])
        assert tokens1 == first.tokens
        [(tokens2, last)] = submitted(scheduler, e, [(turn2, s)])
    finally:
        scheduler.stop()
    assert last.stats.n_reused >= CHUNK and last.stats.n_reused % CHUNK == 0
    assert scheduler.totals.cached_tokens == sum(x.stats.n_reused for x in (last0, last1, last))
    assert tokens2 == cold.tokens


def test_a_joining_prompt_goes_in_chunks_between_the_running_requests_rounds(tiny):
    """A request that joins while another generates has its prompt decoded a chunk a step, each chunk alone (as a
    cold start decodes it), and the running request's rounds go on between them; both write their own text."""
    with Engine(tiny["target"], tiny["close"], n_ctx=2 * 256, n_batch=32, prompt_chunk=CHUNK, n_seq=2) as e:
        running = (e.tokenize_prompt("hi"), GenerationSettings(max_tokens=100, ignore_eos=True, mode="target"))
        joining = (e.tokenize_prompt("a prompt long enough for several chunks of eight tokens"),
                   GenerationSettings(max_tokens=16, ignore_eos=True, mode="draft", temperature=0.9, seed=5))
        alone = [e.generate(prompt_tokens=t, settings=s, reuse_prompt=False).tokens for t, s in (running, joining)]
        events, queues = [], [queue.SimpleQueue(), queue.SimpleQueue()]

        def deliver(i):
            return lambda item: (events.append((i, item)), queues[i].put(item))

        scheduler = Scheduler(e.generation, e.release, e.batch(), 2, reusable=e.reusable).start()
        try:
            scheduler.submit(Ticket(*running, deliver(0)))
            texts = [list(queues[0].get(timeout=60).tokens), []]  # it is generating
            events.append(("joins", None))
            scheduler.submit(Ticket(*joining, deliver(1)))
            for i in (0, 1):
                while (item := queues[i].get(timeout=120)) is not None:
                    assert not isinstance(item, BaseException), item
                    texts[i] += item.tokens
                    last = item
        finally:
            scheduler.stop()
    assert texts == alone
    joined = events.index(("joins", None))
    first = next(k for k, (i, item) in enumerate(events) if i == 1)
    pieces = -(-(len(joining[0]) - last.stats.n_reused) // CHUNK)
    assert pieces >= 3
    assert sum(i == 0 for i, _ in events[joined:first]) >= pieces - 1  # a round of the other between its chunks
