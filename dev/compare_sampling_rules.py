#!/usr/bin/env python
"""The two sampling rules side by side: acceptance and speed of the coupled rule (a seed gives the
target's own text in every mode) against Leviathan's rejection rule, on the same prompts and seeds.

For each temperature and suite, every prompt runs with each seed in target, draft and lookup mode,
once per rule, the rules taking turns; rows give α (accepted / drafted), τ (tokens per target pass),
generation tok/s over all runs, and whether the coupled runs wrote target-only's text.

    python dev/compare_sampling_rules.py [--pair NAME] [--temps 0.7,1.0] [--suites code,chat] [-n 64] [--seeds 2]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from ggufspec.bench.runs import prompt_tokens
from ggufspec.engine import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.models.resolve import resolve_models
from ggufspec.bench.prompts import load_suite
from ggufspec.bench.report import table
from ggufspec.llama.system import cpu_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default=None, help="a pair of models.toml (default: the default pair)")
    ap.add_argument("--temps", default="0.7,1.0")
    ap.add_argument("--suites", default="code,chat")
    ap.add_argument("--limit", type=int, default=2, help="prompts per suite")
    ap.add_argument("-n", type=int, default=64, help="tokens per run")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per prompt")
    ap.add_argument("--draft-max", type=int, default=4)
    a = ap.parse_args(argv)
    try:
        target, draft, _ = resolve_models(a.pair, None, None, use_default=a.pair is None)
        with Engine(target, draft, n_ctx=2048) as engine:
            out = compare(engine, a)
    except GGUFSpecError as e:
        print(f"compare_sampling_rules: {e}", file=sys.stderr)
        return 1
    print(f"{cpu_model()}, {out['threads']} threads, -n {a.n}, draft-max {a.draft_max}, {a.seeds} seeds per prompt")
    print(table(out["rows"]))
    return 0


def compare(engine: Engine, a) -> dict:
    sums = defaultdict(lambda: {"drafted": 0, "accepted": 0, "tokens": 0, "rounds": 0, "timed": 0, "seconds": 0.0,
                                "same": True})
    for temp in (float(t) for t in a.temps.split(",")):
        for suite in a.suites.split(","):
            for p in load_suite(suite)[: a.limit]:
                tokens = prompt_tokens(engine, p)
                for seed in range(a.seeds):
                    reference = None
                    for mode in ("target", "draft", "lookup"):
                        for rule in ("coupled", "rejection"):
                            r = engine.generate(prompt_tokens=tokens, max_tokens=a.n, temperature=temp, seed=seed,
                                                mode=mode, sampling_rule=rule, draft_max=a.draft_max, ignore_eos=True)
                            if mode == "target" and rule == "coupled":
                                reference = r.tokens
                            s = sums[(temp, suite, mode, rule)]
                            s["drafted"] += r.stats.n_drafted
                            s["accepted"] += r.stats.n_accepted
                            s["tokens"] += r.stats.n_generated
                            s["rounds"] += r.stats.rounds
                            s["timed"] += r.stats.n_timed
                            s["seconds"] += r.stats.generation_seconds
                            if rule == "coupled":
                                s["same"] &= r.tokens == reference
    rows = []
    for (temp, suite, mode, rule), s in sums.items():
        rows.append({"temp": temp, "suite": suite, "mode": mode, "rule": rule,
                     "α": f"{s['accepted'] / s['drafted']:.0%}" if s["drafted"] else "-",
                     "τ": f"{s['tokens'] / max(1, s['rounds']):.2f}",
                     "tok/s": f"{s['timed'] / s['seconds']:.1f}" if s["seconds"] else "-",
                     "= target": ("yes" if s["same"] else "NO") if rule == "coupled" else "-"})
    return {"rows": rows, "threads": engine.target_ctx.n_threads}


if __name__ == "__main__":
    sys.exit(main())
