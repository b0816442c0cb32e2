"""Measuring what a decode costs here, and remembering it.

Measured once per (model file, threads, offload, machine) and remembered in the cache
directory: target decode time for batches of 1..16 tokens and of the longer sizes in
`costs.LONG_BATCHES` (those between take the next measured size's time), the draft's time per token,
the largest batch whose logits equal one-token decoding bit for bit, and how far a batch that is not moves a
pick's gap (the drift that sets greedy verification's tie margin: verification.margin_for). The machine is named
by its CPU, the features this llama.cpp build uses, its devices and its version, so a cache
shared between machines (an NFS home, a copied image) never hands one machine another's costs.

A table serves a context only if it reaches as far as that context can use (its rows and the KV
lengths checked for exactness): one measured in a small context is measured again in a larger one.
A table that does not make sense (a batch of more tokens far cheaper than one of fewer, a one-token
step that takes another time when timed again: a machine busy with something else) is measured
again, and one that stays so is used for this run only, not cached. The file itself is `cost_cache`'s.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, fields

import numpy as np

from .backend import Context, machine
from .cost_cache import load_cache, update_cache, valid_draft_entry, valid_seconds, valid_target_entry
from .head_costs import head_key, measure_head_step, probe_tokens as _probe_tokens
from .runtime import warn
from .system import say_if_shared
from ..costs import EXACT_MAX, KV_CHECKPOINTS, LONG_BATCHES, LONG_KV, MAX_BATCH, Costs, Rollback, batch_drift


def measure_target(ctx: Context, max_batch: int = MAX_BATCH, repeats: int = 3) -> dict:
    """{"seconds": per batch size 1..max_batch, "exact": the largest bit-exact batch, "exact_kv": the KV length up to
    which it was found exact (None: at every checkpoint the context allows), "drift": the largest move of a pick's
    gap seen in a batch that was not exact (costs.batch_drift)}. Leaves the KV cache empty.

    Sizes up to EXACT_MAX are each timed, longer ones at LONG_BATCHES (and max_batch); a size between
    takes the time of the next timed one up. Each is timed against a one-token step beside it (`paired_batches`).
    The drift is read where exactness ends: after the prompt where no batch is exact (and with LONG_KV tokens
    cached), else at the first cached length where exact batches stop being so.
    """
    max_batch = min(max_batch, reach(ctx)[0])
    timed = sorted(set(range(1, EXACT_MAX + 1)) | set(LONG_BATCHES) | {max_batch})
    timed = [b for b in timed if b <= max_batch]
    prefix = _probe_tokens(ctx, 8 + max_batch)
    ctx.clear()
    ctx.decode(prefix[:8], logits="none")
    base = ctx.n_past
    tokens = prefix[8:]
    for x in tokens[:3]:  # warm-up: the first decodes page the mmapped weights in
        ctx.decode([x])
    best = paired_batches(ctx, base, tokens, timed, repeats)
    seconds = [best[min(b for b in timed if b >= n)] for n in range(1, max_batch + 1)]
    rows = min(max_batch, EXACT_MAX)
    exact, drift = exact_batch_at(ctx, base, rows)
    exact_kv, held = None, base + exact  # held: the longest KV length where exactness was seen
    if exact > 1:
        for kv in KV_CHECKPOINTS:
            if kv > ctx.n_ctx:
                exact_kv = held  # not seen beyond: verify as inexact there
                break
            exact_there, drift_there = exact_batch_at(ctx, kv - exact, exact)
            if exact_there < exact:
                exact_kv, drift = held, max(drift, drift_there)
                break
            held = kv
    elif rows > 1 and LONG_KV + rows <= ctx.n_ctx:  # no batch exact anywhere: a long cache's drift too
        drift = max(drift, exact_batch_at(ctx, LONG_KV, rows)[1])
    ctx.clear()
    return {"seconds": seconds, "exact": exact, "exact_kv": exact_kv, "drift": drift}


QUICK_STEP = 0.005  # seconds: a one-token step this short is timed QUICK_REPEATS times (paired_batches)
QUICK_REPEATS = 9


def paired_batches(ctx: Context, base: int, tokens: list[int], sizes, repeats: int) -> dict[int, float]:
    """{size: seconds to decode tokens[:size] after the `base` cached tokens}, as what matters to planning: its
    ratio to a one-token step. Each batch is timed right after a one-token step, and a size's time is the median of
    its ratios to that step, times the median step. On a VM whose speed moves by a quarter from one second to the
    next (here a step read 144 to 191 ms within a minute while a batch of 64 held at 3.36-3.39 s), the fastest of
    each size (each size's luckiest moment) set a batch of 3 at 1.14 steps and one of 64 at 24 where paired timing
    reads about 1.5 and 20: auto then drafted 2-token copies where copies of 15 paid more. The sizes take turns
    within each repeat.

    Where a step takes under QUICK_STEP (a tiny model), the whole table is timed within a second, too briefly for
    the machine's speed to move, while one hiccup of the scheduler lasts as long as a batch: there each size is
    timed QUICK_REPEATS times and its fastest kept (pairs of sub-millisecond times read a batch of 64 at 1.06 ms
    beside 2.13 ms for one of 48 in 1 of 40 tables, the fastest rule in none)."""
    ratios: dict[int, list[float]] = {b: [] for b in sizes}
    fastest = dict.fromkeys(sizes, float("inf"))
    steps: list[float] = []

    def timed(b: int) -> float:
        ctx.truncate(base)
        start = time.perf_counter()
        ctx.decode(tokens[:b], logits="all")
        seconds = time.perf_counter() - start
        fastest[b] = min(fastest[b], seconds)
        return seconds

    done, quick = 0, False
    while done < (QUICK_REPEATS if quick else repeats):
        for b in sizes:
            step = timed(1)
            steps.append(step)
            if b > 1:
                ratios[b].append(timed(b) / step)
        done += 1
        quick = float(np.median(steps)) < QUICK_STEP
    if quick:
        return fastest
    step = float(np.median(steps))
    return {b: step * (float(np.median(ratios[b])) if b > 1 else 1.0) for b in sizes}


def exact_batch_at(ctx: Context, n_past: int, max_batch: int) -> tuple[int, float]:
    """(the largest batch, up to max_batch, whose logits equal one-token decoding's bit for bit after n_past
    tokens; how far a batch of max_batch moved a pick's gap there: costs.batch_drift, 0.0 where it is exact).
    Leaves the KV cache empty."""
    tokens = _probe_tokens(ctx, n_past + max_batch)
    ctx.clear()
    ctx.decode(tokens[:n_past], logits="none")
    singles = np.stack([ctx.decode([x])[0].copy() for x in tokens[n_past:]])
    exact, drift = max_batch, 0.0
    for b in range(2, max_batch + 1):
        ctx.truncate(n_past)
        if not np.array_equal(ctx.decode(tokens[n_past:n_past + b], logits="all"), singles[:b]):
            exact = b - 1
            ctx.truncate(n_past)
            drift = batch_drift(ctx.decode(tokens[n_past:n_past + max_batch], logits="all"), singles)
            break
    ctx.clear()
    return exact, drift


def measure_deep_rows(ctx: Context, seconds: list[float], repeats: int = 3) -> list | None:
    """[cached tokens, extra rows there]: what a batch's rows beyond its first cost with LONG_KV tokens cached, over
    what they cost in the table's nearly empty cache (every row attends to every cached token: auto plans a long
    prompt's rounds with it, `Costs.rows_at`). None where the context or the table is too short. Leaves it empty."""
    rows = min(len(seconds), EXACT_MAX)
    kv = min(LONG_KV, ctx.n_ctx - rows - 1)
    if rows < 2 or kv < KV_CHECKPOINTS[0] or seconds[rows - 1] <= seconds[0]:
        return None
    tokens = _probe_tokens(ctx, kv + rows)
    ctx.clear()
    ctx.decode(tokens[:kv], logits="none")
    best = paired_batches(ctx, kv, tokens[kv:], (1, rows), repeats)
    ctx.clear()
    return [kv, max(0.0, best[rows] - best[1]) / (seconds[rows - 1] - seconds[0])]


def measure_rollback(ctx: Context, repeats: int = 5) -> dict | None:
    """What a rewind costs where the memory cannot be cut (None where it can): the recurrent state's size,
    the seconds to save it (before every verify batch) and to restore it and cut the attention part (at every
    rejection), each the fastest of `repeats`. Leaves the cache empty."""
    if ctx.cuttable:
        return None
    tokens = _probe_tokens(ctx, 12)
    ctx.clear()
    ctx.decode(tokens[:8], logits="none")
    base, save, restore = ctx.n_past, float("inf"), float("inf")
    for _ in range(repeats):
        ctx.checkpoints.clear()
        start = time.perf_counter()
        ctx.checkpoints.save(ctx._ctx, base)
        save = min(save, time.perf_counter() - start)
        ctx.decode(tokens[8:], logits="none")  # a verify batch of 4, rejected whole:
        start = time.perf_counter()
        ctx.truncate(base)  # the state saved before it restored, nothing decoded again
        restore = min(restore, time.perf_counter() - start)
    size = len(ctx.checkpoints.saved[-1][1])
    ctx.clear()
    return asdict(Rollback(state_bytes=size, save_seconds=save, restore_seconds=restore, kept=ctx.checkpoints.rollback))


def measure_draft_step(ctx: Context, n: int = 6, repeats: int = 2) -> float:
    """Seconds per one-token draft step, after a warm-up (the first decodes page the weights in)."""
    tokens = _probe_tokens(ctx, 8 + n)
    ctx.clear()
    ctx.decode(tokens[:8], logits="none")
    base = ctx.n_past
    for x in tokens[8:11]:  # warm-up: mmapped weights, thread pool, caches
        ctx.decode([x])
    best = float("inf")
    for _ in range(repeats):
        ctx.truncate(base)
        start = time.perf_counter()
        for x in tokens[8:]:
            ctx.decode([x])
        best = min(best, (time.perf_counter() - start) / n)
    ctx.clear()
    return best


def measure_draft_round(ctx: Context, target: Context, step: float, repeats: int = 3) -> float:
    """Seconds a draft model's round spends beyond its steps and the target's verify batch timed alone: each draft
    begins by decoding the last round's drafted token and the target's own in one batch of 2 rows (a step is timed 1
    row at a time), and draft and target, decoding by turns, each find the CPU's caches holding the other's weights.
    Timed as rounds run (the target's 2 rows, then the draft's 2), against the target's 2 rows decoded by
    themselves. 0.5B Q4_K_M drafting for the 1.5B on an Emerald Rapids Xeon: a 1-token draft's round took 120 ms
    where the table's target batch of 2 and draft step said 96."""
    tokens = _probe_tokens(ctx, 8 + 2 * (repeats + 1))
    probe = _probe_tokens(target, 8 + 2 * (repeats + 1))  # each repeat: 2 rows after the same 8, in both
    ctx.clear(), target.clear()
    ctx.decode(tokens[:8], logits="none")
    target.decode(probe[:8], logits="none")
    base, tbase = ctx.n_past, target.n_past

    def timed(c: Context, toks: list[int]) -> float:
        start = time.perf_counter()
        c.decode(toks)
        return time.perf_counter() - start

    alone, together = [], []
    for i in range(repeats + 1):  # the first of each: a warm-up
        target.truncate(tbase)
        alone.append(timed(target, probe[8 + 2 * i:10 + 2 * i]))
    for i in range(repeats + 1):
        target.truncate(tbase), ctx.truncate(base)
        t = timed(target, probe[8 + 2 * i:10 + 2 * i])
        together.append(t + timed(ctx, tokens[8 + 2 * i:10 + 2 * i]))
    ctx.clear(), target.clear()
    return max(0.0, float(np.median(together[1:]) - np.median(alone[1:])) - step)


# What this version measures, in every key: entries of other versions are never read (measured again).
_FORMAT = f"exact@{LONG_KV}kv|b{MAX_BATCH}|deep|paired|at{'-'.join(map(str, LONG_BATCHES))}"


def _key(ctx: Context) -> str:
    # a quantized KV cache decodes at another speed
    return model_key(ctx.model, ctx.n_threads, getattr(ctx, "cache_types", ("f16", "f16")))


def model_key(m, n_threads: int, cache_types: tuple[str, str] = ("f16", "f16")) -> str:
    """The cache key of what model m costs with n_threads and these KV types on this machine (m.stamp: the file's
    size|mtime when it was loaded; it may be gone since)."""
    kv = "" if cache_types == ("f16", "f16") else f",kv:{cache_types[0]}/{cache_types[1]}"
    return (f"{m.path.resolve()}|{m.stamp}|t{n_threads}|ngl{m.n_gpu_layers}|{m.devices_key}{kv}"
            f"|{_FORMAT}|machine {machine()['id']}")


def reach(ctx: Context) -> tuple[int, int]:
    """How far a table for this context must go: (batch sizes, the KV length exactness is checked to)."""
    return max(1, min(MAX_BATCH, ctx.n_batch, ctx.n_ctx - 16)), min(ctx.n_ctx, LONG_KV)


def serves(entry: dict, ctx: Context) -> bool:
    """Whether a valid cached table reaches as far as this context can use."""
    rows, kv = reach(ctx)
    return (len(entry["target_batch_seconds"]) >= rows and entry.get("kv_reach", 0) >= kv
            and (ctx.cuttable or (entry.get("rollback") or {}).get("kept") == ctx.checkpoints.rollback))


# Tables this process measured but did not cache (erratic: shared CPUs), by key: the next Engine on the same
# model in this process uses them instead of measuring again, while the CPUs are still shared.
_UNCACHED: dict[str, dict] = {}

NOISE = 1e-3  # seconds: differences below a millisecond are timer and scheduler noise, not a busy machine


def sane(seconds: list[float], again: float) -> bool:
    """No batch far cheaper than a smaller one (under half), and the one-token step about as long when timed
    again (within 3x); differences under NOISE do not count."""
    most = 0.0
    for s in seconds:
        if s < 0.5 * most and most - s > NOISE:
            return False
        most = max(most, s)
    return abs(again - seconds[0]) <= NOISE or 1 / 3 <= again / seconds[0] <= 3.0


def measure_target_sanely(ctx: Context, tries: int = 3) -> tuple[dict, bool]:
    """A target entry for the cache, and whether it made sense (measured up to `tries` times until it does, or
    once where the CPUs are shared: measuring again there only gives another erratic table)."""
    for _ in range(tries):
        measured = measure_target(ctx)
        seconds = measured["seconds"]
        again = measure_draft_step(ctx, n=3, repeats=2)  # the one-token step, timed afresh
        ok = sane(seconds, again)
        if ok or say_if_shared(ctx.n_threads):
            break  # otherwise measured again, quietly: one hiccup of the scheduler is not worth a line
    if not ok:
        warn(f"ggufspec: {ctx.model.path.name}: the measured decode times do not add up (one token "
             f"{seconds[0] * 1e3:.2f} ms, then {again * 1e3:.2f} ms; a busy machine?): used for this run, not cached")
    entry = {"target_batch_seconds": seconds, "exact_batch": measured["exact"], "exact_kv": measured["exact_kv"],
             "drift": measured["drift"], "kv_reach": reach(ctx)[1],
             "deep_rows": measure_deep_rows(ctx, seconds), "rollback": measure_rollback(ctx),
             "machine": machine()["summary"]}
    return entry, ok


MOVED = 1.5  # a one-token step this many times faster or slower than the cached table's: measured again
RESCALED = 1.1  # ... this many times, but under MOVED: the cached table read at the speed timed now


def step_now(cached: float, ctx: Context) -> float | None:
    """The factor this model's one-token step now takes over the `cached` seconds (timed afresh, as
    measure_target_sanely does); None where the table is to be measured again (by MOVED or more, and by more than
    NOISE: a table measured while something else ran, or before a change of clocks or power settings, would
    misplace auto's choices and every footer's figures; warns). Slower because others run now, on shared CPUs: 1
    (the table measured when quiet stands). Within RESCALED (or NOISE) of the table: 1."""
    now = measure_draft_step(ctx, n=3, repeats=2)
    if abs(now - cached) <= NOISE or 1 / RESCALED < now / cached < RESCALED:
        return 1.0
    if now > cached and say_if_shared(ctx.n_threads):
        return 1.0
    if 1 / MOVED < now / cached < MOVED:
        return now / cached  # the same shape, at another speed: a busier or quieter day on the same machine
    warn(f"ggufspec: {ctx.model.path.name}: a step takes {now * 1e3:.1f} ms now, {cached * 1e3:.1f} ms when its "
         "costs were measured (the machine was busier or freer then): measuring them again")
    return None


def is_current(key: str) -> bool:
    """Whether this version would read the entry under `key` today: its format, and its file as it was measured."""
    parts = key.split("|")  # path|size|mtime|tN|nglN|devices|exact@...|bN|machine id[|draft]
    if f"|{_FORMAT}|machine " not in key:
        return False
    try:
        st = os.stat(parts[0])
    except OSError:
        return False
    return parts[1:3] == [str(st.st_size), str(st.st_mtime_ns)]


def costs_for(target: Context, draft: Context | None = None, *, refresh: bool = False, heads=()) -> Costs:
    """The costs of this target (and draft, and the heads following it: MTP, EAGLE-3, DFlash), from the cache or
    measured now."""
    cache, new = load_cache(), {}
    tkey = _key(target)
    entry = None if refresh else cache.get(tkey)
    # absent, damaged by hand or by another version, or too short for this context: measure again
    usable = valid_target_entry(entry) and serves(entry, target)
    speed = 1.0  # a cached table's seconds times this: today's (the heads' too: they run on the target's device)
    if usable:
        factor = step_now(entry["target_batch_seconds"][0], target)
        if factor is None:
            refresh = True  # the machine runs at another speed than when this was measured: the draft's too
        elif factor != 1.0:  # read at today's speed (auto's first choices, the footers), not written back
            speed = factor
            entry = dict(entry, target_batch_seconds=[s * factor for s in entry["target_batch_seconds"]])
    if not refresh and not usable and tkey in _UNCACHED and say_if_shared(target.n_threads):
        entry = _UNCACHED[tkey]  # erratic in this process, and the CPUs still shared: not measured again and again
    elif refresh or not usable:
        entry, keep = measure_target_sanely(target)
        if keep:
            new[tkey] = entry
            _UNCACHED.pop(tkey, None)
        else:
            _UNCACHED[tkey] = entry
    draft_seconds, draft_round = None, 0.0
    if draft is not None:
        dkey = _key(draft) + "|draft"
        d = None if refresh else cache.get(dkey)
        factor = step_now(d["token_seconds"], draft) if valid_draft_entry(d) else None
        if factor is None:
            step = measure_draft_step(draft)
            d = new[dkey] = {"token_seconds": step, "round_seconds": measure_draft_round(draft, target, step),
                             "machine": machine()["summary"]}
        elif not valid_seconds(d.get("round_seconds")):  # an older entry (or one damaged by hand): timed now, at
            # today's speed, and kept at the speed its step was measured at
            d = new[dkey] = dict(d, round_seconds=measure_draft_round(draft, target, d["token_seconds"] * factor) / factor)
        factor = factor or 1.0  # measured just now: as it is
        draft_seconds, draft_round = d["token_seconds"] * factor, d["round_seconds"] * factor
    head_seconds = {}
    for head in heads or ():
        hkey = head_key(tkey, head)
        d = None if refresh else cache.get(hkey)
        if not valid_draft_entry(d):
            measured = measure_head_step(head)
            d = {"token_seconds": measured["token"], "round_seconds": measured.get("round", 0.0),
                 "machine": machine()["summary"]}
            new[hkey] = d
        scale = 1.0 if hkey in new else speed
        head_seconds[head.name] = {"token": d["token_seconds"] * scale, "round": (d.get("round_seconds") or 0.0) * scale,
                                   "longest": getattr(head, "max_draft", None)}  # a DFlash block's drafts
    update_cache(new)
    rollback = entry.get("rollback")
    return Costs(entry["target_batch_seconds"], entry["exact_batch"], draft_seconds, entry.get("exact_kv"),
                 Rollback(**{f.name: rollback[f.name] for f in fields(Rollback)}) if rollback else None,
                 head_seconds=head_seconds, deep_rows=tuple(entry["deep_rows"]) if entry.get("deep_rows") else None,
                 drift=entry.get("drift"), draft_round_seconds=draft_round)
