"""Writes tiny llama-architecture GGUF models with the `gguf` package, for tests.

Random weights from a seed; relations between models are controlled:
- the same seed gives the same model (an identical draft),
- `perturb` adds noise to every weight (a draft that mostly agrees),
- `sharpen` scales the output matrix (a draft whose q is sharper than p),
- `vocab="letters"` vs `vocab="bytes"` / `vocab_shift` gives incompatible vocabularies,
- `pad=N` appends N unused tokens to the vocabulary (as Qwen2.5-7B's 152,064 against the 0.5B's
  151,936), with their own embedding and output rows; every other weight is the unpadded model's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter, TokenType

NORMAL, CONTROL, UNKNOWN, BYTE = TokenType.NORMAL, TokenType.CONTROL, TokenType.UNKNOWN, TokenType.BYTE


def vocabulary(kind: str, shift: int = 0) -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [UNKNOWN, CONTROL, CONTROL]
    if kind == "bytes":  # byte fallback + printable ASCII: any text tokenizes
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [BYTE] * 256
        chars = ["\u2581"] + [chr(c) for c in range(33, 127)]
    elif kind == "letters":  # 16 tokens in all: small enough for exact distribution tests
        chars = ["\u2581"] + list("abcdefghijkl")
    else:
        raise ValueError(kind)
    chars = chars[shift:] + chars[:shift]
    tokens += chars
    types += [NORMAL] * len(chars)
    return tokens, [int(t) for t in types]


def write_tiny_model(path, *, seed: int = 0, vocab: str = "bytes", vocab_shift: int = 0, n_layer: int = 2,
                     n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 2048,
                     perturb: float = 0.0, perturb_seed: int = 1234, sharpen: float = 1.0, logit_scale: float = 4.0,
                     add_bos: bool = True, chat_template: str | None = None, name: str = "tiny", pad: int = 0,
                     pad_scale: float = 1.0, arch: str = "llama", weights: bool = True,
                     head_count: int | None = None) -> Path:
    """arch, weights=False (a vocabulary-only file) and head_count (what the header says) make files whose
    vocabulary loads but whose model does not."""
    path = Path(path)
    tokens, types = vocabulary(vocab, vocab_shift)
    n_vocab = len(tokens)
    pad_rng = np.random.default_rng(seed + 777)

    def padded(x: np.ndarray, scale: float) -> np.ndarray:
        """x with `pad` more rows (the padded tokens'), drawn apart so the other rows stay the same."""
        if not pad:
            return x
        extra = pad_rng.standard_normal((pad, x.shape[1])) * scale
        return np.concatenate([x, extra.astype(np.float32)])
    w = _weights(seed, perturb, perturb_seed)
    head_dim = n_embd // n_head
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head if head_count is None else head_count)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)  # all F32
    _add_vocab(writer, tokens + [f"[PAD{n_vocab + i}]" for i in range(pad)], types + [int(TokenType.UNUSED)] * pad,
               add_bos=add_bos)
    if chat_template:
        writer.add_chat_template(chat_template)

    if not weights:
        return _write(writer, path, tensors=False)
    writer.add_tensor("token_embd.weight", padded(w(n_vocab, n_embd, scale=1.0), 1.0))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    # logit_scale makes the distribution peaked enough to be interesting; sharpen changes only this model.
    output = w(n_vocab, n_embd) * np.float32(logit_scale * sharpen)
    writer.add_tensor("output.weight", padded(output, pad_scale * logit_scale * sharpen / np.sqrt(n_embd)))
    return _write(writer, path)


def write_tiny_mamba2(path, *, seed: int = 0, n_layer: int = 2, n_embd: int = 64, d_state: int = 16, n_head: int = 4,
                      d_conv: int = 4, perturb: float = 0.0, perturb_seed: int = 1234, logit_scale: float = 4.0) -> Path:
    """A tiny mamba2 (recurrent: no KV cache, a state per sequence that llama.cpp cannot cut) with the byte
    vocabulary of the llama models above, so a llama model and a mamba2 model can draft for each other."""
    path = Path(path)
    tokens, types = vocabulary("bytes")
    n_vocab, d_inner, n_group = len(tokens), 2 * n_embd, 1
    conv_dim = d_inner + 2 * n_group * d_state
    w = _weights(seed, perturb, perturb_seed)
    writer = GGUFWriter(str(path), "mamba2")
    writer.add_name("tiny-mamba2")
    writer.add_context_length(2048)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_uint32("mamba2.ssm.conv_kernel", d_conv)
    writer.add_uint32("mamba2.ssm.inner_size", d_inner)
    writer.add_uint32("mamba2.ssm.state_size", d_state)
    writer.add_uint32("mamba2.ssm.time_step_rank", n_head)
    writer.add_uint32("mamba2.ssm.group_count", n_group)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)
    _add_vocab(writer, tokens, types)
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd, scale=1.0))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ssm_in.weight", w(d_inner + conv_dim + n_head, n_embd))
        writer.add_tensor(f"blk.{i}.ssm_conv1d.weight", w(conv_dim, d_conv, scale=0.5))
        writer.add_tensor(f"blk.{i}.ssm_conv1d.bias", np.zeros(conv_dim, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ssm_dt.bias", np.full(n_head, -1.0, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ssm_a", -np.exp(w.rng.uniform(0, 1, (n_head, 1))).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ssm_d", np.ones((n_head, 1), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ssm_out.weight", w(n_embd, d_inner))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, n_embd) * np.float32(logit_scale))
    return _write(writer, path)


def _weights(seed: int, perturb: float, perturb_seed: int):
    """w(*shape, scale=None): float32 weights drawn from the seed (scale 1/sqrt(last dim) unless given), plus
    `perturb` of that scale in noise from perturb_seed; w.rng is the seed's generator."""
    rng, noise = np.random.default_rng(seed), np.random.default_rng(perturb_seed)

    def w(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        x = rng.standard_normal(shape) * scale
        if perturb:
            x = x + noise.standard_normal(shape) * scale * perturb
        return x.astype(np.float32)

    w.rng = rng
    return w


def _add_vocab(writer, tokens, types, *, add_bos: bool = True) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)


def _write(writer, path: Path, *, tensors: bool = True) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    if tensors:
        writer.write_tensors_to_file()
    writer.close()
    return path
