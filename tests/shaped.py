"""Real-shape llama models with random weights, written directly as quantized blocks (Q4_K matrices, Q8_0 token
embeddings and output), for speed measurements where no real model can travel: a step costs what a real model of
that shape and type costs on the same kernels. Unless chained (below), what they generate means nothing (one drafts
for another about as well as chance), so only a model drafting for itself has its drafts accepted.

    write_shaped(path, "llama-3.1-8b")            # 32 layers of 4096, 128,256 tokens: 4.6 GB
    write_shaped(path, "llama-3.2-1b")            # 16 layers of 2048, tied embeddings: 1.0 GB
    write_shaped(path, "llama-3.1-8b", n_layer=2) # any hyperparameter overridden (a quick try on a CPU)
    write_shaped(path, "llama-3.1-8b", chain=Chain(seed=1))                 # a target whose text is a chain...
    write_shaped(path, "llama-3.2-1b", seed=2, chain=Chain(seed=1, alpha=0.7))  # ...its draft, accepted 70% of tokens

Every matrix of one shape shares one random array (the file holds a copy per layer), so writing an 8B model takes
seconds and a few hundred MB of memory. Nothing here is copied from llama.cpp: the blocks follow ggml's layouts,
checked against the gguf package's dequantizers (tests/pure/test_shaped.py).

A `Chain` makes a pair whose acceptance rate is chosen, at a real model's cost: every block's output projections
(attn_output, ffn_down) are zero blocks, so the full stack is computed but the residual stream stays the last token's
embedding, and the embedding and output rows make each token's successor a fixed function of it (Chain's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from tiny import NORMAL, _add_vocab, _write, vocabulary

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


@dataclass(frozen=True)
class Chain:
    """Which token a chained model writes after which. σ, the target's rule, is one cycle through every ordinary
    token (the text's own: not control, unknown or byte-fallback tokens), in an order drawn from `seed`: no token
    comes twice within a generation shorter than the cycle, so copying from the text never pays. A model of this
    chain writes σ(t) after a share `alpha` of the ordinary tokens (a subset A drawn from `seed` too, each alpha's
    holding every lower one's) and another ordinary token after the rest, each once (its rule is a permutation
    too). As a draft for alpha 1's model, a drafted token is accepted exactly when the token before it is in A: at
    temperature 0, with probability alpha given the tokens before it were. Any other token is read as the cycle's
    last, so a prompt ending in BOS goes on at the cycle's start, and none is ever written.
    `logit`: about the successor's logit. The others' are about normal with standard deviation logit/√n_embd, so
    the largest of them all stays below it while n_embd is well above 4·ln(n_vocab) (tests/pure/test_shaped.py)."""

    seed: int = 0
    alpha: float = 1.0
    logit: float = 40.0

    def cycle(self, types) -> np.ndarray:
        """The ordinary token ids in σ's order: σ(cycle[i]) = cycle[i + 1], and the last's is the first."""
        ordinary = np.flatnonzero(np.asarray(types) == int(NORMAL))
        return np.random.default_rng(self.seed).permutation(ordinary)

    def successors(self, types) -> np.ndarray:
        """The token this chain's model writes after each token id of a vocabulary of these types."""
        cycle = self.cycle(types)
        n = len(cycle)
        sigma = np.roll(cycle, -1)
        n_followed = round(self.alpha * n)
        n_followed -= n - n_followed == 1  # a lone token left over has no other's successor to take
        others = np.random.default_rng([self.seed, 1]).permutation(n)[n_followed:]
        written = sigma.copy()
        written[others] = sigma[np.roll(others, -1)]  # each takes the next one's: a successor, never its own
        after = np.full(len(types), written[-1])
        after[cycle] = written
        return after


def shaped_vocabulary(n_vocab: int) -> tuple[list[str], list[int]]:
    """tiny's bytes vocabulary padded with word tokens ("▁w0", "▁w1", ...) to n_vocab."""
    tokens, types = vocabulary("bytes")
    tokens += [f"\u2581w{i}" for i in range(n_vocab - len(tokens))]
    types += [int(types[-1])] * (n_vocab - len(types))  # NORMAL, as the printable characters
    return tokens, types


def write_shaped(path, shape: str = "llama-3.1-8b", *, seed: int = 0, logit_scale: float = 4.0,
                 chain: Chain | None = None, **overrides) -> Path:
    """A llama of `shape`'s hyperparameters (SHAPES; any overridden) with random Q4_K/Q8_0 weights. Its vocabulary
    is shaped_vocabulary(n_vocab), so text round-trips and output rows cost as many as the real vocabulary's.
    chain: the model writes chain.successors(...) after each token, at temperature 0; its attn_output and ffn_down
    are zero blocks, so logits depend on the last token alone, and its output matrix is its own even where the
    shape's is tied (a tied one cannot map a token to another). seed draws the weights, chain the rule."""
    h = {**SHAPES[shape], **overrides}
    if chain is not None:
        h["tied"] = False
    n_embd, n_ff, n_vocab = h["n_embd"], h["n_ff"], h["n_vocab"]
    head_dim = n_embd // h["n_head"]
    n_kv = h["n_head_kv"] * head_dim
    tokens, types = shaped_vocabulary(n_vocab)
    path = Path(path)
    writer = GGUFWriter(str(path), "llama")
    writer.add_name(f"{shape}-shaped" if chain is None else f"{shape}-chained-{chain.seed}-{chain.alpha:g}")
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
            made[key] = (q4_k if kind == Q4_K else q8_0)(rows, cols, rng, cols ** -0.5 if std is None else std)
        writer.add_tensor(name, made[key], raw_dtype=kind)  # the shape in bytes per row, as gguf takes it

    ones = np.ones(n_embd, dtype=np.float32)
    out_std = None if chain is None else 0.0  # zero blocks: each block adds nothing to the residual stream
    if chain is None:
        tensor("token_embd.weight", Q8_0, n_vocab, n_embd, std=logit_scale * n_embd ** -0.5 if h["tied"] else 1.0)
    else:
        embeddings, output = chained_rows(chain, types, n_embd, rng)
        writer.add_tensor("token_embd.weight", embeddings, raw_dtype=Q8_0)
    for i in range(h["n_layer"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        tensor(f"blk.{i}.attn_q.weight", Q4_K, n_embd, n_embd)
        tensor(f"blk.{i}.attn_k.weight", Q4_K, n_kv, n_embd)
        tensor(f"blk.{i}.attn_v.weight", Q4_K, n_kv, n_embd)
        tensor(f"blk.{i}.attn_output.weight", Q4_K, n_embd, n_embd, std=out_std)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        tensor(f"blk.{i}.ffn_gate.weight", Q4_K, n_ff, n_embd)
        tensor(f"blk.{i}.ffn_up.weight", Q4_K, n_ff, n_embd)
        tensor(f"blk.{i}.ffn_down.weight", Q4_K, n_embd, n_ff, std=out_std)
    writer.add_tensor("output_norm.weight", ones)
    if chain is not None:
        writer.add_tensor("output.weight", output, raw_dtype=Q8_0)
    elif not h["tied"]:
        tensor("output.weight", Q8_0, n_vocab, n_embd, std=logit_scale * n_embd ** -0.5)
    return _write(writer, path)


def chained_rows(chain: Chain, types, n_embd: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 embedding and output matrices whose logits, read from token t's embedding alone, peak at
    chain.successors(types)[t]: random embedding rows E[t], and the output row of t's successor c·E[t] (the
    same 8-bit values, the block scale times c), so its logit is c·|E[t]|²/rms(E[t]) ≈ c·n_embd = chain.logit
    and another's c·E[u]·E[t]/rms(E[t]). The rows of the tokens outside the cycle: its last's embedding, and zero
    output (their logit 0, far below the successor's)."""
    cycle, after = chain.cycle(types), chain.successors(types)
    embeddings = q8_0(len(types), n_embd, rng, 1.0)
    outside = np.ones(len(types), dtype=bool)
    outside[cycle] = False
    embeddings[outside] = embeddings[cycle[-1]]
    rows = after[cycle]
    output = np.zeros_like(embeddings)
    output[rows] = embeddings[cycle]
    blocks = output.reshape(len(types), -1, 34)  # a view: each block's f16 scale d, then its 32 values
    d = blocks[rows, :, :2].copy().view(np.float16).astype(np.float32) * (chain.logit / n_embd)
    blocks[rows, :, :2] = d.astype(np.float16).view(np.uint8)
    return embeddings, output


def alpha_from_rounds(accepted_per_round: float, k: int) -> float:
    """The α at which rounds drafting k tokens each accept accepted_per_round on average: α + α² + ... + α^k (how
    α is read from a program that prints counts only, as llama.cpp's speculative-simple)."""
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(mid ** i for i in range(1, k + 1)) < accepted_per_round else (low, mid)
    return (low + high) / 2
