"""--mode mtp: drafting with the target's own MTP (NextN) layers (ggufspec/llama/heads.py, drafters.HeadDrafter).

On tiny models with one NextN block (tests/tiny_mtp.py), an attention-only mixture of experts (glm4moe) and a
hybrid of recurrent and attention layers (qwen35, whose rewinds go through llama.cpp's rollback or checkpoints):
the guarantees in every mode (greedy and seeded text = target-only's), the head following the target's rewinds,
one line for a model without MTP layers, and the drafted and accepted counts equal to llama.cpp's own draft-mtp
(llama-speculative-simple) on the same model, prompt and length.
"""

import numpy as np
import pytest

from clirun import one_line, run
from ggufspec import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.sampling import SamplingParams
from spec_order import reference_bin, speculative_simple_counts
from tiny_mtp import write_tiny_glm4moe_mtp, write_tiny_qwen35_mtp

PROMPTS = ["def fib(n):", "The quick brown fox"]
SHAPES = ["glm4moe", "qwen35"]


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    return {"glm4moe": write_tiny_glm4moe_mtp(d / "glm4moe-mtp.gguf"),
            "qwen35": write_tiny_qwen35_mtp(d / "qwen35-mtp.gguf"),
            "plain": write_tiny_glm4moe_mtp(d / "glm4moe-plain.gguf", nextn=False)}


@pytest.fixture(scope="module", params=SHAPES)
def engine(request, mtp_models):
    with Engine(mtp_models[request.param], n_ctx=512) as e:
        yield e


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_the_targets_in_every_mode(engine, prompt):
    target = engine.generate(prompt, max_tokens=40, mode="target")
    for mode in ("mtp", "lookup", "auto"):
        for draft_max in (1, 3, 6, 10):  # qwen35: up to 8 drafts rewind by llama.cpp's rollback, 10 by checkpoints
            r = engine.generate(prompt, max_tokens=40, mode=mode, draft_max=draft_max)
            assert r.tokens == target.tokens, (mode, draft_max)
    mtp = engine.generate(prompt, max_tokens=40, mode="mtp", draft_max=3)
    assert mtp.stats.rounds_by_source.get("mtp", 0) > 5 and 0 < mtp.stats.n_accepted <= mtp.stats.n_drafted


@pytest.mark.parametrize("seed", [1, 7])
def test_seeded_text_is_the_targets(engine, seed):
    kw = dict(max_tokens=40, temperature=0.8, seed=seed)
    target = engine.generate(PROMPTS[0], mode="target", **kw)
    for mode in ("mtp", "auto"):
        r = engine.generate(PROMPTS[0], mode=mode, draft_max=3, **kw)
        assert r.tokens == target.tokens, mode
    assert engine.generate(PROMPTS[0], mode="mtp", draft_max=3, **kw).stats.n_accepted > 0


def test_unseeded_sampling_drafts_with_the_heads_q(engine):
    r = engine.generate(PROMPTS[0], max_tokens=40, mode="mtp", draft_max=3, temperature=0.8)
    assert r.stats.n_drafted > 0 and len(r.tokens) == 40


def test_the_head_follows_the_target(engine):
    """Every decode of the target is decoded in the MTP context; every cut follows; a head that missed decodes
    (not following) drafts nothing until the target starts over."""
    head, ctx = engine.mtp_head, engine.target_ctx
    engine.generate(PROMPTS[0], max_tokens=20, mode="mtp", draft_max=3)
    assert head.active and head.synced and head.n_past == ctx.n_past
    engine.generate(PROMPTS[0], max_tokens=5, mode="target")  # plain decoding: the head rests
    assert not head.active and not head.synced
    assert not head.ready(ctx.n_past)
    r = engine.generate(PROMPTS[0], max_tokens=20, mode="mtp", draft_max=3, reuse_prompt=True)
    assert r.stats.n_reused == 0 and r.stats.n_drafted > 0  # evaluated anew, with the head following
    assert head.synced and head.n_past == ctx.n_past
    ctx.truncate(ctx.n_past - 3)
    assert head.n_past == ctx.n_past and head.ready(ctx.n_past)


