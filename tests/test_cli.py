"""The CLI through CliRunner: output formats, and one clear line for every bad input."""

import os

from clirun import ggufspec, one_line, run, stderr_lines
import json
import re

import pytest

from ggufspec.costs import MAX_BATCH


def test_generate_json_is_one_object(tiny):
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hello", "-n", "12", "--ignore-eos", "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert len(data["tokens"]) == 12
    for key in ("n_drafted", "n_accepted", "acceptance_rate", "tokens_per_second", "n_generated"):
        assert key in data["stats"]
    assert data["stats"]["n_generated"] == 12


def test_generate_streams_text_then_stats(tiny):
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hello", "-n", "12", "--ignore-eos")
    assert r.exit_code == 0, r.output
    assert "12 tokens in" in r.stderr and "tok/s" in r.stderr


def test_generate_same_text_with_and_without_draft(tiny):
    base = json.loads(run("generate", "-m", tiny["target"], "-p", "hi there", "-n", "30", "--ignore-eos", "--json").stdout)
    spec = json.loads(run("generate", "-m", tiny["target"], "-md", tiny["far"], "-p", "hi there", "-n", "30",
                          "--ignore-eos", "--mode", "draft", "--json").stdout)
    assert spec["tokens"] == base["tokens"] and spec["text"] == base["text"]
    assert spec["stats"]["n_drafted"] > 0


