"""The model shapes beside dense attention, as target and as draft: recurrent (mamba2: a state per sequence and no
KV cache), hybrid (lfm2's short convolutions, granitehybrid's mamba2 layers, beside attention layers) and mixture of
experts (qwen3moe). llama.cpp refuses a partial `llama_memory_seq_rm` on a recurrent state, so the context saves that
state before a decode that may be cut and rewinds by restoring it and decoding the kept tokens again. Both guarantees
hold on every shape, in every mode and both roles."""

import numpy as np
import pytest

from ggufspec import Engine
from ggufspec.llama.backend import Context, Model
from ggufspec.sampling import SamplingParams
from stats import assert_follows_p_not_q
from test_engine import _joint_two_tokens, _sample_two_tokens
from tiny import write_tiny_hybrid, write_tiny_mamba2, write_tiny_moe

PROMPTS = ("hello hello hello", "def f(x): return x + f(x)")
MODES = ("draft", "lookup", "auto")
UNCUT = ("mamba2", "lfm2", "granitehybrid")  # memories llama.cpp cannot cut
SHAPES = UNCUT + ("qwen3moe",)


def _write(d, arch, name, **kw):
    if arch == "mamba2":
        return write_tiny_mamba2(d / name, **kw)
    if arch == "qwen3moe":
        return write_tiny_moe(d / name, **kw)
    return write_tiny_hybrid(d / name, arch, **kw)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """For each architecture a target and a draft that mostly agrees with it."""
    d = tmp_path_factory.mktemp("shapes")
    return {arch: {"target": _write(d, arch, f"{arch}.gguf"), "close": _write(d, arch, f"{arch}-close.gguf", perturb=0.05)}
            for arch in SHAPES}


@pytest.mark.parametrize("arch", UNCUT)
@pytest.mark.parametrize("rollback", [0, 8])
def test_the_context_knows_its_memory_cannot_be_cut_and_rewinds_all_the_same(shapes, tiny, arch, rollback):
    """A rewind into a verify batch restores the state saved before the batch, cuts the attention part and decodes
    the kept tokens again as one batch: the logits that follow are those of a context that decoded just those
    tokens, bit for bit. Where llama.cpp keeps the last states itself (lfm2, asked with rollback) a rewind that
    keeps part of the batch is a cut, nothing decoded again, and the state is the batch's own (as a KV cache's
    is: equal to a fresh context's up to the batched kernels' rounding); a whole batch goes the checkpoint way, from
    the state saved before it (not decoded again from the start: as one batch, its numerics would move the text)."""
    with Model(shapes[arch]["target"]) as m, Context(m, n_ctx=256, rollback=rollback) as ctx, \
            Context(m, n_ctx=256) as fresh, Model(tiny["target"]) as dense, Context(dense, n_ctx=256) as dense_ctx:
        assert not ctx.cuttable and dense_ctx.cuttable
        assert ctx.checkpoints.rollback == (rollback if arch == "lfm2" else 0)  # llama.cpp's list of architectures
        decoded, decode = [], ctx.decode
        ctx.decode = lambda tokens, **kw: decoded.append(len(tokens)) or decode(tokens, **kw)
        tokens = m.tokenize("hello world, hello again")
        ctx.decode(tokens[:5], logits="none")
        for keep in (8, 7, 6, 5):
            ctx.decode(tokens[5:9], logits="none")  # a "verify batch" up to position 9
            decoded.clear()
            ctx.truncate(keep)  # rewind into it (keep 5: the whole batch)
            assert ctx.n_past == keep and ctx.tokens == tokens[:keep]
            # a cut keeps a draft of the batch; the first token alone is decoded again, a whole batch restored
            cut = bool(ctx.checkpoints.rollback) and keep > 6
            assert decoded == ([] if cut or keep == 5 else [keep - 5]), keep
            fresh.clear()
            fresh.decode(tokens[:5], logits="none")
            if keep > 5:
                fresh.decode(tokens[5:keep], logits="none")
            ours, theirs = ctx.decode([tokens[keep]])[0], fresh.decode([tokens[keep]])[0]
            if cut:
                np.testing.assert_allclose(ours, theirs, atol=1e-4)
            else:
                assert (ours == theirs).all(), keep
            ctx.truncate(5)  # past the last batch: from a checkpoint, or decoded again from the start
        ctx.truncate(2)  # before any saved state: decoded again from the start
        assert ctx.n_past == 2 and ctx.tokens == tokens[:2]