def test_costs_measure_the_mtp_step(engine):
    assert engine.costs.mtp_token_seconds > 0
    assert "MTP head" in engine.cost_report()["drafters"]


def test_a_model_without_mtp_layers_is_one_line(mtp_models):
    with Engine(mtp_models["plain"], n_ctx=256, measure=False) as e:
        assert e.mtp_head is None
        with pytest.raises(GGUFSpecError, match="no MTP"):
            e.generate("hi", max_tokens=4, mode="mtp")
    result = run("generate", "-m", mtp_models["plain"], "-p", "hi", "-n", "4", "--mode", "mtp")
    assert result.exit_code == 1
    one_line(result, "no MTP (NextN) layers", "glm4moe-plain.gguf")


def test_models_info_counts_mtp_layers(mtp_models):
    from ggufspec.llama.gguf_info import read_info

    assert read_info(mtp_models["glm4moe"]).n_nextn == 1
    assert read_info(mtp_models["plain"]).n_nextn == 0


def test_spec_type_draft_mtp_is_mode_mtp(mtp_models):
    result = run("generate", "-m", mtp_models["glm4moe"], "-p", "def fib(n):", "-n", "16",
                 "--spec-type", "draft-mtp", "--draft-max", "2", "-c", "256", "--json")
    assert result.exit_code == 0, result.output
    assert '"mode": "mtp"' in result.output


# -- beside llama.cpp's own draft-mtp ------------------------------------------------------------------

@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_accepted_counts_equal_llama_cpps_draft_mtp(engine, prompt, draft_max):
    from ggufspec.bench.reference import speculative_simple

    program = reference_bin()
    n = 48
    theirs = speculative_simple(program.parent, engine.target_model.path, None, prompt, n,
                                engine.target_ctx.n_threads, engine.n_ctx, draft_max, "draft-mtp")
    tokens = engine.target_model.tokenize(prompt)
    drafted, accepted, _ = speculative_simple_counts(engine.target_ctx, engine.mtp_head, tokens, n, draft_max)
    assert 0 < theirs["n_accepted"] < theirs["n_drafted"]  # some drafts rejected: the rewinds are compared too
    assert (drafted, accepted) == (theirs["n_drafted"], theirs["n_accepted"])


def test_gguf_draft_model_says_why_mtp_cannot_serve_a_llama():
    from ggufspec import GGUFDraftModel

    with pytest.raises(GGUFSpecError, match="cannot serve llama-cpp-python's Llama.*--mode mtp"):
        GGUFDraftModel(None, mode="mtp")


def test_models_info_and_check_say_how_many_mtp_layers(mtp_models):
    info = run("models", "info", mtp_models["glm4moe"], "--json")
    assert info.exit_code == 0 and '"mtp_layers": 1' in info.output
    check = run("models", "check", mtp_models["glm4moe"], mtp_models["plain"])
    assert check.exit_code == 0 and "carries 1 MTP layer of its own (--mode mtp)" in check.output


def test_costs_and_doctor_show_the_mtp_step(mtp_models):
    costs = run("costs", "-m", mtp_models["glm4moe"], "-c", "256")
    assert costs.exit_code == 0, costs.output
    assert "MTP step" in costs.output and "MTP head:" in costs.output
    doctor = run("doctor")
    assert doctor.exit_code == 0 and "MTP step" in doctor.output


def test_tune_sweeps_the_mtp_draft_length(mtp_models):
    """A target with MTP layers needs no draft model to tune: target, mtp at each length, auto."""
    r = run("tune", "-m", mtp_models["glm4moe"], "-c", "512", "-n", "16", "--repeats", "1", "--draft-max", "1,2")
    assert r.exit_code == 0, r.output
    modes = [w for line in r.stdout.splitlines() if line[:1].isdigit() for w in line.split()
             if w in ("target", "draft", "mtp", "auto")]
    assert modes.count("mtp") == 2 and "target" in modes and "auto" in modes and "draft" not in modes


