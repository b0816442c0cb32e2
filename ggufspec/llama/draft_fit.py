"""Whether a file that is not a plain model fits its target, from the two GGUF headers alone (no weights, no
llama.cpp call): a draft reading the target's hidden states (EAGLE-3, DFlash) and a sibling file of MTP layers.
Each misuse here aborts or corrupts memory inside llama.cpp, so `generate`, `models check` and `drafts` all ask
these functions before llama.cpp is asked (`hidden.check_eagle3`, `dflash.check_dflash`, `Engine._load_draft`,
`models.resolve.check_pair`, `models.drafts.check_file`)."""

from __future__ import annotations

from pathlib import Path

HIDDEN_STATE_ARCHS = {"eagle3": 3, "dflash": None}  # drafts reading target layers: how many ids they take (None: any)

# The target architectures whose graph in this llama.cpp release exposes the inputs of its layers
# (`res->t_layer_inp[il]` in src/models/*.cpp), which EAGLE-3 and DFlash drafts read; on any other target
# llama.cpp asserts ("layer input tensor is null", llama-graph.cpp) at the first decode. Read from the release
# llama-cpp-python pins (tests/test_architecture.py compares it with the source where the source is at hand).
LAYER_INPUT_ARCHS = frozenset({
    "bailingmoe3", "deepseek4", "gemma4", "gpt-oss", "hunyuan_vl", "lfm2", "llama", "mimo2", "minimax-01",
    "minimax-m2", "muse-glimmer", "nanbeige", "nemotron_h", "qwen3", "qwen35", "qwen35moe", "qwen3moe", "qwen3next",
    "qwen4exp",
})


def layer_inputs_misfit(target) -> str | None:
    """Why a target (a GGUFInfo) cannot give a hidden-state draft its layer inputs; None where it can."""
    if target.architecture in LAYER_INPUT_ARCHS:
        return None
    return (f"the target's architecture {target.architecture} does not expose its layers' inputs in this llama.cpp "
            f"release (EAGLE-3 and DFlash drafts read them); use --mode draft, lookup or mtp")


def hidden_state_misfit(target, draft) -> str | None:
    """Why a draft reading a target's hidden states (eagle3, dflash; GGUFInfo) cannot read this target's (also a
    GGUFInfo): its architecture, the layers read, their width (the `fc` tensor's shape, which decides the rows
    llama.cpp reads), the vocabulary; None where it fits."""
    ids, want = draft.target_layers, HIDDEN_STATE_ARCHS[draft.architecture]
    if not ids or (want and len(ids) != want):
        return f"reads {len(ids)} target layers; {draft.architecture} reads {want or 'some'}"
    arch = layer_inputs_misfit(target)
    if arch:
        return arch
    beyond = [i for i in ids if not 0 <= i <= target.n_layers]
    if beyond:
        return f"reads target layer {beyond[0]}; the target has {target.n_layers}: made for another target"
    fc = next((t for t in draft.tensors if t.name == "fc.weight"), None)
    width = fc.shape[0] // len(ids) if fc is not None else target.n_embd
    if width != target.n_embd or (fc is not None and fc.shape[0] % len(ids)):
        return f"reads hidden states {width} wide; the target's are {target.n_embd}: made for another target"
    if draft.n_vocab and draft.n_vocab != target.n_vocab:
        return f"its vocabulary has {draft.n_vocab} tokens, the target's {target.n_vocab}"
    return None


def is_mtp_file(info) -> bool:
    """Whether a GGUF holds MTP layers alone (llama.cpp's converter with --mtp writes such an `mtp-*.gguf` beside
    a trunk-only model): MTP blocks and no trunk (llama.cpp's loader tells them so, by a missing blk.0.attn_norm)."""
    return bool(info.n_nextn) and not any(t.name == "blk.0.attn_norm.weight" for t in info.tensors)


def mtp_file_misfit(target, mtp) -> str | None:
    """Why a file of MTP layers alone (`is_mtp_file`) is not the MTP layers of this target (both GGUFInfo), as
    llama.cpp's loader and draft-mtp see it: the same architecture, hidden width, layer count and vocabulary size
    (the tokens' texts are `compat.incompatibility`'s); None where it fits."""
    facts = (("architecture", "architecture"), ("hidden width", "n_embd"), ("layer count", "n_layers"),
             ("vocabulary size", "n_vocab"))
    for label, key in facts:
        if getattr(target, key) != getattr(mtp, key):
            return (f"holds MTP layers for another model (its {label} is {getattr(mtp, key)}, the target's "
                    f"{getattr(target, key)})")
    return None


def alone_misuse(info) -> str | None:
    """Why a file cannot run as a model on a context of its own (as -m, or as a plain draft model): MTP layers
    alone, or a draft that reads a target's hidden states; None for a plain model. llama.cpp segfaults or decodes
    garbage on either."""
    name = Path(info.path).name
    if is_mtp_file(info):
        return (f"holds MTP layers alone (llama.cpp's split mtp-*.gguf), not a model to run: give it with -md beside "
                f"the model it belongs to (-m MODEL.gguf -md {name} --mode mtp)")
    if info.architecture in HIDDEN_STATE_ARCHS:
        what = "an EAGLE-3" if info.architecture == "eagle3" else "a DFlash"
        return (f"is {what} draft, which reads its target's hidden states and cannot run alone: give it with -md "
                f"beside its target (-m TARGET.gguf -md {name} --mode {info.architecture})")
    return None
