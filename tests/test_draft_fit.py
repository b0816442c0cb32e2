"""Files that are not plain models (EAGLE-3 and DFlash drafts, a split file of MTP layers), each checked against its
target from the headers before llama.cpp is asked (`llama.draft_fit`): a misfit is one line in `generate` (every
mode, auto included), `models check`, `drafts` and `GGUFDraftModel` alike, where llama.cpp would assert, segfault or
read past its buffers."""

import json
import os
import re
from pathlib import Path

import pytest

from clirun import one_line, run
from ggufspec.errors import GGUFSpecError
from tiny import write_tiny_hybrid, write_tiny_mamba2, write_tiny_model
from tiny_hidden import read_target, write_tiny_dflash, write_tiny_eagle3, write_tiny_target
from tiny_mtp import write_tiny_glm4moe_mtp


def no_layer_inputs_target(arch: str, path: Path) -> Path:
    if arch == "mamba2":
        return write_tiny_mamba2(path)
    if arch == "granitehybrid":
        return write_tiny_hybrid(path, "granitehybrid", layers="rar")
    return write_tiny_glm4moe_mtp(path, nextn=False)


@pytest.mark.parametrize("arch", ["mamba2", "granitehybrid", "glm4moe"])
def test_hidden_state_drafts_refuse_targets_that_hide_their_layer_inputs(tmp_path, arch):
    """llama.cpp asserts (`t_layer_inp[il] != nullptr`) at the first decode of such a target: refused first."""
    target = no_layer_inputs_target(arch, tmp_path / f"{arch}.gguf")
    t = read_target(target)
    drafts = {"eagle3": write_tiny_eagle3(tmp_path / "eagle3.gguf", t, layers=(0, 1, 1)),
              "dflash": write_tiny_dflash(tmp_path / "dflash.gguf", t, layers=(0, 1))}
    why = f"architecture {arch} does not expose its layers' inputs"
    for kind, draft in drafts.items():
        for mode in ([kind, "auto"] if kind == "eagle3" else [kind]):
            one_line(run("generate", "-m", target, "-md", draft, "-p", "abc", "-n", 4, "-c", 256, "--mode", mode), why)
        one_line(run("models", "check", target, draft), why)
    models = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    models.mkdir(parents=True)
    for kind, draft in drafts.items():
        (models / draft.name).write_bytes(draft.read_bytes())
    out = run("drafts", target, "--json")
    assert out.exit_code == 0, out.output
    found = {c["name"]: c for c in json.loads(out.stdout)["candidates"]}
    for kind in drafts:
        assert found[f"{kind}.gguf"]["usable"] is False and why in found[f"{kind}.gguf"]["why"]


def test_layer_input_architectures_are_llama_cpps(tmp_path):
    """LAYER_INPUT_ARCHS is what the pinned llama.cpp's graphs expose: read again from its source, where the
    reference build unpacked it (CI), every architecture whose graph sets `t_layer_inp`."""
    from ggufspec.llama.draft_fit import LAYER_INPUT_ARCHS

    bin_dir = os.environ.get("LLAMA_CPP_REFERENCE_BIN")
    src = Path(bin_dir).parent.parent / "src" / "src" if bin_dir else None
    if src is None or not (src / "llama-model.cpp").is_file():
        pytest.skip("llama.cpp's source is not here (set LLAMA_CPP_REFERENCE_BIN: ../shared/tools/llama-cpp-reference)")
    names = dict(re.findall(r'\{\s*(LLM_ARCH_\w+),\s*"([^"]+)"\s*\}', (src / "llama-arch.cpp").read_text()))
    classes = dict(re.findall(r"case (LLM_ARCH_\w+):\s*return new (llama_model_\w+)\(", (src / "llama-model.cpp").read_text()))
    parents = dict(re.findall(r"struct (llama_model_\w+)\s*:\s*public (llama_model_\w+)", (src / "models/models.h").read_text()))
    builders, graphs = {}, {}
    for f in (src / "models").glob("*.cpp"):
        text = f.read_text()
        for cls in re.findall(r"(llama_model_\w+)::build_arch_graph", text):
            body = re.search(cls + r"::build_arch_graph[^{]*\{(.*?)\n\}", text, re.S)
            builders[cls] = (text, body.group(1) if body else "")
        for cls in re.findall(r"(llama_model_\w+)::graph(?:<\w+>)?::graph\(", text):
            graphs[cls] = text

    def exposes(cls: str) -> bool:
        while cls not in builders and cls in parents:
            cls = parents[cls]
        if cls not in builders:
            return False
        text, body = builders[cls]
        built = re.findall(r"(llama_model_\w+)::graph", body) or [cls]
        return all("t_layer_inp[" in graphs.get(b, text) for b in built)

    assert {names[a] for a, cls in classes.items() if a in names and exposes(cls)} == LAYER_INPUT_ARCHS


