"""Whether a model loads with llama.cpp's CPU weight repacking, as measured on this machine.

llama.cpp repacks Q4_0, Q4_K, IQ4_NL (and more) weights of the layers on the CPU into its CPU_REPACK buffer, whose
GEMM kernels take activation rows in groups of four: on many CPUs that decodes prompts faster, but a batch of 4 rows
or more then rounds differently than one-token decoding, so exact verification is held to batches of 3 and a loaded
server's four requests take two decodes. Without repacking the same weights go through the one-token kernels'
dot products, row by row, and batches up to 7 stay bit-identical (`ggufspec costs` shows both). Which is faster
depends on the CPU and the model: on an AMD EPYC Zen 5 (AVX-512) the Q4_K_M 1.5B decoded a 512-token prompt at 196
tok/s without repacking against 127 with it (llama-bench `--repack 0,1`), but one token at 25 against 30-33 tok/s.

`load` times one token and a batch of BATCH rows both ways, once per (model file, threads, offload, machine), and
loads without repacking where a step is no slower than STEP_TOLERANCE and a batch than TOLERANCE; elsewhere llama.cpp's
default stands. Most rounds are plain steps, so a step's few percent weigh more than further exact batches: on an Intel
Xeon (Emerald Rapids, AVX-512) the 1.5B read a step 64.6 ms without repacking against 62.0 with it at load (a batch of
64 0.61 s against 0.78), and generated 14.3-14.9 tok/s without against 15.4-15.8 with it (64 tokens after prompts of 40-130),
so at 5% its plain decoding ran 7% behind llama.cpp's own for exact batches of 7 instead of 3.
Repacking is timed twice, before and after, and its faster timings count: a VM's slow spell during one load once
made repacking look level (a Q4_K_M 1.5B's step 38.0 ms against 37.3 without, on a Zen 4) where it decodes a step in
30.0 ms against 36.7 and two streams' rows in 58 against 78, and that choice, cached, slowed every later run.
The choice is cached beside the cost tables (a table is kept per choice: `Model.devices_key` names it). A model
llama.cpp repacks nothing of (a Q8_0 or F16 one, every layer on a GPU) is loaded as it is, with nothing measured.
"""

from __future__ import annotations

from .backend import Context, Model, machine
from .cost_cache import load_cache, update_cache, valid_repack_entry
from .head_costs import probe_tokens
from .measure import model_key, paired_batches
from .system import default_threads

BATCH = 64  # rows of the batch timed both ways: a long copy's verify, a prompt's chunk
TOLERANCE = 1.05  # off where its batch takes at most this many times repacking's,
STEP_TOLERANCE = 1.02  # and its step at most this many


def load(path, *, repack: bool | None, measure: bool, n_threads: int | None, **kwargs) -> Model:
    """The model at `path` (Model's kwargs), with repacking as asked (True, False) or as measured here (None); where
    nothing is cached and `measure` is false, llama.cpp's default (repacked)."""
    model = Model(path, repack=True if repack is None else repack, **kwargs)
    if repack is not None or "CPU_REPACK" not in model.buffers:  # llama.cpp's own report: nothing repacked
        return model
    key = model_key(model, n_threads or default_threads()) + "|repack"  # as the tables', with repacking on
    cached = load_cache().get(key)
    if valid_repack_entry(cached) and "on_timings" in cached:  # (one made from one timing each way is made again)
        choice = prefers_repack(cached["on"], cached["off"])  # the rule as it is now, on the timings kept
        if choice != cached["repack"]:  # made under an earlier rule: the entry says the choice loads make now
            update_cache({key: dict(cached, repack=choice)})
    elif not measure:
        return model
    else:  # repacked, not, repacked again: each load timed, closed before the next (never two in memory at once)
        with model:
            first = timed(model, n_threads)
        with Model(path, repack=False, **kwargs) as unpacked:
            off = timed(unpacked, n_threads)
        model = Model(path, repack=True, **kwargs)
        try:
            again = timed(model, n_threads)
        except BaseException:
            model.close()
            raise
        on = {k: min(first[k], again[k]) for k in first}  # a slow spell of the VM during one load is not the kernel's
        choice = prefers_repack(on, off)
        update_cache({key: {"repack": choice, "on": on, "off": off, "on_timings": [first, again],
                            "machine": machine()["summary"]}})
    if choice == model.repacks:
        return model
    model.close()
    return Model(path, repack=choice, **kwargs)


def prefers_repack(on: dict, off: dict) -> bool:
    """Whether to keep repacking, from {"step", "batch"} seconds with it (`on`) and without (`off`): kept unless
    without it a step takes at most STEP_TOLERANCE and a batch TOLERANCE times as long (then batches stay exact
    further)."""
    return not (off["step"] <= on["step"] * STEP_TOLERANCE and off["batch"] <= on["batch"] * TOLERANCE)


def timed(model: Model, n_threads: int | None, repeats: int = 3) -> dict:
    """{"step": seconds of a one-token decode, "batch": of BATCH rows with a logits row each}, each timed paired
    with a step beside it (measure.paired_batches), after 8 cached tokens."""
    ctx = Context(model, n_ctx=BATCH + 32, n_batch=BATCH, n_threads=n_threads)
    try:
        tokens = probe_tokens(ctx, 8 + BATCH)
        ctx.decode(tokens[:8], logits="none")
        for x in tokens[8:11]:  # warm-up: the first decodes page the mmapped weights in
            ctx.decode([x])
        seconds = paired_batches(ctx, 8, tokens[8:], [1, BATCH], repeats)
    finally:
        ctx.close()
    return {"step": seconds[1], "batch": seconds[BATCH]}

