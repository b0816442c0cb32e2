"""Tiny GGUF models with multi-token-prediction ("NextN"/MTP) layers, for the `--mode mtp` drafter's tests.

An MTP block sits after the trunk (`block_count` counts it, `nextn_predict_layers` says how many): it reads the
trunk's last hidden state h_t and the embedding of the token after t, and predicts the token after that. llama.cpp
runs it in a second context (ctx_type MTP) of the same model, loaded with `load_mtp`.

How the head is made to agree with the target: the output matrix maps each printable character's embedding to a
successor (a fixed random permutation of the printable characters), and the trunk's blocks add `trunk_scale`
of themselves to the residual, so the target's next token is mostly the successor of the current one (text of
printable characters). The head's `eh_proj` passes the token embedding through ([I | 0]) and its own block adds
little, so it predicts the successor of the token it is given; the trunk's context-dependent part is what it misses.
A larger `trunk_scale` gives lower acceptance. head_agrees=False draws eh_proj at random: a head that rarely
agrees. The MTP block's weights come from their own generator, so nextn=False writes the very same trunk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tiny import _begin, _weights, _write


def write_tiny_glm4moe_mtp(path, *, seed: int = 0, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                           n_ff: int = 128, n_expert: int = 4, n_expert_used: int = 2, n_ff_exp: int = 32,
                           trunk_scale: float = 2.0, head_agrees: bool = True, logit_scale: float = 4.0,
                           nextn: bool = True, part: str = "all") -> Path:
    """A tiny glm4moe: block 0 dense, block 1 MoE (routed experts + one shared expert), and block 2 the NextN
    (MTP) block, itself an MoE block with `nextn.{eh_proj,enorm,hnorm,shared_head_norm}`. It has no
    `nextn.embed_tokens`/`nextn.shared_head_head`: llama.cpp then uses token_embd and output. nextn=False
    writes the same trunk without the MTP block (block_count 2, no nextn_predict_layers). part="trunk" / "mtp"
    splits the model as llama.cpp's converter does for a separate MTP file (`mtp-*.gguf`, given as the draft):
    "trunk" has the header (with nextn_predict_layers) and every tensor but block 2's, "mtp" the same header
    and only block 2, token_embd, output_norm and output."""
    arch, n_trunk = "glm4moe", 2
    n_layer = n_trunk + (1 if nextn else 0)
    head_dim = n_embd // n_head
    writer, w, n_vocab = _begin(path, arch, n_layer, n_embd, seed, 0.0, 1234)
    if part != "all":
        writer = _Part(writer, part, f"blk.{n_trunk}.")
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_uint32(f"{arch}.expert_count", n_expert)
    writer.add_uint32(f"{arch}.expert_used_count", n_expert_used)
    writer.add_uint32(f"{arch}.expert_feed_forward_length", n_ff_exp)
    writer.add_uint32(f"{arch}.expert_shared_count", 1)
    writer.add_uint32(f"{arch}.leading_dense_block_count", 1)
    writer.add_float32(f"{arch}.expert_weights_scale", 1.0)
    writer.add_bool(f"{arch}.expert_weights_norm", True)
    writer.add_uint32(f"{arch}.expert_gating_func", 2)  # sigmoid, as GLM-4.5
    if nextn:
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    ones = np.ones(n_embd, dtype=np.float32)
    _embed_and_output(writer, w, n_vocab, n_embd, logit_scale)
    w_trunk, w_mtp = w, _weights(seed + 1, 0.0, 1234)  # the MTP block's own generator
    for i in range(n_layer):
        w = w_mtp if i >= n_trunk else w_trunk
        scale = trunk_scale if i < n_trunk else 0.5  # the MTP block stays weak: a clean copy of the successor map
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        _attention(writer, w, i, n_embd, n_head_kv * head_dim, out_scale=scale)
        writer.add_tensor(f"blk.{i}.post_attention_norm.weight", ones)
        if i == 0:  # the leading dense block
            writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff) * np.float32(scale))
        else:
            writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", w(n_expert, n_embd))
            writer.add_tensor(f"blk.{i}.exp_probs_b.bias", np.zeros(n_expert, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", w(n_expert, n_ff_exp, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", w(n_expert, n_ff_exp, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", w(n_expert, n_embd, n_ff_exp) * np.float32(scale))
            writer.add_tensor(f"blk.{i}.ffn_gate_shexp.weight", w(n_ff_exp, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_up_shexp.weight", w(n_ff_exp, n_embd))
            writer.add_tensor(f"blk.{i}.ffn_down_shexp.weight", w(n_embd, n_ff_exp) * np.float32(scale))
        if i >= n_trunk:
            _nextn(writer, w, i, n_embd, head_agrees)
    writer.add_tensor("output_norm.weight", ones)
    return _write(writer, Path(path))


class _Part:
    """A writer that keeps only the tensors of one part: "trunk" (all but the MTP block's) or "mtp" (the MTP
    block's and the shared token_embd, output_norm, output that an MTP-only file must carry)."""

    def __init__(self, writer, part: str, mtp_prefix: str):
        if part not in ("trunk", "mtp"):
            raise ValueError(part)
        self.writer, self.part, self.mtp_prefix = writer, part, mtp_prefix

    def add_tensor(self, name: str, tensor) -> None:
        shared = name in ("token_embd.weight", "output_norm.weight", "output.weight")
        if (self.part == "trunk") != name.startswith(self.mtp_prefix) or (self.part == "mtp" and shared):
            self.writer.add_tensor(name, tensor)

    def __getattr__(self, name):
        return getattr(self.writer, name)


def _attention(writer, w, i: int, n_embd: int, n_kv: int, out_scale: float = 1.0) -> None:
    """tiny's q, k, v, output projections, the output scaled by out_scale (how much the block adds)."""
    writer.add_tensor(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
    writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_kv, n_embd))
    writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_kv, n_embd))
    writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd) * np.float32(out_scale))


