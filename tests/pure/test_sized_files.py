"""The real-size fixture (tests/sized.py): sparse files whose tensors are the types and sizes llama.cpp's quantizer
would give, read back by the gguf package and by the offload planner's own reader."""

import os

import numpy as np
import pytest
from gguf import GGUFReader, GGMLQuantizationType as T

from ggufspec.llama.gguf_info import read_info
from ggufspec.models.offload import sizes_from_info
from sized import SIZED_SHAPES, quant_type, use_more_bits, write_sized

SMALL = dict(n_layer=8, n_embd=512, n_ff=1024, n_vocab=1024, n_head=4, n_head_kv=2)


def test_a_sized_file_is_sparse_and_its_tensors_read_back_as_zeros(tmp_path):
    path = write_sized(tmp_path / "m.gguf", "llama-3-70b", "Q3_K_S", **SMALL)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    data = sum(int(t.n_bytes) for t in tensors.values())
    assert os.path.getsize(path) >= data
    assert os.stat(path).st_blocks * 512 < data / 4  # the holes hold no disk
    assert not np.asarray(tensors["blk.3.ffn_up.weight"].data).any()
    assert tensors["blk.0.attn_norm.weight"].data.tolist() == [1.0] * 512  # the norms are real


def test_the_mixes_follow_llama_cpps_quantizer():
    assert [use_more_bits(i, 32) for i in (0, 3, 4, 5, 6, 7, 28, 31)] == [True, True, False, False, True, False, True, True]
    assert quant_type("Q3_K_S", "attn_v", 5, 80) == T.Q5_K and quant_type("Q3_K_S", "attn_v", 5, 32) == T.Q3_K
    assert quant_type("Q3_K_S", "ffn_down", 5, 80) == T.Q3_K and quant_type("Q3_K_S", "output", 0, 80) == T.Q6_K
    assert quant_type("Q4_K_M", "ffn_down", 0, 32) == T.Q6_K and quant_type("Q4_K_M", "ffn_down", 4, 32) == T.Q4_K
    assert quant_type("Q4_K_M", "attn_q", 0, 32) == T.Q4_K


@pytest.mark.parametrize("shape, quant, gb", [("llama-3-70b", "Q3_K_S", 30.91), ("qwen3-30b-a3b", "Q4_K_M", 18.6)])
def test_full_sizes_are_the_published_files_within_a_percent(tmp_path, shape, quant, gb):
    """The published files' sizes in GB (bartowski's Meta-Llama-3-70B-Instruct-Q3_K_S, Qwen's Qwen3-30B-A3B-Q4_K_M;
    the 32B and 8B Q4_K_M come as close: 19.85 and 4.92). Written in full: sparse, a moment and no disk."""
    path = write_sized(tmp_path / "m.gguf", shape, quant)
    assert os.path.getsize(path) / 1e9 == pytest.approx(gb, rel=0.01)
    os.remove(path)


def test_the_planner_reads_a_mixture_of_experts_and_a_tied_output(tmp_path):
    moe = sizes_from_info(read_info(write_sized(tmp_path / "moe.gguf", "qwen3-30b-a3b", "Q4_K_M", n_layer=4,
                                                n_vocab=1024)))
    h = SIZED_SHAPES["qwen3-30b-a3b"]
    experts = 3 * h["n_expert"] * h["n_ff_exp"] * h["n_embd"]  # gate, up, down: weights per layer
    assert moe.head_dim == 128 and len(moe.expert_bytes) == 4
    assert moe.expert_bytes[1] == experts // 256 * 144  # Q4_K throughout on layer 1
    assert moe.expert_bytes[2] > moe.expert_bytes[1]  # layer 2 of 4: ffn_down_exps at Q6_K (use_more_bits)
    tied = sizes_from_info(read_info(write_sized(tmp_path / "tied.gguf", "qwen3-0.6b", "Q4_K_M", n_layer=2)))
    assert tied.output_bytes == tied.embed_bytes + 1024 * 4  # the output layer's copy of token_embd, and its norm
