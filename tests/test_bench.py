"""ggufspec bench through the CLI on tiny models: rows, formats, identity, prompt files."""

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from clirun import TIMEOUT, one_line, run, stderr_lines, stderr_until
import csv
import io
import json
import re

import pytest
from click.testing import CliRunner

from ggufspec.costs import predicted_speedup
from ggufspec.bench.prompts import load_prompts_file, load_suite
from ggufspec.cli.main import cli


def bench(*args):
    return CliRunner().invoke(cli, ["bench", *[str(a) for a in args]])


def test_json_has_a_row_per_mode_and_greedy_rows_identical(tiny):
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code,chat", "--limit", "0", "-n", "16", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    modes = [row["mode"] for row in data["rows"]]
    assert modes == ["target", "draft-alone", "draft", "lookup", "auto"]
    for row in data["rows"]:
        for key in ("tokens_per_second", "speedup", "acceptance_rate", "identical_to_target"):
            assert key in row
        assert row["n_prompts"] == 8 and row["n_generated"] == 8 * 16
    by_mode = {row["mode"]: row for row in data["rows"]}
    assert by_mode["target"]["speedup"] == 1.0
    assert by_mode["draft"]["identical_to_target"] is True and by_mode["lookup"]["identical_to_target"] is True
    assert 0 < by_mode["draft"]["acceptance_rate"] <= 1
    assert by_mode["draft"]["predicted_speedup"] > 0
    assert data["costs"]["target_batch_seconds"][0] > 0
    # without --draft-max: the draft row drafts 4, auto's model drafts as far as the measured costs say pays
    assert (by_mode["draft"]["label"], by_mode["auto"]["label"]) == ("draft (draft-max 4)", "auto")


def test_modes_take_turns_on_each_prompt_and_every_other_repeat_the_other_way_round(tiny):
    """A drift within a prompt's runs favours no row: the last mode is not always the one run last."""
    from ggufspec import Engine
    from ggufspec.bench.runs import BenchSettings, run as run_bench

    done = []
    with Engine(tiny["target"], tiny["close"], n_ctx=256) as engine:
        runs = run_bench(engine, load_suite("code")[:1], BenchSettings(("target", "draft", "auto"), max_tokens=4,
                                                                        repeats=3), [], progress=done.append)
    assert [p.config.mode for p in done] == ["target", "draft", "auto"] * 2 + ["auto", "draft", "target"] * 1 + \
        ["target", "draft", "auto"]  # the warm-up, then repeats 0, 1 and 2
    assert [(r.config.mode, r.repeat) for r in runs][3:6] == [("auto", 1), ("draft", 1), ("target", 1)]


def test_draft_max_values_make_draft_and_auto_rows_and_a_pairs_length_only_draft_rows():
    from dataclasses import replace

    from ggufspec.bench.runs import BenchSettings, plan

    given = BenchSettings(("target", "draft", "auto"), (2, 8))
    assert [c.label for c in plan(given, True)] == ["target", "draft (draft-max 2)", "draft (draft-max 8)",
                                                     "auto (draft-max 2)", "auto (draft-max 8)"]
    pair = replace(BenchSettings(("target", "draft", "lookup", "auto")), draft_length=5)
    assert [c.label for c in plan(pair, True)] == ["target", "draft (draft-max 5)", "lookup", "auto"]


def test_sweep_table_csv_markdown_and_saved_outputs(tiny, tmp_path):
    args = ["-m", tiny["target"], "-md", tiny["close"], "--suite", "edit", "--limit", "0", "-n", "8", "--modes", "target,draft",
            "--draft-max", "1,3"]
    table = bench(*args)
    assert table.exit_code == 0, table.output
    assert "draft (draft-max 1)" in table.stdout and "draft (draft-max 3)" in table.stdout
    assert "bit-identical" in table.stdout
    rows = list(csv.DictReader(io.StringIO(bench(*args, "--csv").stdout)))
    assert [r["label"] for r in rows] == ["target", "draft (draft-max 1)", "draft (draft-max 3)"]
    md = bench(*args, "--markdown", "--save-outputs", tmp_path / "out").stdout
    assert md.lstrip().startswith("| mode")
    saved = sorted((tmp_path / "out").glob("*.md"))
    assert len(saved) == 4 and "## draft (draft-max 3)" in saved[0].read_text()


def test_per_suite_rows_and_sampled_runs(tiny):
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code,edit", "-n", "8", "--modes", "target,auto",
              "--by-suite", "--temp", "0.7", "--repeats", "2", "--json")
    data = json.loads(r.stdout)
    assert {(row["mode"], row["group"]) for row in data["rows"]} == {
        ("target", "code"), ("target", "edit"), ("auto", "code"), ("auto", "edit")}
    # sampled runs get seed 0 and so the coupled rule: every mode must write the target's own text
    assert [row["identical_to_target"] for row in data["rows"] if row["mode"] == "auto"] == [True, True]
    assert data["settings"]["seed"] == 0
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code", "-n", "8", "--modes", "target,draft",
              "--temp", "0.7", "--sampling-rule", "rejection", "--json")
    data = json.loads(r.stdout)
    assert all(row["identical_to_target"] is None for row in data["rows"])  # the rejection rule's text may differ


def test_footer_says_per_suite_what_auto_chose_and_its_predicted_against_measured_rate(tiny):
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code,edit", "-n", "8", "--modes", "target,auto",
              "--by-suite")
    assert r.exit_code == 0, r.output
    unwrapped = re.sub(r"\n  (?=\S)", " ", r.stdout)  # a footer line longer than 120 columns goes on indented
    assert max(len(line) for line in r.stdout.splitlines() if "rounds by source" in line) <= 120
    lines = {line.split(":")[0]: line for line in unwrapped.splitlines() if "rounds by source" in line}
    assert set(lines) == {"auto, code", "auto, edit"}
    for line in lines.values():  # 8 tokens: the first from the prompt's row, then rounds that add up to 7 or more
        counts = [int(n) for n in re.findall(r"(?:none|lookup|draft|mtp) (\d+)", line)]
        assert sum(counts) >= 2 * 2 and re.search(r"predicted [0-9.]+ tok/s, measured [0-9.]+", line), line
        assert re.search(r": [0-9.]+x of the best fixed mode \(target, 1.00x\); rounds by source", line), line