@pytest.mark.parametrize("n_batch", [3, 7, 9, 10])
def test_a_batch_smaller_than_the_rollback_rows_gets_fewer_of_them(shapes, tiny, n_batch):
    """llama.cpp aborts a decode unless a micro-batch holds the n_rs_seq + 1 last tokens with room to spare
    (n_ubatch > n_rs_seq + 1): the target's context asks for as many rollback rows as its batch allows."""
    with Engine(shapes["lfm2"]["target"], tiny["far"], n_ctx=256, n_batch=n_batch, measure=False) as e:
        assert e.target_ctx.checkpoints.rollback == min(8, n_batch - 2)
        reference = e.generate(PROMPTS[1], max_tokens=24, mode="target", ignore_eos=True).tokens
        out = e.generate(PROMPTS[1], max_tokens=24, mode="draft", ignore_eos=True)
        assert out.tokens == reference and out.stats.n_drafted > 0
    with Model(shapes["lfm2"]["target"]) as m, Context(m, n_ctx=9, n_batch=512, rollback=8) as ctx:  # -c caps n_batch
        assert ctx.checkpoints.rollback == 7
        ctx.decode(m.tokenize("hello world")[:8], logits="none")


def test_a_context_saves_no_state_where_nothing_will_be_cut(shapes):
    """Saving the recurrent state costs a copy of it per decode: only decodes that may be rewound pay it."""
    with Model(shapes["lfm2"]["target"]) as m, Context(m, n_ctx=256) as ctx:
        tokens = m.tokenize("hello world, hello again")
        with ctx.no_rewind():
            ctx.decode(tokens[:5], logits="none")
            ctx.decode(tokens[5:6])
        assert ctx.checkpoints.saved == []
        ctx.decode(tokens[6:9], logits="none")
        assert [pos for pos, _ in ctx.checkpoints.saved] == [6]
        ctx.truncate(7)
        assert ctx.tokens == tokens[:7]


@pytest.mark.parametrize("arch", SHAPES)
@pytest.mark.parametrize("roles", ["shape target, shape draft", "shape target, llama draft", "llama target, shape draft"])
def test_greedy_output_is_the_targets_in_every_mode(shapes, tiny, arch, roles):
    target = shapes[arch]["target"] if roles.startswith("shape") else tiny["target"]
    draft = shapes[arch]["close"] if roles.endswith("shape draft") else tiny["close"]
    with Engine(target, draft, n_ctx=512) as e:
        for prompt in PROMPTS:
            reference = e.generate(prompt, max_tokens=60, mode="target", ignore_eos=True).tokens
            for mode in MODES:
                out = e.generate(prompt, max_tokens=60, mode=mode, ignore_eos=True, draft_max=4)
                assert out.tokens == reference, (prompt, mode)
        drafted = e.generate(PROMPTS[0], max_tokens=60, mode="draft", ignore_eos=True)
        assert drafted.stats.n_drafted > 0 and drafted.stats.n_drafted > drafted.stats.n_accepted  # rewinds happened


@pytest.mark.parametrize("arch", UNCUT)
def test_a_draft_that_never_agrees_rolls_back_every_round_and_keeps_the_targets_text(shapes, tiny, arch):
    """Every round rejects every draft and rewinds to the target's own token: the state saved before the batch is
    restored and that token decoded again by itself (lfm2 too, where llama.cpp could cut: the batch's state of it
    differs in the last bits, and the text left the target's at token 28), so the memory ends bit for bit as
    target-only decoding's. A near-tie at a batch's first row rewinds the whole batch to that same saved state."""
    with Engine(shapes[arch]["target"], tiny["target"], n_ctx=512) as e:
        assert e.target_ctx.checkpoints.rollback == (8 if arch == "lfm2" else 0)
        never = 0
        for prompt in PROMPTS + ("The quick brown fox", "int main() {"):
            reference = e.generate(prompt, max_tokens=64, mode="target", ignore_eos=True).tokens
            state = _state(e.target_ctx)
            out = e.generate(prompt, max_tokens=64, mode="draft", ignore_eos=True)
            assert out.stats.n_drafted > 100 and out.stats.n_accepted <= 1, prompt
            assert out.tokens == reference, prompt
            if out.stats.n_accepted == 0:  # bit for bit: identity by construction (an accepted draft's is the batch's)
                never += 1
                assert np.array_equal(_state(e.target_ctx), state), prompt
        assert never >= 2


