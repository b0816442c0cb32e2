"""llama.cpp's own programs as reference rows in `ggufspec bench --compare-llama-cpp BIN_DIR`.

Runs llama-bench (target-only generation speed) and llama-speculative-simple (draft-model and
n-gram speculation) on the same models, prompts, token count and threads, and parses what they
print. Build them from the same llama.cpp release as the installed llama-cpp-python, e.g. with
../shared/tools/llama-cpp-reference in this workplace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from ..errors import GGUFSpecError
from ..llama.runtime import warn


def _env(bin_dir: Path) -> dict:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{bin_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    return env


def _program(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not path.is_file() or not os.access(path, os.X_OK):
        raise GGUFSpecError(f"--compare-llama-cpp: {path} not found; build llama.cpp's tools and give their folder")
    return path


PROGRAMS = ("llama-bench", "llama-speculative-simple")
TIMEOUT_VARIABLE = "GGUFSPEC_LLAMA_CPP_TIMEOUT"
DEFAULT_TIMEOUT = 600.0  # seconds per call: llama-bench's five repetitions of a long -n on a slow CPU fit


def check_reference(bin_dir: str | Path) -> float:
    """Before anything runs: both programs are there, and the time limit per call they get (seconds)."""
    for name in PROGRAMS:
        _program(Path(bin_dir), name)
    return timeout()


def timeout() -> float:
    """Seconds one call of llama.cpp's programs may take: GGUFSPEC_LLAMA_CPP_TIMEOUT, else 600."""
    value = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_TIMEOUT
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise GGUFSpecError(f"{TIMEOUT_VARIABLE}={value!r}: give the seconds one call of llama.cpp's programs may take, "
                            f"e.g. {DEFAULT_TIMEOUT:.0f}")
    return seconds


class ProgramHung(GGUFSpecError):
    """llama.cpp's program ran past the time limit: it was killed, and is not called again."""


def _call(cmd: list[str], bin_dir: Path) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of one of llama.cpp's programs. It runs in a process group of its own,
    killed with whatever it started when it runs past the limit or when this process is stopped (Ctrl-C, SIGTERM)."""
    limit = timeout()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(bin_dir),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except BaseException as e:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # already gone
            pass
        proc.wait()
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
        if isinstance(e, subprocess.TimeoutExpired):
            raise ProgramHung(f"{Path(cmd[0]).name} gave no result in {limit:g} s and was stopped "
                              f"({TIMEOUT_VARIABLE} sets the limit)") from None
        raise
    return proc.returncode, out, err


def _last_line(text: str) -> str:
    return ([line.strip() for line in text.splitlines() if line.strip()][-1:] or ["nothing"])[0][:200]


def _parse_llama_bench(stdout: str, depths: tuple[int, ...]) -> dict[int, dict]:
    """llama-bench's JSON (-o json): one result per depth; anything else is one line."""
    try:
        data, _ = json.JSONDecoder().raw_decode(stdout, stdout.index("["))
        found = {int(d.get("n_depth", depth)): d for d, depth in zip(data, depths)}
    except (ValueError, TypeError, AttributeError):  # no JSON list of objects
        raise GGUFSpecError(f"llama-bench printed no JSON results (its output ends: {_last_line(stdout)!r})") from None
    missing = [d for d in depths if d not in found]
    if missing:
        printed = f"depth {', '.join(map(str, sorted(found)))} only" if found else "no results"
        raise GGUFSpecError(f"llama-bench printed no result at depth {missing[0]} ({printed}: too old for -d? build "
                            f"the llama.cpp release llama-cpp-python is built from)")
    try:
        return {d: {"tokens_per_second": float(found[d]["avg_ts"]),
                    "tokens_per_second_sd": float(found[d].get("stddev_ts", 0))} for d in depths}
    except (KeyError, ValueError, TypeError):
        raise GGUFSpecError(f"llama-bench printed results without a speed (avg_ts): {_last_line(stdout)!r}") from None


def llama_bench(bin_dir: Path, model: Path, n_tokens: int, threads: int, depths: tuple[int, ...] = (0,),
                placement: tuple[str, ...] = ()) -> dict[int, dict]:
    """Target-only generation speed as llama-bench measures it (tg N, 5 repetitions), after `depth`
    tokens in the cache (-d: ggufspec's runs generate after their prompt, and at 100 cached tokens a
    step costs some 5% more than in an empty cache). Returns {depth: {"tokens_per_second", ...}}.
    placement: llama-bench's flags for the engine's layers (`placement(engine, "llama-bench")`)."""
    depths = tuple(sorted(set(depths))) or (0,)
    cmd = [str(_program(bin_dir, "llama-bench")), "-m", str(model), "-p", "0", "-n", str(n_tokens), "-t", str(threads),
           "-d", ",".join(map(str, depths)), "-o", "json", *placement]
    code, out, err = _call(cmd, bin_dir)
    if code != 0:
        raise GGUFSpecError(f"llama-bench failed: {_last_line(err.decode('utf-8', 'replace'))}")
    return _parse_llama_bench(out.decode("utf-8", "replace"), depths)


