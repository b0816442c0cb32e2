#!/usr/bin/env python
"""How often would a prompt-lookup draft be right, by how far back its match agrees?

Generates the target's own greedy answer to each prompt of the given suites, then replays it:
at every position where lookup finds a match, checks whether its first and first two drafted
tokens equal what the target wrote next. Rows are (suite, agreement bucket) as auto tracks them; "resumed" rows are
copies resumed past a token the text changed, which auto tracks apart whatever their agreement.

    python dev/lookup_acceptance.py [SUITE ...] [-m TARGET] [-n 160]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from ggufspec.auto import lookup_bucket
from ggufspec.bench.runs import prompt_tokens
from ggufspec.bench.prompts import load_suite
from ggufspec.drafters import LookupDrafter
from ggufspec.engine import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.models.resolve import resolve_models
from ggufspec.bench.report import table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("suites", nargs="*", default=["code", "edit", "chat", "summarize", "fix"])
    ap.add_argument("-m", dest="target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("-n", type=int, default=160, help="tokens of each answer")
    a = ap.parse_args(argv)
    try:
        counts = defaultdict(lambda: [0, 0, 0])  # (suite, bucket, resumed) -> [matches, first right, first two right]
        target = resolve_models(None, a.target, None)[0]
        with Engine(target, n_ctx=2048) as engine:
            for suite in a.suites:
                for p in load_suite(suite):
                    tokens = prompt_tokens(engine, p)
                    answer = engine.generate(prompt_tokens=tokens, max_tokens=a.n, mode="target").tokens
                    history, lookup = list(tokens), LookupDrafter()
                    for i, t in enumerate(answer):
                        draft, agreement, resumed = lookup.match(history, 2)
                        if draft:
                            c = counts[(suite, lookup_bucket(agreement), resumed)]
                            c[0] += 1
                            c[1] += draft[:1] == answer[i:i + 1]
                            c[2] += len(draft) == 2 and draft == answer[i:i + 2]
                        history.append(t)
    except GGUFSpecError as e:
        print(f"lookup_acceptance: {e}", file=sys.stderr)
        return 1
    rows = [{"suite": s, "agreement": f"{b}+" + (" resumed" if resumed else ""), "matches": n,
             "first right": f"{r1 / n:.0%}", "two right": f"{r2 / n:.0%}"}
            for (s, b, resumed), (n, r1, r2) in sorted(counts.items())]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