def test_auto_rows_stand_beside_the_fastest_fixed_mode_of_their_suite():
    from ggufspec.bench.rows import beside_best_fixed

    rows = [dict(_row("target", 10.0, 10, 10, "chat"), speedup=1.0), dict(_row("draft", 12.0, 12, 12, "chat"), speedup=1.2),
            dict(_row("draft-alone", 40.0, 40, 40, "chat"), speedup=4.0),  # the draft's own text: no choice of a user's
            dict(_row("auto", 11.4, 11, 12, "chat"), speedup=1.14),
            dict(_row("target", 10.0, 10, 10, "fix"), speedup=1.0), dict(_row("lookup", 25.0, 25, 25, "fix"), speedup=2.5),
            dict(_row("auto", 24.0, 24, 24, "fix"), speedup=2.4),
            dict(_row("llama.cpp draft", 30.0, 30, 30, "fix"), speedup=3.0, reference=True)]  # not a mode of ours
    beside_best_fixed(rows)
    chat, fix = rows[3], rows[6]
    assert (chat["best_fixed"], round(chat["vs_best_fixed"], 3)) == ("draft", 0.95)
    assert (fix["best_fixed"], fix["best_fixed_speedup"], round(fix["vs_best_fixed"], 3)) == ("lookup", 2.5, 0.96)


def _row(label, tps, low, high, group="all", repeats=2, mode=None):
    return {"label": label, "mode": mode or label, "group": group, "repeats": repeats, "tokens_per_second": tps,
            "tokens_per_second_min": low, "tokens_per_second_max": high}


def test_notes_say_where_rows_are_within_the_runs_noise():
    from ggufspec.bench.rows import noise_notes

    rows = [_row("target", 20.0, 19.5, 20.5), _row("draft-alone", 60.0, 59, 61), _row("draft", 23.0, 22.0, 23.5),
            _row("lookup", 20.3, 20.1, 21.0), _row("auto", 23.4, 22.8, 24.0),
            dict(_row("llama.cpp ngram-mod", 30.0, 30.0, 30.0), reference=True)]  # llama.cpp's rows are not judged
    assert noise_notes(rows) == ["draft within noise of the fastest row, auto (their min-max ranges overlap)",
                                 "lookup within noise of target-only"]
    apart = [_row("target", 20.0, 19.5, 20.5, "code"), _row("auto", 30.0, 29.0, 31.0, "code")]
    assert noise_notes(apart) == []
    single = [_row("target", 20.0, 20.0, 20.0, repeats=1), _row("auto", 20.4, 20.4, 20.4, repeats=1)]
    assert noise_notes(single)[0].startswith("one repeat: min-max shows no spread")


def test_a_note_says_where_speculative_simple_decoded_past_the_tokens_asked():
    """speculative-simple drafts 48 tokens at position 64 of a 64-token run and counts all 113 it decoded: the note
    gives its speed counted up to -n beside; a row that stopped near -n, and ggufspec's own rows, get none."""
    from ggufspec.bench.rows import overshoot_notes

    over = dict(_row("llama.cpp speculative-simple, ngram-simple", 22.6, 22.6, 22.6, "fix"), reference=True,
                speedup=3.0, n_generated=226, n_asked=128)
    near = dict(_row("llama.cpp speculative-simple, ngram-mod", 9.0, 9.0, 9.0, "fix"), reference=True,
                speedup=1.2, n_generated=131, n_asked=128)
    ours = dict(_row("lookup", 15.0, 15.0, 15.0, "fix"), n_generated=300, n_asked=128)
    assert overshoot_notes([over, near, ours]) == [
        "fix: llama.cpp speculative-simple, ngram-simple decoded 226 tokens for the 128 asked (its last draft runs "
        "past -n) and its tok/s counts them all; counted up to -n: 12.8 tok/s (1.70x)"]


def test_a_row_counted_to_n_is_charged_for_the_rounds_up_to_n_only():
    """speculative-simple's rounds end at -n, then its loop runs one more whose n-gram draft nothing cut (48 tokens
    here): by its log's times the 9 tokens asked were out at 1.5 s of its 2.5, so its row reads 6 tok/s where all
    57 over all its time read 22.8. A log that does not show every round leaves the whole time (None)."""
    from ggufspec.bench.reference import seconds_to
    from ggufspec.bench.reference_runs import _speed
    from ggufspec.bench.rows import overshoot_notes

    def line(at, accepted):
        return f"0.{int(at):02d}.{round(at % 1 * 1000):03d}.000 D accepted {accepted}/{accepted} draft tokens, the last"

    log = "\n".join(["0.00.500.000 I llama_context: n_ctx = 512", line(1.0, 0), line(1.5, 3), line(2.0, 3),
                     line(3.0, 47), "0.03.000.100 I decoded   57 tokens in    2.500 seconds, speed: 22.8 t/s"])
    assert seconds_to(log, 9, 57, 2.5) == 1.5
    assert seconds_to(log, 200, 57, 2.5) == 2.5  # never reached: all of it
    assert seconds_to(log, 9, 58, 2.5) is None and seconds_to("decoded 57 tokens", 9, 57, 2.5) is None
    run = {"n_generated": 57, "seconds": 2.5, "seconds_to_n": 1.5}
    assert (_speed([run], 9), _speed([run])) == (6.0, 22.8)
    row = dict(_row("llama.cpp speculative-simple, ngram-simple", 6.0, 6.0, 6.0, "fix"), reference=True,
               n_generated=57, n_asked=9, counted_to_n=True, tokens_per_second_all=22.8)
    assert overshoot_notes([row]) == [
        "fix: llama.cpp speculative-simple, ngram-simple decoded 57 tokens for the 9 asked (its last draft runs past "
        "-n); its tok/s counts the 9 over the time until they were out; all 57 over all its time: 22.8 tok/s"]


def test_a_default_bench_shows_no_range_for_one_repeat_and_says_so(tiny):
    r = bench("-m", tiny["target"], "--suite", "code", "--limit", "1", "-n", "4", "--modes", "target,lookup")
    assert r.exit_code == 0, r.output
    target = next(line for line in r.stdout.splitlines() if line.startswith("target"))
    assert target.split()[2] == "-"  # tok/s, then min-max: not a range of one value
    assert "note: one repeat: min-max shows no spread" in r.stdout
    two = bench("-m", tiny["target"], "--suite", "code", "--limit", "1", "-n", "4", "--modes", "target", "--repeats", "2")
    line = next(line for line in two.stdout.splitlines() if line.startswith("target"))
    assert re.fullmatch(r"[0-9.]+-[0-9.]+", line.split()[2]), line


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
                         (["--repeats", "0"], "--repeats"), (["--modes", "draft"], "needs a draft model"),
                         (["--modes", "target,draft-alone"], "--modes draft-alone needs a draft model"),
                         (["--modes", ","], "--modes names no mode")]:
        r = bench("-m", tiny["target"], *args)
        assert r.exit_code == 1 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_builtin_suites_exist():
    for name in ("code", "edit", "chat", "summarize", "fix"):
        assert len(load_suite(name)) >= 4


