"""Models whose memory cannot be cut like a KV cache (mamba2: a recurrent state per sequence), as target and as
draft: llama.cpp refuses a partial `llama_memory_seq_rm` there, so the context saves the recurrent state before
each decode and rewinds by restoring it and decoding the kept tokens again. Both guarantees hold."""

import pytest

from ggufspec import Engine
from ggufspec.llama.backend import Context, Model
from tiny import write_tiny_mamba2

PROMPTS = ("hello hello hello", "def f(x): return x + f(x)")
MODES = ("draft", "lookup", "auto")


@pytest.fixture(scope="module")
def mamba(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba")
    return {"target": write_tiny_mamba2(d / "mamba.gguf"), "close": write_tiny_mamba2(d / "mamba-close.gguf", perturb=0.05)}


def test_the_context_knows_its_memory_cannot_be_cut_and_rewinds_all_the_same(mamba, tiny):
    """A rewind into a verify batch restores the state saved before the batch and decodes the kept tokens
    again as one batch: the state is then the one a context that decoded just those tokens has, bit for bit."""
    with Model(mamba["target"]) as m, Context(m, n_ctx=256) as ctx, Context(m, n_ctx=256) as fresh, \
            Model(tiny["target"]) as dense, Context(dense, n_ctx=256) as dense_ctx:
        assert not ctx.cuttable and dense_ctx.cuttable
        tokens = m.tokenize("hello world, hello again")
        ctx.decode(tokens[:5], logits="none")
        for keep in (8, 7, 6, 5):
            ctx.decode(tokens[ctx.n_past:9], logits="none")  # a "verify batch" up to position 9
            ctx.truncate(keep)  # rewind into it
            assert ctx.n_past == keep and ctx.tokens == tokens[:keep]
            fresh.clear()
            fresh.decode(tokens[:5], logits="none")
            if keep > 5:
                fresh.decode(tokens[5:keep], logits="none")
            assert (ctx.decode([tokens[keep]])[0] == fresh.decode([tokens[keep]])[0]).all(), keep
            ctx.truncate(keep)
        ctx.truncate(2)  # before any saved state: decoded again from the start
        assert ctx.n_past == 2 and ctx.tokens == tokens[:2]


@pytest.mark.parametrize("roles", ["mamba target, mamba draft", "mamba target, llama draft", "llama target, mamba draft"])
def test_greedy_output_is_the_targets_in_every_mode(mamba, tiny, roles):
    target = mamba["target"] if roles.startswith("mamba") else tiny["target"]
    draft = mamba["close"] if roles.endswith("mamba draft") else tiny["close"]
    with Engine(target, draft, n_ctx=512) as e:
        for prompt in PROMPTS:
            reference = e.generate(prompt, max_tokens=60, mode="target", ignore_eos=True).tokens
            for mode in MODES:
                out = e.generate(prompt, max_tokens=60, mode=mode, ignore_eos=True, draft_max=4)
                assert out.tokens == reference, (prompt, mode)
        drafted = e.generate(PROMPTS[0], max_tokens=60, mode="draft", ignore_eos=True)
        assert drafted.stats.n_drafted > 0 and drafted.stats.n_drafted > drafted.stats.n_accepted  # rewinds happened


def test_a_seed_gives_the_targets_own_text_in_every_mode(mamba):
    with Engine(mamba["target"], mamba["close"], n_ctx=512) as e:
        for seed in (0, 7):
            reference = e.generate(PROMPTS[1], max_tokens=40, temperature=0.8, seed=seed, mode="target", ignore_eos=True)
            for mode in MODES:
                out = e.generate(PROMPTS[1], max_tokens=40, temperature=0.8, seed=seed, mode=mode, ignore_eos=True)
                assert out.tokens == reference.tokens, (seed, mode)


def test_costs_and_target_mode_run_on_a_recurrent_model(mamba):
    from clirun import run

    r = run("costs", "-m", mamba["target"], "-md", mamba["close"])
    assert r.exit_code == 0 and "draft step" in r.stdout, r.output
    g = run("generate", "-m", mamba["target"], "-p", "hello", "-n", 8, "--mode", "target")
    assert g.exit_code == 0, g.output


def test_a_recurrent_draft_serves_llama_and_a_recurrent_llama_target_is_named(mamba, tiny):
    """llama.cpp's own speculative example fails with a recurrent draft; GGUFDraftModel drafts with one. A Llama whose
    own model is recurrent cannot rewind a rejected draft (its partial seq_rm is refused): one error at attach."""
    from llama_cpp import Llama

    from ggufspec import GGUFDraftModel, GGUFSpecError

    no_eos = {2: -1000.0}
    plain = Llama(model_path=str(tiny["target"]), n_ctx=512, verbose=False)
    alone = plain.create_completion("hello hello", max_tokens=60, temperature=0, logit_bias=no_eos)["choices"][0]["text"]
    draft = GGUFDraftModel(mamba["close"], mode="draft")
    llm = Llama(model_path=str(tiny["target"]), n_ctx=512, draft_model=draft, verbose=False)
    draft.attach(llm)
    spec = llm.create_completion("hello hello", max_tokens=60, temperature=0, logit_bias=no_eos)["choices"][0]["text"]
    assert spec == alone and draft.stats["drafted"] > 0
    draft.close()
    other = GGUFDraftModel(tiny["close"], mode="draft")
    recurrent = Llama(model_path=str(mamba["target"]), n_ctx=512, draft_model=other, verbose=False)
    with pytest.raises(GGUFSpecError, match="a recurrent or hybrid model, whose state llama-cpp-python's Llama cannot rewind"):
        other.attach(recurrent)
    other.close()
