"""Derived models: a registry entry the offline mirror makes from another one with llama.cpp's
own quantizer (the CPU pair's Q8_0 target), on a tiny generated model."""

import numpy as np
import pytest

from ggufspec import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.llama.gguf_info import read_info
from ggufspec.models.hub import stamp_path, verified_sha256
from ggufspec.models.mirror import fetch
from ggufspec.models.registry import load_registry
from tiny import write_tiny_model


def registry(tmp_path, quant="Q8_0"):
    """A registry whose base model is already in the models folder, verified, and a model made from it."""
    models = tmp_path / "models"
    models.mkdir()
    base = write_tiny_model(models / "base.gguf")
    sha = verified_sha256(base)
    (tmp_path / "models.toml").write_text(f"""
[models.base]
repo = "x/base"
file = "base.gguf"
[models.base.mirror]
source = "pypi-chunks"
package = "never-downloaded-part{{n}}"
parts = 1
version = "1.0"
sha256 = "{sha}"

[models.made]
repo = "x/made"
file = "made-{quant.lower()}.gguf"
quant = "{quant}"
[models.made.mirror]
source = "quantize"
from = "base"
""")
    return load_registry(tmp_path / "models.toml"), models


def test_a_derived_model_is_made_checked_and_then_left_alone(tmp_path):
    reg, models = registry(tmp_path)
    logs = []
    path = fetch(reg.model("made"), models, registry=reg, log=logs.append)
    assert read_info(path).file_type == "Q8_0"
    assert len(read_info(path).tensors) == len(read_info(models / "base.gguf").tensors)
    assert stamp_path(path).exists()
    assert not [p for p in models.iterdir() if p.name.endswith(".partial")]
    assert any("made and checked" in line for line in logs)
    # It is a model llama.cpp runs, whose text follows its base's (the same weights, rounded to 8 bits).
    with Engine(str(models / "base.gguf"), None, n_ctx=128) as a, Engine(str(path), None, n_ctx=128) as b:
        prompt = list(range(40, 60))
        pa = a.generate(prompt_tokens=prompt, max_tokens=8, mode="target", ignore_eos=True).tokens
        pb = b.generate(prompt_tokens=prompt, max_tokens=8, mode="target", ignore_eos=True).tokens
        assert len(pb) == 8 and np.mean(np.array(pa) == np.array(pb)) >= 0.5, (pa, pb)
    logs.clear()
    fetch(reg.model("made"), models, registry=reg, log=logs.append)
    assert any("already here" in line for line in logs)


def test_a_changed_or_cut_file_is_made_again(tmp_path):
    reg, models = registry(tmp_path)
    path = fetch(reg.model("made"), models, registry=reg, log=lambda m: None)
    whole = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(whole // 2)
    logs = []
    fetch(reg.model("made"), models, registry=reg, log=logs.append)
    assert any("making it again" in line for line in logs)
    assert path.stat().st_size == whole and read_info(path).file_type == "Q8_0"


def test_an_unknown_quantization_is_one_line_and_writes_nothing(tmp_path):
    reg, models = registry(tmp_path, quant="Q9_9")
    with pytest.raises(GGUFSpecError, match="Q9_9.*not one llama.cpp can write"):
        fetch(reg.model("made"), models, registry=reg, log=lambda m: None)
    assert sorted(p.name for p in models.iterdir()) == ["base.gguf", "base.gguf.sha256"]


def test_the_registry_names_the_cpu_pair_as_derived():
    reg = load_registry()
    pair = reg.pair("qwen2.5-coder-1.5b-q8_0")
    target, draft = reg.model(pair.target), reg.model(pair.draft)
    assert (target.quant, target.mirror.source, target.mirror.base) == ("Q8_0", "quantize", "qwen2.5-coder-1.5b-instruct")
    assert draft.mirror.source == "quantize" and reg.model(draft.mirror.base).mirror.source == "pypi-chunks"


def test_a_derived_entry_without_its_base_is_one_line(tmp_path):
    reg, models = registry(tmp_path)
    toml = (tmp_path / "models.toml").read_text()
    (tmp_path / "models.toml").write_text(toml.replace('from = "base"', 'from = "nowhere"'))
    with pytest.raises(GGUFSpecError, match="no model named 'nowhere'"):
        fetch(load_registry(tmp_path / "models.toml").model("made"), models, registry=load_registry(tmp_path / "models.toml"),
              log=lambda m: None)
    (tmp_path / "models.toml").write_text(toml.replace('from = "base"\n', ''))
    with pytest.raises(GGUFSpecError, match=r"\[models.made.mirror\] is incomplete or malformed"):
        load_registry(tmp_path / "models.toml")
    assert not list(models.glob("made*"))