def _state(ctx) -> np.ndarray:
    """Everything llama.cpp holds of sequence 0 (recurrent state and KV rows), as bytes."""
    import ctypes

    from ggufspec.llama.runtime import C

    size = C.llama_state_seq_get_size_ext(ctx._ctx, 0, 0)
    buf = (ctypes.c_uint8 * size)()
    C.llama_state_seq_get_data_ext(ctx._ctx, buf, size, 0, 0)
    return np.frombuffer(bytes(buf), np.uint8)


@pytest.mark.parametrize("arch", SHAPES)
def test_several_requests_at_once_each_write_their_own_text(shapes, arch):
    """Three requests sharing the target's batches (its own draft, lookup, auto seeded), prompts in chunks of 4: each
    sequence rewinds its own state from its own checkpoints, and writes what `generate` writes for it alone; drafts
    were kept; a finished request leaves its whole prompt chunks where the memory can be cut, else nothing."""
    from test_serve import run_together

    requests = [(PROMPTS[0], "draft", {}), (PROMPTS[1], "lookup", {}), (PROMPTS[0] + " x", "auto", {"temperature": 0.8, "seed": 5})]
    with Engine(shapes[arch]["target"], shapes[arch]["close"], n_ctx=256, prompt_chunk=4) as alone:
        want = [alone.generate(p, max_tokens=24, ignore_eos=True, mode="target", **kw).tokens for p, _, kw in requests]
    with Engine(shapes[arch]["target"], shapes[arch]["close"], n_ctx=3 * 256, n_seq=3, prompt_chunk=4) as e:
        results, totals = run_together(e, 3, requests, max_tokens=24)
        assert [tokens for tokens, _ in results] == want
        assert totals.accepted > 0 and totals.errors == 0
        kept = [len(s.tokens) for s in e.target_ctx.sequences]
        assert kept == [s.canonical if s.checkpoints is None else 0 for s in e.target_ctx.sequences]
        assert any(kept) == e.target_ctx.cuttable


@pytest.mark.parametrize("arch", SHAPES)
def test_a_seed_gives_the_targets_own_text_in_every_mode(shapes, arch):
    with Engine(shapes[arch]["target"], shapes[arch]["close"], n_ctx=512) as e:
        for seed in (0, 7):
            reference = e.generate(PROMPTS[1], max_tokens=40, temperature=0.8, seed=seed, mode="target", ignore_eos=True)
            for mode in MODES:
                out = e.generate(PROMPTS[1], max_tokens=40, temperature=0.8, seed=seed, mode=mode, ignore_eos=True)
                assert out.tokens == reference.tokens, (seed, mode)


@pytest.mark.parametrize("rule", ["rejection", "coupled"])
def test_sampled_output_follows_a_hybrid_targets_distribution(tmp_path_factory, rule):
    """A hybrid pair (lfm2, a 16-token vocabulary, the draft sharper than the target): the 2nd and 3rd tokens,
    drafted and verified with a rewind at every rejection, follow the target's exact joint distribution."""
    d = tmp_path_factory.mktemp("hybrid-letters")
    target = write_tiny_hybrid(d / "t.gguf", "lfm2", seed=5, vocab="letters", logit_scale=1.5)
    draft = write_tiny_hybrid(d / "d.gguf", "lfm2", seed=5, vocab="letters", logit_scale=1.5, sharpen=3.0)
    params = SamplingParams(temperature=1.0)
    prompt = [1, 5, 6]
    with Engine(target, draft, n_ctx=64) as e:
        assert not e.target_ctx.cuttable and not e.draft_ctx.cuttable
        p = _joint_two_tokens(e.target_ctx, prompt, params)
        q = _joint_two_tokens(e.draft_ctx, prompt, params)
        counts = _sample_two_tokens(e, prompt, params, 3000, rule=rule)
    assert_follows_p_not_q(counts, p, q)
    assert np.isclose(p.sum(), 1.0)


@pytest.mark.parametrize("arch", ["mamba2", "lfm2", "qwen3moe"])
def test_costs_and_target_mode_run_on_every_shape_and_say_what_rewinds_and_routing_cost(shapes, arch):
    from clirun import run

    r = run("costs", "-m", shapes[arch]["target"], "-md", shapes[arch]["close"])
    assert r.exit_code == 0 and "draft step" in r.stdout, r.output
    said = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert ("rollback" in said) == (arch != "qwen3moe") and ("routing" in said) == (arch == "qwen3moe")
    if arch == "mamba2":  # llama.cpp keeps no states of a mamba2: checkpoints
        assert "this target's recurrent state (0.02 MiB) cannot be cut like a KV cache: saving it" in said["rollback"]
    elif arch == "lfm2":
        assert "llama.cpp keeps it for the last 8 positions: a round drafting up to 8 tokens rewinds by a cut" in said["rollback"]
    else:
        assert said["routing"].startswith("routing: this target sends each token to 2 of 4 experts per layer, so a batch "
                                          "of 4 needs about 3.8 distinct experts (1.9x a step's expert weights")
    g = run("generate", "-m", shapes[arch]["target"], "-p", "hello", "-n", 8, "--mode", "target")
    assert g.exit_code == 0, g.output