def test_llama_cpp_text_is_compared_with_the_targets():
    from ggufspec.bench.reference import generated_text, same_text

    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = "\n\n" + prompt + "Hello! How can I help?\n\n\n\n"  # what speculative-simple prints
    assert generated_text(out, prompt) == "Hello! How can I help?\n\n\n\n"
    assert generated_text("no echo", prompt) is None
    assert same_text("Hello! How can", "Hello! How can I help?")  # -n cut either text short
    assert same_text("Hello! How can I help?", "Hello! How can I h\ufffd")  # a token cut mid-character
    assert not same_text("Hello! What do you need?", "Hello! How can I help?")
    assert same_text(None, "x") is None and same_text("", "x") is None
    # bytes, as compared: texts that are not UTF-8 (a tiny random model's bytes) differ where their decodings would not
    assert generated_text(b"\n" + prompt.encode() + b"\xff\xfeab", prompt.encode()) == b"\xff\xfeab"
    assert same_text(b"\xff\xfeab", b"\xff\xfe") and not same_text(b"\xff", b"\xfe")
    assert b"\xff".decode("utf-8", "replace") == b"\xfe".decode("utf-8", "replace")


def test_leviathan_formula():
    assert predicted_speedup(0.0, 4, 0.0) == 1.0
    assert predicted_speedup(1.0, 3, 0.0) == 4.0
    assert predicted_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / 0.2 / 1.2)


def test_ngl_sweep_makes_rows_per_value(tiny):
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code", "--limit", "1", "-n", "4",
              "--modes", "target,draft", "-ngl", "0,all", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [(row["label"], row["n_gpu_layers"]) for row in data["rows"]] == [
        ("target (ngl 0)", 0), ("draft (draft-max 4) (ngl 0)", 0),
        ("target (ngl all)", "all"), ("draft (draft-max 4) (ngl all)", "all")]
    assert data["n_gpu_layers"] == [0, "all"]
    gen = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-p", "hi", "-ngl", "0,4"])
    assert gen.exit_code == 1 and "sweep" in gen.stderr and len(gen.stderr.strip().splitlines()) == 1


def test_compare_llama_cpp_rows_from_the_programs_output(tiny, tmp_path):
    """Stand-ins print what llama-bench and llama-speculative-simple print (building them takes minutes),
    including generated text that is not valid UTF-8."""
    import os
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        # one result per -d depth, its speed the depth's last digit + 20
        "llama-bench": ('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = "-d" ] && D=$2; shift; done\n'
                        'printf "["; sep=""; for d in $(echo $D | tr , " "); do '
                        'printf "%s{\\"n_depth\\": %s, \\"avg_ts\\": %s.5}" "$sep" $d $((20 + d % 10)); sep=","; done; echo "]"\n'),
        # echoes its prompt (-p), then a text of its own, partly not UTF-8
        "llama-speculative-simple": ('#!/bin/sh\nE=1; while [ $# -gt 0 ]; do [ "$1" = "-p" ] && P=$2; '
                                     '[ "$1" = "--no-escape" ] && E=0; shift; done\n[ $E = 1 ] && exit 3\n'
                                     "printf '\\n\\n%s' \"$P\"; printf 'text \\257\\377 more\\n'\n"
                                     "echo 'decoded   16 tokens in    2.000 seconds, speed:    8.000 t/s' >&2\n"
                                     "echo 'n_drafted = 10' >&2\necho 'n_accept  = 7' >&2\n"),
    }
    for name, body in scripts.items():
        (bin_dir / name).write_text(body)
        os.chmod(bin_dir / name, os.stat(bin_dir / name).st_mode | stat.S_IEXEC)
    r = bench("-m", tiny["target"], "-md", tiny["close"], "--suite", "code", "--limit", "1", "-n", "4",
              "--modes", "target", "--draft-max", "2", "--compare-llama-cpp", bin_dir, "--json")
    assert r.exit_code == 0, r.output
    ref = [row for row in json.loads(r.stdout)["rows"] if row.get("reference")]
    depth = ref[0]["depth"]  # the code prompt's length in tokens
    assert depth > 0 and [row["label"] for row in ref] == [f"llama.cpp llama-bench (target, depth {depth})",
                                              "llama.cpp speculative-simple, draft model (draft-max 2)",
                                              "llama.cpp speculative-simple, ngram-simple",
                                              "llama.cpp speculative-simple, ngram-map-k",
                                              "llama.cpp speculative-simple, ngram-mod",
                                              "llama.cpp speculative-simple, ngram-cache"]
    assert ref[0]["tokens_per_second"] == 20.5 + depth % 10  # at the prompt's length, before and after ggufspec's runs
    assert ref[1]["identical_to_target"] is False and ref[1]["divergence"] == {"prompt": "code-0"}  # not the target's text
    assert ref[0]["identical_to_target"] is None  # llama-bench writes no text
    assert ref[1]["tokens_per_second"] == 8.0 and ref[1]["acceptance_rate"] == 0.7
    by_suite = bench("-m", tiny["target"], "--suite", "code,fix", "--limit", "1", "-n", "4", "--modes", "target",
                     "--compare-llama-cpp", bin_dir, "--by-suite", "--json")
    assert by_suite.exit_code == 0, by_suite.output
    by_rows = [row for row in json.loads(by_suite.stdout)["rows"] if row.get("reference")]
    groups = [(row["group"], row["mode"]) for row in by_rows]
    assert groups == [(suite, mode) for suite in ("code", "fix")
                      for mode in ("llama-bench", "llama.cpp-ngram-simple", "llama.cpp-ngram-map-k",
                                   "llama.cpp-ngram-mod", "llama.cpp-ngram-cache")]
    benches = [row for row in by_rows if row["mode"] == "llama-bench"]
    assert benches[0]["depth"] == depth and benches[1]["depth"] > depth  # each suite at its own prompts' length
    assert [row["tokens_per_second"] for row in benches] == [20.5 + row["depth"] % 10 for row in benches]
    old = bin_dir / "llama-bench"  # a llama-bench without -d: one result, whatever depths were asked
    old.write_text('#!/bin/sh\necho \'[{"avg_ts": 20.5, "stddev_ts": 0.3}]\'\n')
    no_depth = bench("-m", tiny["target"], "--suite", "code,fix", "--limit", "1", "-n", "4", "--modes", "target",
                     "--compare-llama-cpp", bin_dir, "--by-suite")
    assert no_depth.exit_code == 0 and "Traceback" not in no_depth.output
    assert [line for line in stderr_lines(no_depth.stderr) if "llama-bench" in line] == [
        f"note: llama-bench printed no result at depth {benches[1]['depth']} (depth {depth} only: too old for -d? "
        "build the llama.cpp release llama-cpp-python is built from); llama-bench's row is left out"]
    missing = bench("-m", tiny["target"], "--suite", "code", "--limit", "1", "-n", "4", "--compare-llama-cpp", tmp_path)
    assert missing.exit_code == 1 and "llama-bench not found" in missing.stderr


