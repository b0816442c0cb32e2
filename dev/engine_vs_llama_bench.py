#!/usr/bin/env python
"""Target-only speed through ggufspec against llama-bench, in alternating pairs.

Each pair runs llama-bench (tg N, its own repetitions) and then ggufspec's target-only decoding
of N tokens three times in one loaded engine (median), so that the machine's drift hits both
alike. Prints each pair and the ratio of the means.

    python dev/engine_vs_llama_bench.py "$(../shared/tools/llama-cpp-reference)" [-m TARGET] [--pairs 4] [-n 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from ggufspec.engine import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.models.resolve import resolve_models
from ggufspec.bench.reference import llama_bench


PROMPT = "def fibonacci(n):"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bin_dir", help="folder with llama.cpp's llama-bench")
    ap.add_argument("-m", dest="target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("-n", type=int, default=64)
    a = ap.parse_args(argv)
    try:
        target = resolve_models(None, a.target, None)[0]
        theirs, ours = [], []
        with Engine(target, n_ctx=512, measure=False) as engine:
            # llama-bench at the depth ggufspec's generation starts from (its prompt in the cache)
            depth, threads = len(engine.tokenize_prompt(PROMPT, None)), engine.target_ctx.n_threads
        for i in range(a.pairs):
            # llama-bench with no engine loaded: beside one, this process's idle llama.cpp threads slowed it by
            # up to a sixth on 2 cores (0.97x read here where `ggufspec bench`, which runs it first, read 0.90x)
            ref = llama_bench(Path(a.bin_dir), target, a.n, threads, (depth,))[depth]
            with Engine(target, n_ctx=512) as engine:
                engine.generate("def f", max_tokens=8, mode="target", ignore_eos=True)  # warm-up
                runs = [engine.generate(PROMPT, max_tokens=a.n, mode="target", ignore_eos=True)
                        .stats.tokens_per_second for _ in range(3)]
                ref = ref["tokens_per_second"]
            theirs.append(ref)
            ours.append(statistics.median(runs))
            print(f"pair {i + 1}: llama-bench {ref:.2f} tok/s, ggufspec {ours[-1]:.2f} tok/s ({ours[-1] / ref:.2f})")
    except GGUFSpecError as e:
        print(f"engine_vs_llama_bench: {e}", file=sys.stderr)
        return 1
    mean_theirs, mean_ours = statistics.mean(theirs), statistics.mean(ours)
    print(f"mean: llama-bench {mean_theirs:.2f}, ggufspec {mean_ours:.2f} tok/s: {mean_ours / mean_theirs:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
