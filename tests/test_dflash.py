"""DFlash drafts (ggufspec/llama/dflash.py's DflashHead, drafters.HeadDrafter) on the tiny llama target and the
drafts of tests/tiny_hidden.py: the drafted and accepted counts equal to llama.cpp's own draft-dflash
(llama-speculative-simple) on the same models, prompts and lengths; greedy text equal to target-only decoding;
the head following the target's rewinds; one line for each draft it cannot drive, before llama.cpp aborts."""

import numpy as np
import pytest
from gguf import GGUFWriter

from ggufspec.errors import GGUFSpecError
from ggufspec.llama.backend import Context, Model
from ggufspec.llama.dflash import DflashHead
from ggufspec.verification import Verification
from spec_order import assert_counts_equal_llama_cpps, run_with
from tiny_hidden import read_target, write_tiny_dflash, write_tiny_target

PROMPTS = ["def fib(n):", "The quick brown fox"]
N_CTX = 512


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target = write_tiny_target(d / "target.gguf")
    t = read_target(target)
    return {"target": target, "dflash": write_tiny_dflash(d / "dflash.gguf", t),
            "final": write_tiny_dflash(d / "dflash-final.gguf", t, layers=(1, t["n_layer"])),
            "beyond": write_tiny_dflash(d / "dflash-beyond.gguf", t, layers=(1, t["n_layer"] + 1)),
            "wide": write_tiny_dflash(d / "dflash-wide.gguf", t, block_size=64)}


@pytest.fixture(scope="module")
def target(files):
    with Model(files["target"]) as model, Context(model, n_ctx=N_CTX) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def heads(files, target):
    models = {k: Model(files[k], role="draft") for k in ("dflash", "final")}
    made = {k: DflashHead(target, m) for k, m in models.items()}
    yield made
    for k in made:
        made[k].close()
        models[k].close()


@pytest.mark.parametrize("draft_max", [1, 3, 7])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_accepted_counts_equal_llama_cpps_draft_dflash(files, target, heads, prompt, draft_max):
    assert_counts_equal_llama_cpps(target, heads["dflash"], files["target"], files["dflash"], prompt, draft_max,
                                   "draft-dflash", N_CTX)


@pytest.mark.parametrize("kind", ["dflash", "final"])
def test_greedy_text_is_the_targets(target, heads, kind):
    """A draft reading two inner layers, and one reading the target's final hidden state: target-only's text."""
    for prompt in PROMPTS:
        _, _, plain = run_with(target, None, prompt, 0, 40)
        for draft_max in (2, 7, 12):  # 12: past the block, capped at block size - 1
            drafted, accepted, tokens = run_with(target, heads[kind], prompt, draft_max, 40,
                                                 verification=Verification())
            assert tokens[: len(plain)] == plain, (prompt, draft_max)  # a round may end past n
            assert 0 < accepted <= drafted


def test_a_draft_is_one_block_capped_at_block_size_less_one(target, heads):
    head = heads["dflash"]
    run_with(target, head, PROMPTS[0], 3, 8)
    n = target.n_past
    assert head.ready(n) and head.max_draft == 7
    first = head.begin(5, n, 12).copy()
    rows = [first] + [head.step(0).copy() for _ in range(6)]
    with pytest.raises(GGUFSpecError, match="block is used up"):
        head.step(0)
    head.end()
    assert head.ready(n)  # the block's positions are forgotten
    again = head.begin(5, n, 2)
    assert np.array_equal(again, first) or np.allclose(again, first, atol=1e-3)  # the block's own masks only
    head.end()
    assert len(rows) == 7


def test_the_head_follows_the_targets_rewinds(target, heads):
    head = heads["dflash"]
    run_with(target, head, PROMPTS[0], 3, 20)
    n = target.n_past
    assert head.ready(n) and head.n_past == n
    target.truncate(n - 3)
    assert head.ready(n - 3) and head.n_past == n - 3
    head.activate(False)
    target.decode([5], logits="none")  # decoded while not following: no draft until the target starts over
    assert not head.ready(target.n_past)
    target.clear()
    assert head.synced and head.n_past == 0


def test_drafts_it_cannot_drive_are_one_line(files, target, tmp_path):
    with Model(files["beyond"], role="draft") as draft:
        with pytest.raises(GGUFSpecError, match=r"dflash-beyond.gguf cannot draft for .*target.gguf: reads target layer 5; the target has 4"):
            DflashHead(target, draft)
    with pytest.raises(GGUFSpecError, match="target.gguf: is not a DFlash draft"):
        DflashHead(target, target.model)
    with Model(files["wide"], role="draft") as draft, Context(target.model, n_ctx=N_CTX, n_batch=32) as small:
        with pytest.raises(GGUFSpecError, match="its block of 64 tokens is larger than the batch .-b 32.; use -b 64"):
            DflashHead(small, draft)
        assert not small.followers
    n_vocab = target.n_vocab  # a Markov head of rank 4, as llama.cpp's dflash loader shapes it
    dspark = _with_extra(files["dflash"], tmp_path / "dspark.gguf",
                         {f"markov_w{i}.weight": np.zeros((n_vocab, 4), dtype=np.float32) for i in (1, 2)})
    with Model(dspark, role="draft") as draft:
        with pytest.raises(GGUFSpecError, match="is a DSpark draft"):
            DflashHead(target, draft)


def _with_extra(src, dst, tensors: dict):
    """A copy of a GGUF with more tensors."""
    from gguf import GGUFReader

    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), "dflash")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0].name == "ARRAY" else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, data in tensors.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