def test_prompt_from_file_and_chat(tiny, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("hello")
    assert run("generate", "-m", tiny["target"], "-f", f, "-n", "3", "--json").exit_code == 0
    assert run("generate", "-m", tiny["target"], "--chat", "hi", "-n", "3", "--json").exit_code == 0


def test_missing_file(tiny, tmp_path):
    one_line(run("generate", "-m", tmp_path / "nope.gguf", "-p", "x"), "nope.gguf", "no such file")


def test_not_a_gguf(tmp_path):
    f = tmp_path / "notes.gguf"
    f.write_text("just text")
    one_line(run("generate", "-m", f, "-p", "x"), "notes.gguf", "not a GGUF")


@pytest.mark.parametrize("command", [
    ["generate", "-m", "{fifo}", "-p", "x"], ["generate", "-m", "{target}", "-md", "{fifo}", "-p", "x"],
    ["models", "info", "{fifo}"], ["models", "check", "{target}", "{fifo}"], ["costs", "-m", "{fifo}"],
    ["bench", "-m", "{target}", "-md", "{fifo}"],
])
def test_a_fifo_is_refused_before_anything_opens_it(tiny, tmp_path, command):
    """Opening a FIFO blocks until something writes to it: a process of its own, so a hang fails the test."""
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    r = ggufspec(*[a.format(fifo=fifo, target=tiny["target"]) for a in command], timeout=60)
    assert r.returncode == 1 and stderr_lines(r.stderr) == [
        f"Error: {fifo}: not a regular file (a pipe, socket or device); give the path of a .gguf file"], r.stderr


def test_bytes_that_are_not_utf8_on_the_command_line_are_run_as_given(tiny, tmp_path):
    """Linux hands a program bytes: a file name or a prompt in Latin-1 is valid input (Python holds such bytes
    as surrogates; llama.cpp gets them back as they were)."""
    name = tmp_path / os.fsdecode(b"caf\xe9.gguf")
    name.write_bytes(open(tiny["target"], "rb").read())
    prompt = os.fsdecode(b"caf\xe9")
    latin = ggufspec("generate", "-m", name, "-p", prompt, "-n", 3, "--json", errors="surrogateescape")
    assert latin.returncode == 0, latin.stderr
    utf8 = ggufspec("generate", "-m", tiny["target"], "-p", "caf\u00e9", "-n", 3, "--json")
    # the prompt's bytes reached the tokenizer as given: é in Latin-1 is one byte, in UTF-8 two
    assert json.loads(latin.stdout)["n_prompt"] == json.loads(utf8.stdout)["n_prompt"] - 1
    info = ggufspec("models", "info", name, errors="surrogateescape")
    assert info.returncode == 0 and os.fsencode(name.name) in os.fsencode(info.stdout)  # the name's own bytes
    missing = ggufspec("generate", "-m", tmp_path / os.fsdecode(b"x\xe9.gguf"), "-p", "hi", errors="surrogateescape")
    assert missing.returncode == 1 and len(stderr_lines(missing.stderr)) == 1 and "no such file" in missing.stderr


def test_truncated_gguf(tiny, tmp_path):
    f = tmp_path / "cut.gguf"
    data = open(tiny["target"], "rb").read()
    f.write_bytes(data[: len(data) // 2])
    one_line(run("generate", "-m", f, "-p", "x"), "cut.gguf", "truncated")


def test_damaged_header(tiny, tmp_path):
    f = tmp_path / "bad.gguf"
    data = bytearray(open(tiny["target"], "rb").read())
    data[24:32] = b"\xff" * 8  # the first key's length: now absurd
    f.write_bytes(bytes(data))
    one_line(run("generate", "-m", f, "-p", "x"), "bad.gguf", "damaged")


def test_a_draft_of_another_vocabulary_drafts_through_text(tiny):
    args = ("generate", "-m", tiny["target"], "-p", "ab cd", "-n", 40, "--ignore-eos")
    alone = run(*args, "--mode", "target")
    drafted = run(*args, "-md", tiny["other_vocab"], "--mode", "draft", "--draft-max", 3)  # the same texts at other ids
    assert alone.exit_code == drafted.exit_code == 0, drafted.output
    assert drafted.stdout == alone.stdout and "drafted " in drafted.stderr, drafted.stderr


def test_a_draft_whose_tokenizer_would_abort_on_the_targets_text_is_one_line(tiny):
    """16 tokens and no byte tokens: llama.cpp's tokenizer throws (inside C code) on any text it has no token for."""
    one_line(run("generate", "-m", tiny["target"], "-md", tiny["letters"], "-p", "x"),
             "letters.gguf cannot draft for", "no token for 244 of the 256 bytes", "pick a draft with byte tokens")


def test_prompt_longer_than_context(tiny):
    one_line(run("generate", "-m", tiny["target"], "-c", "16", "-p", "x" * 100), "longer than the context")


def test_context_fills_mid_generation(tiny):
    one_line(run("generate", "-m", tiny["target"], "-md", tiny["close"], "-c", "32", "-p", "hello",
                              "-n", "100", "--ignore-eos"), "context filled up")


@pytest.mark.parametrize("args, needle", [
    (["--draft-max", "0"], "--draft-max"),
    (["--draft-max", "x"], "--draft-max"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--min-p", "1"], "--min-p"),
    (["--top-k", "-2"], "--top-k"),
    (["-n", "0"], "-n"),
    (["--draft-min", "5", "--draft-max", "2"], "--draft-min"),
    (["--draft-p-min", "1.2"], "--draft-p-min"),
    (["--lookup-max", "0"], "--lookup-max"),
    (["-c", "4"], "-c"),
    (["-t", "0"], "-t"),
    (["--mode", "magic"], "--mode"),
    (["--mode", "draft"], "draft model"),
    (["-ngl", "-3"], "negative"),
    (["-ngl", "lots"], "layer count"),
    (["-ngl", str(2**32)], "must be at most 2147483647"),  # through the 32-bit field it would offload nothing
    (["-ngld", str(2**32 + 1)], "must be at most 2147483647"),
])
def test_out_of_range_settings(tiny, args, needle):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", *args), needle)


@pytest.mark.parametrize("args", [["--top-p", "0"], ["--mode", "magic"], ["--mode", "target", "-n", "2"]])
def test_nothing_is_measured_for_a_refused_setting_or_the_target_alone(tiny, monkeypatch, args):
    """A bad value is one line before any model loads (a busy machine's measuring notes once came first); the
    target alone verifies nothing, so its costs are not measured either."""
    from ggufspec.llama import measure

    measured = []
    monkeypatch.setattr(measure, "measure_target_sanely", lambda ctx, *a: measured.append(ctx) or 1 / 0)
    r = run("generate", "-m", tiny["target"], "-p", "hi", *args)
    assert measured == [] and (r.exit_code == 0) == ("target" in args), r.output


def test_generate_and_costs_take_llama_cpps_kv_cache_flags(tiny, tmp_path):
    """-ctv once read as `-c tv` (and plan printed flags generate refused): the flags plan prints run."""
    from tiny import write_tiny_model

    wide = write_tiny_model(tmp_path / "wide.gguf", n_embd=128)
    r = run("generate", "-m", wide, "-p", "hi", "-n", 4, "--mode", "target", "-ctk", "q8_0", "-ctv", "q8_0")
    assert r.exit_code == 0, r.output
    r = run("costs", "-m", wide, "-c", 256, "--cache-type-k", "q4_0", "--cache-type-v", "q8_0", "--json")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args", [["--mode", "target"], ["-md", "close", "--mode", "draft", "--temp", "0.8"]])
def test_a_model_whose_weights_are_nan_is_one_line(tiny, tmp_path, args):
    """It once wrote token 0 forever (greedy), or accepted the draft's tokens with numpy's RuntimeWarning (sampled)."""
    import warnings

    from tiny import write_tiny_model

    nan = write_tiny_model(tmp_path / "nan.gguf", logit_scale=float("nan"))
    args = [tiny["close"] if a == "close" else a for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        one_line(run("generate", "-m", nan, "-p", "hi", "-n", 8, *args), "the target's logits are not finite")


def test_a_batch_of_one_says_that_it_switches_drafting_off(tiny):
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 8, "-b", 1, "--mode", "draft")
    assert r.exit_code == 0 and "-b/--batch-size 1 leaves no room to verify a draft" in r.stderr, r.output
    assert "--mode draft runs as the target alone; use -b 2 or more" in r.stderr


def test_one_thread_is_singular(tiny):
    r = run("costs", "-m", tiny["target"], "-c", 64, "-t", 1)
    assert r.exit_code == 0 and "1 thread:" in r.stdout, r.output


def test_prompt_sources_are_exclusive(tiny):
    one_line(run("generate", "-m", tiny["target"], "-p", "a", "--chat", "b"), "exactly one")
    one_line(run("generate", "-m", tiny["target"]), "exactly one")


def test_chat_without_template(tiny):
    one_line(run("generate", "-m", tiny["close"], "--chat", "hi"), "no chat template")


def test_costs_reports_the_measured_table_and_where_drafting_pays(tiny):
    r = run("costs", "-m", tiny["target"], "-md", tiny["close"], "-c", 256, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    seconds = out["target_batch_seconds"]
    assert len(seconds) == MAX_BATCH and all(t > 0 for t in seconds)
    assert len(set(seconds[16:24])) == 1 and seconds[16] == seconds[23]  # 17-23 untimed: a batch of 24's time
    assert out["exact_batch"] >= 1 and out["draft_token_seconds"] > 0
    assert set(out["drafters"]) == {"lookup", "draft model"}
    assert out["deep_rows"][0] == 256 - 16 - 1 and out["deep_rows"][1] >= 0  # rows timed as deep as -c 256 allows
    assert out["drift"] is not None and out["tie_margin"] == max(0.5, 2 * out["drift"])  # no batch exact: measured
    for d in out["drafters"].values():
        assert d["break_even_alpha"] is None or 0 < d["break_even_alpha"] <= 1
        assert d["speedup_if_always_right"] <= out["ceiling_speedup"] + 1e-9  # drafting is never free-er than free
    r = run("costs", "-m", tiny["target"], "-c", 256, "--refresh")
    assert r.exit_code == 0, r.output
    assert "tokens / steps" in r.output and "lookup:" in r.output and "with 239 tokens cached a verified row" in r.output
    assert re.search(r"a batched row whose top-2 gap is under [0-9.]+ is decoded again by itself \((the default "
                     r"margin; the drift measured here, [0-9.e-]+, asks no more|2 x the drift measured here, [0-9.]+)\)",
                     r.output), r.output  # --refresh measured the drift again: either reason


def test_costs_with_a_missing_model_is_one_line(tmp_path):
    one_line(run("costs", "-m", tmp_path / "nope.gguf"), "nope.gguf", "no such file")


@pytest.mark.parametrize("threads", [0, 100000, 5000])
def test_thread_counts_are_bounded(tiny, threads):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "-n", 4, "-t", threads), "-t/--threads must be between 1 and")


def test_a_seed_out_of_range_names_the_range(tiny):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "-s", 2**63), "between 0 and 2**63-1")


def test_an_empty_stop_string_is_refused(tiny):
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--stop", ""), "--stop", "non-empty")


def test_llama_cpps_current_flag_names(tiny):
    def tokens(*args):
        r = run("generate", "-m", tiny["target"], "-p", "hello world", "-n", 30, "--ignore-eos", "--json", *args)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)

    ours = tokens("-md", tiny["close"], "--mode", "draft", "--draft-max", 3, "--draft-min", 1)
    theirs = tokens("--spec-draft-model", tiny["close"], "--spec-type", "draft-simple", "--spec-draft-n-max", 3,
                    "--spec-draft-n-min", 1)
    assert theirs["tokens"] == ours["tokens"] and theirs["stats"]["mode"] == "draft"
    assert tokens("--spec-type", "ngram-simple")["stats"]["mode"] == "lookup"
    assert tokens("--spec-type", "none")["stats"]["mode"] == "target"
    assert tokens("-md", tiny["close"], "--spec-type", "draft-simple,ngram-simple")["stats"]["mode"] == "auto"
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--spec-type", "ngram-mod"), "ngram-mod",
             "does not have", "--mode lookup")
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--spec-type", "magic"), "'magic'")
    one_line(run("generate", "-m", tiny["target"], "-p", "hi", "--spec-type", "draft-simple", "--mode", "lookup"),
             "means --mode draft")
    help_text = run("generate", "--help").output
    for flag in ("--draft-max", "--spec-draft-n-max", "--spec-type", "--spec-draft-model", "--sampling-rule"):
        assert flag in help_text


def test_a_symlink_loop_names_the_cause(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    one_line(run("generate", "-m", "loop1", "-p", "hi"), "loop1", "symbolic links")
    os.symlink(tmp_path / "nowhere.gguf", "dangling")
    one_line(run("generate", "-m", "dangling", "-p", "hi"), "dangling")


@pytest.mark.parametrize("port", [70000, -1, 0])
def test_rpc_server_port_out_of_range(port):
    one_line(run("rpc-server", "--port", port), "range")


def test_rpc_server_threads_out_of_range():
    one_line(run("rpc-server", "-t", 100000), "-t/--threads")