def test_the_planner_counts_the_mtp_context(mtp_models):
    """Its KV (the MTP block is one of the layers) and a compute buffer of its own, beside the target's: what
    llama.cpp allocates for the two contexts stays within the plan."""
    from ggufspec.models.offload import sizes_for

    with_mtp, plain = sizes_for(mtp_models["glm4moe"]), sizes_for(mtp_models["plain"])
    assert with_mtp.mtp_layers == 1 and plain.mtp_layers == 0
    assert with_mtp.compute_bytes() == 2 * plain.compute_bytes()
    assert with_mtp.kv_bytes(2, 4096) > 0
    with Engine(mtp_models["glm4moe"], n_ctx=4096, measure=False) as e:
        kv = sum(e.target_ctx.buffers["KV"].values()) + sum(e.mtp_head.buffers["KV"].values())
        compute = sum(e.target_ctx.buffers["compute"].values()) + sum(e.mtp_head.buffers["compute"].values())
    assert kv * MiB <= sum(with_mtp.kv_bytes(i, 4096) for i in range(with_mtp.n_layers)) * 1.01
    assert compute * MiB <= with_mtp.compute_bytes()


MiB = 1 << 20


def test_a_sibling_mtp_file_given_as_the_draft(tmp_path):
    """llama.cpp's converter with --mtp writes the MTP layers to a file of their own beside a trunk-only model:
    given with -md, ggufspec drafts with them as llama.cpp's draft-mtp does, and the text is the target's."""
    whole = write_tiny_glm4moe_mtp(tmp_path / "whole.gguf")
    trunk = write_tiny_glm4moe_mtp(tmp_path / "trunk.gguf", part="trunk")
    layers = write_tiny_glm4moe_mtp(tmp_path / "mtp-trunk.gguf", part="mtp")
    with Engine(whole, n_ctx=512) as e:
        expected = e.generate(PROMPTS[0], max_tokens=32, mode="mtp", draft_max=3)
    with Engine(trunk, layers, n_ctx=512) as e:
        assert e.draft_model is None and e.mtp_head is not None
        target = e.generate(PROMPTS[0], max_tokens=32, mode="target")
        for mode in ("mtp", "draft", "auto"):
            r = e.generate(PROMPTS[0], max_tokens=32, mode=mode, draft_max=3)
            assert r.tokens == target.tokens == expected.tokens, mode
        r = e.generate(PROMPTS[0], max_tokens=32, mode="mtp", draft_max=3)
        assert (r.stats.n_drafted, r.stats.n_accepted) == (expected.stats.n_drafted, expected.stats.n_accepted)
    result = run("generate", "-m", trunk, "-md", layers, "-p", PROMPTS[0], "-n", "8", "--mode", "mtp", "-c", "256")
    assert result.exit_code == 0, result.output


def test_unseeded_sampling_follows_the_targets_distribution(mtp_models):
    """Leviathan's rule with the head's q: the second token (the first a round drafts) follows p, not q."""
    from ggufspec.sampling import probs_from_logits
    from stats import assert_follows_p_not_q

    params = SamplingParams(temperature=1.0)
    with Engine(mtp_models["glm4moe"], n_ctx=256) as e:
        prompt = e.target_model.tokenize(PROMPTS[0])
        ctx, head = e.target_ctx, e.mtp_head
        head.activate(True)
        ctx.clear()
        p1 = probs_from_logits(ctx.decode(prompt)[0], params)
        t1 = int(np.argmax(p1))
        q = probs_from_logits(head.begin(t1, len(prompt)), params).copy()
        head.end()
        p = probs_from_logits(ctx.decode([t1])[0], params).copy()
        counts, drafted = np.zeros(len(p)), 0
        for _ in range(4000):
            r = e.generate(prompt_tokens=prompt, max_tokens=3, temperature=1.0, mode="mtp", draft_max=2,
                           ignore_eos=True, sampling_rule="rejection")
            if r.tokens[0] == t1:
                counts[r.tokens[1]] += 1
                drafted += r.stats.n_drafted
    assert drafted > 0 and counts.sum() > 500
    assert_follows_p_not_q(counts, p, q)
