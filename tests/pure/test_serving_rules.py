"""Several streams on one target, without llama.cpp: how many rows a batch decodes and in how many ubatches, how
far auto's streams may draft when they share a batch, and the scheduler's joins, leaves, queue and cancels, on
numpy targets (each request's text is the one it writes alone)."""

import queue
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from fake import FakeTarget
from ggufspec.core import Stats
from ggufspec.costs import Costs
from ggufspec.drafters import ModelDrafter
from ggufspec.errors import GGUFSpecError
from ggufspec.generation import Generation, GenerationSettings
from ggufspec.batching import (Batch, batch_budget, exact_size, groups, identity_price, identity_price_line, trimmed,
                               ubatches)
from ggufspec.serving import Scheduler, Ticket
from ggufspec.verification import Verification

GPU = Costs([0.010 * (1 + 0.01 * i) for i in range(64)], 1)  # a batch of 64 rows costs 1.6 steps
CPU = Costs([0.070 * (1 + 0.9 * i) for i in range(64)], 16)  # each row costs nearly a step


def test_ubatches_follow_llama_cpp_split():
    """As llama.cpp splits a batch of several sequences: by rows and, with a KV stream each, by runs of ids."""
    assert ubatches([5, 1, 3], unified=True) == [9]
    assert ubatches([3, 3, 3], unified=False) == [9]  # as many rows each: one ubatch
    assert ubatches([5, 1, 3], unified=False) == [3, 4, 2]  # one per distinct count
    assert groups([2, 3, 4, 1], None) == [[0, 1, 2, 3]]
    assert groups([2, 3, 4, 1], 5) == [[0, 1], [2, 3]]  # exact verification: at most 5 rows a decode
    # a KV stream per sequence: only consecutive ids in one ubatch (llama.cpp's split_equal(sequential=true))
    assert ubatches([1, 1], unified=False, ids=[0, 2]) == [1, 1]
    assert ubatches([1, 1, 1], unified=False, ids=[0, 2, 3]) == [1, 2]
    assert ubatches([1, 2, 1, 2], unified=False) == [4, 1, 1]  # the second rows of 1 and 3: not consecutive
    assert ubatches([1, 1], unified=True, ids=[0, 2]) == [2]
    assert groups([1, 1, 1, 1], 3, ids=[0, 1, 3, 4]) == [[0, 1], [2, 3]]  # not [0, 1, 3] + [4]: three decodes
    assert groups([1, 1, 1], 3, ids=[0, 1, 2]) == [[0, 1, 2]]


def test_auto_drafts_less_as_streams_are_added_and_not_where_rows_cost_a_step():
    """On a GPU-like table auto keeps drafting with several streams, less far as they are added; where each row
    costs nearly a step (two CPU cores) a second stream already turns drafting off."""
    sure = (0.8, 0.0)  # acceptance 0.8, drafting free (prompt lookup)
    lengths = [batch_budget(GPU, [sure] * n, 16) for n in (1, 2, 4, 8)]
    assert lengths[0] > 0 and all(a >= b for a, b in zip(lengths, lengths[1:])), lengths
    assert batch_budget(CPU, [sure] * 2, 16) == 0
    assert batch_budget(GPU, [(0.02, 0.0)] * 4, 16) == 0  # drafts that are rarely right never pay
    assert batch_budget(GPU, [(0.8, 0.05)] * 4, 16) == 0  # nor a draft step dearer than the rows it saves
    # a KV stream per sequence: a stream drafting alone costs a ubatch of its own, a step on a GPU; one cache: not
    assert batch_budget(GPU, [sure] * 4, 16, unified=False) == 0 < batch_budget(GPU, [sure] * 4, 16, unified=True)


