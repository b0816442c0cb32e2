"""The real-size fixture (tests/sized.py) as llama.cpp reads it, on small shapes: llama.cpp's own llama-simple and
ggufspec load every architecture and mix the GPU run uses (dev/gpu_offload.py), a mixture of experts with its
experts on the CPU too, and a chained pair keeps its chain and its chosen acceptance."""

import subprocess

import pytest

from ggufspec import Engine
from shaped import Chain, alpha_from_rounds, shaped_vocabulary
from sized import write_sized
from spec_order import reference_bin

SMALL = dict(n_layer=2, n_embd=256, n_ff=512, n_vocab=1024, n_head=4, n_head_kv=2)
CASES = {
    "70b-q3_k_s": ("llama-3-70b", "Q3_K_S", SMALL),
    "32b-q4_k_m": ("qwen2.5-32b", "Q4_K_M", SMALL),
    "moe": ("qwen3-30b-a3b", "Q4_K_M", dict(n_layer=2, n_embd=256, n_vocab=1024, n_ff_exp=256, n_expert=8,
                                            n_expert_used=2)),
    "qwen3-tied": ("qwen3-0.6b", "Q4_K_M", dict(n_layer=2, n_vocab=1024)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_loads_and_decodes_each_shape(tmp_path, case):
    shape, quant, size = CASES[case]
    path = write_sized(tmp_path / f"{case}.gguf", shape, quant, **size)
    simple = subprocess.run([str(reference_bin("llama-simple")), "-m", str(path), "-n", "4", "w1 w2"],
                            capture_output=True, text=True, timeout=120)
    assert simple.returncode == 0, simple.stderr[-2000:]
    with Engine(path, n_ctx=256, n_threads=1, measure=False, cpu_moe=-1 if case == "moe" else 0) as engine:
        out = engine.generate("w1 w2", max_tokens=6, mode="target", ignore_eos=True)
    assert out.tokens == [0] * 6  # zero logits everywhere: the first token, every time


def test_a_chained_sized_pair_follows_its_chain_at_its_alpha(tmp_path):
    target = write_sized(tmp_path / "t.gguf", "llama-3-70b", "Q3_K_S", chain=Chain(seed=1), **SMALL)
    draft = write_sized(tmp_path / "d.gguf", "llama-3.1-8b", "Q4_K_M", chain=Chain(seed=1, alpha=0.5), seed=2,
                        **{**SMALL, "n_layer": 1})
    successor = Chain(seed=1).successors(shaped_vocabulary(SMALL["n_vocab"])[1])
    with Engine(target, draft, n_ctx=512, n_threads=1, measure=False) as engine:
        prompt = engine.tokenize_prompt("w1 w2")
        alone = engine.generate(prompt_tokens=prompt, max_tokens=200, mode="target", ignore_eos=True)
        drafted = engine.generate(prompt_tokens=prompt, max_tokens=200, mode="draft", draft_max=4, ignore_eos=True)
    written = [prompt[-1]] + alone.tokens
    assert [int(successor[t]) for t in written[:-1]] == written[1:]
    assert drafted.tokens == alone.tokens
    rounds = drafted.stats.rounds_by_source["draft"]
    assert alpha_from_rounds(drafted.stats.n_accepted / rounds, 4) == pytest.approx(0.5, abs=0.15)  # ~100 rounds
