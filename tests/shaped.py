"""Real-shape llama models with random weights, written directly as quantized blocks (Q4_K matrices, Q8_0 token
embeddings and output), for speed measurements where no real model can travel: a step costs what a real model of
that shape and type costs on the same kernels; what they generate means nothing (one drafts for another about as
well as chance), so only a model drafting for itself has its drafts accepted.

    write_shaped(path, "llama-3.1-8b")            # 32 layers of 4096, 128,256 tokens: 4.6 GB
    write_shaped(path, "llama-3.2-1b")            # 16 layers of 2048, tied embeddings: 1.0 GB
    write_shaped(path, "llama-3.1-8b", n_layer=2) # any hyperparameter overridden (a quick try on a CPU)

Every matrix of one shape shares one random array (the file holds a copy per layer), so writing an 8B model takes
seconds and a few hundred MB of memory. Nothing here is copied from llama.cpp: the blocks follow ggml's layouts,
checked against the gguf package's dequantizers (tests/pure/test_shaped.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tiny import _add_vocab, _write, vocabulary

SHAPES = {
    "llama-3.1-8b": dict(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, tied=False),
    "llama-3.2-1b": dict(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_vocab=128256, tied=True),
}
Q4_K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q8_0
_SUB = 32  # Q4_K: every sub-block's 6-bit scale and min (so each weight is d*32*q - dmin*32, q in 0..15)


def q4_k(rows: int, cols: int, rng, std: float) -> np.ndarray:
    """(rows, cols/256*144) bytes of Q4_K blocks whose weights are uniform with mean 0 and standard deviation std:
    d (f16), dmin (f16), 12 bytes of packed 6-bit scales and mins, 128 bytes of 4-bit values."""
    assert cols % 256 == 0, cols
    n = rows * cols // 256
    d = std / (_SUB * np.sqrt((16 ** 2 - 1) / 12))  # a uniform q in 0..15 has standard deviation 4.61
    head = np.array([d, d * 7.5], dtype=np.float16).view(np.uint8)  # dmin*32 = d*32*7.5: the values' mean
    lo, hi = _SUB & 0x3F, _SUB >> 4  # sub-blocks 0-3 keep 6 bits in place; 4-7 split 4 low bits and 2 high
    scales = np.array([lo | hi << 6] * 8 + [(_SUB & 0x0F) | (_SUB & 0x0F) << 4] * 4, dtype=np.uint8)
    blocks = np.empty((n, 144), dtype=np.uint8)
    blocks[:, :4], blocks[:, 4:16] = head, scales
    blocks[:, 16:] = rng.integers(0, 256, (n, 128), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def q8_0(rows: int, cols: int, rng, std: float) -> np.ndarray:
    """(rows, cols/32*34) bytes of Q8_0 blocks: d (f16) and 32 int8 values, uniform with standard deviation std."""
    assert cols % 32 == 0, cols
    n = rows * cols // 32
    blocks = np.empty((n, 34), dtype=np.uint8)
    blocks[:, :2] = np.array([std / np.sqrt((255 ** 2 - 1) / 12)], dtype=np.float16).view(np.uint8)
    blocks[:, 2:] = rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_shaped(path, shape: str = "llama-3.1-8b", *, seed: int = 0, logit_scale: float = 4.0, **overrides) -> Path:
    """A llama of `shape`'s hyperparameters (SHAPES; any overridden) with random Q4_K/Q8_0 weights. Its vocabulary
    is tiny's bytes vocabulary padded with word tokens to n_vocab, so text round-trips and output rows cost as many
    as the real vocabulary's."""
    h = {**SHAPES[shape], **overrides}
    n_embd, n_ff, n_vocab = h["n_embd"], h["n_ff"], h["n_vocab"]
    head_dim = n_embd // h["n_head"]
    n_kv = h["n_head_kv"] * head_dim
    tokens, types = vocabulary("bytes")
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    types += [int(types[-1])] * (n_vocab - len(types))  # NORMAL, as the printable characters
    path = Path(path)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"{shape}-shaped")
    writer.add_context_length(8192)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(h["n_layer"])
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(h["n_head"])
    writer.add_head_count_kv(h["n_head_kv"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(15)  # MOSTLY_Q4_K_M, as the mix most users run
    _add_vocab(writer, tokens, types)
    rng = np.random.default_rng(seed)
    made: dict = {}

    def tensor(name: str, kind, rows: int, cols: int, std: float | None = None) -> None:
        key = (kind, rows, cols, std)
        if key not in made:
            made[key] = (q4_k if kind == Q4_K else q8_0)(rows, cols, rng, std or cols ** -0.5)
        writer.add_tensor(name, made[key], raw_dtype=kind)  # the shape in bytes per row, as gguf takes it

    ones = np.ones(n_embd, dtype=np.float32)
    tensor("token_embd.weight", Q8_0, n_vocab, n_embd, std=logit_scale * n_embd ** -0.5 if h["tied"] else 1.0)
    for i in range(h["n_layer"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        tensor(f"blk.{i}.attn_q.weight", Q4_K, n_embd, n_embd)
        tensor(f"blk.{i}.attn_k.weight", Q4_K, n_kv, n_embd)
        tensor(f"blk.{i}.attn_v.weight", Q4_K, n_kv, n_embd)
        tensor(f"blk.{i}.attn_output.weight", Q4_K, n_embd, n_embd)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        tensor(f"blk.{i}.ffn_gate.weight", Q4_K, n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", Q4_K, n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", Q4_K, n_embd, n_ff)
    writer.add_tensor("output_norm.weight", ones)
    if not h["tied"]:
        tensor("output.weight", Q8_0, n_vocab, n_embd, std=logit_scale * n_embd ** -0.5)
    return _write(writer, path)
