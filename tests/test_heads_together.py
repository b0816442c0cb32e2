"""The heads that read the target's hidden states (MTP layers, EAGLE-3 and DFlash drafts) on a server's several
sequences: a head per sequence on one llama.cpp context of as many sequences (llama.heads.Follower), each reading
its own rows of the target's shared batches. Several requests at once, greedy and seeded, each write what the
target writes for them alone, on an attention target, a mixture of experts and hybrids of recurrent layers; the
heads drafted and their drafts were kept; a chat's next turn keeps its prompt's chunks with the head following."""

import pytest

from ggufspec import Engine
from ggufspec.llama.rows import decode_asks
from test_serve import run_together
from tiny import write_tiny_hybrid
from tiny_hidden import read_target, write_tiny_dflash, write_tiny_eagle3, write_tiny_target
from tiny_mtp import write_tiny_glm4moe_mtp, write_tiny_qwen35_mtp

PROMPTS = ("def fib(n):", "The quick brown fox", "def fib(n): return fib(n - 1)")
CASES = [("glm4moe", "mtp"), ("qwen35", "mtp"), ("llama", "eagle3"), ("llama", "dflash"), ("lfm2", "eagle3")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("heads-together")
    llama = write_tiny_target(d / "llama.gguf")
    lfm2 = write_tiny_hybrid(d / "lfm2.gguf", "lfm2", layers="rar")
    return {("glm4moe", "mtp"): (write_tiny_glm4moe_mtp(d / "glm4moe-mtp.gguf"), None),
            ("qwen35", "mtp"): (write_tiny_qwen35_mtp(d / "qwen35-mtp.gguf"), None),
            ("llama", "eagle3"): (llama, write_tiny_eagle3(d / "llama-eagle3.gguf", read_target(llama), layers=(1, 2, 3))),
            ("llama", "dflash"): (llama, write_tiny_dflash(d / "llama-dflash.gguf", read_target(llama), layers=(1, 3))),
            ("lfm2", "eagle3"): (lfm2, write_tiny_eagle3(d / "lfm2-eagle3.gguf", read_target(lfm2), layers=(0, 1, 2)))}


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_several_requests_draft_with_their_own_heads_and_write_their_own_text(files, case, monkeypatch):
    """Four requests through three sequences (one waits for a free one): the head's mode greedy and seeded, auto
    greedy, target-only. Each writes `generate`'s target-only text alone, and a head's request drafts and keeps
    what it drafts and keeps alone. MTP and EAGLE-3 heads decode the rows several sequences asked in one batch,
    their draft steps and their catch-up on the target's batches alike (DFlash: a block per sequence)."""
    several_requests(files, case, monkeypatch)


def several_requests(files, case, monkeypatch, **placement):
    """The test above's body on a placement (n_gpu_layers=..., draft_n_gpu_layers=...: tests/test_gpu.py); the
    weights' placement of the Engine of several sequences."""
    import ggufspec.llama.heads as heads

    together = []
    monkeypatch.setattr(heads, "decode_asks", lambda owner, parts: together.append(
        (len(parts), max(ask.n for _, ask in parts))) or decode_asks(owner, parts))
    target, draft = files[case]
    kind = case[1]
    requests = [(PROMPTS[0], kind, {"draft_max": 3}), (PROMPTS[1], kind, {"temperature": 0.8, "seed": 3}),
                (PROMPTS[2], "auto", {}), (PROMPTS[2], kind, {"draft_max": 3})]
    with Engine(target, draft, n_ctx=256, prompt_chunk=4, **placement) as alone:
        want = [alone.generate(p, max_tokens=24, ignore_eos=True, mode="target",
                               **{k: v for k, v in kw.items() if k != "draft_max"}).tokens for p, _, kw in requests]
        counts = [(r.stats.n_drafted, r.stats.n_accepted) for r in
                  (alone.generate(p, max_tokens=24, ignore_eos=True, mode=m, **kw) for p, m, kw in requests)]
    with Engine(target, draft, n_ctx=3 * 256, n_seq=3, prompt_chunk=4, **placement) as e:
        assert kind in e.modes and all(kind in heads for heads in e.slot_heads)
        weights = e.weights()
        results, totals = run_together(e, 3, requests, max_tokens=24)
        assert [tokens for tokens, _ in results] == want
        assert totals.errors == 0
        got = [(last.stats.n_drafted, last.stats.n_accepted) for _, last in results]
        assert [got[i] for i in (0, 1, 3)] == [counts[i] for i in (0, 1, 3)]
        assert all(n > 3 for n, _ in got[:2]), got
        if case[0] == "llama" or kind == "mtp":  # the fixtures' heads agree with these targets
            assert totals.accepted > 0
    if kind != "dflash":
        assert any(n > 1 and rows == 1 for n, rows in together), together  # draft steps of several
        assert any(n > 1 and rows > 1 for n, rows in together), together  # catch-ups of several
    else:
        assert not together
    return weights


def _rows(head) -> dict:
    """What a head holds of its target's rows, by position: an MTP head's hidden states, an EAGLE-3 draft's g."""
    return {p: r.copy() for p, r in (head._rows if head.name == "mtp" else head._g).items()}


@pytest.mark.parametrize("case", [("glm4moe", "mtp"), ("llama", "eagle3")], ids="-".join)
def test_each_head_reads_its_own_sequences_rows_of_a_shared_batch(files, case):
    """When a request ends, its sequence's head holds the rows a lone Engine's head holds after the same text, row for
    row (to rounding): each sequence's part of a batch of several is its own (the fixtures' heads draft nearly as
    well from another sequence's rows, so the text and the counts alone would not tell)."""
    import numpy as np

    target, draft = files[case]
    kind = case[1]
    requests = [(p, kind, {"draft_max": 3}) for p in PROMPTS]
    with Engine(target, draft, n_ctx=256, prompt_chunk=4) as alone:
        want = {}
        for p, m, kw in requests:
            alone.generate(p, max_tokens=24, ignore_eos=True, mode=m, **kw)
            want[tuple(alone.target_ctx.tokens)] = _rows(alone.heads[kind])
    with Engine(target, draft, n_ctx=3 * 256, n_seq=3, prompt_chunk=4) as e:
        held, release = {}, e.release

        def keep(slot):
            held[tuple(e.target_ctx.sequences[slot].tokens)] = _rows(e.slot_heads[slot][kind])
            release(slot)

        e.release = keep
        run_together(e, 3, requests, max_tokens=24)
    assert set(held) == set(want)
    for tokens, rows in held.items():
        assert len(rows) >= 24 and rows.keys() == want[tokens].keys()
        for p, row in rows.items():
            assert np.allclose(row, want[tokens][p], atol=1e-4), (p, tokens)
