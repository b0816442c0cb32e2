#!/usr/bin/env python
"""llama-cpp-python's `Llama` with and without drafters, beside ggufspec's Engine, on the same prompts.

Rows: plain `Llama`; `Llama` + its own `LlamaPromptLookupDecoding`; `Llama` + `GGUFDraftModel` in draft,
lookup and auto mode; ggufspec's `Engine` target-only and auto. Greedy, the same prompts (through the
chat template), the same number of tokens (end of generation suppressed), 2 threads, models loaded
once per row; generation tok/s over all prompts (from the first token on: streamed chunks for `Llama`,
the Engine's own generation time), and whether the text equals the same family's plain row.

    python dev/compare_llama.py [--pair qwen2.5-coder-1.5b] [-n 128] [--suite code] [--limit 2]
"""

from __future__ import annotations

import argparse
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from ggufspec import Engine, GGUFDraftModel
from ggufspec.models.resolve import resolve_models
from ggufspec.bench.prompts import load_suite
from ggufspec.bench.report import table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default="qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--suite", default="code")
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    target, draft, _ = resolve_models(a.pair, None, None, offline=True)
    prompts = [p for s in a.suite.split(",") for p in load_suite(s)[: a.limit or None]]
    n_ctx = 4096
    rows, texts = [], {}

    def run_llama(label, make_draft=None):
        draft_model = make_draft() if make_draft else None
        llm = Llama(model_path=str(target), n_ctx=n_ctx, n_threads=a.threads, n_threads_batch=a.threads,
                    draft_model=draft_model, verbose=False)
        specials = llm.tokenize(b"<|im_end|><|endoftext|>", add_bos=False, special=True)
        no_eos = {t: -1000.0 for t in {llm.token_eos(), *specials}}  # the same length for every row
        outs, seconds, tokens = [], 0.0, 0
        for p in prompts:
            parts, first = [], None
            for chunk in llm.create_chat_completion([{"role": "user", "content": p.text}], max_tokens=a.n,
                                                    temperature=0, logit_bias=no_eos, stream=True):
                delta = chunk["choices"][0]["delta"].get("content")
                if delta is None:
                    continue
                if first is None:
                    first = time.perf_counter()  # generation time starts at the first token, as the Engine's does
                else:
                    tokens += 1
                parts.append(delta)
            seconds += time.perf_counter() - first
            outs.append("".join(parts))
        texts[label] = outs
        extra = ""
        if isinstance(draft_model, GGUFDraftModel):
            extra = f"{draft_model.stats['drafted']} drafted, α {draft_model.acceptance_rate:.0%}"
            draft_model.close()
        rows.append({"row": label, "tok/s": f"{tokens / seconds:.1f}", "note": extra,
                     "= plain": "-" if label == "Llama" else "yes" if outs == texts["Llama"] else "no"})
        print(f"{label}: done", file=sys.stderr)

    run_llama("Llama")
    run_llama("Llama + LlamaPromptLookupDecoding(4)", lambda: LlamaPromptLookupDecoding(num_pred_tokens=4))
    for mode in ("draft", "lookup", "auto"):
        run_llama(f"Llama + GGUFDraftModel({mode})",
                  lambda mode=mode: GGUFDraftModel(draft, target=target, mode=mode, n_ctx=n_ctx, n_threads=a.threads))
    with Engine(target, draft, n_ctx=n_ctx, n_threads=a.threads) as engine:
        for mode in ("target", "auto"):
            outs, seconds, tokens = [], 0.0, 0
            for p in prompts:
                r = engine.generate(messages=[{"role": "user", "content": p.text}], max_tokens=a.n, mode=mode,
                                    ignore_eos=True)
                seconds += r.stats.generation_seconds
                tokens += r.stats.n_generated
                outs.append(r.text)
            texts[f"Engine {mode}"] = outs
            rows.append({"row": f"ggufspec Engine ({mode})", "tok/s": f"{tokens / seconds:.1f}", "note": "generation only",
                         "= plain": "-" if mode == "target" else "yes" if outs == texts["Engine target"] else "no"})
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