def test_a_cached_table_without_the_rewind_costs_of_a_recurrent_target_is_measured_again(shapes):
    """A table cached without `rollback` (by a version that did not measure it, or for a context llama.cpp kept
    other states for) does not serve a target whose memory cannot be cut: it is measured again and rewritten."""
    import json

    from clirun import run
    from ggufspec.paths import costs_file

    assert run("costs", "-m", shapes["lfm2"]["target"]).exit_code == 0
    cache = json.loads(costs_file().read_text())
    (key,) = [k for k in cache if "lfm2.gguf" in k]
    assert cache[key]["rollback"]["kept"] == 8
    for stale in ({k: v for k, v in cache[key].items() if k != "rollback"}, {**cache[key], "rollback": {**cache[key]["rollback"], "kept": 0}}):
        costs_file().write_text(json.dumps({key: stale}))
        r = run("costs", "-m", shapes["lfm2"]["target"])
        assert r.exit_code == 0 and "llama.cpp keeps it for the last 8 positions" in r.stdout, r.output
        assert json.loads(costs_file().read_text())[key]["rollback"]["kept"] == 8


def test_a_recurrent_draft_serves_llama_and_a_recurrent_llama_target_is_named(shapes, tiny):
    """llama.cpp's own speculative example fails with a recurrent draft; GGUFDraftModel drafts with one. A Llama whose
    own model is recurrent cannot rewind a rejected draft (its partial seq_rm is refused): one error at attach."""
    from llama_cpp import Llama

    from ggufspec import GGUFDraftModel, GGUFSpecError

    no_eos = {2: -1000.0}
    plain = Llama(model_path=str(tiny["target"]), n_ctx=512, verbose=False)
    alone = plain.create_completion("hello hello", max_tokens=60, temperature=0, logit_bias=no_eos)["choices"][0]["text"]
    for arch in ("mamba2", "granitehybrid"):
        draft = GGUFDraftModel(shapes[arch]["close"], mode="draft")
        llm = Llama(model_path=str(tiny["target"]), n_ctx=512, draft_model=draft, verbose=False)
        draft.attach(llm)
        spec = llm.create_completion("hello hello", max_tokens=60, temperature=0, logit_bias=no_eos)["choices"][0]["text"]
        assert spec == alone and draft.stats["drafted"] > 0, arch
        draft.close()
    other = GGUFDraftModel(tiny["close"], mode="draft")
    recurrent = Llama(model_path=str(shapes["lfm2"]["target"]), n_ctx=512, draft_model=other, verbose=False)
    with pytest.raises(GGUFSpecError, match="a recurrent or hybrid model, whose state llama-cpp-python's Llama cannot rewind"):
        other.attach(recurrent)
    other.close()


def test_bench_on_a_hybrid_target_pair_beside_llama_cpps_checkpointing(shapes):
    """`ggufspec bench` on the lfm2 pair with llama.cpp's own programs: every ggufspec mode writes the target's
    text, and so does llama.cpp's speculative-simple, which speculates on a hybrid target with checkpoints."""
    import json

    from clirun import run
    from ggufspec.bench.reference import NGRAM_TYPES
    from test_llama_cpp_text import llama_simple

    bin_dir = llama_simple().parent
    r = run("bench", "-m", shapes["lfm2"]["target"], "-md", shapes["lfm2"]["close"], "--suite", "code,fix", "--limit",
            "1", "-n", "32", "--modes", "target,draft,lookup,auto", "--compare-llama-cpp", bin_dir, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    rows = {row["label"]: row["identical_to_target"] for row in out["rows"]}
    ours = [label for label in rows if not label.startswith(("target", "draft-alone", "llama.cpp"))]
    theirs = [label for label in rows if label.startswith("llama.cpp speculative-simple")]
    assert len(ours) == 3 and len(theirs) == 1 + len(NGRAM_TYPES), rows  # the draft model's, each n-gram type's
    assert all(rows[label] is True for label in ours + theirs), rows
    assert out["costs"]["rollback"]["kept"] == 8  # llama.cpp keeps lfm2's last states itself
