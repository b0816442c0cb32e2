"""Tiny GGUF drafts that read the target's hidden states (llama.cpp's `eagle3` and `dflash` architectures), for
the `--mode eagle3` / `--mode dflash` drafters' tests, and the tiny llama target they draft for.

The target (write_tiny_target) is a tiny llama whose next token is mostly the successor of the current one, as in
tiny_mtp: its output matrix maps each printable character's embedding to a successor (a fixed random permutation
of the printable characters) and its blocks add `trunk_scale` of themselves to the residual, so the rest of the
context changes the next token now and then. Every printable character's embedding also carries a common
direction u (and the mask token -u): the dflash draft's attention tells the block's anchor from its masks by it.

- eagle3: one decoder layer over (token t, fused features g). Its queries and keys are the token's embedding, so
  a position attends to itself (and to earlier copies of the same token), its values pass the embedding through,
  and `norm_before_residual` with a small hidden_norm keeps g a small part of the residual; its output rows are
  the target's, so it predicts the successor of the token it is given, one step after another.
- dflash: two layers over [anchor, mask, mask, ...]; each mask position attends to the anchor (keys along +-u,
  the context's injected keys along -u through fc), so every block position predicts the anchor's successor:
  the first draft token agrees often, later ones rarely (acceptance about p / n_draft).

The drafts take the target's vocabulary (llama.cpp checks it) and, unless shared=True, their own copies of its
token_embd and output, so their contexts need no ctx_other. Nothing here is copied from llama.cpp.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from tiny import _begin, _write
from tiny_mtp import _attention

N_PRINTABLE = 95  # "\u2581" and chr(33..126), last in tiny's bytes vocabulary
MASK_ID = 0  # <unk> doubles as dflash's mask token: the bytes vocabulary has no spare token


def write_tiny_target(path, *, seed: int = 0, n_layer: int = 4, n_embd: int = 64, n_head: int = 4,
                      n_head_kv: int = 2, n_ff: int = 128, trunk_scale: float = 1.0, common: float = 4.0,
                      logit_scale: float = 4.0) -> Path:
    """A tiny llama (bytes vocabulary) whose next token is mostly the successor of the current one; a larger
    trunk_scale makes it depend more on the rest of the context (lower acceptance). `common` is the weight
    of the direction u shared by the printable embeddings (minus it on the mask token)."""
    head_dim = n_embd // n_head
    writer, w, n_vocab = _begin(path, "llama", n_layer, n_embd, seed, 0.0, 1234)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    embd = w(n_vocab, n_embd, scale=1.0)
    u = _unit(w.rng.standard_normal(n_embd))
    printable = np.arange(n_vocab - N_PRINTABLE, n_vocab)
    embd[printable] += np.float32(common) * u
    embd[MASK_ID] -= np.float32(common) * u
    output = w(n_vocab, n_embd, scale=0.5 / np.sqrt(n_embd))
    output[w.rng.permutation(printable)] = embd[printable] / np.float32(np.sqrt(n_embd))
    writer.add_tensor("token_embd.weight", embd)
    ones = np.ones(n_embd, dtype=np.float32)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        _attention(writer, w, i, n_embd, n_head_kv * head_dim, out_scale=trunk_scale)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff) * np.float32(trunk_scale))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", output * np.float32(logit_scale))
    return _write(writer, Path(path))


def read_target(path) -> dict:
    """What a draft needs of a target written by write_tiny_target (or another tiny model with the bytes vocabulary
    and its own output matrix): n_embd, n_layer, token_embd, output and u (the printable embeddings' common
    direction, recovered from the file)."""
    reader = GGUFReader(str(path))
    tensors = {t.name: np.array(t.data, dtype=np.float32) for t in reader.tensors
               if t.name in ("token_embd.weight", "output.weight")}
    embd = tensors["token_embd.weight"]
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    n_layer = int(reader.fields[f"{arch}.block_count"].parts[-1][0])
    return {"embd": embd, "output": tensors["output.weight"], "n_embd": embd.shape[1], "n_layer": n_layer,
            "u": _unit(embd[-N_PRINTABLE:].mean(axis=0))}


def write_tiny_eagle3(path, target, *, layers=(1, 2, 3), d2t: bool = True, draft_vocab: int | None = None,
                      seed: int = 7, noise: float = 0.1, n_head: int = 4, n_ff: int = 128, shared: bool = False,
                      hidden_norm: float = 0.1) -> Path:
    """An eagle3 draft for `target` (a path written by write_tiny_target, or read_target's dict) reading the
    inputs of target layers `layers` (3 ids; an id equal to the target's n_layer means its final hidden state).
    d2t=True: its own output head over the printable characters only (draft_vocab of them, a random subset,
    when given), with the I64 `d2t` table of their target ids (ascending); d2t=False: the full vocabulary.
    shared=True leaves token_embd and output out (the full-vocabulary case only): llama.cpp then takes the
    target's through ctx_other. `noise` mixes the fused features into q, k, v and scales the FFN."""
    t = target if isinstance(target, dict) else read_target(target)
    n_embd, u, embd = t["n_embd"], t["u"], t["embd"]
    if len(layers) != 3 or shared and d2t:
        raise ValueError("eagle3 takes exactly 3 layers; shared=True needs d2t=False")
    writer, w, n_vocab = _begin(path, "eagle3", 1, n_embd, seed, 0.0, 1234)
    head_dim = n_embd // n_head
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)  # v must carry the whole embedding
    writer.add_rope_dimension_count(head_dim)
    writer.add_array("eagle3.target_layers", [int(i) for i in layers])
    writer.add_uint32("eagle3.target_hidden_size", n_embd)
    writer.add_bool("eagle3.norm_before_residual", True)  # the residual gets hidden_norm * norm(g): small
    ones = np.ones(n_embd, dtype=np.float32)
    if d2t:
        ids = np.arange(n_vocab - N_PRINTABLE, n_vocab)
        if draft_vocab is not None:
            ids = np.sort(w.rng.choice(ids, size=draft_vocab, replace=False))
        writer.add_tensor("d2t", ids.astype(np.int64), raw_dtype=GGMLQuantizationType.I64)
        writer.add_tensor("output.weight", t["output"][ids])
    elif not shared:
        writer.add_tensor("output.weight", t["output"])
    if not shared:
        writer.add_tensor("token_embd.weight", embd)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("fc.weight", w(n_embd, 3 * n_embd))
    # q = k = the token's embedding without u (printable tokens would all look alike), scaled so softmax is sharp
    self_qk = np.float32(3.0) * (np.eye(n_embd, dtype=np.float32) - np.outer(u, u).astype(np.float32))
    qkv = [np.hstack([m, w(n_embd, n_embd) * np.float32(noise)])
           for m in (self_qk, self_qk, np.eye(n_embd, dtype=np.float32))]
    writer.add_tensor("blk.0.attn_norm.weight", ones)
    writer.add_tensor("blk.0.attn_norm_2.weight", ones * np.float32(hidden_norm))
    for name, m in zip(("attn_q", "attn_k", "attn_v"), qkv):
        writer.add_tensor(f"blk.0.{name}.weight", m)
    writer.add_tensor("blk.0.attn_output.weight", np.eye(n_embd, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_norm.weight", ones)
    writer.add_tensor("blk.0.ffn_gate.weight", w(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_up.weight", w(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", w(n_embd, n_ff) * np.float32(noise))
    return _write(writer, Path(path))


def write_tiny_dflash(path, target, *, layers=(1, 3), block_size: int = 8, seed: int = 11, noise: float = 0.05,
                      n_head: int = 4, n_ff: int = 128, shared: bool = False, mask_id: int = MASK_ID,
                      d2t: bool = False) -> Path:
    """A 2-layer dflash draft for `target` reading the inputs of target layers `layers` (llama.cpp's
    `dflash.target_layers` are layer-input ids: an HF DFlash config's layer i is written as i + 1), with
    `dflash.block_size` block_size (so at most block_size - 1 draft tokens) and mask token mask_id
    (tokenizer.ggml.mask_token_id). d2t=True: a reduced head over the printable characters, as eagle3's."""
    t = target if isinstance(target, dict) else read_target(target)
    n_embd, u, embd = t["n_embd"], t["u"], t["embd"]
    writer, w, n_vocab = _begin(path, "dflash", 2, n_embd, seed, 0.0, 1234)
    head_dim = n_embd // n_head
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(head_dim)
    writer.add_array("dflash.target_layers", [int(i) for i in layers])
    writer.add_uint32("dflash.block_size", block_size)
    writer.add_uint32("tokenizer.ggml.mask_token_id", mask_id)
    ones = np.ones(n_embd, dtype=np.float32)
    if not shared:
        writer.add_tensor("token_embd.weight", embd)
    if d2t:
        ids = np.arange(n_vocab - N_PRINTABLE, n_vocab)
        writer.add_tensor("d2t", ids.astype(np.int64), raw_dtype=GGMLQuantizationType.I64)
        writer.add_tensor("output.weight", t["output"][ids])
    elif not shared:
        writer.add_tensor("output.weight", t["output"])
    # fc sends each target feature's u part to -u: the injected context keys then point away from the mask's query
    fc = np.hstack([-np.outer(u, u)] * len(layers)).astype(np.float32) + w(n_embd, len(layers) * n_embd) * noise
    writer.add_tensor("fc.weight", fc)
    writer.add_tensor("enc.output_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    # every head's key is u's weight on the slowest-rotating dimension (RoPE barely turns it over a few positions)
    k_dir = np.zeros(head_dim, dtype=np.float32)
    k_dir[head_dim // 2 - 1] = 1.0
    along_u = np.vstack([np.outer(k_dir, u)] * n_head).astype(np.float32)
    for i in range(2):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.attn_q.weight", -along_u + w(n_embd, n_embd) * noise)  # the mask (-u) asks for +u
        writer.add_tensor(f"blk.{i}.attn_k.weight", along_u + w(n_embd, n_embd) * noise)
        writer.add_tensor(f"blk.{i}.attn_v.weight", np.eye(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q_norm.weight", np.full(head_dim, 2.5, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.full(head_dim, 2.5, dtype=np.float32))
        # layer 0 copies the anchor's embedding into the masks; layer 1 only adds a little noise
        wo = np.eye(n_embd, dtype=np.float32) * np.float32(3.0) if i == 0 else w(n_embd, n_embd) * np.float32(0.3)
        writer.add_tensor(f"blk.{i}.attn_output.weight", wo)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(n_embd, n_ff) * np.float32(noise * 4))
    return _write(writer, Path(path))


IDENTITY_CHILD = """
import json, sys
from ggufspec.engine import Engine
target, draft, kind, on, engine = sys.argv[1:]
accepted = []
with Engine(target, draft, n_ctx=512, **json.loads(engine)) as e:
    assert sum(mib for k, mib in e.weights()["target"].items() if k.startswith(on)) > 0, e.weights()
    for sampled in ({}, {"seed": 3, "temperature": 0.8}):
        alone = e.generate("def fib(n):", max_tokens=32, mode="target", ignore_eos=True, **sampled).tokens
        out = e.generate("def fib(n):", max_tokens=32, mode=kind, draft_max=3, ignore_eos=True, **sampled)
        assert out.tokens == alone, (kind, sampled)
        accepted.append(out.stats.n_accepted)
print(json.dumps(accepted))
"""


def identity_in_a_process(target, draft, kind: str, on: str, *, env=None, timeout: float = 300, **engine) -> list[int]:
    """`kind` (eagle3, dflash) drafting with `draft` for `target` in a process of its own (a crash is that
    process's, and an RPC server gone later leaves ggml's device behind only there), with the Engine's placement
    `engine`: the target's weights partly in buffers named `on`, greedy and seeded text the target's own.
    Returns the accepted counts (greedy, seeded)."""
    r = subprocess.run([sys.executable, "-c", IDENTITY_CHILD, str(target), str(draft), kind, on, json.dumps(engine)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x)).astype(np.float32)