def test_a_stream_that_has_not_drafted_is_priced_at_its_cheapest_heads_measured_step():
    """Before a stream has drafted, the step its budget weighs is its head's, as measured at load (a DFlash block
    spread over its drafts): without it, an auto stream with only a head looked free to draft."""
    from ggufspec.batching import _draft_step

    costs = Costs([0.01] * 4, 1, head_seconds={"mtp": {"token": 0.004}, "dflash": {"token": 0.001, "round": 0.02}})
    stream = lambda drafter: SimpleNamespace(stats=Stats(), drafter=drafter)
    assert _draft_step(stream(SimpleNamespace(model=None, heads={"mtp": 1})), costs) == 0.004
    assert _draft_step(stream(SimpleNamespace(model=None, heads={"mtp": 1, "dflash": 1})), costs) == 0.004  # 0.006
    assert _draft_step(stream(SimpleNamespace(model=None, heads={"eagle3": 1})), costs) == 0.0  # not measured
    assert _draft_step(stream(SimpleNamespace(model=None)), costs) == 0.0  # prompt lookup
    seen = SimpleNamespace(stats=Stats(n_drafted=4, draft_seconds=0.02), drafter=None)
    assert _draft_step(seen, costs) == 0.005


def test_a_lazy_draft_models_catch_up_on_the_prompt_is_not_priced_as_its_drafting(monkeypatch):
    """A server's draft model catches up on a prompt only when a batch first lets it draft (lazily): that round's
    draft seconds are mostly the prompt's, once. Priced per drafted token, they made drafting look many times dearer
    than it is, and a stream that had drafted once was not given a budget again."""
    from fake import on_clock

    from ggufspec.core import Round
    from ggufspec.sampling import SamplingParams
    from ggufspec.batching import _draft_step

    clock = on_clock(monkeypatch)
    target = FakeTarget(seed=3)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 5
    drafter = ModelDrafter(target.like(1, 0.0, clock=clock, seconds=lambda n: 0.001 * n))  # 1 ms a decoded token
    rng, stats = np.random.default_rng(0), Stats()
    drafter.reset(prompt, lazy=True)
    history = list(prompt)
    for caught_up in (len(prompt) - 1, 0, 0):
        draft = drafter.propose(history, 2, SamplingParams(), rng)
        assert draft.caught_up == caught_up and len(draft.tokens) == 2
        history += draft.tokens + [0]  # both kept, then the target's own
        stats.add(Round(tokens=draft.tokens + [0], n_drafted=2, n_accepted=2, draft_seconds=draft.seconds,
                        draft=draft))
    assert stats.draft_seconds == pytest.approx(0.001 * (len(prompt) + 1 + 2 * 3))  # every decode still counted
    assert _draft_step(SimpleNamespace(stats=stats, drafter=None), None) == pytest.approx(0.003 / 2)  # 3 tokens a draft
    drafter.reset(prompt)  # with the prompt (one stream): nothing to catch up on later
    assert drafter.propose(prompt, 2, SamplingParams(), rng).caught_up == 0


def test_unequal_drafts_are_cut_to_a_common_length_where_that_pays():
    """With a KV stream per sequence, drafts of unequal length cost a ubatch each: auto's are cut where the
    batch then returns more tokens a second; a fixed mode's draft stays as drafted."""
    cut = trimmed(CPU, [4, 0, 0], [0.9, 0.9, 0.9], [True, True, True], None, unified=False)
    assert cut == [0, 0, 0]
    kept = trimmed(GPU, [4, 4, 4], [0.9, 0.9, 0.9], [True] * 3, None, unified=False)
    assert kept == [4, 4, 4]
    fixed = trimmed(CPU, [4, 0, 0], [0.9, 0.9, 0.9], [False, True, True], None, unified=False)
    assert fixed[0] == 4


def generation(target, draft, prompt, settings):
    model = SimpleNamespace(token_to_piece=lambda t: bytes([97 + t % 26]), eog_mask=np.zeros(target.n_vocab, bool))
    drafter = ModelDrafter(draft) if settings.mode == "draft" else None
    return Generation(settings, prompt, model, target, drafter, Verification(), 4 if drafter else 0)