@pytest.mark.parametrize("suite", ["", ",", " , "])
def test_bench_with_no_suite(tiny, suite):
    one_line(run("bench", "-m", tiny["target"], "--suite", suite), "--suite names no suite")


def test_bench_prompts_with_messages_of_the_wrong_shape(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"messages": [1, 2]}\n')
    one_line(run("bench", "-m", tiny["target"], "--prompts", f), "p.jsonl, line 1", "messages[0]")


@pytest.mark.parametrize("n", [1, 0, -5])
def test_bench_fewer_than_two_tokens_is_refused(tiny, n):
    """-n 0 is refused like -n 1 (it once ran 64 tokens): the first token comes with the prompt, nothing to time."""
    one_line(run("bench", "-m", tiny["target"], "-n", n), f"-n must be at least 2 (got {n})")


def test_bench_plot_without_matplotlib_is_refused_before_running(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    start = time.monotonic()
    one_line(run("bench", "-m", tiny["target"], "--plot", tmp_path / "x.png"), "matplotlib")
    assert time.monotonic() - start < 5  # nothing was loaded or run


def test_bench_save_outputs_where_nothing_can_be_written(tiny, tmp_path):
    (tmp_path / "file").write_text("x")
    one_line(run("bench", "-m", tiny["target"], "-n", 4, "--save-outputs", tmp_path / "file" / "out"),
             "--save-outputs", "cannot write there")


def test_bench_save_outputs_on_a_full_disk_keeps_the_table(tiny, tmp_path, monkeypatch):
    real = Path.write_text

    def full(self, data, *a, **kw):
        if self.suffix == ".tmp":
            real(self, data[:10], *a, **kw)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, *a, **kw)

    monkeypatch.setattr(Path, "write_text", full)
    out = tmp_path / "out"
    r = run("bench", "-m", tiny["target"], "-n", 4, "--modes", "target,lookup", "--suite", "code", "--limit", 1,
            "--save-outputs", out)
    assert r.exit_code == 1
    assert "target" in r.stdout and "lookup" in r.stdout  # the table is there
    assert "No space left on device" in stderr_lines(r.stderr)[-1]
    assert list(out.iterdir()) == []  # no empty or partial file
    assert bench  # (imported for the module under test)


@pytest.mark.parametrize("signum, said", [(signal.SIGTERM, "terminated"), (signal.SIGHUP, "hung up")])
def test_sigterm_or_sighup_during_bench_keeps_the_finished_rows(tiny, tmp_path, signum, said):
    """SIGTERM (`timeout`, a service manager) and SIGHUP (the terminal or ssh session closed): the finished
    rows are printed and the texts saved, as after Ctrl-C."""
    outputs = tmp_path / "texts"
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "bench", "-m", str(tiny["target"]), "--modes",
                             "target,lookup", "-n", "16", "--repeats", "2000", "--suite", "code", "--limit", "1",
                             "--save-outputs", str(outputs)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "GGUFSPEC_STDERR_TTY": "1"})
    seen = stderr_until(proc, b"bench 6/")  # the progress line: counted runs finished
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=TIMEOUT)
    err = (seen + err).decode()
    assert proc.returncode == 128 + signum, err
    assert f"{said}: showing the finished runs" in err
    out = out.decode()
    assert "target" in out and "lookup" in out and "tok/s" in out
    assert sorted(p.name for p in outputs.iterdir()), "no text was saved"


def test_a_llama_cpp_program_that_crashes_is_named_run_again_and_its_row_left_out(tmp_path):
    """llama.cpp's speculative-simple dies of a signal now and then: the message names the signal (its last
    line says nothing of it), one crash is run again, two leave that row out in one line; ggufspec's rows stay."""
    import stat

    from ggufspec.bench.reference import ProgramDied, _run_twice, speculative_simple

    program = tmp_path / "llama-speculative-simple"
    program.write_text("#!/bin/sh\necho 'llama threadpool init, n_threads = 2' >&2\nkill -SEGV $$\n")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(ProgramDied, match=r"llama-speculative-simple \(ngram-mod\) died of SIGSEGV"):
        speculative_simple(tmp_path, tmp_path / "t.gguf", None, "hi", 8, 2, 512, 4, "ngram-mod")
    said, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise ProgramDied("llama-speculative-simple (ngram-mod) died of SIGSEGV")
        return {"ok": True}

    assert _run_twice(flaky, said.append) == {"ok": True} and said == []

    def dead():
        raise ProgramDied("llama-speculative-simple (ngram-mod) died of SIGSEGV")

    assert _run_twice(dead, said.append) is None
    assert said == ["llama-speculative-simple (ngram-mod) died of SIGSEGV twice; its row is left out"]


def test_a_short_run_whose_log_was_lost_is_run_until_its_counts_come(tmp_path):
    """llama.cpp's log thread lost everything after the first line in most runs of a tiny model on a Zen 5: a short
    run is run again past the first six tries (here its tenth prints the counts); one that never prints them ends."""
    import stat

    from ggufspec.bench.reference import LOST_LOG_MOST, speculative_simple
    from ggufspec.errors import GGUFSpecError

    calls = tmp_path / "calls"
    program = tmp_path / "llama-speculative-simple"
    program.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'llama threadpool init, n_threads = 2' >&2\n"
                       f'[ $(wc -l < {calls}) -lt 10 ] && exit 0\n'
                       "echo 'decoded    8 tokens in    0.010 seconds' >&2\necho 'n_drafted = 4' >&2\n"
                       "echo 'n_accept  = 3' >&2\n")
    program.chmod(program.stat().st_mode | stat.S_IEXEC)
    out = speculative_simple(tmp_path, tmp_path / "t.gguf", None, "hi", 8, 2, 512, 4, "ngram-mod")
    assert (out["n_generated"], out["n_drafted"], out["n_accepted"]) == (8, 4, 3)
    assert len(calls.read_text().split()) == 10
    program.write_text(f"#!/bin/sh\necho x >> {calls}\necho 'llama threadpool init' >&2\n")
    calls.write_text("")
    with pytest.raises(GGUFSpecError, match="printed no timing"):
        speculative_simple(tmp_path, tmp_path / "t.gguf", None, "hi", 8, 2, 512, 4, "ngram-mod")
    assert len(calls.read_text().split()) == LOST_LOG_MOST


