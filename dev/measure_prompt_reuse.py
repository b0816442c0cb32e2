#!/usr/bin/env python
"""Time to first token of a chat's second turn: cold (the whole prompt evaluated) against reused
(the KV cache's whole n_batch batches of the shared prefix kept), on the real pair.

The chat: a source file pasted into the first user message (about 1,700 tokens), a first answer
(64 tokens, greedy), then a second question. Per repeat, turn 1 runs, then turn 2 reused; turn 1
again, then turn 2 cold; so both second turns start from the same cache. Prints n_prompt, the
tokens reused, the median TTFT of each, and whether the second turn's text is the same. With
--llama, `Llama` (which keeps every cached token, the first answer's included) for reference.

    python dev/measure_prompt_reuse.py [--pair qwen2.5-coder-1.5b] [-b 512,64] [--repeats 3] [--llama]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from ggufspec import Engine
from ggufspec.models.resolve import resolve_models
from ggufspec.bench.report import table

SOURCE = Path(__file__).resolve().parent.parent / "ggufspec" / "speculative.py"
QUESTIONS = ("Summarise what this module does in three sentences.", "Which function rewinds the KV cache, and when?")


def turns(answer: str | None) -> list[dict]:
    first = [{"role": "user", "content": f"Here is a Python module:\n\n```python\n{SOURCE.read_text()}```\n\n{QUESTIONS[0]}"}]
    return first if answer is None else first + [{"role": "assistant", "content": answer},
                                                  {"role": "user", "content": QUESTIONS[1]}]


def engine_rows(target, draft, n_batch: int, a) -> list[dict]:
    rows = []
    with Engine(target, draft, n_ctx=4096, n_batch=n_batch, n_threads=a.threads) as e:
        kw = dict(max_tokens=a.n, mode=a.mode)
        answer = e.generate(messages=turns(None), reuse_prompt=False, **kw).text
        second = e.tokenize_prompt(messages=turns(answer))
        ttft = {True: [], False: []}
        texts, reused = {}, 0
        for _ in range(a.repeats):
            for reuse in (True, False):
                e.generate(messages=turns(None), reuse_prompt=False, **kw)  # the cache as after turn 1
                out = e.generate(prompt_tokens=second, reuse_prompt=reuse, **kw)
                ttft[reuse].append(out.stats.prompt_seconds)
                texts.setdefault(reuse, out.text)
                if reuse:
                    reused = out.stats.n_reused
        cold, warm = statistics.median(ttft[False]), statistics.median(ttft[True])
        rows.append({"row": f"Engine, -b {n_batch}, cold", "n_prompt": len(second), "reused": 0,
                     "TTFT s": f"{cold:.2f}", "x": "1.00x", "= cold": "-"})
        rows.append({"row": f"Engine, -b {n_batch}, reused", "n_prompt": len(second), "reused": reused,
                     "TTFT s": f"{warm:.2f}", "x": f"{cold / warm:.2f}x",
                     "= cold": "yes" if texts[True] == texts[False] else "NO"})
    return rows


def llama_rows(target, a) -> list[dict]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(target), n_ctx=4096, n_threads=a.threads, n_threads_batch=a.threads, verbose=False)

    def ask(messages):
        start, first, parts = time.perf_counter(), None, []
        for chunk in llm.create_chat_completion(messages, max_tokens=a.n, temperature=0, stream=True):
            delta = chunk["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter() - start
                parts.append(delta)
        return first, "".join(parts)

    _, answer = ask(turns(None))
    ttft = {True: [], False: []}
    texts = {}
    for _ in range(a.repeats):
        for warm in (True, False):
            ask(turns(None))
            if not warm:
                llm.reset()  # n_tokens = 0: no prefix matches, the whole prompt is evaluated
            t, texts[warm] = ask(turns(answer))
            ttft[warm].append(t)
    cold, warm = statistics.median(ttft[False]), statistics.median(ttft[True])
    n = "-"
    llm.close()
    return [{"row": "Llama, cold", "n_prompt": n, "reused": 0, "TTFT s": f"{cold:.2f}", "x": "1.00x", "= cold": "-"},
            {"row": "Llama, reused (all cached tokens)", "n_prompt": n, "reused": "all", "TTFT s": f"{warm:.2f}",
             "x": f"{cold / warm:.2f}x", "= cold": "yes" if texts[True] == texts[False] else "NO"}]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b")
    ap.add_argument("-b", "--batch-sizes", default="512,64")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--llama", action="store_true", help="add llama-cpp-python's Llama, which reuses its cache too")
    a = ap.parse_args(argv)
    target, draft, _ = resolve_models(a.pair, None, None, offline=True)
    rows = []
    for b in (int(x) for x in a.batch_sizes.split(",")):
        rows += engine_rows(target, draft, b, a)
        print(table(rows[-2:], [(k, k) for k in rows[0]]), file=sys.stderr)
    if a.llama:
        rows += llama_rows(target, a)
    print(table(rows, [(k, k) for k in rows[0]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
