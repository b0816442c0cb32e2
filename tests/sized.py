"""Models of a real model's size in a second: every matrix a run of zero blocks left unwritten (a sparse file),
for what depends on sizes alone: the offload planner against what a GPU backend allocates, and speeds, since
llama.cpp's kernels cost the same on zeros. A 70B-shaped Q3_K_S file takes 30 GB of address and almost no disk;
llama.cpp reads its holes as zeros, as fast as memory.

    write_sized(path, "llama-3-70b", "Q3_K_S")                 # the seed's target: 80 layers of 8192, 29 GiB
    write_sized(path, "qwen3-30b-a3b", "Q4_K_M")               # a mixture of experts: 128 experts, 8 used
    write_sized(path, "llama-3.1-8b", "Q4_K_M", chain=Chain(seed=1, alpha=0.7))  # a draft accepted 70% of tokens

The quantization mixes follow llama.cpp's quantizer (src/llama-quant.cpp) where they decide sizes: Q3_K_S keeps
a 70B's attn_v at Q5_K and the output at Q6_K; Q4_K_M puts attn_v and ffn_down at Q6_K on the layers
`use_more_bits` picks, the output at Q6_K. Unchained, a model's logits are all zero: it writes token 0 forever.
Chained (tests/shaped.py's Chain), its token embeddings and output matrix are the chain's rows in Q8_0 (real data,
so its text follows the chain), and every other weight stays zero, as a chained model's output projections are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter

from shaped import SHAPES, Chain, chained_rows, shaped_vocabulary
from tiny import _add_vocab

# The shapes beyond tests/shaped.py's llama ones: head_dim where it is not n_embd / n_head, and the experts.
SIZED_SHAPES = {
    **SHAPES,
    "llama-3-70b": dict(n_embd=8192, n_layer=80, n_head=64, n_head_kv=8, n_ff=28672, n_vocab=128256, tied=False),
    "qwen2.5-32b": dict(n_embd=5120, n_layer=64, n_head=40, n_head_kv=8, n_ff=27648, n_vocab=152064, tied=False),
    "qwen3-30b-a3b": dict(arch="qwen3moe", n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, head_dim=128, n_ff=6144,
                          n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936, tied=False),
    "qwen3-0.6b": dict(arch="qwen3", n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, head_dim=128, n_ff=3072,
                       n_vocab=151936, tied=True),
}
FILE_TYPES = {"Q3_K_S": 11, "Q4_K_M": 15, "Q8_0": 7}  # llama_ftype, as general.file_type records it


class Hole:
    """A tensor of zero bytes that the writer skips over: the file keeps a hole there (a sparse file)."""

    dtype = np.dtype(np.uint8)

    def __init__(self, shape: tuple[int, ...]):
        self.shape = tuple(shape)
        self.nbytes = int(np.prod(self.shape))

    def tofile(self, f) -> None:  # what GGUFWriter calls to write a tensor's data
        f.seek(self.nbytes - 1, 1)
        f.write(b"\0")  # the last byte written, so a hole at the end still gives the file its length


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's quantizer's choice of the layers that get more bits (llama-quant.cpp)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def quant_type(quant: str, kind: str, i: int, n_layer: int) -> T:
    """The type llama.cpp's quantizer gives tensor `kind` of layer i in a `quant` file (the rules that move sizes)."""
    if quant == "Q8_0":
        return T.Q8_0
    base = {"Q3_K_S": T.Q3_K, "Q4_K_M": T.Q4_K}[quant]
    if kind == "output":
        return T.Q6_K
    if quant == "Q3_K_S" and kind == "attn_v" and n_layer == 80:  # a 70B's attn_v, shared by 8 heads
        return T.Q5_K
    if quant == "Q4_K_M" and kind in ("attn_v", "ffn_down") and use_more_bits(i, n_layer):
        return T.Q6_K
    return base