def llama_bench_before(bin_dir: Path, model: Path, n_tokens: int, threads: int, depths: tuple[int, ...],
                       note, placement: tuple[str, ...] = ()) -> dict[int, dict] | None:
    """llama_bench() before ggufspec's runs; None, with one line through note(), where it fails: its row is then
    left out and ggufspec's own rows still run (a reference that fails never costs them)."""
    try:
        return llama_bench(bin_dir, model, n_tokens, threads, depths, placement)
    except GGUFSpecError as e:
        note(f"{e}; llama-bench's row is left out")
        return None


# llama.cpp's programs log through a thread of their own and may exit before it wrote the last lines (its
# common/log.cpp says so; on a loaded 2-core machine half the runs of a tiny model lost them, on an idle Zen 5 all
# but one to three in twelve lost everything after the first line): a run whose counts are missing is run again, at
# least LOST_LOG_TRIES times in all, and on while the runs are short (a tiny model's take some 40 ms), up to
# LOST_LOG_SECONDS of them or LOST_LOG_MOST runs.
LOST_LOG_TRIES, LOST_LOG_MOST, LOST_LOG_SECONDS = 6, 60, 5.0

# What speculative-simple's draft types draft with, in a row's label.
DRAFTERS = {"draft-mtp": "MTP layers", "draft-eagle3": "EAGLE-3 draft", "draft-dflash": "DFlash draft"}


def speculative_simple(bin_dir: Path, target: Path, draft: Path | None, prompt_text: str, n_tokens: int, threads: int,
                       n_ctx: int, draft_max: int, spec_type: str = "draft-simple", placement: tuple[str, ...] = ()) -> dict:
    """One greedy run of llama-speculative-simple; its own timing of the generation phase. The prompt is
    passed with --no-escape: by default llama.cpp's programs read a backslash sequence in -p as an escape,
    so a prompt of code holding `"\\n"` would be another prompt. placement: its flags for the engine's layers."""
    cmd = [str(_program(bin_dir, "llama-speculative-simple")), "-m", str(target), "-p", prompt_text, "-n", str(n_tokens),
           "--spec-type", spec_type, "--spec-draft-n-max", str(draft_max), "-t", str(threads), "--temp", "0",
           "-c", str(n_ctx), "--ignore-eos", "--no-escape", *ROUND_LOG, *placement]
    if draft is not None and spec_type.startswith("draft-"):  # draft-mtp's is a sibling mtp-*.gguf, where given
        cmd[3:3] = ["-md", str(draft)]
    start = time.monotonic()
    for attempt in range(1, LOST_LOG_MOST + 1):  # llama.cpp's log thread can lose the last lines at exit: run again
        code, stdout, stderr = _call(cmd, bin_dir)
        text = (stdout + stderr).decode("utf-8", "replace")
        m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
        if code != 0 or (m and re.search(r"n_accept\s*=", text)):
            break
        if attempt >= LOST_LOG_TRIES and time.monotonic() - start > LOST_LOG_SECONDS:
            break
    if code < 0:  # killed by a signal: its last line says nothing of why
        raise ProgramDied(f"llama-speculative-simple ({spec_type}) died of {_signal_name(-code)}")
    if code != 0 or not m:
        said = "printed no timing" if code == 0 else f"failed (exit {code})"
        raise GGUFSpecError(f"llama-speculative-simple ({spec_type}) {said}: {_last_line(text)}")
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", text)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", text)
    n_generated, seconds = int(m.group(1)), float(m.group(2))
    return {"n_generated": n_generated, "seconds": seconds,
            "n_drafted": int(drafted.group(1)) if drafted else 0, "n_accepted": int(accepted.group(1)) if accepted else 0,
            "seconds_to_n": seconds_to(text, n_tokens, n_generated, seconds),
            "text": generated_text(stdout, prompt_text.encode("utf-8", "surrogateescape"))}


# speculative-simple's loop stops after the round that passes -n, and a draft it asks for with no tokens left to
# draft (its budget -n minus what it has, minus one, is 0 once a round ends at -n or one short of it) is not cut:
# its n-gram drafters then verify a whole 48-64 token draft as the last round, which -n did not ask for (llama-server
# drafts nothing there). Its debug log (-lv 5) prints each round's accepted count, with a time: where the rounds
# are all there, a row counts the -n tokens asked over the time until the round that brought them ended.
ROUND_LOG = ("-lv", "5", "--log-timestamps", "--log-prefix")
_ROUND = re.compile(r"^(?:\x1b\[[0-9;]*m)?(\d+)\.(\d+)\.(\d+)\.(\d+)\S* (?:\x1b\[[0-9;]*m)?D (?:\x1b\[[0-9;]*m)?"
                    r"accepted (\d+)/(\d+) draft tokens", re.M)


