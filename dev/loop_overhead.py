#!/usr/bin/env python
"""The speculative loop's own cost per round where decoding is nearly free, beside llama.cpp's.

A tiny llama model with Qwen2.5's vocabulary size (151,936 rows of logits, as a 7B target returns on
a GPU) drafts for itself, so every draft is accepted and each round verifies draft-max + 1 rows. In
one process: ggufspec's draft mode (greedy, and sampled with a seed), with every `llama_decode` timed,
so the loop's own time (Python: logits rows, picks, sampling, bookkeeping) is the round's time less the
decodes'; and llama.cpp's speculative-simple on the same pair, tokens and draft length, whose decoded
time per round is its decodes plus its own C++ loop. Pairs alternate so the machine's drift hits both.

    python dev/loop_overhead.py "$(../shared/tools/llama-cpp-reference)" [--draft-max 4] [-n 256] [--pairs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ggufspec.bench.reference import speculative_simple  # noqa: E402
from ggufspec.engine import Engine  # noqa: E402
from ggufspec.llama import backend  # noqa: E402
from tests.tiny import write_tiny_model  # noqa: E402

QWEN_VOCAB = 151_936
PROMPT = "def f(x):"


class DecodeClock:
    """Wraps llama_decode as the backend calls it: the seconds spent inside it, and how many calls. With
    `waits` ({context: seconds}), each decode on that context then sleeps that long: a GPU's step, during
    which the CPU is idle (the GIL released), emulated."""

    def __init__(self):
        self.seconds, self.calls, self._decode, self.waits = 0.0, 0, backend.C.llama_decode, {}

    def __call__(self, ctx, batch):
        start = time.perf_counter()
        try:
            return self._decode(ctx, batch)
        finally:
            wait = next((s for c, s in self.waits.items() if c is ctx), 0.0)
            if wait:
                time.sleep(wait)
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def reset(self):
        self.seconds, self.calls = 0.0, 0


def ours(engine: Engine, clock: DecodeClock, n: int, settings: dict) -> dict:
    engine.generate(PROMPT, max_tokens=8, ignore_eos=True, **settings)  # warm-up
    chunk = None
    for i, chunk in enumerate(engine.stream(PROMPT, max_tokens=n, ignore_eos=True, **settings)):
        if i == 0:  # the prompt's row: prefill done, the rounds start
            clock.reset()
    s = chunk.stats
    rounds = s.rounds - 1  # the first round is the prompt's row: no decode of its own
    return {"rounds": rounds, "seconds": s.generation_seconds, "decode": clock.seconds,
            "loop": s.generation_seconds - clock.seconds, "drafted": s.n_drafted, "tokens": s.n_generated,
            "tps": s.tokens_per_second, "calls": clock.calls, "ties": s.ties_settled}


def theirs(bin_dir: Path, model: Path, n: int, draft_max: int, threads: int) -> dict:
    r = speculative_simple(bin_dir, model, model, PROMPT, n, threads, 1024, draft_max)
    rounds = r["n_drafted"] / draft_max if draft_max else r["n_generated"]
    return {"rounds": rounds, "seconds": r["seconds"], "tokens": r["n_generated"], "drafted": r["n_drafted"],
            "tps": r["n_generated"] / r["seconds"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bin_dir", type=Path, help="folder with llama.cpp's llama-speculative-simple")
    ap.add_argument("--draft-max", type=int, default=4)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--emulate-gpu", metavar="TARGET_MS,DRAFT_MS",
                    help="each target and draft decode also waits this long with the CPU idle, as on a GPU "
                         "(the target counts as on the GPU: sampling noise is made during its steps)")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(Path(tmp) / "tiny-qwen-vocab.gguf", pad=QWEN_VOCAB - 354, n_embd=a.n_embd,
                                 logit_scale=40.0)  # peaked, as a trained model: few near-ties to re-decode
        clock = DecodeClock()
        backend.C.llama_decode = clock
        runs = {"draft, greedy": dict(mode="draft", draft_max=a.draft_max),
                "draft, T 0.8": dict(mode="draft", draft_max=a.draft_max, temperature=0.8, seed=1),
                "auto, greedy": dict(mode="auto", draft_max=a.draft_max)}
        results = {name: [] for name in [*runs, "llama.cpp"]}
        with Engine(model, model, n_ctx=1024) as engine:
            threads = engine.target_ctx.n_threads
            if a.emulate_gpu:
                target_ms, draft_ms = (float(x) / 1e3 for x in a.emulate_gpu.split(","))
                clock.waits = {engine.target_ctx._ctx: target_ms, engine.draft_ctx._ctx: draft_ms}
                engine.target_model.cpu_waits = True
            for _ in range(a.pairs):
                if not a.emulate_gpu:
                    results["llama.cpp"].append(theirs(a.bin_dir, model, a.n, a.draft_max, threads))
                for name, settings in runs.items():
                    results[name].append(ours(engine, clock, a.n, settings))
    print(f"tiny model, n_embd {a.n_embd}, vocabulary {QWEN_VOCAB:,}; draft = target, draft-max {a.draft_max}, "
          f"{a.n} tokens, {threads} threads; median of {a.pairs}")
    if a.emulate_gpu:
        print(f"emulated GPU steps: target {a.emulate_gpu.split(',')[0]} ms, draft {a.emulate_gpu.split(',')[1]} ms")
    for name, runs in results.items():
        if not runs:
            continue
        ms_round = statistics.median(1e3 * r["seconds"] / r["rounds"] for r in runs)
        line = f"{name:14s} {statistics.median(r['tps'] for r in runs):7.1f} tok/s  {ms_round:6.2f} ms/round"
        if "loop" in runs[0]:
            loop = statistics.median(1e3 * r["loop"] / r["rounds"] for r in runs)
            per_draft = statistics.median(1e3 * r["loop"] / max(1, r["drafted"]) for r in runs)
            decode = statistics.median(1e3 * r["decode"] / r["rounds"] for r in runs)
            calls = statistics.median(r["calls"] / r["rounds"] for r in runs)
            line += (f"  (decodes {decode:.2f} in {calls:.2f} calls, loop {loop:.2f} ms/round = {per_draft:.3f} ms per "
                     f"drafted token; {statistics.median(r['ties'] for r in runs)} near-ties re-decoded)")
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