def alone(settings, prompt, scale: float = 2.0):
    target = FakeTarget(seed=3, scale=scale)
    g = generation(target, target.like(1, 0.3), prompt, settings)
    return [t for chunk in g.chunks() for t in chunk.tokens]


REQUESTS = [([1, 2, 3], dict(mode="draft")), ([4, 5], dict(mode="target")), ([6, 7, 8, 9], dict(mode="draft")),
            ([2, 2], dict(mode="draft", temperature=0.9, seed=5)), ([9, 1], dict(mode="target", temperature=0.9, seed=5))]


def test_requests_join_and_leave_and_each_writes_its_own_text():
    """Five requests through three sequences of numpy targets: each writes what it writes alone, greedy and seeded."""
    targets = [FakeTarget(seed=3) for _ in range(3)]
    drafts = [t.like(1, 0.3) for t in targets]

    def build(prompt, settings, slot):
        return generation(targets[slot], drafts[slot], prompt, settings)

    def decode_together(parts):
        return [target.decode(tokens, logits=logits) for target, tokens, logits in parts]

    scheduler = Scheduler(build, lambda slot: targets[slot].truncate(0), Batch(decode_together, None), 3).start()
    try:
        queues = []
        for prompt, kw in REQUESTS:
            q = queue.SimpleQueue()
            scheduler.submit(Ticket(prompt, GenerationSettings(max_tokens=30, **kw), q.put))
            queues.append(q)
        for q, (prompt, kw) in zip(queues, REQUESTS):
            tokens = []
            while (item := q.get(timeout=30)) is not None:
                tokens += item.tokens
            assert tokens == alone(GenerationSettings(max_tokens=30, **kw), prompt), kw
    finally:
        scheduler.stop()
    assert scheduler.totals.requests == 5 and scheduler.totals.drafted > 0
    assert all(t.n_past == 0 for t in targets)


def test_a_full_queue_says_so_and_a_cancelled_request_never_runs():
    built = []
    scheduler = Scheduler(lambda *a: built.append(a), lambda slot: None, Batch(lambda parts: [], None), 1, max_queue=1)
    ticket = Ticket([1], GenerationSettings(), lambda item: None)
    assert scheduler.submit(ticket) == 0
    with pytest.raises(GGUFSpecError, match="busy.*1 waiting"):
        scheduler.submit(Ticket([2], GenerationSettings(), lambda item: None))
    ticket.cancel()
    scheduler.start()
    scheduler.stop()
    assert built == [] and scheduler.totals.cancelled == 1


def test_a_request_goes_to_the_free_sequence_that_holds_most_of_its_prompt():
    held = {0: 0, 1: 16, 2: 8, 3: 16}
    scheduler = Scheduler(None, None, None, 4, reusable=lambda slot, tokens: held[slot])
    assert scheduler._free_slot([1, 2, 3]) == 1  # of two that hold as much, the lower
    scheduler.active = {1: None}
    assert scheduler._free_slot([1, 2, 3]) == 3
    scheduler.active = {1: None, 3: None}
    assert scheduler._free_slot([1, 2, 3]) == 2
    assert Scheduler(None, None, None, 4)._free_slot([1, 2, 3]) == 0  # nothing known: the lowest