def write_tiny_qwen35_mtp(path, *, seed: int = 0, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                          n_ff: int = 128, d_state: int = 16, ssm_heads: int = 4, d_conv: int = 4,
                          trunk_scale: float = 2.0, head_agrees: bool = True, logit_scale: float = 4.0,
                          nextn: bool = True) -> Path:
    """A tiny qwen35 (Qwen3.5: a hybrid of gated-delta-net recurrent layers and gated full attention): block 0
    recurrent, block 1 attention (full_attention_interval 2), and block 2 the MTP block, a dense full-attention
    block with the nextn tensors. The MTP head agrees as write_tiny_glm4moe_mtp's does."""
    arch, n_trunk = "qwen35", 2
    n_layer = n_trunk + (1 if nextn else 0)
    head_dim = n_embd // n_head
    writer, w, n_vocab = _begin(path, arch, n_layer, n_embd, seed, 0.0, 1234)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_array(f"{arch}.rope.dimension_sections", [head_dim // 4, head_dim // 8, head_dim // 8, 0])
    writer.add_uint32(f"{arch}.full_attention_interval", 2)  # layer i is recurrent unless (i + 1) % 2 == 0
    writer.add_uint32(f"{arch}.ssm.conv_kernel", d_conv)
    writer.add_uint32(f"{arch}.ssm.inner_size", d_state * ssm_heads)  # value heads x head size
    writer.add_uint32(f"{arch}.ssm.state_size", d_state)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", ssm_heads)  # the number of value heads
    writer.add_uint32(f"{arch}.ssm.group_count", 1)  # the number of key heads
    if nextn:
        writer.add_uint32(f"{arch}.nextn_predict_layers", 1)
    ones = np.ones(n_embd, dtype=np.float32)
    _embed_and_output(writer, w, n_vocab, n_embd, logit_scale)
    w_trunk, w_mtp = w, _weights(seed + 1, 0.0, 1234)  # the MTP block's own generator
    for i in range(n_layer):
        w = w_mtp if i >= n_trunk else w_trunk
        scale = trunk_scale if i < n_trunk else 0.5  # the MTP block stays weak: a clean copy of the successor map
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.post_attention_norm.weight", ones)
        if i % 2 == 0 and i < n_trunk:  # gated delta net
            key_dim, value_dim = d_state, d_state * ssm_heads
            writer.add_tensor(f"blk.{i}.attn_qkv.weight", w(2 * key_dim + value_dim, n_embd))
            writer.add_tensor(f"blk.{i}.attn_gate.weight", w(value_dim, n_embd))
            writer.add_tensor(f"blk.{i}.ssm_conv1d.weight", w(2 * key_dim + value_dim, d_conv, scale=0.5))
            writer.add_tensor(f"blk.{i}.ssm_dt.bias", np.full(ssm_heads, -1.0, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.ssm_a", -np.exp(w.rng.uniform(0, 1, ssm_heads)).astype(np.float32))
            writer.add_tensor(f"blk.{i}.ssm_beta.weight", w(ssm_heads, n_embd))
            writer.add_tensor(f"blk.{i}.ssm_alpha.weight", w(ssm_heads, n_embd))
            writer.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones(d_state, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.ssm_out.weight", w(n_embd, value_dim) * np.float32(scale))
        else:  # gated attention: attn_q yields query and gate per head
            writer.add_tensor(f"blk.{i}.attn_q.weight", w(2 * n_embd, n_embd))
            writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_head_kv * head_dim, n_embd))
            writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_head_kv * head_dim, n_embd))
            writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd) * np.float32(scale))
            writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(head_dim, dtype=np.float32))
            writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(head_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff) * np.float32(scale))
        if i >= n_trunk:
            _nextn(writer, w, i, n_embd, head_agrees)
    writer.add_tensor("output_norm.weight", ones)
    return _write(writer, Path(path))


def _nextn(writer, w, i: int, n_embd: int, head_agrees: bool) -> None:
    """The NextN tensors of block i: eh_proj maps [enorm(embed) | hnorm(h)] to n_embd, passing the token's
    embedding through when head_agrees, else a random mix."""
    ones = np.ones(n_embd, dtype=np.float32)
    eh = np.hstack([np.eye(n_embd), np.zeros((n_embd, n_embd))]).astype(np.float32)
    writer.add_tensor(f"blk.{i}.nextn.eh_proj.weight", eh if head_agrees else w(n_embd, 2 * n_embd))
    writer.add_tensor(f"blk.{i}.nextn.enorm.weight", ones)
    writer.add_tensor(f"blk.{i}.nextn.hnorm.weight", ones)
    writer.add_tensor(f"blk.{i}.nextn.shared_head_norm.weight", ones)


def _embed_and_output(writer, w, n_vocab: int, n_embd: int, logit_scale: float) -> None:
    """token_embd at random; output rows such that the printable character x's embedding scores its successor
    perm[x] highest (the row of perm[x] is x's embedding), every other token's row a weak random one."""
    embd = w(n_vocab, n_embd, scale=1.0)
    output = w(n_vocab, n_embd, scale=0.5 / np.sqrt(n_embd))
    printable = np.arange(n_vocab - 95, n_vocab)  # "\u2581" and chr(33..126), last in tiny's bytes vocabulary
    output[w.rng.permutation(printable)] = embd[printable] / np.float32(np.sqrt(n_embd))
    writer.add_tensor("token_embd.weight", embd)
    writer.add_tensor("output.weight", output * np.float32(logit_scale))
