#!/usr/bin/env python
"""ggufspec's lookup and auto beside llama.cpp's n-gram drafters, round by round, on the same prompts.

For each prompt of the suites (edit and fix by default: answers that copy their prompt), runs ggufspec's modes
(greedy, through the Python API, the rounds as `Engine.stream` yields them) and llama.cpp's speculative-simple with
each n-gram --spec-type (its debug log says what each round drafted and kept). Every program writes the target's
greedy text, so rounds line up by output position: per program, a summary (rounds, drafted, kept, tokens per round,
the longest draft, rounds that kept nothing, speed; llama.cpp's counts its -n tokens over its time until they were
out) and, with --rounds, each round: where it starts in the output, what was drafted and kept, and for ggufspec
where the copy came from (the prompt or the answer so far, how far back the match agreed, whether it resumed past a
changed token) and what its verify batch cost; for llama.cpp, each round's time from its log's timestamps (the line
of the round before to its own: the verify and the drafting, as one). Under each prompt, the ceiling: the fewest
target steps the measured cost table allows for the answer's tokens where every copy that lookup's matches offer is
known in advance to be right as far as it is (a drafter with foresight: plain steps elsewhere, each right copy at
its best length in one batch or in exact chunks, whichever the table prices lower), as a speed-up over plain
decoding; beside it llama.cpp's n-gram rule (a 12-token key, 48 drafted in one batch) priced by the same table.
With `--modes target,...` the target's own row shows what those speed-ups mean here.

What llama.cpp's drafters do (common/ngram-map.cpp, common/ngram-mod.cpp, common/speculative.cpp of the release
llama-cpp-python pins; ../shared/tools/llama-cpp-reference unpacks it):
  ngram-simple  the last 12 tokens (the sampled one included) looked up, latest occurrence first; drafts the up to 48
                that followed it (none while the history is under 61 tokens); nothing is learned from a miss.
  ngram-map-k   the same 12-gram key, its 48-token continuation proposed once seen --spec-ngram-map-k-min-hits times.
  ngram-mod     24-gram hashes into a shared 4M-entry table of next tokens; drafts by chaining the table, 48 to 64
                tokens or nothing; five rounds in a row keeping under a quarter reset the table.
None reads --spec-draft-n-max, none weighs what a verify batch costs.

    python dev/ngram_rounds.py [PAIR] [--suites edit,fix] [-n 96] [--modes lookup,auto]
                               [--types ngram-simple,ngram-map-k,ngram-mod] [--rounds] [--limit N] [--bin DIR]

--bin (or LLAMA_CPP_REFERENCE_BIN): llama.cpp's programs, from ../shared/tools/llama-cpp-reference. Timings mean
something only on a quiet machine; name the CPU (`ggufspec doctor`) beside them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ggufspec.bench.prompts import load_suite
from ggufspec.bench.reference import ROUND_LOG, generated_text, logged_rounds, same_text, seconds_to
from ggufspec.bench.runs import prompt_text, prompt_tokens
from ggufspec.drafters import LookupDrafter
from ggufspec.engine import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.models.resolve import resolve_models

TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


@dataclass
class Rnd:
    start: int  # output position the round began at
    drafted: int
    kept: int
    source: str = ""
    agreement: int | None = None  # ggufspec's lookup: how far back the matched place agrees with the history
    origin: str = ""  # ggufspec's lookup: "prompt" or "answer" (where the copied place is)
    resumed: bool = False
    verify_ms: float | None = None


@dataclass
class Runout:
    program: str
    rounds: list[Rnd] = field(default_factory=list)
    n_generated: int = 0
    seconds: float = 0.0
    text: str | bytes | None = None
    tokens: list[int] = field(default_factory=list)

    def summary(self) -> list:
        drafting = [r for r in self.rounds if r.drafted]
        drafted, kept = sum(r.drafted for r in drafting), sum(r.kept for r in drafting)
        return [self.program, len(self.rounds), len(drafting), drafted, kept,
                f"{kept / drafted:.2f}" if drafted else "-",
                f"{self.n_generated / max(1, len(self.rounds)):.2f}",
                max((r.drafted for r in drafting), default=0),
                sum(1 for r in drafting if r.kept == 0),
                sum(1 for r in drafting if r.kept == r.drafted),
                f"{self.n_generated / self.seconds:.1f}" if self.seconds else "-"]


def ours(engine: Engine, tokens: list[int], mode: str, n: int) -> Runout:
    """One greedy generation in `mode`, its rounds from the stream; where a lookup draft's copy came from, from a
    LookupDrafter replaying the same history (auto's own may differ where it learned a rename)."""
    out, history, position = Runout(f"ggufspec {mode}"), list(tokens), 0
    replay, previous = LookupDrafter(), None
    stream = engine.stream(prompt_tokens=tokens, mode=mode, max_tokens=n, ignore_eos=True, temperature=0.0)
    try:
        for chunk in stream:
            r = Rnd(position, chunk.n_drafted, chunk.n_accepted, chunk.source)
            if chunk.n_drafted and "lookup" in chunk.source:
                copy, r.agreement, r.resumed = replay.match(history, chunk.n_drafted)
                j = replay._cursor[0] if copy else None  # the copied place, as `match` chose it
                r.origin = "" if j is None else "prompt" if j < len(tokens) else "answer"
            seconds = chunk.stats.target_seconds
            r.verify_ms = (seconds - (previous or 0.0)) * 1e3
            previous = seconds
            out.rounds.append(r)
            history += chunk.tokens
            out.tokens += chunk.tokens
            position += len(chunk.tokens)
            out.text = (out.text or "") + chunk.text
            out.n_generated, out.seconds = chunk.stats.n_generated, chunk.stats.generation_seconds
    finally:
        stream.close()
    return out


def theirs(bin_dir: Path, engine: Engine, text: str, spec_type: str, n: int) -> Runout:
    """speculative-simple with one n-gram type, its rounds from the debug log ("accepted K/D draft tokens")."""
    program = bin_dir / "llama-speculative-simple"
    cmd = [str(program), "-m", str(engine.target_model.path), "-p", text, "-n", str(n), "--spec-type", spec_type,
           "-t", str(engine.target_ctx.n_threads), "--temp", "0", "-c", str(engine.n_ctx), "--ignore-eos",
           "--no-escape", *ROUND_LOG]
    done = subprocess.run(cmd, capture_output=True, timeout=900,
                          env=dict(os.environ, LD_LIBRARY_PATH=f"{bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}"))
    log = (done.stdout + done.stderr).decode("utf-8", "replace")
    out, position, before = Runout(f"llama.cpp {spec_type}"), 0, None
    for at, kept, drafted in logged_rounds(log):  # a round's time: from the line of the round before (the first: none)
        out.rounds.append(Rnd(position, drafted, kept, spec_type if drafted else "target",
                              verify_ms=None if before is None else (at - before) * 1e3))
        position, before = position + kept + 1, at
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if done.returncode != 0 or not m:
        raise GGUFSpecError(f"llama-speculative-simple ({spec_type}) exited {done.returncode}: "
                            f"{log.strip().splitlines()[-1] if log.strip() else 'no output'}")
    out.n_generated, out.seconds = int(m.group(1)), float(m.group(2))
    to_n = seconds_to(log, n, out.n_generated, out.seconds)  # the -n asked, over the time until they were out
    if to_n is not None:
        out.n_generated, out.seconds = min(n, out.n_generated), to_n
    out.text = generated_text(done.stdout, text.encode("utf-8", "surrogateescape"))
    return out


def ceiling(engine: Engine, prompt: list[int], answer: list[int]) -> tuple[float, float]:
    """(steps, steps of llama.cpp's rule) for the answer's tokens after its first (the prompt's row gives that one),
    by the engine's cost table: the ceiling with foresight (module docstring) and the 12-token key rule."""
    costs, verification = engine.costs, engine.verification()
    step, n = costs.batch_seconds(1), len(answer)

    def price(rows: int, kv: int) -> float:  # in steps: one batch, or exact chunks where those cost less
        limit = verification.batch_limit(kv)
        one = costs.batch_seconds(rows)
        return (min(one, costs.verify_seconds(rows, limit)) if limit else one) / step

    def kept(copy: list[int], i: int) -> int:  # how many of a copy drafted at output position i the answer keeps
        r = 0
        while r < len(copy) and i + r < n and copy[r] == answer[i + r]:
            r += 1
        return r

    right, history, lookup = [0], prompt + answer[:1], LookupDrafter()
    for i in range(1, n):  # how far lookup's copy at each position is right
        right.append(kept(lookup.match(history, 64)[0], i))
        history.append(answer[i])
    best = [float("inf")] * (n + 1)
    best[1] = 0.0
    for i in range(1, n):
        best[i + 1] = min(best[i + 1], best[i] + 1)
        for k in range(1, right[i] + 1):  # i: tokens out, so the round's rows start after prompt + i - 1 cached
            j = min(n, i + k + 1)
            best[j] = min(best[j], best[i] + price(k + 1, len(prompt) + i + k))
    theirs_steps, i = 0.0, 1
    while i < n:
        h, copy = prompt + answer[:i], []
        for j in range(len(h) - 13, -1, -1) if len(h) >= 61 else ():  # the latest earlier place of the 12-token key
            if h[j:j + 12] == h[-12:]:
                copy = h[j + 12:j + 60]
                break
        theirs_steps += costs.batch_seconds(len(copy) + 1) / step if copy else 1.0
        i += kept(copy, i) + 1
    return best[n], theirs_steps


HEAD = ["program", "rounds", "drafting", "drafted", "kept", "α", "tok/round", "longest", "kept 0", "kept all", "tok/s"]


def show(runs: list[Runout], rounds: bool) -> None:
    from ggufspec.bench.report import table

    print(table([dict(zip(HEAD, r.summary())) for r in runs]))
    if not rounds:
        return
    for run in runs:
        print(f"\n  {run.program}: start drafted/kept source [agreement, from, resumed] verify ms")
        for r in run.rounds:
            if not r.drafted:
                continue
            extra = f" [{r.agreement}, {r.origin}{', resumed' if r.resumed else ''}]" if r.agreement is not None else ""
            ms = f" {r.verify_ms:.0f} ms" if r.verify_ms is not None else ""
            print(f"    {r.start:4d} {r.drafted:3d}/{r.kept:<3d} {r.source}{extra}{ms}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pair", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--suites", default="edit,fix")
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--modes", default="lookup,auto")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--rounds", action="store_true", help="every drafting round, not only the summary")
    ap.add_argument("--bin", default=os.environ.get("LLAMA_CPP_REFERENCE_BIN"))
    ap.add_argument("--offline", action="store_true")
    ap.add_argument("--limit", type=int, default=None, help="the first N prompts of each suite (the bench's: 2)")
    a = ap.parse_args(argv)
    if not a.bin:
        print("ngram_rounds: give --bin DIR (or LLAMA_CPP_REFERENCE_BIN): llama.cpp's programs, from "
              "../shared/tools/llama-cpp-reference", file=sys.stderr)
        return 2
    try:
        target, draft, _ = resolve_models(a.pair, None, None, offline=a.offline)
        with Engine(target, draft, n_ctx=2048) as engine:
            for suite in a.suites.split(","):
                for p in load_suite(suite)[:a.limit]:
                    tokens = prompt_tokens(engine, p)
                    runs = [ours(engine, tokens, mode, a.n) for mode in a.modes.split(",") if mode]
                    runs += [theirs(Path(a.bin), engine, prompt_text(engine, p), t, a.n) for t in a.types.split(",") if t]
                    texts = [r.text.encode("utf-8", "surrogateescape") if isinstance(r.text, str) else r.text
                             for r in runs]
                    same = all(same_text(texts[0], t) is not False for t in texts[1:])
                    print(f"\n{p.label} ({len(tokens)} prompt tokens, -n {a.n}; "
                          f"{'every text the same' if same else 'the texts differ'}):")
                    show(runs, a.rounds)
                    answer = next((r.tokens for r in runs if r.tokens), None)
                    if answer and engine.costs is not None:
                        steps, llama_steps = ceiling(engine, tokens, answer)
                        print(f"ceiling, every right copy foreseen: {steps:.1f} target steps for the "
                              f"{len(answer) - 1} tokens after the first ({(len(answer) - 1) / steps:.2f}x plain "
                              f"decoding); llama.cpp's n-gram rule by the same table {llama_steps:.1f} "
                              f"({(len(answer) - 1) / llama_steps:.2f}x)")
    except GGUFSpecError as e:
        print(f"ngram_rounds: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