def test_a_request_goes_where_its_rows_join_the_running_ones_unless_its_cached_prefix_outweighs_that():
    """With a KV stream per sequence llama.cpp puts only sequences of consecutive ids in one ubatch, so a request on
    a sequence apart from the running ones costs every step an extra ubatch (Q8_0 1.5B on a Zen 3: sequences 0 and 2
    143 ms a step against 0 and 1 96): it goes next to them, or into a gap between them, unless a prefix cached
    elsewhere is worth more than that extra ubatch over its max_tokens (gap_tokens prompt tokens a step)."""
    from ggufspec.batching import gap_tokens, runs

    assert [runs(s) for s in (set(), {0}, {0, 1, 2}, {0, 2, 3}, {0, 2, 4}, {3, 1})] == [0, 1, 1, 2, 3, 2]
    held = {0: 0, 1: 0, 2: 0, 3: 128}
    scheduler = Scheduler(None, None, None, 4, reusable=lambda slot, tokens: held[slot])
    scheduler.gap_tokens = 2.0
    assert scheduler._free_slot([1], 64) == 3  # nothing running: the prefix decides
    scheduler.active = {0: None}
    assert scheduler._free_slot([1], 64) == 1  # 128 cached against 2 x 64 tokens' extra ubatches: a tie, the lower
    assert scheduler._free_slot([1], 32) == 3  # a shorter answer: the prefix
    held[3] = 256
    assert scheduler._free_slot([1], 64) == 3
    scheduler.active = {0: None, 2: None}
    held[3] = 0
    assert scheduler._free_slot([1], 64) == 1  # into the gap: one ubatch a step again
    held[3] = 640
    assert scheduler._free_slot([1], 64) == 3  # (0, 2, 3: as many ubatches as 0 and 2 took)
    bare = Scheduler(None, None, None, 4)
    bare.gap_tokens = 2.0
    assert bare._free_slot([1], 64) == 0  # nothing cached anywhere
    # Q8_0 1.5B on a Zen 3 (ms, 1..4 rows; a batch of 64 1.72 s): a decode's fixed part of 53 ms, 2 prompt tokens
    q8 = Costs([0.082, 0.120, 0.187, 0.168] + [1.72 / 64 * n for n in range(5, 65)], 16)
    assert gap_tokens(q8) == pytest.approx((0.082 - (0.168 - 0.082) / 3) / (1.72 / 64))
    assert gap_tokens(None) is None
    assert Scheduler(None, None, Batch(lambda parts: [], q8), 4).gap_tokens == gap_tokens(q8)  # from its batch's
    assert Scheduler(None, None, Batch(lambda parts: [], q8, unified=True), 4).gap_tokens is None  # one ubatch anyway


# exact batches of up to 3 rows (a Q4_K_M target's repacked CPU kernels are bit-identical only to 3 rows), each
# row beyond the first costing 5% of a step
THREE = Costs([0.010 * (1 + 0.05 * i) for i in range(64)], 3)
SHARED = [([1, 2, 3], dict(mode="target")), ([4, 5], dict(mode="target", temperature=0.9, seed=5)),
          ([6, 7, 8, 9], dict(mode="draft")), ([2, 2], dict(mode="draft", temperature=0.9, seed=7)),
          ([9, 1], dict(mode="target"))]
SCALE = 8.0  # logits far enough apart that near-ties are few, as in most text


def shared_run(exact: bool | None, drift: float = 0.1, margin: float | None = None):
    """SHARED through four sequences whose rows move by up to ~drift logits wherever a decode holds more than 3 rows
    in all (as llama.cpp's batched kernels move them): (each request's tokens, the rows of every decode)."""
    targets = [FakeTarget(seed=3, scale=SCALE, batch_drift=drift) for _ in range(4)]
    drafts = [t.like(1, 0.3) for t in targets]
    sizes = []

    def build(prompt, settings, slot):
        drafter = ModelDrafter(drafts[slot]) if settings.mode == "draft" else None
        model = SimpleNamespace(token_to_piece=lambda t: bytes([97 + t % 26]),
                                eog_mask=np.zeros(targets[slot].n_vocab, bool))
        policy = Verification.of(THREE, exact=exact, tie_margin=margin)
        return Generation(settings, prompt, model, targets[slot], drafter, policy, 2 if drafter else 0)

    def decode_together(parts):
        sizes.append(sum(len(tokens) for _, tokens, _ in parts))
        out = []
        for target, tokens, logits in parts:
            start = target.n_past
            rows = target.decode(tokens, logits=logits)
            out.append(rows + target._drift[start:target.n_past] if sizes[-1] > 3 else rows)
        return out

    batch = Batch(decode_together, THREE, unified=True)
    scheduler = Scheduler(build, lambda slot: targets[slot].truncate(0), batch, 4).start()
    try:
        queues = []
        for prompt, kw in SHARED:
            queues.append(q := queue.SimpleQueue())
            scheduler.submit(Ticket(prompt, GenerationSettings(max_tokens=40, **kw), q.put))
        texts = []
        for q in queues:
            tokens = []
            while (item := q.get(timeout=30)) is not None:
                tokens += item.tokens
            texts.append(tokens)
        return texts, sizes
    finally:
        scheduler.stop()


