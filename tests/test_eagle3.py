"""EAGLE-3 drafts (ggufspec/llama/hidden.py's Eagle3Head, drafters.HeadDrafter) on the tiny llama target and
drafts of tests/tiny_hidden.py: the drafted and accepted counts equal to llama.cpp's own draft-eagle3
(llama-speculative-simple) on the same models, prompts and lengths; greedy text equal to target-only decoding;
the head following the target's rewinds; one line for a draft that cannot serve the target."""

import pytest

from ggufspec.errors import GGUFSpecError
from ggufspec.llama.backend import Context, Model
from ggufspec.llama.hidden import Eagle3Head
from ggufspec.verification import Verification
from spec_order import assert_counts_equal_llama_cpps, run_with
from tiny_hidden import read_target, write_tiny_eagle3, write_tiny_target

PROMPTS = ["def fib(n):", "The quick brown fox"]
N_CTX = 512


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3")
    target = write_tiny_target(d / "target.gguf")
    t = read_target(target)
    return {"target": target, "eagle3": write_tiny_eagle3(d / "eagle3.gguf", t),
            "final": write_tiny_eagle3(d / "eagle3-final.gguf", t, layers=(1, 2, t["n_layer"])),
            "shared": write_tiny_eagle3(d / "eagle3-shared.gguf", t, d2t=False, shared=True),
            "beyond": write_tiny_eagle3(d / "eagle3-beyond.gguf", t, layers=(1, 2, t["n_layer"] + 1))}


@pytest.fixture(scope="module")
def target(files):
    with Model(files["target"]) as model, Context(model, n_ctx=N_CTX) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def heads(files, target):
    models = {k: Model(files[k], role="draft") for k in ("eagle3", "final", "shared")}
    made = {k: Eagle3Head(target, m) for k, m in models.items()}
    yield made
    for k in made:
        made[k].close()
        models[k].close()


@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_accepted_counts_equal_llama_cpps_draft_eagle3(files, target, heads, prompt, draft_max):
    assert_counts_equal_llama_cpps(target, heads["eagle3"], files["target"], files["eagle3"], prompt, draft_max,
                                   "draft-eagle3", N_CTX)


@pytest.mark.parametrize("kind", ["eagle3", "final", "shared"])
def test_greedy_text_is_the_targets(target, heads, kind):
    """d2t and full-vocabulary heads, one reading the target's final hidden state: the text is target-only's."""
    for prompt in PROMPTS:
        _, _, plain = run_with(target, None, prompt, 0, 40)
        for draft_max in (2, 5):
            drafted, accepted, tokens = run_with(target, heads[kind], prompt, draft_max, 40,
                                                 verification=Verification())
            assert tokens[: len(plain)] == plain, (prompt, draft_max)  # a round may end past n
            assert 0 < accepted <= drafted


def test_the_head_follows_the_targets_rewinds(target, heads):
    head = heads["eagle3"]
    run_with(target, head, PROMPTS[0], 3, 20)
    n = target.n_past
    assert head.ready(n) and head.pending_pos == n - 1 and head.n_draft <= n
    target.truncate(n - 3)
    assert head.ready(n - 3) and head.pending_pos == n - 4 and head.n_draft == n - 4
    head.activate(False)
    target.decode([5], logits="none")  # decoded while not following: no draft until the target starts over
    assert not head.ready(target.n_past)
    target.clear()
    assert head.synced and head.n_draft == 0


def test_a_draft_for_another_target_is_one_line(files, target):
    with Model(files["beyond"], role="draft") as draft:
        with pytest.raises(GGUFSpecError, match=r"eagle3-beyond.gguf cannot draft for .*target.gguf: reads target layer 5; the target has 4"):
            Eagle3Head(target, draft)
    with pytest.raises(GGUFSpecError, match="target.gguf: is not an EAGLE-3 draft"):
        Eagle3Head(target, target.model)
