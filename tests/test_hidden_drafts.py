"""--mode eagle3 and --mode dflash through the Engine (a draft GGUF given as the draft, recognised by its
architecture): the guarantees on an attention target (tests/tiny_hidden.py's llama) and on a hybrid one (an lfm2 of
short-convolution and attention layers, whose rewinds go through llama.cpp's rollback): greedy text = target-only's
in the head's mode, auto and draft (which drafts with the head the file is), at draft lengths within and past a
DFlash block; seeded text = target-only's; unseeded sampling by Leviathan's rule with the draft's q follows p."""

import numpy as np
import pytest

from clirun import one_line, run
from ggufspec import Engine
from ggufspec.sampling import SamplingParams
from tiny import write_tiny_hybrid
from tiny_hidden import read_target, write_tiny_dflash, write_tiny_eagle3, write_tiny_target

PROMPTS = ["def fib(n):", "The quick brown fox"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hidden")
    out = {}
    for shape, target, eagle3_layers, dflash_layers in (
            ("llama", write_tiny_target(d / "llama.gguf"), (1, 2, 3), (1, 3)),
            ("lfm2", write_tiny_hybrid(d / "lfm2.gguf", "lfm2", layers="rar"), (0, 1, 2), (1, 2))):
        t = read_target(target)
        out[shape] = {"target": target,
                      "eagle3": write_tiny_eagle3(d / f"{shape}-eagle3.gguf", t, layers=eagle3_layers),
                      "dflash": write_tiny_dflash(d / f"{shape}-dflash.gguf", t, layers=dflash_layers)}
    return out


@pytest.fixture(scope="module", params=[(s, k) for s in ("llama", "lfm2") for k in ("eagle3", "dflash")],
                ids=lambda p: "-".join(p))
def engine(request, models):
    shape, kind = request.param
    with Engine(models[shape]["target"], models[shape][kind], n_ctx=512) as e:
        yield kind, e


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_text_is_the_targets_in_every_mode(engine, prompt):
    kind, e = engine
    target = e.generate(prompt, max_tokens=40, mode="target", ignore_eos=True)
    for mode in (kind, "auto", "draft"):
        for draft_max in (1, 3, 10):  # dflash: 10 is past the block (7 drafts at most); lfm2: 10 rewinds by checkpoints
            r = e.generate(prompt, max_tokens=40, mode=mode, draft_max=draft_max, ignore_eos=True)
            assert r.tokens == target.tokens, (mode, draft_max)
    r = e.generate(prompt, max_tokens=40, mode=kind, draft_max=3, ignore_eos=True)
    assert r.stats.rounds_by_source.get(kind, 0) > 5 and r.stats.n_accepted <= r.stats.n_drafted
    if e.target_model.info.architecture == "llama":  # the fixtures' drafts agree with their llama target only
        assert r.stats.n_accepted > 0


@pytest.mark.parametrize("seed", [1, 7])
def test_seeded_text_is_the_targets(engine, seed):
    kind, e = engine
    kw = dict(max_tokens=40, temperature=0.8, seed=seed, ignore_eos=True)
    target = e.generate(PROMPTS[0], mode="target", **kw)
    for mode in (kind, "auto"):
        assert e.generate(PROMPTS[0], mode=mode, draft_max=3, **kw).tokens == target.tokens, mode
    assert e.generate(PROMPTS[0], mode=kind, draft_max=3, **kw).stats.n_drafted > 0


def test_costs_measure_the_heads_step(engine):
    kind, e = engine
    h = e.costs.head_seconds[kind]
    assert h["token"] > 0 and (h["round"] > 0) == (kind == "dflash")  # a DFlash block costs per draft
    assert kind in {n: 1 for n in e.cost_report()["head_seconds"]}


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_unseeded_sampling_follows_the_targets_distribution(models, kind):
    """Leviathan's rule with the draft's q: the second token (the first a round drafts) follows p, not q."""
    from ggufspec.sampling import probs_from_logits
    from stats import assert_follows_p_not_q

    params = SamplingParams(temperature=1.0)
    with Engine(models["llama"]["target"], models["llama"][kind], n_ctx=256) as e:
        prompt = e.target_model.tokenize("x = 1\ny =")  # p spread (its top 0.6) and q far from it
        ctx, head = e.target_ctx, e.heads[kind]
        head.activate(True)
        ctx.clear()
        ctx.decode(prompt[:-1], logits="none")
        p1 = probs_from_logits(ctx.decode(prompt[-1:])[0], params)
        t1 = int(np.argmax(p1))
        q = probs_from_logits(head.begin(t1, len(prompt), 1), params).copy()
        head.end()
        p = probs_from_logits(ctx.decode([t1])[0], params).copy()
        counts, drafted = np.zeros(len(p)), 0
        for _ in range(3000):
            r = e.generate(prompt_tokens=prompt, max_tokens=3, temperature=1.0, mode=kind, draft_max=2,
                           ignore_eos=True, sampling_rule="rejection")
            if r.tokens[0] == t1:
                counts[r.tokens[1]] += 1
                drafted += r.stats.n_drafted
    assert drafted > 0 and counts.sum() > 500
    assert_follows_p_not_q(counts, p, q)


def test_cli_modes_and_spec_types(models):
    m = models["llama"]
    for kind in ("eagle3", "dflash"):
        out = run("generate", "-m", m["target"], "-md", m[kind], "-p", PROMPTS[0], "-n", 24, "-c", 512,
                  "--spec-type", f"draft-{kind}", "--draft-max", 3)
        assert out.exit_code == 0, out.output
        assert f"mode {kind} | drafted" in out.output
    out = run("generate", "-m", m["target"], "-p", PROMPTS[0], "-n", 4, "--mode", "eagle3")
    one_line(out, "--mode eagle3 drafts with an EAGLE-3 draft", "give one with -md")
    out = run("generate", "-m", m["target"], "-md", m["eagle3"], "-p", PROMPTS[0], "-n", 4, "--mode", "dflash")
    one_line(out, "eagle3.gguf's architecture is eagle3")
    out = run("models", "check", m["target"], m["dflash"])
    assert out.exit_code == 0 and "is a DFlash draft for llama.gguf: it reads the inputs of target layers 1, 3" in out.output


@pytest.mark.parametrize("buffers, software, refused", [
    ({"CPU_Mapped": 4.0}, True, None),
    ({"CPU_Mapped": 1.0, "CUDA0": 3.0, "CUDA_Host": 0.1}, False, None),  # an H100 (dev/gpu_figures.py)
    ({"CPU_Mapped": 1.0, "Vulkan0": 3.0, "Vulkan_Host": 0.1}, False, None),  # the H100 through NVIDIA's Vulkan driver
    ({"CPU_Mapped": 1.0, "RPC0[127.0.0.1:50052]": 3.0}, False, None),  # tests/test_rpc.py runs it
    ({"CPU_Mapped": 1.0, "Vulkan0": 3.0}, True, "Vulkan0"),  # Mesa's llvmpipe corrupts memory (the GPU tier)
    ({"CPU_Mapped": 4.0, "Vulkan_Host": 0.1}, True, None)])  # the target's layers all on the CPU
def test_the_target_may_be_anywhere_but_on_a_software_vulkan_device(monkeypatch, buffers, software, refused):
    """The placements a hidden-state draft follows: every device but Mesa's software Vulkan (llvmpipe), where
    lavapipe corrupts memory copying layer inputs back (llama.cpp's own program alike): one line naming it, before
    any layer input is asked for. The GPU tier runs the refusal on llvmpipe, a lent GPU the hardware cases."""
    from types import SimpleNamespace

    from ggufspec.errors import GGUFSpecError
    from ggufspec.llama import devices, hidden

    monkeypatch.setattr(devices, "software_vulkan", lambda: software)
    target, draft = SimpleNamespace(buffers=buffers), SimpleNamespace(path="eagle3.gguf")
    if refused is None:
        hidden.check_target_on_host(target, draft, "EAGLE-3")
    else:
        with pytest.raises(GGUFSpecError, match=f"Mesa's software Vulkan device \\({refused}, llvmpipe\\) corrupts"):
            hidden.check_target_on_host(target, draft, "EAGLE-3")