def test_streams_past_the_exact_batch_size_decode_in_exact_groups_and_keep_each_text():
    """Four streams of a target whose batches are bit-identical only to 3 rows, and move by ~0.1 logits beyond: every
    decode holds at most 3 rows and each request writes what it writes alone, greedy and seeded, drafting or not;
    the same decodes judged without exact groups (the drift let in) change a text."""
    wanted = [alone(GenerationSettings(max_tokens=40, **kw), prompt, SCALE) for prompt, kw in SHARED]
    texts, sizes = shared_run(None)
    assert texts == wanted and max(sizes) <= 3 and sizes.count(3) >= 10, sizes
    texts, sizes = shared_run(False, margin=0.0)  # --no-exact, no near-tie re-checked: one decode a step
    assert texts != wanted and max(sizes) > 3


# a Qwen2.5-Coder 1.5B Q4_K_M target's measured table on an AMD EPYC Zen 3 (ms per batch of 1..8 rows), exact to 3
ZEN3 = Costs([x / 1000 for x in (82.5, 116.6, 178.2, 205.6, 236.1, 286.0, 338.7, 511.1)], 3)


def test_exact_groups_are_of_the_size_that_costs_least():
    """Four streams of one row where 3 rows cost 2.16 steps and 2 rows 1.41: exact decoding packs them 2 + 2 (2.82
    steps), not 3 + 1 (3.16); a stream of 2 rows beside one of 1 goes in one decode of 3."""
    assert groups([1, 1, 1, 1], exact_size(ZEN3, [1, 1, 1, 1], 3, False)) == [[0, 1], [2, 3]]
    assert exact_size(ZEN3, [1, 2], 3, False) == 3
    assert exact_size(ZEN3, [1, 1, 1, 1], None, False) is None  # no exact batch: one decode


# the same model's table on an Intel Xeon (Emerald Rapids), 2 threads, repacked: exact to 3, 4 rows (a GEMM) cheaper than 3
EMERALD = Costs([x / 1000 for x in (84.8, 106.1, 163.2, 133.1, 133.4, 153.3, 251.7, 199.0)], 3)


def test_what_each_answers_identity_costs_a_loaded_step_is_said_where_it_is_dear():
    """Four requests' rows in exact groups of 2 cost 2.50 steps there against 1.57 in one decode: a line says so and
    names --no-exact (Zen 3's 2 + 2 too: 2.83 steps against 2.49); not where the rows fit one exact decode, the
    groups cost about what one decode does (rows of nearly a step each), nothing is exact, or one KV cache holds
    them all."""
    size, grouped, one = identity_price(EMERALD, 4)
    assert size == 2 and round(grouped / 0.0848, 2) == 2.50 and round(one / 0.0848, 2) == 1.57
    line = identity_price_line(EMERALD, 4)
    assert "exact groups of 2" in line and "2.50 target steps" in line and "1.57 in one decode" in line
    assert "--no-exact" in line
    assert "groups of 2 up to 256 cached tokens," in identity_price_line(replace(EMERALD, exact_kv=256), 4)
    assert identity_price(EMERALD, 3) is None  # fits one exact decode
    assert identity_price(ZEN3, 4)[0] == 2
    assert identity_price(CPU, 32) is None  # 16 + 16 rows cost what 32 do, within a tenth
    assert identity_price(Costs(EMERALD.target_batch_seconds, 1), 4) is None  # no exact batch: one decode anyway
    assert identity_price(EMERALD, 4, unified=True) is None
    assert identity_price(None, 4) is None and identity_price_line(None, 4) is None
