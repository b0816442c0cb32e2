"""`ggufspec drafts`: candidates found, checked by the pair rule from headers and vocabularies, ranked; --measure,
--json, --write on tiny models; the real Qwen pair and Gemma 3 270M in the slow tier."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from clirun import run
from conftest import real_model
from tiny import write_tiny_model
from tiny_hidden import write_tiny_dflash, write_tiny_eagle3, write_tiny_target
from tiny_mtp import write_tiny_qwen35_mtp


def write_mmproj(path: Path) -> Path:
    writer = GGUFWriter(str(path), "clip")  # a vision projector: no vocabulary, no text
    writer.add_tensor("v.patch_embd.weight", np.ones((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def fixture_cache(tmp_path):
    """A target outside the models directory and a folder of drafts, each a case of the rule."""
    models = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    models.mkdir(parents=True)
    target = write_tiny_model(tmp_path / "target.gguf", seed=0, n_layer=4, n_embd=128)
    write_tiny_model(models / "close.gguf", seed=0, perturb=0.05)
    write_tiny_model(models / "padded.gguf", seed=0, pad=64)
    write_tiny_model(models / "other-vocab.gguf", seed=0, vocab_shift=3)
    write_tiny_model(models / "letters.gguf", seed=0, vocab="letters")
    write_tiny_model(models / "no-bos.gguf", seed=0, add_bos=False)
    write_mmproj(models / "mmproj-tiny.gguf")
    whole = (models / "close.gguf").read_bytes()
    (models / "cut.gguf").write_bytes(whole[: len(whole) // 2])
    return target


def by_name(out: dict) -> dict:
    return {c["name"]: c for c in out["candidates"]}


def test_each_candidate_says_whether_it_fits_and_why(fixture_cache):
    result = run("drafts", fixture_cache, "--json")
    assert result.exit_code == 0, result.output
    c = by_name(json.loads(result.stdout))
    assert c["close.gguf"]["usable"] and c["close.gguf"]["why"] == "same vocabulary (354 tokens)"
    assert c["padded.gguf"]["usable"] and "padding" in c["padded.gguf"]["why"]
    assert not c["other-vocab.gguf"]["usable"] and "token 259 differs" in c["other-vocab.gguf"]["why"]
    assert not c["letters.gguf"]["usable"] and "vocabulary sizes differ by 338" in c["letters.gguf"]["why"]
    assert not c["no-bos.gguf"]["usable"] and "BOS handling differs" in c["no-bos.gguf"]["why"]
    assert not c["mmproj-tiny.gguf"]["usable"] and "mmproj" in c["mmproj-tiny.gguf"]["why"]
    assert not c["cut.gguf"]["usable"] and "truncated" in c["cut.gguf"]["why"]
    assert c["prompt lookup"]["usable"] and c["prompt lookup"]["mode"] == "lookup"
    assert 0 < c["close.gguf"]["cost_ratio"] < 1 and c["close.gguf"]["quant"] == "ALL_F32"


def test_the_table_labels_its_predictions_and_names_the_next_command(fixture_cache):
    result = run("drafts", fixture_cache)
    assert result.exit_code == 0, result.output
    assert "predicted from sizes" in result.stdout and "assumed alpha of 0.7" in result.stdout
    assert "next: ggufspec generate -m" in result.stdout and "close.gguf --mode draft" in result.stdout


def test_the_targets_own_mtp_layers_are_a_candidate(tmp_path):
    target = write_tiny_qwen35_mtp(tmp_path / "mtp-target.gguf")
    result = run("drafts", target, "--json")
    assert result.exit_code == 0, result.output
    mtp = by_name(json.loads(result.stdout))["MTP layers (in the target)"]
    assert mtp["usable"] and mtp["mode"] == "mtp" and mtp["cost_ratio"] > 0


def test_hidden_state_drafts_fit_by_the_target_layers_they_read(tmp_path):
    models = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    models.mkdir(parents=True)
    target = write_tiny_target(tmp_path / "target.gguf")  # 4 layers
    write_tiny_eagle3(models / "eagle3.gguf", target, layers=(1, 2, 3))
    write_tiny_dflash(models / "dflash-far.gguf", target, layers=(1, 9))
    c = by_name(json.loads(run("drafts", target, "--json").stdout))
    assert c["eagle3.gguf"]["mode"] == "eagle3" and c["eagle3.gguf"]["usable"]
    assert c["eagle3.gguf"]["why"] == "reads target layers [1, 2, 3]"
    assert not c["dflash-far.gguf"]["usable"] and "reads target layer 9" in c["dflash-far.gguf"]["why"]


def test_a_target_that_is_no_text_model_is_one_line(tmp_path):
    result = run("drafts", write_mmproj(tmp_path / "mmproj.gguf"))
    assert result.exit_code == 1 and "not a text model" in result.stderr


def test_measure_and_write_keep_the_registrys_other_entries(fixture_cache, tmp_path):
    registry = tmp_path / "mine.toml"
    registry.write_text('# my pairs\n[pairs.kept]\ntarget = "a.gguf"\ndraft = "b.gguf"  # by hand\n')
    result = run("drafts", fixture_cache, "--measure", "--write", "-n", "4", "--limit", "1", "--draft-max", "2",
                 "--registry", registry, "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    close = by_name(out)["close.gguf"]["measured"]
    assert 0.0 <= close["alpha"] <= 1.0 and close["speedup"] > 0 and close["cost_ratio"] > 0
    text = registry.read_text()
    assert text.startswith('# my pairs\n[pairs.kept]\ntarget = "a.gguf"\ndraft = "b.gguf"  # by hand\n')
    assert f'[pairs."{out["saved"]["pair"]}"]' in text and 'mode = "draft"' in text


@pytest.mark.slow
def test_the_real_pair_fits_and_gemma_says_why_not(monkeypatch, tmp_path):
    models = tmp_path / "real"
    models.mkdir()
    for name in ("qwen2.5-coder-0.5b-instruct-q4_0.gguf", "gemma-3-270m-q4_k_m.gguf"):
        (models / name).symlink_to(real_model(name))
    monkeypatch.setenv("GGUFSPEC_MODELS_DIR", str(models))
    result = run("drafts", real_model("qwen2.5-coder-1.5b-instruct-q8_0.gguf"), "--json")
    assert result.exit_code == 0, result.output
    c = by_name(json.loads(result.stdout))
    draft = c["qwen2.5-coder-0.5b-instruct-q4_0"]
    assert draft["usable"] and draft["quant"] == "Q4_0" and 0.1 < draft["cost_ratio"] < 0.4
    gemma = c["gemma-3-270m"]
    assert not gemma["usable"] and "vocabulary" in gemma["why"], gemma["why"]
