"""The offload planner: pure arithmetic on GGUF metadata and budgets; and -ngl reaching llama.cpp."""

import numpy as np

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from clirun import TIMEOUT, one_line, run, stderr_lines, stderr_until

import pytest
from click.testing import CliRunner

from ggufspec import Engine
from ggufspec.llama import backend
from ggufspec.cli.main import cli
from ggufspec.errors import GGUFSpecError
from ggufspec.llama.gguf_info import read_info
from ggufspec.models.offload import GiB, MiB, ModelSizes, parse_size, plan, resolve_layers, sizes_from_info, sizes_from_spec
from ggufspec.models.registry import load_registry


def synthetic(name, n_layers, layer_gib, output_gib, embed_gib, n_embd, n_head_kv, head_dim, n_vocab):
    return ModelSizes(name, n_layers, (int(layer_gib * GiB),) * n_layers, int(output_gib * GiB), int(embed_gib * GiB),
                      n_embd, n_head_kv, head_dim, n_vocab)


# Shapes of the seed pair: Llama 3 70B Instruct Q3_K_S (30.9 GB) and Llama 3 8B Instruct Q3_K_L (4.3 GB).
LLAMA3_70B = synthetic("70b", 80, 0.345, 0.80, 0.43, 8192, 8, 128, 128256)
LLAMA3_8B = synthetic("8b", 32, 0.105, 0.40, 0.26, 4096, 8, 128, 128256)


def test_seed_pair_at_24_gib_is_near_the_seeds_45_of_80_with_the_draft_on_the_gpu():
    p = plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=24 * GiB, ram_bytes=64 * GiB, n_ctx=8192)
    assert p.draft.flag == "all"
    assert 41 <= p.target.n_gpu_layers <= 49, p.target
    assert p.gpu_bytes <= 24 * GiB


def test_registry_estimate_for_the_seed_pair_agrees():
    reg = load_registry()
    p = plan(sizes_from_spec(reg.model("llama-3-70b-instruct")), sizes_from_spec(reg.model("llama-3-8b-instruct")),
             vram_bytes=24 * GiB, ram_bytes=64 * GiB, n_ctx=8192)
    assert p.draft.flag == "all" and 41 <= p.target.n_gpu_layers <= 49
    assert p.target.estimated


def test_kv_cache_size_formula():
    # layers x context x kv heads x head size x 2 (K and V) x 2 bytes (f16)
    assert LLAMA3_70B.kv_bytes_per_layer(8192) * 80 == 80 * 8192 * 8 * 128 * 2 * 2


def test_budgets_zero_tiny_and_huge():
    zero = plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=0, ram_bytes=64 * GiB, n_ctx=8192)
    assert zero.target.n_gpu_layers == 0 and zero.draft.n_gpu_layers == 0 and zero.gpu_bytes == 0
    tiny = plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=300 * MiB, ram_bytes=64 * GiB, n_ctx=8192)
    assert tiny.gpu_bytes <= 300 * MiB and tiny.target.n_gpu_layers == 0
    huge = plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=200 * GiB, ram_bytes=64 * GiB, n_ctx=8192)
    assert huge.target.flag == "all" and huge.draft.flag == "all"
    # a larger context leaves room for fewer target layers
    long = plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=24 * GiB, ram_bytes=64 * GiB, n_ctx=32768)
    assert long.target.n_gpu_layers < plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=24 * GiB, ram_bytes=64 * GiB,
                                           n_ctx=8192).target.n_gpu_layers


def test_draft_goes_first():
    p = plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=6 * GiB, ram_bytes=64 * GiB, n_ctx=4096)
    assert p.draft.flag == "all" and p.target.n_gpu_layers <= 2


def test_ram_refusal_says_how_much_is_missing():
    with pytest.raises(GGUFSpecError, match=r"GiB missing"):
        plan(LLAMA3_70B, LLAMA3_8B, vram_bytes=0, ram_bytes=16 * GiB, n_ctx=8192)


