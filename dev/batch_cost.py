"""What a batch of one row per sequence costs through ggufspec (`Context(n_seq=N)` and `decode_together`) against a
bare llama-cpp-python context decoding the same rows with `llama_decode`, taking turns on one loaded model so a
VM's drifting speed moves both alike (docs/serve.md, "Where a loaded server's time goes").

    python dev/batch_cost.py MODEL.gguf [--rows 4] [--rounds 3] [--reps 12] [--prompt 64]

Each round prints the median milliseconds of `reps` timed decodes (the first left out) of `rows` sequences' rows
(every row with logits, as a server's step) and of one row, bare and through ggufspec. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp as C

from ggufspec.llama.backend import Context, Model, default_threads
from ggufspec.llama.sequences import decode_together


def bare_context(model, n_seq: int, n_threads: int):
    p = C.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = 8192, 512, 512, n_seq
    p.n_threads = p.n_threads_batch = n_threads
    p.no_perf = True
    return C.llama_init_from_model(model._model, p)


def bare(ctx, rows: int, prompt: int, reps: int) -> float:
    """Median ms of llama_decode of one row in each of `rows` sequences after a prompt of `prompt` tokens each."""
    b, mem = C.llama_batch_init(512, 0, 1), C.llama_get_memory(ctx)
    C.llama_memory_clear(mem, True)
    for s in range(rows):
        for i in range(prompt):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = 100 + i, i, 1, i == prompt - 1
            b.seq_id[i][0] = s
        b.n_tokens = prompt
        assert C.llama_decode(ctx, b) == 0
    times = []
    for _ in range(reps):
        for i in range(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = 500 + i, prompt, 1, True
            b.seq_id[i][0] = i
        b.n_tokens = rows
        start = time.perf_counter()
        assert C.llama_decode(ctx, b) == 0
        C.llama_synchronize(ctx)
        times.append(time.perf_counter() - start)
        for s in range(rows):
            C.llama_memory_seq_rm(mem, s, prompt, -1)
    C.llama_batch_free(b)
    return statistics.median(times[1:]) * 1000


def ours(ctx, seqs, prompt: int, reps: int) -> float:
    """The same through ggufspec's sequences."""
    for s in seqs:
        s.clear()
        s.decode([100 + i for i in range(prompt)])
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        decode_together(ctx, [(s, [500 + j], "all") for j, s in enumerate(seqs)])
        times.append(time.perf_counter() - start)
        for s in seqs:
            s.truncate(prompt)
    return statistics.median(times[1:]) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--no-repack", action="store_true", help="load the model without llama.cpp's CPU weight repacking")
    a = ap.parse_args()
    threads = default_threads()
    model = Model(a.model, role="target", repack=not a.no_repack)
    raw, ctx = bare_context(model, a.rows, threads), Context(model, n_ctx=8192, n_seq=a.rows, n_threads=threads)
    try:
        for _ in range(a.rounds):
            print(f"bare {a.rows} rows {bare(raw, a.rows, a.prompt, a.reps):6.1f} ms, 1 row "
                  f"{bare(raw, 1, a.prompt, a.reps):6.1f} | ggufspec {a.rows} rows "
                  f"{ours(ctx, ctx.sequences, a.prompt, a.reps):6.1f} ms, 1 row "
                  f"{ours(ctx, ctx.sequences[:1], a.prompt, a.reps):6.1f}", flush=True)
    finally:
        C.llama_free(raw)
        ctx.close()
        model.close()


if __name__ == "__main__":
    main()
