"""What a step costs by which sequences' rows it holds: one row for each sequence of a set, decoded together on a
context of several sequences (a KV stream each, as `ggufspec serve -np N` runs), a fresh token a step so every
sequence's cache grows as a server's does. llama.cpp puts only sequences of consecutive ids, in increasing order,
into one ubatch of such a context (`llama_batch_allocr::split_equal(sequential=true)`), so rows of sequences 0 and 2
take two ubatches where rows of 0 and 1 take one. A set may also be a list of sets decoded one after another in a
step (exact groups), and `rot` sets take turns.

    python dev/seq_sets.py MODEL.gguf [--n-seq 4] [--steps 48] [--rounds 2] [SET ...]

SET: sequence ids joined by commas (`0,1,2`), groups by `+` (`0,1+2,3`), or `rotK` (K of the n-seq sequences a step,
taking turns in sequence order: consecutive ids except where a turn wraps). Prints ms per step and per token for
each set, the sets taking turns in each round so a VM's drift moves all alike. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import time

from ggufspec.llama.backend import Context, Model, default_threads
from ggufspec.llama.sequences import decode_together

DEFAULT_SETS = ["0", "0,1", "0,2", "0,1,2", "0,2,3", "0,1+2,3", "rot3", "0,1,2,3"]


def pattern(spec: str, n_seq: int):
    """The groups of sequence ids step k decodes."""
    if spec.startswith("rot"):
        m = int(spec[3:])
        return lambda k: [sorted((k * m + i) % n_seq for i in range(m))]
    groups = [[int(x) for x in g.split(",")] for g in spec.split("+")]
    return lambda k: groups


def run(ctx, groups_of, steps: int) -> tuple[float, float]:
    """(ms per step, ms per token) over `steps` steps after 8 prompt tokens on every sequence."""
    for s in ctx.sequences:
        s.clear()
        s.decode([100 + i for i in range(8)])
    tokens, start = 0, time.perf_counter()
    for k in range(steps):
        for group in groups_of(k):
            decode_together(ctx, [(ctx.sequences[j], [500 + k], "all") for j in group])
            tokens += len(group)
    seconds = time.perf_counter() - start
    return 1000 * seconds / steps, 1000 * seconds / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("sets", nargs="*", default=DEFAULT_SETS)
    ap.add_argument("--n-seq", type=int, default=4)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_intermixed_args()
    model = Model(a.model, role="target")
    ctx = Context(model, n_ctx=1024 * a.n_seq, n_seq=a.n_seq, n_threads=default_threads())
    try:
        for _ in range(a.rounds):
            print("  ".join(f"{spec}: {step:.1f} ms ({token:.1f}/token)"
                            for spec in a.sets for step, token in [run(ctx, pattern(spec, a.n_seq), a.steps)]),
                  flush=True)
    finally:
        ctx.close()
        model.close()


if __name__ == "__main__":
    main()