def test_plan_from_real_gguf_metadata(tiny):
    info = read_info(tiny["target"])
    sizes = sizes_from_info(info)
    assert sizes.n_layers == 2 and sum(sizes.layer_bytes) + sizes.output_bytes + sizes.embed_bytes == sum(
        t.n_bytes for t in info.tensors)
    assert plan(sizes, None, vram_bytes=100 * GiB, ram_bytes=GiB, n_ctx=512).target.flag == "all"
    assert plan(sizes, None, vram_bytes=0, ram_bytes=GiB, n_ctx=512).target.n_gpu_layers == 0


def test_parse_size():
    assert parse_size("24GiB") == 24 * GiB == parse_size("24G") == parse_size("24 GB")
    assert parse_size("8192MiB") == 8 * GiB and parse_size("0") == 0 and parse_size("1.5GiB") == int(1.5 * GiB)
    with pytest.raises(GGUFSpecError, match="not a size"):
        parse_size("lots")


def test_plan_command_for_the_seed_pair():
    r = CliRunner().invoke(cli, ["plan", "llama-3-70b-instruct", "--vram", "24GiB", "-c", "8192", "--ram", "64GiB"])
    assert r.exit_code == 0, r.output
    assert "-ngld all" in r.stdout and "/80 + output" in r.stdout
    data = json.loads(CliRunner().invoke(cli, ["plan", "llama-3-70b-instruct", "--vram", "24GiB", "-c", "8192",
                                               "--ram", "64GiB", "--json"]).stdout)
    assert 41 <= data["models"][0]["n_gpu_layers"] <= 49
    bad = CliRunner().invoke(cli, ["plan", "llama-3-70b-instruct", "--vram", "0", "--ram", "8GiB"])
    assert bad.exit_code == 1 and "missing" in bad.stderr


def test_layer_values_reach_the_model(tiny):
    assert resolve_layers(tiny["target"], tiny["close"], "all", 3, n_ctx=512) == (-1, 3, 0)
    assert resolve_layers(tiny["target"], tiny["close"], "auto", "auto", n_ctx=512, vram_bytes=0) == (0, 0, 0)
    assert resolve_layers(tiny["target"], tiny["close"], "auto", "auto", n_ctx=512, vram_bytes=10 * GiB) == (3, 3, 0)
    with Engine(tiny["target"], tiny["close"], n_ctx=256, n_gpu_layers=2, draft_n_gpu_layers=-1) as e:
        assert (e.target_model.n_gpu_layers, e.draft_model.n_gpu_layers) == (2, -1)
        assert e.generate("hi", max_tokens=3).tokens  # llama.cpp loaded and ran with them


@pytest.mark.skipif(not backend.supports_gpu_offload(), reason="no GPU here (tests/test_rpc.py checks the same log with a layer-taking RPC device)")
def test_llama_cpp_reports_the_offloaded_layers(tiny, capfd):
    try:
        with Engine(tiny["target"], n_ctx=256, n_gpu_layers=2, verbose=True):
            pass
    finally:
        backend.set_verbose(False)
    assert "offloaded 2/3 layers to GPU" in capfd.readouterr().err


def test_tune_with_no_placement_that_loads_says_why_in_one_line(tiny):
    """Every placement tune tries is refused at load (here: a draft whose tokenizer cannot write the target's text): one line
    naming the placement and llama.cpp's or ggufspec's reason, no traceback."""
    line = one_line(run("tune", "-m", tiny["target"], "-md", tiny["letters"], "-n", 4, "--repeats", 1,
                        "--draft-max", "1"), "no placement around the plan could be loaded", "was left out:")
    assert "cannot draft for" in line


