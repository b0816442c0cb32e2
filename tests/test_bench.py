"""ggufspec bench through the CLI on tiny models: rows, formats, identity, prompt files."""

import csv
import io
import json

import pytest
from click.testing import CliRunner

from ggufspec.bench import load_prompts_file, load_suite, predicted_speedup
from ggufspec.cli import cli


def bench(*args):
    return CliRunner().invoke(cli, ["bench", *[str(a) for a in args]])


def test_json_has_a_row_per_mode_and_greedy_rows_identical(tiny):
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code,chat", "--limit", "0", "-n", "16", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    modes = [row["mode"] for row in data["rows"]]
    assert modes == ["target", "draft", "speculative", "lookup", "auto"]
    for row in data["rows"]:
        for key in ("tokens_per_second", "speedup", "acceptance_rate", "identical_to_target"):
            assert key in row
        assert row["n_prompts"] == 8 and row["n_generated"] == 8 * 16
    by_mode = {row["mode"]: row for row in data["rows"]}
    assert by_mode["target"]["speedup"] == 1.0
    assert by_mode["speculative"]["identical_to_target"] is True and by_mode["lookup"]["identical_to_target"] is True
    assert 0 < by_mode["speculative"]["acceptance_rate"] <= 1
    assert by_mode["speculative"]["predicted_speedup"] > 0
    assert data["costs"]["target_batch_seconds"][0] > 0


def test_sweep_table_csv_markdown_and_saved_outputs(tiny, tmp_path):
    args = ["-m", tiny["target"], "-md", tiny["close"], "--suite", "edit", "--limit", "0", "-n", "8", "--modes", "target,speculative",
            "--draft-max", "1,3"]
    table = bench(*args)
    assert table.exit_code == 0, table.output
    assert "speculative (draft-max 1)" in table.stdout and "speculative (draft-max 3)" in table.stdout
    assert "bit-identical" in table.stdout
    rows = list(csv.DictReader(io.StringIO(bench(*args, "--csv").stdout)))
    assert [r["label"] for r in rows] == ["target", "speculative (draft-max 1)", "speculative (draft-max 3)"]
    md = bench(*args, "--markdown", "--save-outputs", tmp_path / "out").stdout
    assert md.lstrip().startswith("| mode")
    saved = sorted((tmp_path / "out").glob("*.md"))
    assert len(saved) == 4 and "## speculative (draft-max 3)" in saved[0].read_text()


def test_per_suite_rows_and_sampled_runs(tiny):
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code,edit", "-n", "8", "--modes", "target,auto",
              "--by-suite", "--temp", "0.7", "--repeats", "2", "--json")
    data = json.loads(r.stdout)
    assert {(row["mode"], row["group"]) for row in data["rows"]} == {
        ("target", "code"), ("target", "edit"), ("auto", "code"), ("auto", "edit")}
    assert all(row["identical_to_target"] is None for row in data["rows"])  # not a greedy run
    assert data["settings"]["seed"] == 0


def test_prompts_file_text_and_jsonl(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello"}\n{"messages": [{"role": "user", "content": "hi"}]}\nplain line\n')
    prompts = load_prompts_file(f)
    assert [p.text for p in prompts] == ["hello", None, "plain line"]
    r = bench("-m", tiny["target"], "--prompts", f, "-n", "4", "--json")
    assert r.exit_code == 0, r.output
    assert [row["mode"] for row in json.loads(r.stdout)["rows"]] == ["target", "lookup", "auto"]


def test_bad_bench_input_is_one_line(tiny, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"nope": 1}\n')
    for args, needle in [(["--prompts", bad], "line 2"), (["--suite", "poems"], "not a built-in suite"),
                         (["--draft-max", "0"], "--draft-max"), (["--modes", "warp"], "unknown mode"),
                         (["--repeats", "0"], "--repeats")]:
        r = bench("-m", tiny["target"], *args)
        assert r.exit_code == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_builtin_suites_exist():
    for name in ("code", "edit", "chat", "summarize"):
        assert len(load_suite(name)) >= 4


def test_leviathan_formula():
    assert predicted_speedup(0.0, 4, 0.0) == 1.0
    assert predicted_speedup(1.0, 3, 0.0) == 4.0
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.2)
