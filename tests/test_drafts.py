"""`ggufspec drafts`: candidates found, checked by the pair rule from headers and vocabularies, ranked; --measure,
--json, --write on tiny models; the real Qwen pair and Gemma 3 270M in the slow tier."""

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from clirun import TIMEOUT, run, stderr_until
from ggufspec.bench import draft_choice
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
    # another vocabulary drafts through text (the same letters at other ids; a BOS it does not add)
    for name in ("other-vocab.gguf", "no-bos.gguf"):
        assert c[name]["usable"] and c[name]["why"] == "text-level: shares 72% of the target's tokens", c[name]
    assert c["other-vocab.gguf"]["expected"] < c["close.gguf"]["expected"]  # ranked at alpha times that share
    assert not c["letters.gguf"]["usable"] and "vocabulary sizes differ by 338" in c["letters.gguf"]["why"]
    assert "no token for 244 of the 256 bytes" in c["letters.gguf"]["why"]  # llama.cpp's tokenizer would abort
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


@pytest.fixture
def close_measures_fastest(monkeypatch):
    """The real measurement, with close.gguf's speed-up then set above the rest: tiny models' speeds are noise,
    and --write saves only the fastest."""
    real = draft_choice.measure

    def measure(found, *args, **kw):
        out = real(found, *args, **kw)
        for c in out["candidates"]:
            if c["name"] == "close.gguf":
                c["measured"]["speedup"] = 100.0
        return out

    monkeypatch.setattr(draft_choice, "measure", measure)


def test_measure_and_write_keep_the_registrys_other_entries(fixture_cache, tmp_path, close_measures_fastest):
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


def test_names_ending_gguf_that_are_no_files_are_labelled_for_what_they_are(tmp_path):
    """Before: a link loop beside the target was a traceback (RuntimeError: Symlink loop); a link to nothing, a
    directory and a FIFO were each a "damaged GGUF header: download it again"."""
    target = write_tiny_model(tmp_path / "target.gguf", seed=0)
    (tmp_path / "loop.gguf").symlink_to("loop.gguf")
    (tmp_path / "gone.gguf").symlink_to("nowhere.gguf")
    (tmp_path / "folder.gguf").mkdir()
    os.mkfifo(tmp_path / "pipe.gguf")
    (tmp_path / "alias.gguf").symlink_to("target.gguf")  # the target itself: left out
    result = run("drafts", target, "--json")
    assert result.exit_code == 0, result.output
    c = by_name(json.loads(result.stdout))
    assert "alias.gguf" not in c
    assert c["loop.gguf"]["why"] == "a symbolic link loop: no file"
    assert c["gone.gguf"]["why"] == "a link to nowhere.gguf, which is not there"
    assert c["folder.gguf"]["why"] == "a directory, not a GGUF file"
    assert c["pipe.gguf"]["why"] == "a named pipe (FIFO), not a GGUF file"
    assert not any(c[n]["usable"] for n in ("loop.gguf", "gone.gguf", "folder.gguf", "pipe.gguf"))