@pytest.fixture(scope="module")
def mtp_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp-split")
    return {"trunk": write_tiny_glm4moe_mtp(d / "trunk.gguf", part="trunk"),
            "layers": write_tiny_glm4moe_mtp(d / "mtp-trunk.gguf", part="mtp"),
            "wider": write_tiny_glm4moe_mtp(d / "mtp-wider.gguf", part="mtp", n_embd=128),
            "llama": write_tiny_model(d / "llama.gguf")}


def test_a_file_of_mtp_layers_alone_is_not_a_model(mtp_files):
    """As -m, as a draft model (GGUFDraftModel, so the server's --draft_model) or checked alone: one line saying
    what it is and how to use it, where llama.cpp segfaulted creating its context."""
    from ggufspec import GGUFDraftModel

    layers = mtp_files["layers"]
    said = "holds MTP layers alone"
    one_line(run("generate", "-m", layers, "-p", "abc", "-n", 4, "-c", 256, "--mode", "target"), said, "-md mtp-trunk.gguf")
    one_line(run("models", "check", layers), said)
    with pytest.raises(GGUFSpecError, match=said):
        GGUFDraftModel(str(layers), mode="draft")


def test_a_sibling_mtp_file_is_checked_against_its_target(mtp_files):
    """llama.cpp loads MTP layers of another model and asserts or reads past its rows at the first draft:
    architecture, width, layer count and vocabulary are checked first, in generate and models check alike."""
    trunk, llama = mtp_files["trunk"], mtp_files["llama"]
    ok = run("models", "check", trunk, mtp_files["layers"])
    assert ok.exit_code == 0 and "holds the MTP layers of trunk.gguf" in ok.output, ok.output
    for target, layers, said in ((llama, mtp_files["layers"], "its architecture is glm4moe, the target's llama"),
                                 (trunk, mtp_files["wider"], "its hidden width is 128, the target's 64")):
        one_line(run("models", "check", target, layers), "holds MTP layers for another model", said)
        one_line(run("generate", "-m", target, "-md", layers, "-p", "abc", "-n", 4, "-c", 256, "--mode", "mtp"),
                 "holds MTP layers for another model", said)


def test_a_dflash_draft_for_another_width_is_refused_everywhere(tmp_path):
    """Its `fc` reads rows of another width than the target's hidden states (llama.cpp reads past the batch's
    buffer): the fc tensor's shape is the one check of generate, models check and drafts."""
    target = write_tiny_target(tmp_path / "target.gguf")
    other = read_target(write_tiny_target(tmp_path / "wide.gguf", n_embd=96))
    models = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    models.mkdir(parents=True)
    draft = write_tiny_dflash(models / "dflash-wide.gguf", other, layers=(1, 3))
    said = "reads hidden states 96 wide; the target's are 64"
    one_line(run("generate", "-m", target, "-md", draft, "-p", "abc", "-n", 4, "-c", 256, "--mode", "dflash"), said)
    one_line(run("models", "check", target, draft), said)
    out = run("drafts", target, "--json")
    found = {c["name"]: c for c in json.loads(out.stdout)["candidates"]}
    assert found["dflash-wide.gguf"]["usable"] is False and said in found["dflash-wide.gguf"]["why"]


def test_a_hidden_state_draft_does_not_run_as_a_plain_model(tmp_path):
    """An EAGLE-3 draft as -m (any mode) or as a draft model for llama-cpp-python's Llama (the server's
    --draft_model) decoded garbage without a word: one line saying how it drafts."""
    from ggufspec import GGUFDraftModel

    eagle3 = write_tiny_eagle3(tmp_path / "eagle3.gguf", write_tiny_target(tmp_path / "target.gguf"))
    said = "is an EAGLE-3 draft, which reads its target's hidden states"
    one_line(run("generate", "-m", eagle3, "-p", "abc", "-n", 4, "-c", 256, "--mode", "target"), said, "--mode eagle3")
    with pytest.raises(GGUFSpecError, match=said):
        GGUFDraftModel(str(eagle3), mode="draft")


def test_attaching_a_closed_draft_model_says_so(tiny):
    """A closed GGUFDraftModel has no model to draft or measure with: attach() says so, for a new Llama and for
    the one it served."""
    from llama_cpp import Llama

    from ggufspec import GGUFDraftModel

    draft = GGUFDraftModel(str(tiny["close"]), mode="draft", n_ctx=256)
    llm = Llama(model_path=str(tiny["target"]), n_ctx=256, verbose=False)
    try:
        draft.attach(llm)
        draft.close()
        for _ in range(2):
            with pytest.raises(GGUFSpecError, match="this draft was closed"):
                draft.attach(llm)
    finally:
        llm.close()