# llama-bench as llama.cpp prints it: one JSON result per -d depth
GOOD_LLAMA_BENCH = ('while [ $# -gt 0 ]; do [ "$1" = "-d" ] && D=$2; shift; done\n'
                    'printf "["; sep=""; for d in $(echo $D | tr , " "); do '
                    'printf "%s{\\"n_depth\\": %s, \\"avg_ts\\": 20.5}" "$sep" $d; sep=","; done; echo "]"\n')


def fake_llama_cpp(folder: Path, **bodies) -> Path:
    """llama.cpp's programs as small shell scripts (named like llama-bench, with _ for -) that misbehave."""
    folder.mkdir(exist_ok=True)
    for name, body in bodies.items():
        path = folder / name.replace("_", "-")
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
    return folder


def compare(tiny, bin_dir, *extra):
    return run("bench", "-m", tiny["target"], "-md", tiny["close"], "--suite", "code", "--limit", 1, "-n", 4,
               "--modes", "target,lookup", "--draft-max", 2, "--compare-llama-cpp", bin_dir, *extra)


def test_llama_cpp_programs_that_fail_after_the_runs_leave_notes_and_keep_ggufspecs_rows(tiny, tmp_path):
    """llama-bench printing garbage after ggufspec's runs, speculative-simple printing nothing: each is a note,
    ggufspec's rows are printed and its texts saved."""
    bin_dir = fake_llama_cpp(tmp_path / "bin", llama_speculative_simple="exit 0\n", llama_bench=(
        'if [ -f "$0.ran" ]; then echo "Traceback: this is not JSON"; exit 0; fi\ntouch "$0.ran"\n' + GOOD_LLAMA_BENCH))
    r = compare(tiny, bin_dir, "--json", "--save-outputs", tmp_path / "texts")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert [row["label"] for row in data["rows"]][:2] == ["target", "lookup"]
    bench_rows = [row for row in data["rows"] if row.get("reference")]
    assert [row["label"].split(" (")[0] for row in bench_rows] == ["llama.cpp llama-bench"]  # its run before ours
    notes = [line for line in stderr_lines(r.stderr) if line.startswith("note: ")]
    assert any("llama-bench printed no JSON results" in n and "only its run before" in n for n in notes), notes
    assert any("llama-speculative-simple (draft-simple) printed no timing" in n for n in notes), notes
    assert data["notes"] and "Traceback" not in r.stderr.replace("Traceback: this", "")
    assert sorted(p.name for p in (tmp_path / "texts").iterdir()) == ["code-0.md"]


@pytest.mark.parametrize("garbage", ["not JSON at all", "[1, 2]", '[{"n_depth": "x"}]', "[{\"avg_ts\": oops"])
def test_llama_bench_printing_garbage_before_the_runs_is_a_note_and_ggufspecs_rows_stand(tiny, tmp_path, garbage):
    calls = tmp_path / "calls"
    bin_dir = fake_llama_cpp(tmp_path / "bin", llama_bench=f"echo x >> {calls}\necho '{garbage}'\n",
                             llama_speculative_simple="exit 0\n")
    r = compare(tiny, bin_dir, "--json")
    assert r.exit_code == 0, r.output
    assert [row["mode"] for row in json.loads(r.stdout)["rows"]] == ["target", "lookup"]
    notes = [line for line in stderr_lines(r.stderr) if "llama-bench" in line]
    assert len(notes) == 1 and notes[0].startswith("note: llama-bench printed no"), notes
    assert notes[0].endswith("; llama-bench's row is left out") and calls.read_text() == "x\n"  # not run again


# speculative-simple as llama.cpp prints it: the prompt echoed, a text, its timing and counts on stderr
GOOD_SPECULATIVE_SIMPLE = ('while [ $# -gt 0 ]; do [ "$1" = "-p" ] && P=$2; shift; done\n'
                           "printf '\\n\\n%s' \"$P\"; echo ' some text'\n"
                           "echo 'decoded   16 tokens in    2.000 seconds, speed:    8.000 t/s' >&2\n"
                           "echo 'n_drafted = 10' >&2\necho 'n_accept  = 7' >&2\n")
# an older llama-bench, or another program's JSON: it answers, but at depth 0 whatever -d asked
DEPTHLESS_LLAMA_BENCH = 'echo \'[{"n_depth": 0, "n_gen": 4, "avg_ts": 20.5, "stddev_ts": 0.3}]\'\n'


@pytest.mark.parametrize("output", ["--json", "--csv", "--markdown"])
def test_a_llama_bench_without_the_prompts_depth_is_a_note_and_ggufspecs_rows_are_printed(tiny, tmp_path, output):
    bin_dir = fake_llama_cpp(tmp_path / "bin", llama_bench=DEPTHLESS_LLAMA_BENCH,
                             llama_speculative_simple=GOOD_SPECULATIVE_SIMPLE)
    r = compare(tiny, bin_dir, output)
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "Error" not in r.stderr
    notes = [line for line in stderr_lines(r.stderr) if line.startswith("note: ")]
    assert any(re.fullmatch(r"note: llama-bench printed no result at depth \d+ \(depth 0 only: too old for -d\? .*\); "
                            r"llama-bench's row is left out", n) for n in notes), notes
    if output == "--json":
        labels = [row["label"] for row in json.loads(r.stdout)["rows"]]
    elif output == "--csv":
        labels = [row["label"] for row in csv.DictReader(io.StringIO(r.stdout))]
    else:
        labels = [cell.split("|")[1].strip() for cell in r.stdout.splitlines()[2:] if cell.startswith("|")]
    assert labels[:2] == ["target", "lookup"]
    assert "llama.cpp speculative-simple, draft model (draft-max 2)" in labels  # the other reference rows stand
    assert not any("llama-bench" in label for label in labels)