@pytest.mark.skipif(backend.supports_gpu_offload(), reason="a GPU is here: tests/test_gpu.py tunes on it")
def test_tune_measures_around_the_plan_and_writes_the_pair_defaults(tiny, tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from ggufspec.models.registry import load_registry

    models = Path(tmp_path / "models")
    models.mkdir(exist_ok=True)
    (models / "t.gguf").write_bytes(Path(tiny["target"]).read_bytes())
    (models / "d.gguf").write_bytes(Path(tiny["close"]).read_bytes())
    reg = tmp_path / "mine.toml"
    reg.write_text('[models.t]\nrepo = "x/t"\nfile = "t.gguf"\n[models.d]\nrepo = "x/d"\nfile = "d.gguf"\n'
                   '[pairs.td]\ntarget = "t"\ndraft = "d"\n')
    out = run("tune", "td", "--registry", reg, "-n", 8, "--repeats", 1, "--draft-max", "1,2", "--write")
    assert out.exit_code == 0, out.output
    assert "best: --mode " in out.stdout and "saved as the defaults of pair td" in out.stdout
    assert "only the drafting settings were tuned" in out.stdout  # no GPU here: it says so, and saves no placement
    rows = [line for line in out.stdout.splitlines() if line.startswith("0 ")]
    assert [line.split()[2] for line in rows] == ["target", "draft", "draft", "auto", "auto"]
    pair = load_registry(reg).pair("td")
    assert pair.n_gpu_layers is None and pair.draft_n_gpu_layers is None
    assert pair.settings["mode"] in ("target", "auto", "draft")
    assert pair.target == "t"  # the rest of the file survived
    # --write may also create the user's file: the pair then comes from the registry given by env
    new = tmp_path / "new" / "models.toml"
    monkeypatch.setenv("GGUFSPEC_REGISTRY", str(reg))
    out = run("tune", "td", "--registry", new, "-n", 4, "--draft-max", "1", "--repeats", 1, "--write")
    assert out.exit_code == 0, out.output
    assert new.exists() and "saved as the defaults of pair td" in out.stdout
    # the script is an example over the same API
    script = Path(__file__).parent.parent / "scripts" / "tune_offload.py"
    done = subprocess.run([sys.executable, str(script), "td", "--draft-max", "1"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "best: --mode " in done.stdout, done.stderr


def _tiny_pair_registry(tiny, tmp_path) -> Path:
    """A user's registry naming the tiny target and draft as pair td (files in the test's models directory)."""
    models = tmp_path / "models"
    models.mkdir(exist_ok=True)
    (models / "t.gguf").write_bytes(Path(tiny["target"]).read_bytes())
    (models / "d.gguf").write_bytes(Path(tiny["close"]).read_bytes())
    reg = tmp_path / "mine.toml"
    reg.write_text('# my pairs\n[models.t]\nrepo = "x/t"\nfile = "t.gguf"\n[models.d]\nrepo = "x/d"\nfile = "d.gguf"\n\n'
                   '[pairs.td]  # the tiny pair\ntarget = "t"\ndraft = "d"\n')
    return reg


def test_tune_write_that_could_not_save_says_so_before_measuring(tiny, tmp_path, monkeypatch):
    """Before: everything was measured, then `--write needs a pair name` (or a traceback) threw it away."""
    from ggufspec.bench import tune

    monkeypatch.setattr(tune, "Engine", lambda *a, **kw: pytest.fail("tune measured before it checked --write"))
    one_line(run("tune", "-m", tiny["target"], "-md", tiny["close"], "--write"), "--write needs a pair name")
    reg = _tiny_pair_registry(tiny, tmp_path)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("GGUFSPEC_REGISTRY", str(reg))
    one_line(run("tune", "td", "--registry", tmp_path / "file" / "models.toml", "--write"),
             "file/models.toml: cannot write the registry", "is a file, not a folder")


def test_tune_with_a_context_too_small_for_its_prompts_says_so(tiny):
    """Before: "no placement around the plan could be loaded", as if the placement were the problem."""
    one_line(run("tune", "-m", tiny["target"], "-md", tiny["close"], "-c", 100, "--repeats", 1),
             "-c 100 is too small for tune: prompt code-0 is", "give -c ")


# tune as a process, stopped after a few runs: on the CPU alone (on a GPU, and on a software one most of all, its
# placements make every run slow; tests/test_gpu.py tunes there). The CPU tier runs these everywhere.
ON_THE_CPU = pytest.mark.skipif(backend.supports_gpu_offload(), reason="a GPU is here: tests/test_gpu.py tunes on it")


def _tune_process(args, runs_done: int):
    """`ggufspec tune` as a process, its progress line shown; returns it (and its stderr so far) once it has done
    `runs_done` runs (the first 3 are warm-up: not rows)."""
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "tune", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "GGUFSPEC_STDERR_TTY": "1"})
    return proc, stderr_until(proc, f"bench {runs_done}/".encode())


@pytest.mark.parametrize("signum, said", [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")])
@ON_THE_CPU
def test_tune_stopped_prints_the_finished_rows_and_saves_nothing(tiny, tmp_path, signum, said):
    """Before: Ctrl-C kept nothing, and SIGTERM ended it (143) without a word."""
    reg = _tiny_pair_registry(tiny, tmp_path)
    before = reg.read_text()
    proc, seen = _tune_process(["td", "--registry", reg, "-n", 8, "--draft-max", 1, "--repeats", 5000, "--write"], 7)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=TIMEOUT)
    err = (seen + err).decode()
    assert proc.returncode == 128 + signum, err
    assert f"{said}: showing the finished rows, nothing saved" in err and "Traceback" not in err
    assert "target" in out.decode() and "best of the finished rows: --mode " in out.decode()
    assert reg.read_text() == before


@ON_THE_CPU
def test_tune_write_to_a_pair_renamed_meanwhile_prints_the_table_then_one_error(tiny, tmp_path):
    """The user renames the pair while tune measures: before, the file was replaced by a stub [pairs.td] lacking
    `target`, and every later command failed on it. Now the table, one Error line, the user's file as they left it."""
    reg = _tiny_pair_registry(tiny, tmp_path)
    proc, seen = _tune_process(["td", "--registry", reg, "-n", 8, "--draft-max", 1, "--repeats", 30, "--write"], 3)
    renamed = reg.read_text().replace("[pairs.td]", "[pairs.tiny]")
    reg.write_text(renamed)
    out, err = proc.communicate(timeout=TIMEOUT)
    lines = stderr_lines((seen + err).decode().split("\r")[-1])
    assert proc.returncode == 1 and "best: --mode " in out.decode(), err
    assert lines == [f"Error: {reg}: the setting for pair 'td' was not saved: there is no pair 'td' in it or the "
                     "registries under it any more (renamed or removed?)"]
    assert reg.read_text() == renamed and sorted(p.name for p in tmp_path.glob("*.tmp")) == []


def test_tune_saves_exactly_the_best_it_reports():
    """Before: a CPU-only build saved n_gpu_layers = 0 (pinning a shared registry to the CPU), and a best of
    `--mode auto --draft-max 2` was saved as mode = "auto" alone, which generates uncapped."""
    from ggufspec.bench.tune import TuneResult, best_values
    from ggufspec.models.resolve import merge_pair_settings

    best = {"ngl": 0, "ngld": 0, "cpu_moe": None, "mode": "auto", "draft_max": 2}
    cpu = TuneResult([best], best, "td", gpu=False)
    assert cpu.flags == "--mode auto --draft-max 2" and best_values(cpu) == {"mode": "auto", "draft_max": 2}
    gpu = TuneResult([best], {**best, "ngl": 29, "ngld": 25, "cpu_moe": 3}, "td", gpu=True)
    assert gpu.flags == "-ngl 29 --n-cpu-moe 3 -ngld 25 --mode auto --draft-max 2"
    assert best_values(gpu) == {"n_gpu_layers": 29, "draft_n_gpu_layers": 25, "n_cpu_moe": 3, "mode": "auto",
                                "draft_max": 2}
    settings, _ = merge_pair_settings(best_values(cpu), {})  # generate with the saved pair: what tune measured
    assert settings == {"mode": "auto", "draft_max": 2}
    assert merge_pair_settings(best_values(cpu), {"mode": "auto"})[0]["draft_max"] == 2
    assert "draft_max" not in merge_pair_settings({"draft_max": 2}, {"mode": "auto"})[0]  # draft mode's length alone


def test_plan_ram_messages(tiny):
    one_line(run("plan", "-m", tiny["target"], "--ram", "lots"), "--ram 'lots' is not a size")
    line = one_line(run("plan", "-m", tiny["target"], "--ram", "0"), "needs", "MiB of RAM", "MiB missing")
    assert "0.0 GiB" not in line  # a tiny model's sizes in MiB, not rounded away
    r = run("plan", "-m", tiny["target"], "--vram", "37MiB", "--ram", "1GiB")
    assert r.exit_code == 0 and "budget 37 MiB VRAM (" in r.stdout and "1.0 GiB RAM" in r.stdout, r.output
    assert np  # numpy imported for the fixtures' sake


def moe_sizes(n_layers=4, layer_mib=100, expert_mib=90):
    """A mixture of experts whose layers are mostly experts (as Qwen3-30B-A3B's are)."""
    return ModelSizes("moe", n_layers, (layer_mib * MiB,) * n_layers, 50 * MiB, 50 * MiB, 1024, 4, 64, 32000,
                      expert_bytes=(expert_mib * MiB,) * n_layers)


def test_moe_plan_keeps_as_few_layers_experts_on_the_cpu_as_the_budget_needs():
    m = moe_sizes()
    whole = plan(m, None, vram_bytes=8 * GiB, ram_bytes=None, n_ctx=4096)
    assert (whole.target.flag, whole.target.cpu_moe) == ("all", 0) and "cpu-moe" not in whole.flags()
    for k in (1, 2, 3):  # room for every layer with k layers' experts on the CPU, not with k - 1
        budget = whole.target.gpu_bytes - (k - 1) * 90 * MiB - MiB
        p = plan(m, None, vram_bytes=budget, ram_bytes=None, n_ctx=4096)
        assert (p.target.flag, p.target.cpu_moe) == ("all", k), (k, p.target)
        assert p.target.gpu_bytes <= budget and f"--n-cpu-moe {k}" in p.flags()
    every = plan(m, None, vram_bytes=whole.target.gpu_bytes - 3 * 90 * MiB - MiB, ram_bytes=None, n_ctx=4096)
    assert (every.target.flag, every.target.cpu_moe) == ("all", 4) and "--cpu-moe" in every.flags()
    short = plan(m, None, vram_bytes=whole.target.gpu_bytes - 4 * 90 * MiB - 20 * MiB, ram_bytes=None, n_ctx=4096)
    assert short.target.cpu_moe == 4 and 1 < short.target.n_gpu_layers <= m.n_layers  # not every layer: as many as fit
    fixed = plan(m, None, vram_bytes=8 * GiB, ram_bytes=None, n_ctx=4096, cpu_moe=2)
    assert fixed.target.cpu_moe == 2 and fixed.target.gpu_bytes == whole.target.gpu_bytes - 2 * 90 * MiB
    dense = plan(LLAMA3_8B, None, vram_bytes=GiB, ram_bytes=None, n_ctx=4096)  # no experts: nothing to keep back
    assert dense.target.cpu_moe == 0


def test_kv_cache_type_is_counted_and_named_in_the_flags():
    f16 = plan(LLAMA3_70B, None, vram_bytes=24 * GiB, ram_bytes=None, n_ctx=8192)
    q8 = plan(LLAMA3_70B, None, vram_bytes=24 * GiB, ram_bytes=None, n_ctx=8192, type_k="q8_0", type_v="q8_0")
    assert q8.target.kv_bytes == int(f16.target.kv_bytes / LLAMA3_70B.n_layers * 34 / 64) * LLAMA3_70B.n_layers
    assert q8.target.n_gpu_layers > f16.target.n_gpu_layers
    assert q8.flags().endswith("-ctk q8_0 -ctv q8_0")
    k_only = plan(LLAMA3_70B, None, vram_bytes=24 * GiB, ram_bytes=None, n_ctx=8192, type_k="q8_0")
    assert k_only.flags().endswith("-ctk q8_0") and f16.target.kv_bytes > k_only.target.kv_bytes > q8.target.kv_bytes


def test_plan_takes_ctk_and_ctv_as_llama_cpp_spells_them(tiny):
    """-ctv once read as `-c tv`; each flag plans its own half of the cache."""
    for args, flags in ((["-ctv", "q8_0"], " -ctv q8_0"),
                        (["-ctk", "q4_0", "--cache-type-v", "q8_0"], " -ctk q4_0 -ctv q8_0")):
        r = run("plan", "-m", tiny["target"], "--vram", "1GiB", *args)
        assert r.exit_code == 0 and flags in r.stdout, r.output
    one_line(run("plan", "-m", tiny["target"], "-ctv", "q9_9"), "-ctv 'q9_9' is not a KV cache type", "q8_0")


def test_a_hybrids_kv_cache_counts_only_its_attention_layers(tmp_path):
    from tiny import write_tiny_hybrid

    hybrid = sizes_from_info(read_info(write_tiny_hybrid(tmp_path / "lfm2.gguf", "lfm2", layers="rar")))
    assert hybrid.kv_layers == (1,)
    p = plan(hybrid, None, vram_bytes=GiB, ram_bytes=None, n_ctx=4096)
    assert p.target.kv_bytes == hybrid.kv_bytes_per_layer(4096)  # one attention layer of three, not three


def test_bad_kv_type_and_expert_counts_are_one_line(tiny):
    one_line(run("plan", "-m", tiny["target"], "-ctk", "q9_9"), "-ctk 'q9_9' is not a KV cache type", "q8_0")
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "-n", 2, "--n-cpu-moe", "1,2"),
             "--n-cpu-moe takes one value")
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "-n", 2, "--n-cpu-moe", "-2"), "-2 is negative")