def logged_rounds(log: str) -> list[tuple[float, int, int]]:
    """speculative-simple's rounds as its debug log (ROUND_LOG) prints them: (the line's time in seconds, drafts
    accepted, drafts made), in order."""
    return [(int(mi) * 60 + int(s) + int(ms) / 1e3 + int(us) / 1e6, int(kept), int(drafted))
            for mi, s, ms, us, kept, drafted in _ROUND.findall(log)]


def seconds_to(log: str, n_tokens: int, n_generated: int, seconds: float) -> float | None:
    """The seconds speculative-simple took until its round that brought the tokens to n_tokens ended: its whole
    time less the rounds after that one (by the log's times). None where the log does not show every round (their
    tokens do not add up to what it decoded)."""
    rounds = [(at, kept + 1) for at, kept, _ in logged_rounds(log)]
    if not rounds or sum(n for _, n in rounds) != n_generated:
        return None
    total = 0
    for at, n in rounds:
        total += n
        if total >= n_tokens:
            return max(0.0, seconds - (rounds[-1][0] - at))
    return seconds


class ProgramDied(GGUFSpecError):
    """llama.cpp's program was killed by a signal (it crashed): run again once, then leave its row out."""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _run_twice(run, warn):
    """run(), again if llama.cpp's program crashed (seen now and then with its n-gram drafters); None, with
    one line through warn, if it crashed twice."""
    for attempt in range(2):
        try:
            return run()
        except ProgramDied as e:
            if attempt:
                warn(f"{e} twice; its row is left out")
    return None


def generated_text(stdout, prompt_text):
    """What speculative-simple generated: its standard output after the prompt it echoes (None: not found);
    bytes from bytes (what is compared: two byte strings that are not UTF-8 may read the same once decoded)."""
    i = stdout.find(prompt_text)
    return None if i < 0 else stdout[i + len(prompt_text):]


def same_text(ours, theirs) -> bool | None:
    """Whether two greedy texts (str or bytes) of about the same length agree: the shorter is the longer's
    beginning (llama.cpp may print a round's accepted drafts past -n; in a str, a token cut mid-character
    prints as U+FFFD, dropped here). None where either is unknown or empty."""
    a, b = (None if t is None else t.rstrip().rstrip("\ufffd") if isinstance(t, str) else t.rstrip() for t in (ours, theirs))
    if not a or not b:
        return None
    return a.startswith(b) or b.startswith(a)


# llama.cpp's n-gram drafters as speculative-simple runs them: ngram-simple looks up the last 12 tokens
# and drafts up to the 48 that followed (--spec-ngram-simple-size-n/-m); ngram-map-k the same, keyed by the
# 12-gram alone, its 48-token continuation proposed once seen --spec-ngram-map-k-min-hits times (1); ngram-mod
# hashes 24-grams and drafts 48 to 64; ngram-cache drafts 8 from n-gram statistics of the context (its static
# and dynamic cache files are llama-lookup's and the server's options, not speculative-simple's). None reads
# --spec-draft-n-max, which is the draft model's.
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def reference_rows(bin_dir: str | Path, engine, groups: list[str], n_tokens: int, target_tps: dict[str, float | None],
                   *, into: list, note=warn, llama_bench_before: dict | None = None, llama_bench_again: bool = True,
                   depths: dict[str, int] | None = None, speculative=None) -> list[dict]:
    """Rows shaped like bench rows, for llama.cpp's programs on the same work: per group of prompts (a suite, or
    "all"), llama-bench's row, then speculative-simple's (`speculative(group)`: rows of the runs that took turns
    with ggufspec's, `reference_runs`), speeds against that group's ggufspec target row. Each row is appended to
    `into` as it is made; llama-bench failing leaves its row out with one line through note().

    depths: per group, the cached tokens llama-bench generates after (the group's mean prompt length).
    llama_bench_before: llama-bench's results ({depth: ...}) taken before ggufspec's own runs; with the
    ones taken now they bracket them, so the row shows how much the machine drifted meanwhile.
    llama_bench_again: False where llama-bench failed before the runs (its note given), or the runs were
    interrupted: it is not run again.
    """
    bin_dir, target = Path(bin_dir), engine.target_model.path
    threads = engine.target_ctx.n_threads
    depths = depths or {group: 0 for group in groups}
    after = None
    try:
        if llama_bench_again:
            after = llama_bench(bin_dir, target, n_tokens, threads, tuple(depths.values()), placement(engine, "llama-bench"))
    except GGUFSpecError as e:
        note(f"{e}; llama-bench's row shows only its run before ggufspec's" if llama_bench_before else
             f"{e}; llama-bench's row is left out")
    for group in groups:
        depth = depths[group]
        tg = [r[depth]["tokens_per_second"] for r in (llama_bench_before, after) if r and depth in r]
        if tg:
            row = _row(f"llama.cpp llama-bench (target, depth {depth})", "llama-bench", None, sum(tg) / len(tg),
                       target_tps.get(group), None, group)
            row.update(tokens_per_second_min=min(tg), tokens_per_second_max=max(tg), depth=depth)
            into.append(row)
        into += speculative(group) if speculative else []
    return into


