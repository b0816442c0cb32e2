#!/usr/bin/env python
"""How far do llama.cpp's batched logits drift from one-token decoding, per batch size?

Greedy speculative decoding is token-identical to target-only decoding only if the verify
batch computes the same argmax as one-token steps. This decodes a greedy continuation one
token at a time, then the same tokens in batches of 2..8, and prints for each batch size the
largest logit difference, the largest change of the top-1/top-2 gap (what can flip an
argmax), and whether the batch is bit-identical. It also times each batch twice: with a logits
row for every token, as verification needs, and with the last row only, as `llama-bench pp`
measures; the difference is the output layer, which verification pays once per drafted token.

    python dev/measure_batch_drift.py MODEL.gguf [-n 48] [--no-repack] [--cached 300] [--ngl -1]

--cached N puts N tokens (this file's text) before the prompt: on CPU, past 256 cached tokens
llama.cpp's one-token flash attention splits the keys over the threads and batches that were
bit-identical stop being so.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ggufspec.llama.backend import Context, Model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("-n", type=int, default=48, help="tokens to compare")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--no-repack", action="store_true", help="load without llama.cpp's CPU weight repacking")
    ap.add_argument("--cached", type=int, default=0, help="tokens of filler in the KV cache before the prompt")
    ap.add_argument("--ngl", type=int, default=0, help="layers on the GPU (-1: all)")
    ap.add_argument("-p", "--prompt", default="<|im_start|>user\nWrite a Python function that checks whether a number "
                    "is prime.<|im_end|>\n<|im_start|>assistant\n")
    a = ap.parse_args()
    model = Model(a.model, repack=not a.no_repack, n_gpu_layers=a.ngl)
    filler = model.tokenize(open(__file__).read() * 20, add_special=False)[: a.cached] if a.cached else []
    prompt = filler + model.tokenize(a.prompt, add_special=not filler)
    ctx = Context(model, n_ctx=max(1024, len(prompt) + a.n + 64), n_threads=a.threads)
    ctx.decode(prompt[:-1], logits="none")
    n0 = ctx.n_past
    for x in prompt[-1:] * 3:  # warm-up: page the mmapped weights in
        ctx.decode([x])
    ctx.truncate(n0)
    inputs, singles = [prompt[-1]], []
    start = time.perf_counter()
    for _ in range(a.n):
        row = ctx.decode([inputs[-1]])[0].copy()
        singles.append(row)
        inputs.append(int(row.argmax()))
    single_ms = (time.perf_counter() - start) / a.n * 1000
    print(f"{model.path.name}: repack {'off' if a.no_repack else 'on'}, {ctx.n_threads} threads, {n0} tokens cached, "
          f"one token {single_ms:.1f} ms")
    print(f"{'batch':>5} {'max |dlogit|':>13} {'max |dgap|':>11} {'bit-identical':>14} {'ms/batch':>9} "
          f"{'steps':>6} {'steps, last row only':>21} {'tokens/steps':>13}")
    for b in range(2, 9):
        ctx.truncate(n0)
        dlogit = dgap = 0.0
        seconds, n_batches = 0.0, 0
        for s in range(0, a.n - b + 1, b):
            t = time.perf_counter()
            batch = ctx.decode(inputs[s:s + b], logits="all")
            seconds += time.perf_counter() - t
            n_batches += 1
            single = np.stack(singles[s:s + b])
            dlogit = max(dlogit, float(np.abs(batch - single).max()))
            for rb, rs in zip(batch, single):
                top = int(rs.argmax())
                gap_s = rs[top] - np.max(np.delete(rs, top))
                gap_b = rb[top] - np.max(np.delete(rb, top))
                dgap = max(dgap, abs(float(gap_b - gap_s)))
            ctx.truncate(n0 + s + b)
        ms = seconds / n_batches * 1000
        ctx.truncate(n0)
        last_seconds = 0.0
        for s in range(0, a.n - b + 1, b):
            t = time.perf_counter()
            ctx.decode(inputs[s:s + b], logits="last")
            last_seconds += time.perf_counter() - t
        last_ms = last_seconds / n_batches * 1000
        steps = ms / single_ms
        print(f"{b:>5} {dlogit:>13.4f} {dgap:>11.4f} {str(dlogit == 0.0):>14} {ms:>9.1f} "
              f"{steps:>6.2f} {last_ms / single_ms:>21.2f} {b / steps:>13.2f}")
    ctx.close()
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
