"""Writes tiny llama-architecture GGUF models with the `gguf` package, for tests.

Random weights from a seed; relations between models are controlled:
- the same seed gives the same model (an identical draft),
- `perturb` adds noise to every weight (a draft that mostly agrees),
- `sharpen` scales the output matrix (a draft whose q is sharper than p),
- `vocab="letters"` vs `vocab="bytes"` / `vocab_shift` gives incompatible vocabularies, `vocab="bpe"` a byte-level BPE
  one (another tokenizer: a draft across tokenizers),
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
    elif kind == "bpe":  # byte-level BPE (GPT-2's byte characters, as Qwen's and Llama 3's): any text tokenizes
        from ggufspec.llama.compat import byte_level_chars

        chars = byte_level_chars() + [a + b for a, b in (m.split() for m in BPE_MERGES)]
        types = [CONTROL] * 3
    elif kind == "letters":  # 16 tokens in all: small enough for exact distribution tests
        chars = ["\u2581"] + list("abcdefghijkl")
    else:
        raise ValueError(kind)
    chars = chars[shift:] + chars[:shift]
    tokens += chars
    types += [NORMAL] * len(chars)
    return tokens, [int(t) for t in types]


# A byte-level BPE vocabulary's merges (its tokens beyond the 256 byte characters), for vocab="bpe".
BPE_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "Ġ a", "o n", "Ġ c", "d e", "Ġ f", "Ġ (", "Ġ x"]


def write_tiny_model(path, *, seed: int = 0, vocab: str = "bytes", vocab_shift: int = 0, n_layer: int = 2,
                     n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2, n_ff: int = 128, n_ctx_train: int = 2048,
                     perturb: float = 0.0, perturb_seed: int = 1234, sharpen: float = 1.0, logit_scale: float = 4.0,
                     add_bos: bool = True, chat_template: str | None = None, name: str = "tiny", pad: int = 0,
                     pad_scale: float = 1.0, arch: str = "llama", weights: bool = True,
                     head_count: int | None = None, permute: int | None = None, byte_logits: bool = True) -> Path:
    """arch, weights=False (a vocabulary-only file) and head_count (what the header says) make files whose
    vocabulary loads but whose model does not. permute (a seed): the same model with its text tokens at other ids
    (their embedding and output rows moved with them): another vocabulary that, in text, is the model itself.
    byte_logits=False: the byte-fallback tokens' output rows are 0, so the model writes the letters' own tokens (as
    a real model does where a text has a token of its own; a tokenizer never gives back a byte token there)."""
    path = Path(path)
    tokens, types = vocabulary(vocab, vocab_shift)
    n_vocab = len(tokens)
    order = np.arange(n_vocab)  # new id -> the id it had
    if permute is not None:
        normal = np.flatnonzero(np.array(types) == int(NORMAL))
        order[normal] = np.random.default_rng(permute).permutation(normal)
        tokens, types = [tokens[i] for i in order], [types[i] for i in order]
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
               add_bos=add_bos, bpe=vocab == "bpe")
    if chat_template:
        writer.add_chat_template(chat_template)

    if not weights:
        return _write(writer, path, tensors=False)
    writer.add_tensor("token_embd.weight", padded(w(n_vocab, n_embd, scale=1.0)[order], 1.0))
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
    output = w(n_vocab, n_embd)[order] * np.float32(logit_scale * sharpen)
    if not byte_logits:
        output[np.array(types) == int(BYTE)] = 0.0
    writer.add_tensor("output.weight", padded(output, pad_scale * logit_scale * sharpen / np.sqrt(n_embd)))
    return _write(writer, path)


def write_tiny_mamba2(path, *, seed: int = 0, n_layer: int = 2, n_embd: int = 64, d_state: int = 16, n_head: int = 4,
                      d_conv: int = 4, perturb: float = 0.0, perturb_seed: int = 1234, logit_scale: float = 4.0) -> Path:
    """A tiny mamba2 (recurrent: no KV cache, a state per sequence that llama.cpp cannot cut) with the byte
    vocabulary of the llama models above, so a llama model and a mamba2 model can draft for each other."""
    writer, w, n_vocab = _begin(path, "mamba2", n_layer, n_embd, seed, perturb, perturb_seed)
    _ssm_keys(writer, "mamba2", n_embd, d_state, n_head, d_conv)
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd, scale=1.0))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        _ssm_layer(writer, w, i, n_embd, d_state, n_head, d_conv)
    return _end(writer, path, w, n_vocab, n_embd, logit_scale)


def write_tiny_hybrid(path, arch: str, *, seed: int = 0, layers: str = "rar", n_embd: int = 64, n_head: int = 4,
                      n_head_kv: int = 2, n_ff: int = 128, d_state: int = 16, ssm_heads: int = 4, d_conv: int = 4,
                      perturb: float = 0.0, perturb_seed: int = 1234, logit_scale: float = 4.0, sharpen: float = 1.0,
                      vocab: str = "bytes") -> Path:
    """A tiny hybrid: recurrent layers ("r") beside attention layers ("a"), in the order of `layers`. arch "lfm2":
    short-convolution recurrent layers (LFM2), whose final norm is `token_embd_norm`; "granitehybrid": mamba2
    layers (Granite 4). Both mark a recurrent layer by 0 KV heads in a per-layer array. The byte vocabulary unless
    `vocab` says "letters" (for the distribution tests, with `sharpen` as in write_tiny_model)."""
    n_layer, head_dim = len(layers), n_embd // n_head
    writer, w, n_vocab = _begin(path, arch, n_layer, n_embd, seed, perturb, perturb_seed, vocab)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv([n_head_kv if kind == "a" else 0 for kind in layers])
    writer.add_rope_dimension_count(head_dim)
    if arch == "lfm2":
        writer.add_shortconv_l_cache(d_conv)
    else:
        _ssm_keys(writer, arch, n_embd, d_state, ssm_heads, d_conv)
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd, scale=1.0))
    for i, kind in enumerate(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        if kind == "a":
            _attention(writer, w, i, n_embd, n_head_kv * head_dim, norms=head_dim if arch == "lfm2" else 0)
        elif arch == "lfm2":
            writer.add_tensor(f"blk.{i}.shortconv.conv.weight", w(n_embd, d_conv, scale=0.5))
            writer.add_tensor(f"blk.{i}.shortconv.in_proj.weight", w(3 * n_embd, n_embd))
            writer.add_tensor(f"blk.{i}.shortconv.out_proj.weight", w(n_embd, n_embd))
        else:
            _ssm_layer(writer, w, i, n_embd, d_state, ssm_heads, d_conv)
        _ffn(writer, w, i, n_embd, n_ff)
    return _end(writer, path, w, n_vocab, n_embd, logit_scale * sharpen, norm="token_embd_norm" if arch == "lfm2" else "output_norm")


def write_tiny_moe(path, *, seed: int = 0, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                   n_expert: int = 4, n_expert_used: int = 2, n_ff_exp: int = 64, perturb: float = 0.0,
                   perturb_seed: int = 1234, logit_scale: float = 4.0) -> Path:
    """A tiny qwen3moe (mixture of experts: a router picks n_expert_used of n_expert FFNs per token; the experts
    of a layer are stacked in one tensor each, `ffn_{gate,up,down}_exps`); the byte vocabulary."""
    head_dim = n_embd // n_head
    writer, w, n_vocab = _begin(path, "qwen3moe", n_layer, n_embd, seed, perturb, perturb_seed)
    writer.add_feed_forward_length(n_ff_exp * n_expert_used)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_expert_used)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tensor("token_embd.weight", w(n_vocab, n_embd, scale=1.0))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        _attention(writer, w, i, n_embd, n_head_kv * head_dim, norms=head_dim)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate_inp.weight", w(n_expert, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_gate_exps.weight", w(n_expert, n_ff_exp, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up_exps.weight", w(n_expert, n_ff_exp, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down_exps.weight", w(n_expert, n_embd, n_ff_exp))
    return _end(writer, path, w, n_vocab, n_embd, logit_scale)


def _begin(path, arch: str, n_layer: int, n_embd: int, seed: int, perturb: float, perturb_seed: int,
           vocab: str = "bytes"):
    """A writer with the header every architecture shares and a vocabulary; (writer, w, n_vocab)."""
    tokens, types = vocabulary(vocab)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(2048)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(0)
    _add_vocab(writer, tokens, types)
    return writer, _weights(seed, perturb, perturb_seed), len(tokens)


def _end(writer, path, w, n_vocab: int, n_embd: int, logit_scale: float, norm: str = "output_norm") -> Path:
    writer.add_tensor(f"{norm}.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", w(n_vocab, n_embd) * np.float32(logit_scale))
    return _write(writer, Path(path))


def _ssm_keys(writer, arch: str, n_embd: int, d_state: int, n_head: int, d_conv: int) -> None:
    writer.add_uint32(f"{arch}.ssm.conv_kernel", d_conv)
    writer.add_uint32(f"{arch}.ssm.inner_size", 2 * n_embd)
    writer.add_uint32(f"{arch}.ssm.state_size", d_state)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", n_head)  # the number of SSM heads
    writer.add_uint32(f"{arch}.ssm.group_count", 1)


def _ssm_layer(writer, w, i: int, n_embd: int, d_state: int, n_head: int, d_conv: int) -> None:
    """A mamba2 layer's tensors (`ssm_a`/`ssm_d` have no .weight suffix; A is negative)."""
    d_inner, n_group = 2 * n_embd, 1
    conv_dim = d_inner + 2 * n_group * d_state
    writer.add_tensor(f"blk.{i}.ssm_in.weight", w(d_inner + conv_dim + n_head, n_embd))
    writer.add_tensor(f"blk.{i}.ssm_conv1d.weight", w(conv_dim, d_conv, scale=0.5))
    writer.add_tensor(f"blk.{i}.ssm_conv1d.bias", np.zeros(conv_dim, dtype=np.float32))
    writer.add_tensor(f"blk.{i}.ssm_dt.bias", np.full(n_head, -1.0, dtype=np.float32))
    writer.add_tensor(f"blk.{i}.ssm_a", -np.exp(w.rng.uniform(0, 1, (n_head, 1))).astype(np.float32))
    writer.add_tensor(f"blk.{i}.ssm_d", np.ones((n_head, 1), dtype=np.float32))
    writer.add_tensor(f"blk.{i}.ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32))
    writer.add_tensor(f"blk.{i}.ssm_out.weight", w(n_embd, d_inner))


def _attention(writer, w, i: int, n_embd: int, n_kv: int, norms: int = 0) -> None:
    """q, k, v and output projections; norms > 0 adds the per-head q/k norms of that size (qwen3, lfm2)."""
    writer.add_tensor(f"blk.{i}.attn_q.weight", w(n_embd, n_embd))
    writer.add_tensor(f"blk.{i}.attn_k.weight", w(n_kv, n_embd))
    writer.add_tensor(f"blk.{i}.attn_v.weight", w(n_kv, n_embd))
    writer.add_tensor(f"blk.{i}.attn_output.weight", w(n_embd, n_embd))
    if norms:
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.ones(norms, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(norms, dtype=np.float32))


def _ffn(writer, w, i: int, n_embd: int, n_ff: int) -> None:
    writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
    writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
    writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff))


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


def _add_vocab(writer, tokens, types, *, add_bos: bool = True, bpe: bool = False) -> None:
    writer.add_tokenizer_model("gpt2" if bpe else "llama")
    if bpe:
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(BPE_MERGES)
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