def placement(engine, program: str) -> tuple[str, ...]:
    """The engine's placement as `program`'s flags (llama-bench, llama-speculative-simple), so that llama.cpp's rows
    run at the same -ngl, -ngld and --n-cpu-moe; nothing where this machine has no GPU (their defaults keep every
    layer on the CPU there) or where the target's layers are on RPC servers (not passed on). llama.cpp's own
    defaults would otherwise decide on a GPU: llama-bench puts every layer there, speculative-simple fits
    its own split (-fit on)."""
    from ..llama.devices import local_gpus

    target = engine.target_model
    draft = engine.draft_model or getattr(engine, "head_model", None)  # -md: a draft model, or an EAGLE-3 / DFlash draft
    if target.devices or not local_gpus():
        return ()

    def layers(n: int) -> str:
        return str(n) if n >= 0 or program == "llama-bench" else "all"

    experts = target.cpu_moe if target.cpu_moe >= 0 else target.info.n_layers
    flags = ["-ngl", layers(target.n_gpu_layers)] + (["-ncmoe", str(experts)] if experts else [])
    if program == "llama-speculative-simple":
        flags += ["-fit", "off"] + (["-ngld", layers(draft.n_gpu_layers)] if draft is not None else [])
    return tuple(flags)


def _speculative_configs(engine, draft_max: tuple[int, ...]) -> list[tuple[str, int | None, Path | None]]:
    """speculative-simple's rows for this engine: (--spec-type, draft-max, the -md file): the draft model's, the
    target's MTP layers' (their sibling file, where they are one), llama.cpp's n-gram drafters."""
    draft = engine.draft_model.path if engine.draft_model else None
    mtp_file = engine.mtp_model.path if getattr(engine, "mtp_model", None) else None
    across = getattr(engine, "bridge", None) is not None  # a draft of another vocabulary, which llama.cpp refuses
    configs = [("draft-simple", k, draft) for k in draft_max] if draft and not across else []
    heads = getattr(engine, "heads", {})
    if "mtp" in heads:  # the target's MTP layers, as --mode mtp drafts with them
        configs += [("draft-mtp", k, mtp_file) for k in draft_max]
    for name in ("eagle3", "dflash"):  # a draft reading the target's hidden states, as --mode eagle3/dflash
        if name in heads:
            configs += [(f"draft-{name}", min(k, getattr(heads[name], "max_draft", None) or k), engine.head_model.path)
                        for k in draft_max]
    return configs + [(t, None, None) for t in NGRAM_TYPES]


def _row(label: str, mode: str, draft_max, tps: float, target_tps: float | None, alpha, group: str = "all") -> dict:
    return {"mode": mode, "label": label, "draft_max": draft_max, "group": group, "tokens_per_second": tps,
            "tokens_per_second_min": tps, "tokens_per_second_max": tps,
            "speedup": tps / target_tps if target_tps else None, "acceptance_rate": alpha, "reference": True,
            "identical_to_target": None, "divergence": None}


STARTUP_SECONDS = 300  # llama-server's longest start (loading a model)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama.cpp's llama-server on 127.0.0.1, for as long as the `with` block runs."""

    def __init__(self, bin_dir: Path, args: list[str]):
        self.bin_dir, self.port = Path(bin_dir), free_port()
        self.cmd = [str(_program(self.bin_dir, "llama-server")), *args, "--host", "127.0.0.1", "--port",
                    str(self.port), "--no-webui"]
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LlamaServer":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     env=_env(self.bin_dir), start_new_session=True)
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode("utf-8", "replace").strip().splitlines()
                raise GGUFSpecError(f"llama-server exited ({self.proc.returncode}): {(err or ['nothing said'])[-1][:200]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise GGUFSpecError(f"llama-server did not answer /health within {STARTUP_SECONDS} s")

    def __exit__(self, *exc) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc.stderr.close()