def test_a_hanging_llama_cpp_program_is_stopped_at_the_time_limit_and_not_called_again(tiny, tmp_path, monkeypatch):
    bin_dir = fake_llama_cpp(tmp_path / "bin", llama_bench=GOOD_LLAMA_BENCH,
                             llama_speculative_simple=f'echo x >> {tmp_path / "calls"}\nexec sleep 60\n')
    monkeypatch.setenv("GGUFSPEC_LLAMA_CPP_TIMEOUT", "1")
    start = time.monotonic()
    r = compare(tiny, bin_dir, "--json")
    assert r.exit_code == 0, r.output
    assert time.monotonic() - start < 30
    assert (tmp_path / "calls").read_text() == "x\n"  # three configurations, one wait
    assert [row["mode"] for row in json.loads(r.stdout)["rows"]] == ["target", "lookup", "llama-bench"]
    assert "note: llama-speculative-simple gave no result in 1 s and was stopped (GGUFSPEC_LLAMA_CPP_TIMEOUT" in r.stderr
    monkeypatch.setenv("GGUFSPEC_LLAMA_CPP_TIMEOUT", "soon")
    one_line(compare(tiny, bin_dir), "GGUFSPEC_LLAMA_CPP_TIMEOUT='soon'")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_llama_cpp_runs_keeps_the_rows(tiny, tmp_path, signum):
    """Ctrl-C or SIGTERM while llama.cpp's programs run after ggufspec's: the finished rows are printed and the
    texts saved (exit 130/143), and the program is stopped with us."""
    started = tmp_path / "started"
    bin_dir = fake_llama_cpp(tmp_path / "bin", llama_bench=GOOD_LLAMA_BENCH,
                             llama_speculative_simple=f'echo $$ > {started}.tmp; mv {started}.tmp {started}\nexec sleep 60\n')
    outputs = tmp_path / "texts"
    proc = subprocess.Popen([sys.executable, "-m", "ggufspec", "bench", "-m", str(tiny["target"]), "--modes",
                             "target,lookup", "-n", "4", "--suite", "code", "--limit", "1", "--compare-llama-cpp",
                             str(bin_dir), "--save-outputs", str(outputs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + TIMEOUT
    while not started.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert started.exists(), proc.communicate()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 128 + signum, err
    said = "interrupted" if signum == signal.SIGINT else "terminated"
    assert f"{said}: showing the finished runs" in err.decode() and "Traceback" not in err.decode()
    assert "target" in out.decode() and "lookup" in out.decode() and "llama.cpp llama-bench" in out.decode()
    assert [p.name for p in outputs.iterdir()] == ["code-0.md"]
    with pytest.raises(ProcessLookupError):  # the program was stopped with the run
        os.kill(int(started.read_text()), 0)


def test_a_prompt_that_fills_the_context_with_n_tokens_is_refused_before_anything_runs(tiny, tmp_path):
    """Every prompt and -n tokens must fit: one line names the longest prompt that does not (it once ended the
    run halfway, every finished row lost)."""
    f = tmp_path / "p.txt"
    f.write_text("short\n" + "a long prompt " * 4 + "\n")  # with the chat template: 25 and 76 tokens
    line = one_line(run("bench", "-m", tiny["target"], "--prompts", f, "-c", 100, "-n", 40),
                    f"prompt p-1 ({f}, line 2) is", "with -n 40 it needs a context of", "raise -c to")
    assert "lower -n to" in line


def test_speedups_after_an_interrupt_compare_the_prompts_both_rows_finished(tiny):
    """Interrupted after the target's run of the second prompt: lookup has one prompt, the target two. Lookup's
    speed-up is over the first prompt alone, and its row says it is partial."""
    from ggufspec.bench.benchmark import benchmark
    from ggufspec.bench.report import bench_table
    from ggufspec.bench.prompts import load_suite
    from ggufspec.bench.runs import BenchSettings
    from ggufspec.models.resolve import LoadOptions

    def stop(progress):
        if progress.done == 5:  # warm-up 2, then target and lookup on code-0, then target on code-1
            raise KeyboardInterrupt

    prompts = load_suite("code")[:2]
    result = benchmark(LoadOptions(target=str(tiny["target"])), prompts,
                       BenchSettings(("target", "lookup"), max_tokens=8), progress=stop)
    assert result.interrupted
    target, lookup = result.rows
    assert (target["n_prompts"], lookup["n_prompts"]) == (2, 1)
    assert (target["partial"], lookup["partial"]) == (False, True)
    assert "lookup (partial)" in bench_table(result.rows, grouped=False)
    assert any("lookup finished fewer runs" in n for n in result.meta["notes"])
    # lookup's speed-up is against the target's speed on code-0 alone, not on both prompts
    assert lookup["speedup"] != pytest.approx(lookup["tokens_per_second"] / target["tokens_per_second"])


def test_bench_prompts_with_a_role_no_template_renders(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "sytem", "content": "be brief"}, {"role": "user", "content": "x"}]}\n')
    one_line(run("bench", "-m", tiny["target"], "--prompts", f), "p.jsonl, line 2: messages[0]", "'sytem'")


def test_bench_chat_prompts_on_a_model_without_a_template(tiny, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    line = one_line(run("bench", "-m", tiny["same"], "--prompts", f, "-n", 4), f"p-1 ({f}, line 2)",
                    "no chat template", "`prompt` string")
    assert "-p" not in line.split(": ", 1)[1] and "--chat" not in line


# -- bench --concurrency: the same checks as plain bench, before a server starts ---------------------------------

def refused(result, *needles) -> str:
    """`one_line`, past the notes a busy machine's cost measuring may print first ("ggufspec: ... do not add up ...")."""
    from types import SimpleNamespace

    stderr = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("ggufspec: "))
    return one_line(SimpleNamespace(exit_code=result.exit_code, exception=result.exception, stderr=stderr), *needles)


SAME_LINE = [(["-n", 1], "-n must be at least 2 (got 1)"),
             (["--modes", "bogus"], "--modes: unknown mode 'bogus'; choose from target, draft-alone"),
             (["--temp", -1], "--temp must be a finite number >= 0 (got -1.0)"),
             (["--repeats", 0], "--repeats must be at least 1"),
             (["--draft-max", "1,,2"], "--draft-max has an empty item (got '1,,2')"),
             (["--modes", "draft"], "--modes draft needs a draft model"),
             (["--modes", "mtp"], "--modes mtp needs a target with MTP (NextN) layers; target.gguf has none"),
             (["-c", 8], "raise -c")]


@pytest.mark.parametrize("args,needle", SAME_LINE, ids=[" ".join(map(str, a)) for a, _ in SAME_LINE])
def test_bench_and_its_concurrency_refuse_a_bad_setting_in_the_same_line(tiny, args, needle):
    """--concurrency took these (it ran, or failed with the server's bare 400): now each is plain bench's line."""
    base = ["bench", "-m", tiny["target"], "-ngl", 0, "--suite", "code", "--limit", 1, "-n", 4]
    plain = refused(run(*base, *args), needle)
    assert refused(run(*base, *args, "--concurrency", 2), needle) == plain


def test_what_only_concurrency_refuses_is_one_line(tiny):
    base = ["bench", "-m", tiny["target"], "-ngl", 0, "--suite", "code", "--limit", 1, "-n", 4]
    refused(run(*base, "--concurrency", "1,,2"), "--concurrency has an empty item (got '1,,2')")
    refused(run(*base, "--concurrency", "1,2,"), "--concurrency has an empty item")
    refused(run(*base, "--concurrency", 1, "--temp", 0.5), "--concurrency sends greedy fixed-length requests")
    refused(run(*base, "--concurrency", 1, "-md", tiny["close"], "--modes", "target,draft-alone"),
            "--modes draft-alone: bench --concurrency runs", "target, lookup, draft, mtp, eagle3, dflash, auto")


def test_concurrency_with_c_too_small_for_a_prompt_is_one_line_before_the_server(tiny, tmp_path):
    """-c is each sequence's context: a prompt and -n that do not fit it are refused as plain bench refuses them
    (the server refused each request instead)."""
    f = tmp_path / "p.txt"
    f.write_text("short\n" + "a long prompt " * 4 + "\n")
    refused(run("bench", "-m", tiny["target"], "-ngl", 0, "--prompts", f, "-c", 100, "-n", 60, "--concurrency", 2),
            f"prompt p-1 ({f}, line 2) is", "with -n 60 it needs a context of", "more than -c 100", "raise -c to")


def test_concurrency_sizes_the_context_from_the_prompts_tokens(tiny):
    """A prompt of more tokens than its characters / 2 (the tiny model's byte tokens) once outgrew the context
    estimated for it, and the server refused the request; the context is sized again from the tokens."""
    r = run("bench", "-m", tiny["target"], "-ngl", 0, "--suite", "summarize", "--limit", 1, "-n", 4, "--modes",
            "target", "--concurrency", 1, "--json")
    assert r.exit_code == 0, r.output
    assert [(row["config"], row["tokens"]) for row in json.loads(r.stdout)["rows"]] == [("ggufspec target", 4)]


def test_concurrency_with_speculation_off_alone_runs_the_server_serve_runs(tiny):
    """`--modes target` alone once loaded without the measured costs, which `ggufspec serve` always has: every shared
    step's rows were then judged as a batch that is not exact, near-ties decoded again one by one (the Q8_0 target at
    eight requests: 70 extra one-token decodes, 17.7 against 25.0 tok/s), a slower server than the one users run."""
    from ggufspec.bench.concurrency import fitted_engine
    from ggufspec.bench.prompts import load_prompts
    from ggufspec.models.resolve import LoadOptions

    engine = fitted_engine(LoadOptions(target=str(tiny["target"]), n_gpu_layers=0), load_prompts(None, "code", 1),
                           ("target",), (1, 2), 4, None)
    with engine:
        assert engine.costs is not None  # which shared rows are exact: serve's Batch decodes them without re-checks


def test_a_request_the_server_refuses_shows_the_servers_message():
    """The server's one line (OpenAI's error body) is what the client says, not urllib's 'Bad Request'; a body of
    another shape leaves the status's own text."""
    import http.server
    import threading

    from ggufspec.bench.concurrency import ask
    from ggufspec.errors import GGUFSpecError

    answers = {"/openai": (400, b'{"error": {"message": "the prompt is 900 tokens; a request may use 512", '
                                b'"type": "invalid_request_error", "code": 400}}'),
               "/other": (503, b"<html>down</html>")}

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers[self.path]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(GGUFSpecError) as refused:
            ask(url, 0, "/openai", {"prompt": "x"}, timeout=30)
        assert str(refused.value) == (f"{url}/openai: the server refused the request (HTTP 400): the prompt is 900 "
                                      "tokens; a request may use 512")
        with pytest.raises(GGUFSpecError) as other:
            ask(url, 0, "/other", {"prompt": "x"}, timeout=30)
        assert str(other.value) == f"{url}/other: the server refused the request (HTTP 503): Service Unavailable"
    finally:
        server.shutdown()
        server.server_close()


def test_llama_cpps_rows_run_at_the_engines_placement(monkeypatch):
    """On a GPU, llama-bench would put every layer there and speculative-simple fit its own split: both get the
    engine's -ngl / -ngld / --n-cpu-moe (llama.cpp's spelling); on a machine without a GPU, or a target on RPC
    servers, nothing is added."""
    from types import SimpleNamespace

    from ggufspec.bench import reference
    from ggufspec.llama import devices

    def engine(ngl, ngld, moe=0, rpc=None):
        target = SimpleNamespace(devices=rpc, n_gpu_layers=ngl, cpu_moe=moe, info=SimpleNamespace(n_layers=48))
        return SimpleNamespace(target_model=target, draft_model=SimpleNamespace(n_gpu_layers=ngld), head_model=None)

    monkeypatch.setattr(devices, "local_gpus", lambda: {"CUDA0": 24 << 30})
    seed = engine(47, -1)
    assert reference.placement(seed, "llama-bench") == ("-ngl", "47")
    assert reference.placement(seed, "llama-speculative-simple") == ("-ngl", "47", "-fit", "off", "-ngld", "all")
    moe = engine(-1, 0, moe=-1)
    assert reference.placement(moe, "llama-bench") == ("-ngl", "-1", "-ncmoe", "48")
    assert reference.placement(moe, "llama-speculative-simple") == ("-ngl", "all", "-ncmoe", "48", "-fit", "off",
                                                                    "-ngld", "0")
    assert reference.placement(engine(47, -1, rpc=["RPC0"]), "llama-bench") == ()
    monkeypatch.setattr(devices, "local_gpus", lambda: {})
    assert reference.placement(seed, "llama-speculative-simple") == ()


def _served(config, n, rate, first, identical=1, drafted=0, accepted=0):
    return {"config": config, "concurrency": n, "requests": 1, "tokens": 64, "seconds": 64 / rate,
            "aggregate_tokens_per_second": rate, "request_tokens_per_second": rate + 1, "first_token_seconds": first,
            "drafted": drafted, "accepted": accepted, "identical": identical}


def test_repeated_rounds_are_one_row_each_with_the_median_and_the_spread():
    """--repeats with --concurrency: each (config, N) is one row, in the first round's order, its rates the median
    of the rounds, its counts summed; a row one round lacks (a server that failed to start) is merged from the
    rounds that have it."""
    from ggufspec.bench.concurrency import merged

    rounds = [[_served("ggufspec target", 1, 10.0, 0.5), _served("llama-server", 1, 12.0, 0.4)],
              [_served("ggufspec target", 1, 14.0, 0.7, drafted=4, accepted=3)],
              [_served("ggufspec target", 1, 11.0, 0.6, identical=0), _served("llama-server", 1, 9.0, 0.2)]]
    target, server = merged(rounds)
    assert (target["config"], target["runs"], target["aggregate_tokens_per_second"]) == ("ggufspec target", 3, 11.0)
    assert (target["aggregate_min"], target["aggregate_max"], target["first_token_seconds"]) == (10.0, 14.0, 0.6)
    assert (target["requests"], target["identical"], target["drafted"], target["accepted"]) == (3, 2, 4, 3)
    assert (server["runs"], server["aggregate_tokens_per_second"], server["first_token_seconds"]) == (2, 10.5, 0.3)
    assert merged(rounds[:1]) == rounds[0]


def test_the_footer_weighs_auto_against_the_faster_llama_server_and_off_against_the_plain_one():
    from ggufspec.bench.concurrency import against_llama_server

    rows = [_served("ggufspec target", 1, 9.0, 0.5), _served("ggufspec auto", 1, 10.0, 0.4),
            _served("llama-server", 1, 10.0, 0.3), _served("llama-server + draft", 1, 12.5, 0.6),
            _served("ggufspec target", 2, 15.0, 0.9), _served("ggufspec auto", 2, 15.0, 0.9)]
    assert against_llama_server(rows) == [
        "N=1: ggufspec auto 0.80x of llama-server + draft (the faster), first token 0.40 s against 0.60 s; "
        "ggufspec target 0.90x of llama-server, first token 0.50 s against 0.30 s"]  # N=2: no llama-server row


def test_concurrency_rounds_take_turns_with_llama_server(monkeypatch):
    """--concurrency --repeats: every other round runs llama-server's first and ggufspec's modes in the other
    order, so a drift within the hour favours neither server nor any mode's place; rows stay in the first
    round's order."""
    from ggufspec.bench import concurrency
    from ggufspec.bench.runs import BenchSettings

    calls = []

    def ours(load, prompts, settings, levels, slot_ctx, reference, note, reverse=False):
        calls.append(f"ggufspec reversed={reverse}")
        modes = ["target", "auto"][::-1] if reverse else ["target", "auto"]
        return [_served(f"ggufspec {m}", 1, 10.0, 0.5) for m in modes], (("T.gguf", None), 0, 2, 512)

    def theirs(bin_dir, target, draft, prompts, levels, max_tokens, slot, threads, ngl, reference, note, body):
        calls.append(f"llama-server {target} -t {threads} -c {slot}")
        return [_served("llama-server", 1, 12.0, 0.4)]

    monkeypatch.setattr(concurrency, "ggufspec_rows", ours)
    monkeypatch.setattr(concurrency, "llama_server_rows", theirs)
    settings = BenchSettings(modes=("target", "auto"), max_tokens=4, repeats=3, ignore_eos=True)
    result = concurrency.concurrency_bench(None, [], settings, (1,), llama_cpp_bin="bin")
    llama = "llama-server T.gguf -t 2 -c 512"
    assert calls == ["ggufspec reversed=False", llama, llama, "ggufspec reversed=True", "ggufspec reversed=False", llama]
    assert [r["config"] for r in result["rows"]] == ["ggufspec target", "ggufspec auto", "llama-server"]
    assert [r["runs"] for r in result["rows"]] == [3, 3, 3] and result["meta"]["threads"] == 2


def test_concurrency_repeats_run_each_round_and_show_the_spread(tiny):
    r = run("bench", "-m", tiny["target"], "-ngl", 0, "--suite", "code", "--limit", 1, "-n", 4, "--modes",
            "target", "--concurrency", 1, "--repeats", 2)
    assert r.exit_code == 0, r.output
    head, line = r.stdout.splitlines()[:3:2]
    assert "min-max" in head.split() and line.split()[:4] == ["ggufspec", "target", "1", "2"], r.stdout
    assert "each row the median of 2 runs taking turns" in r.stdout


def test_llama_cpps_runs_take_turns_with_ggufspecs_on_each_prompt_and_repeat(tiny, tmp_path, monkeypatch):
    """On a VM whose speed moves by a quarter within minutes, llama.cpp's rows run after all of ggufspec's met
    another machine. Each speculative-simple configuration is one more turn on every prompt, the order reversed
    every other repeat, and --repeats gives its row a median and range as ggufspec's rows have."""
    from ggufspec.bench import runs as bench_runs

    log = tmp_path / "calls"
    bin_dir = fake_llama_cpp(tmp_path / "bin", llama_bench=GOOD_LLAMA_BENCH, llama_speculative_simple=(
        'while [ $# -gt 0 ]; do [ "$1" = "--spec-type" ] && T=$2; [ "$1" = "-p" ] && P=$2; shift; done\n'
        f'N=$(wc -l < {log} 2>/dev/null || echo 0); echo "spec $T" >> {log}\n'
        "printf '%s' \"$P\"; echo ' text'\n"
        'echo "decoded   16 tokens in    $((1 + N % 2)).000 seconds, speed: 8.0 t/s" >&2\n'
        "echo 'n_drafted = 10' >&2\necho 'n_accept  = 7' >&2\n"))
    real = bench_runs.run_one

    def ours(engine, config, tokens, settings):
        with log.open("a") as f:
            f.write(f"ours {config.mode}\n")
        return real(engine, config, tokens, settings)

    monkeypatch.setattr(bench_runs, "run_one", ours)
    from ggufspec.bench.benchmark import benchmark
    from ggufspec.bench.runs import BenchSettings
    from ggufspec.models.resolve import LoadOptions

    prompts = load_suite("code")[:2]
    result = benchmark(LoadOptions(target=str(tiny["target"])), prompts,
                       BenchSettings(modes=("target", "lookup"), max_tokens=4, repeats=2, warmup=0),
                       llama_cpp_bin=str(bin_dir))
    calls = log.read_text().split("\n")[:-1]
    ngram = [f"spec {t}" for t in ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")]
    one_prompt = ["ours target", "ours lookup", *ngram]
    assert calls == one_prompt * 2 + one_prompt[::-1] * 2  # per prompt, ggufspec's and llama.cpp's turns
    ref = next(r for r in result.rows if r["mode"] == "llama.cpp-ngram-simple")
    assert ref["repeats"] == 2 and ref["n_generated"] == 64 and ref["n_asked"] == 16
    # calls 3 and 9 (1 s each: 32 tokens in 2 s), then 16 and 22 of the reversed repeat (2 s each: in 4 s)
    assert (ref["tokens_per_second"], ref["tokens_per_second_min"], ref["tokens_per_second_max"]) == (12, 8, 16)
    from ggufspec.bench.report import bench_footer
    from ggufspec.llama.backend import machine

    cpu = machine()["summary"]["cpu"]  # every figure with the CPU it was measured on
    assert bench_footer(result.meta).startswith(f"{cpu}, {result.meta['threads']} thread")