def test_tune_says_what_a_layer_moved_and_the_drafts_place_cost():
    """From the measured rows alone: the target alone at two -ngl (the best's -ngld), the drafting rows' best at each
    -ngld; for a mixture of experts, at two expert splits."""
    from ggufspec.bench.tune import why

    def row(ngl, ngld, mode, tps, moe=None):
        return {"ngl": ngl, "ngld": ngld, "cpu_moe": moe, "mode": mode, "tokens_per_second": tps}

    dense = [row(43, 33, "target", 4.0), row(47, 33, "target", 5.0), row(47, 33, "auto", 9.0),
             row(47, 0, "target", 5.1), row(47, 0, "draft", 3.0), row(43, 33, "draft", 7.5)]
    assert why(dense, dense[2]) == [
        "a target layer on the CPU instead of the GPU costs 12.50 ms a token here (the target alone: 4.00 tok/s at "
        "-ngl 43, 5.00 at -ngl 47)",
        "the draft with -ngld 33: 9.00 tok/s at best, with -ngld 0: 3.00 (the plan puts the draft on the GPU first, "
        "then the target's layers)"]
    moe = [row(49, 29, "target", 20.0, 8), row(49, 29, "target", 25.0, 4), row(49, 29, "auto", 40.0, 4)]
    assert why(moe, moe[2]) == ["a layer's experts on the CPU costs 2.50 ms a token here (the target alone: 20.00 "
                                "tok/s at --n-cpu-moe 8, 25.00 at --n-cpu-moe 4)"]