@pytest.mark.parametrize("given", ["relative", "absolute"])
def test_a_written_pair_lists_and_generates_from_any_folder(fixture_cache, tmp_path, monkeypatch, given,
                                                           close_measures_fastest):
    """Before: an absolute target was saved as it was and `models list` failed on the whole registry ("no model
    named '/.../target.gguf'"); a relative one was saved relative, and the pair loaded only from that folder."""
    registry = tmp_path / "mine.toml"
    registry.write_text("# mine\n")
    monkeypatch.chdir(tmp_path)
    target = "target.gguf" if given == "relative" else fixture_cache
    result = run("drafts", target, "--measure", "--write", "-n", 4, "--limit", 1, "--draft-max", 2,
                 "--registry", registry, "--json")
    assert result.exit_code == 0, result.output
    pair = json.loads(result.stdout)["saved"]["pair"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    listed = run("models", "list", "--registry", registry, "--json")
    assert listed.exit_code == 0, listed.output
    row = next(p for p in json.loads(listed.stdout)["pairs"] if p["name"] == pair)
    assert row["ready"] and row["target"] == str(fixture_cache)
    generated = run("generate", pair, "-p", "hello", "-n", 4, "--registry", registry)
    assert generated.exit_code == 0, generated.output


def measured_as(speedups: dict, tmp_path) -> dict:
    """find_drafts' answer after --measure, by hand: {candidate name: measured speed-up}."""
    target = str(tmp_path / "target.gguf")
    files = {"eagle3.gguf": ("eagle3", str(tmp_path / "eagle3.gguf")), "close.gguf": ("draft", str(tmp_path / "close.gguf")),
             "prompt lookup": ("lookup", None), "MTP layers (in the target)": ("mtp", target)}
    return {"target": {"name": target, "path": target}, "measured": True, "interrupted": False,
            "candidates": [{"name": name, "mode": files[name][0], "path": files[name][1], "usable": True,
                            "measured": {"speedup": x, "draft_max": 2}} for name, x in speedups.items()]}


def test_write_saves_only_the_fastest_and_only_a_draft_that_beat_the_target(tmp_path):
    """Before: an EAGLE-3 draft measured 0.56x was saved while lookup measured 0.99x."""
    registry = tmp_path / "mine.toml"
    saved, why = draft_choice.save_best(measured_as({"eagle3.gguf": 0.56, "prompt lookup": 0.99}, tmp_path), registry)
    assert saved is None and not registry.exists()
    assert why == "nothing saved: no draft beat the target alone (the fastest, prompt lookup, measured 0.99x)"
    saved, why = draft_choice.save_best(measured_as({"close.gguf": 1.2, "prompt lookup": 1.5}, tmp_path), registry)
    assert saved is None and why == "nothing saved: prompt lookup measured fastest (1.50x) and needs no pair: --mode lookup"
    saved, why = draft_choice.save_best(measured_as({"close.gguf": 1.2, "MTP layers (in the target)": 1.4}, tmp_path),
                                        registry)
    assert saved is None and "MTP layers (in the target) measured fastest (1.40x)" in why and not registry.exists()
    saved, why = draft_choice.save_best(measured_as({"eagle3.gguf": 1.3, "close.gguf": 1.2, "prompt lookup": 1.1},
                                                    tmp_path), registry)
    assert why is None and saved["pair"] == "target+eagle3"
    assert 'mode = "eagle3"' in registry.read_text() and str(tmp_path / "eagle3.gguf") in registry.read_text()


def test_write_says_in_one_line_why_nothing_was_saved(tmp_path):
    """A registry file not there yet: read as empty (before: "registry file not found"), and left uncreated."""
    target = write_tiny_model(tmp_path / "target.gguf", seed=0)  # alone: prompt lookup is the only candidate
    registry = tmp_path / "mine.toml"
    result = run("drafts", target, "--measure", "--write", "-n", 4, "--limit", 1, "--draft-max", 2, "--registry", registry)
    assert result.exit_code == 0, result.output
    assert [line for line in result.stdout.splitlines() if line.startswith("nothing saved: ")], result.stdout
    assert not registry.exists()


def test_measured_eagle3_and_dflash_rows_have_a_measured_cost(tmp_path):
    """Before: the measured cost column was "-" for every EAGLE-3 and DFlash row."""
    models = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    models.mkdir(parents=True)
    target = write_tiny_target(tmp_path / "target.gguf")
    write_tiny_eagle3(models / "eagle3.gguf", target, layers=(1, 2, 3))
    write_tiny_dflash(models / "dflash.gguf", target, layers=(1, 3))
    result = run("drafts", target, "--measure", "--json", "-n", 4, "--limit", 1, "--draft-max", 2)
    assert result.exit_code == 0, result.output
    c = by_name(json.loads(result.stdout))
    for name in ("eagle3.gguf", "dflash.gguf"):
        assert c[name]["usable"] and c[name]["measured"]["cost_ratio"] > 0, c[name]


@pytest.mark.parametrize("signum, said", [(signal.SIGTERM, "terminated"), (signal.SIGHUP, "hung up")])
def test_sigterm_or_sighup_during_measure_shows_the_measured_rows(tmp_path, signum, said):
    """Before: Ctrl-C printed the measured rows, SIGTERM and SIGHUP ended it without a word. Stopped once prompt
    lookup (the second of two) is being measured: close.gguf's row is kept."""
    target = write_tiny_model(tmp_path / "target.gguf", seed=0)
    write_tiny_model(tmp_path / "close.gguf", seed=0, perturb=0.05)
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "drafts", str(target), "--measure", "--json",
                             "-n", "32", "--limit", "1", "--draft-max", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "GGUFSPEC_STDERR_TTY": "1"})
    seen = stderr_until(proc, b"(2/2)")  # the second group begins
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=TIMEOUT)
    err = (seen + err).decode()
    assert proc.returncode == 128 + signum, err
    assert f"{said}: showing the measured rows" in err and "Traceback" not in err
    out = json.loads(out)
    assert out["interrupted"] and by_name(out)["close.gguf"]["measured"]["speedup"] > 0


def test_the_next_line_runs_as_printed(tmp_path):
    """Before: it ended in a positional "PROMPT", which `generate` refuses (it takes -p), and paths went unquoted."""
    folder = tmp_path / "my models"
    folder.mkdir()
    target = write_tiny_model(folder / "target.gguf", seed=0)
    write_tiny_model(folder / "close.gguf", seed=0, perturb=0.05)
    result = run("drafts", target)
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("next: "))
    args = shlex.split(line.removeprefix("next: "))
    assert args[:2] == ["ggufspec", "generate"] and str(folder / "close.gguf") in args
    generated = run(*args[1:])
    assert generated.exit_code == 0, generated.output


@pytest.mark.slow
def test_the_real_pair_fits_and_gemma_drafts_across_tokenizers(monkeypatch, tmp_path):
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
    gemma = c["gemma-3-270m"]  # SentencePiece, 262k tokens: it drafts through text
    assert gemma["usable"] and gemma["why"] == "text-level: shares 63% of the target's tokens", gemma["why"]
    assert gemma["expected"] < draft["expected"]