def zeros(kind: T, *dims: int) -> Hole:
    """A hole of `kind` blocks for a tensor of dims (rows first, as numpy orders them; the last is quantized)."""
    block, size = GGML_QUANT_SIZES[kind]
    assert dims[-1] % block == 0, (kind, dims)
    return Hole((*dims[:-1], dims[-1] // block * size))


def write_sized(path, shape: str, quant: str = "Q4_K_M", *, chain: Chain | None = None, seed: int = 0,
                **overrides) -> Path:
    """A model of SIZED_SHAPES[shape] (any hyperparameter overridden) in `quant`'s mix, its matrices zero blocks
    left unwritten; chain: its embeddings and output are the chain's (its text then follows the chain)."""
    h = {**SIZED_SHAPES[shape], **overrides}
    arch = h.get("arch", "llama")
    n_embd, n_layer, n_vocab = h["n_embd"], h["n_layer"], h["n_vocab"]
    head_dim = h.get("head_dim", n_embd // h["n_head"])
    n_q, n_kv = h["n_head"] * head_dim, h["n_head_kv"] * head_dim
    tokens, types = shaped_vocabulary(n_vocab)
    path = Path(path)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"{shape}-sized-{quant}" + (f"-chained-{chain.seed}-{chain.alpha:g}" if chain else ""))
    writer.add_context_length(32768)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(h["n_ff"])
    writer.add_head_count(h["n_head"])
    writer.add_head_count_kv(h["n_head_kv"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if head_dim != n_embd // h["n_head"]:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if "n_expert" in h:
        writer.add_expert_count(h["n_expert"])
        writer.add_expert_used_count(h["n_expert_used"])
        writer.add_expert_feed_forward_length(h["n_ff_exp"])
    writer.add_file_type(FILE_TYPES[quant])
    _add_vocab(writer, tokens, types)
    ones = np.ones(n_embd, dtype=np.float32)

    def matrix(name: str, kind: str, i: int, *dims: int) -> None:
        writer.add_tensor(name, zeros(quant_type(quant, kind, i, n_layer), *dims),
                          raw_dtype=quant_type(quant, kind, i, n_layer))

    if chain is not None:
        embeddings, output = chained_rows(chain, types, n_embd, np.random.default_rng(seed))
        writer.add_tensor("token_embd.weight", embeddings, raw_dtype=T.Q8_0)
    else:
        matrix("token_embd.weight", "token_embd", 0, n_vocab, n_embd)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        matrix(f"blk.{i}.attn_q.weight", "attn_q", i, n_q, n_embd)
        matrix(f"blk.{i}.attn_k.weight", "attn_k", i, n_kv, n_embd)
        matrix(f"blk.{i}.attn_v.weight", "attn_v", i, n_kv, n_embd)
        matrix(f"blk.{i}.attn_output.weight", "attn_output", i, n_embd, n_q)
        if arch in ("qwen3", "qwen3moe"):
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        if "n_expert" in h:
            e, f = h["n_expert"], h["n_ff_exp"]
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", zeros(T.F32, e, n_embd), raw_dtype=T.F32)
            matrix(f"blk.{i}.ffn_gate_exps.weight", "ffn_gate", i, e, f, n_embd)
            matrix(f"blk.{i}.ffn_up_exps.weight", "ffn_up", i, e, f, n_embd)
            matrix(f"blk.{i}.ffn_down_exps.weight", "ffn_down", i, e, n_embd, f)
        else:
            matrix(f"blk.{i}.ffn_gate.weight", "ffn_gate", i, h["n_ff"], n_embd)
            matrix(f"blk.{i}.ffn_up.weight", "ffn_up", i, h["n_ff"], n_embd)
            matrix(f"blk.{i}.ffn_down.weight", "ffn_down", i, n_embd, h["n_ff"])
    writer.add_tensor("output_norm.weight", ones)
    if chain is not None:
        writer.add_tensor("output.weight", output, raw_dtype=T.Q8_0)
    elif not h["tied"]:
        matrix("output.weight", "output", 0, n_vocab, n_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
