"""What a decode costs on this machine, which batch sizes are bit-exact, and what pays.

Measured once per (model file, threads, offload, machine) and remembered in the cache
directory: target decode time for batches of 1..max_batch tokens, the draft's time per token,
and the largest batch whose logits equal one-token decoding bit for bit. The machine is named
by its CPU, the features this llama.cpp build uses, its devices and its version, so a cache
shared between machines (an NFS home, a copied image) never hands one machine another's costs.

From these numbers and Leviathan et al. (2023, section 3.4): with acceptance rate a, a draft of
n tokens yields E(a, n) = (1 - a^(n+1)) / (1 - a) tokens per target pass; over what the round
costs here, that is the speed-up over plain decoding that the auto mode plans with.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .backend import Context, machine
from .paths import costs_file

# Batches up to 16 tokens are timed: prompt-lookup drafts of a copied block run that long, and on
# CPUs the kernels work in rows of 4 or 8, so a size between those costs more than the next one up.
MAX_BATCH = 16
# Bit-exactness is also checked with the KV cache filled to these lengths (after the batch): on CPU,
# once the cache holds more than 256 tokens, llama.cpp's flash attention splits a one-token step's
# keys over the threads (ggml's split-KV path, n_kv >= 512) while a batch is not split, so batches
# exact at short lengths stop being exact there (seen on the Qwen pair with 2 threads: exact up to 3
# up to 256 tokens, none above; with 1 thread exact at every length).
KV_CHECKPOINTS = (64, 128, 256, 512)
LONG_KV = KV_CHECKPOINTS[-1]
# Speculate only for an expected gain of 3% or more: estimates of alpha are noisy, and a
# draft that merely breaks even costs more in variance than it gives.
MARGIN = 1.03


def expected_tokens(alpha: float, n_draft: int) -> float:
    """Leviathan et al. (2023), eq. 1: expected tokens per target pass from a draft of n_draft."""
    return float(n_draft + 1) if alpha >= 1.0 else (1.0 - alpha ** (n_draft + 1)) / (1.0 - alpha)


def best_rate(rates: list[tuple[float, int]]) -> tuple[float, int]:
    """The (rate, length) pair with the highest rate; among equal rates the shortest length."""
    return max(rates, key=lambda r: (round(r[0], 9), -r[1]))


@dataclass
class Costs:
    target_batch_seconds: list[float]  # [i] = seconds to decode a batch of i + 1 tokens
    exact_batch: int  # largest batch bit-identical to one-token decoding
    draft_token_seconds: float | None = None  # one draft step (None: no draft model)
    exact_kv: int | None = None  # ... while the KV cache holds at most this many tokens (None: every length checked)
    _chunks: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # limit -> chunk(limit)

    def batch_seconds(self, n: int) -> float:
        """Seconds to decode a batch of n tokens; beyond what was measured, linear in tokens."""
        t = self.target_batch_seconds
        return t[n - 1] if n <= len(t) else t[-1] / len(t) * n

    def chunk(self, limit: int | None = None) -> int:
        """The batch size exact verification decodes in: of the sizes up to `limit` (default: the
        largest bit-exact one), the one with the least cost per token (ties: the larger). On a CPU
        whose kernels take rows 4 or 8 at a time a batch of 8 can cost less per token than one of 9."""
        limit = min(limit or self.exact_batch, len(self.target_batch_seconds))
        if limit not in self._chunks:  # asked for every draft length the planner weighs, each round
            self._chunks[limit] = min(range(1, limit + 1), key=lambda k: (round(self.batch_seconds(k) / k, 12), -k))
        return self._chunks[limit]

    def verify_seconds(self, n: int, exact_batch: int | None = None, alpha: float = 1.0) -> float:
        """Expected seconds to verify n tokens, in one batch or (exact verification) in batches of
        at most exact_batch (those of `chunk(exact_batch)` tokens, as the loop decodes them).

        A batch starting at row s runs only if the s drafts before it were all accepted
        (probability alpha**s): exact verification stops at the first rejected batch.
        """
        if not exact_batch or n <= exact_batch:
            return self.batch_seconds(n)
        size = self.chunk(exact_batch)
        cost, start = 0.0, 0
        while start < n:
            m = min(size, n - start)
            cost += alpha ** start * self.batch_seconds(m)
            start += m
        return cost

    def ceiling(self, exact_batch: int | None = None) -> tuple[float, int]:
        """(best speed-up any drafter could give, tokens per round that give it): every draft
        accepted and drafting free, so a round of n tokens costs one verify of n rows."""
        t1 = self.batch_seconds(1)
        rates = [(n * t1 / self.verify_seconds(n, exact_batch), n) for n in range(1, len(self.target_batch_seconds) + 1)]
        return best_rate(rates)

    @property
    def target_token_seconds(self) -> float:
        return self.target_batch_seconds[0]

    def speedup(self, alpha: float, n_draft: int, draft_step: float, exact_batch: int | None = None) -> float:
        """Expected speed-up over plain decoding of rounds drafting n_draft tokens at draft_step
        seconds each, verified in one batch or in batches of at most exact_batch."""
        seconds = n_draft * draft_step + self.verify_seconds(n_draft + 1, exact_batch, alpha)
        return expected_tokens(alpha, n_draft) * self.target_token_seconds / seconds

    def best_length(self, alpha: float, draft_step: float, exact_batch: int | None = None,
                    draft_max: int = 8) -> tuple[float, int]:
        """(speed-up, draft length) of the best round at acceptance rate alpha."""
        return best_rate([(self.speedup(alpha, n, draft_step, exact_batch), n) for n in range(1, draft_max + 1)])

    def break_even(self, draft_step: float, exact_batch: int | None = None, margin: float = MARGIN,
                   draft_max: int = 8) -> float | None:
        """The smallest acceptance rate at which drafting beats plain decoding by `margin`;
        None when even an always-right drafter would not."""
        def pays(a: float) -> bool:
            return self.best_length(a, draft_step, exact_batch, draft_max)[0] > margin

        if not pays(1.0):
            return None
        lo, hi = 0.0, 1.0
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if pays(mid) else (mid, hi)
        return hi

    def report(self, exact_batch: int | None, quant: str | None = None) -> dict:
        """The ceiling, and for each kind of drafter where it starts to pay (`ggufspec costs`)."""
        ceiling, ceiling_n = self.ceiling(exact_batch)
        longest = max(1, len(self.target_batch_seconds) - 1)
        steps = {"lookup": 0.0}
        if self.draft_token_seconds:
            steps["draft model"] = self.draft_token_seconds
        drafters = {}
        for name, step in steps.items():
            best, n = self.best_length(1.0, step, exact_batch, longest)
            drafters[name] = {"draft_step_seconds": step, "break_even_alpha": self.break_even(step, exact_batch, MARGIN, longest),
                              "speedup_if_always_right": best, "draft_max_if_always_right": n}
        return {"target_batch_seconds": self.target_batch_seconds, "draft_token_seconds": self.draft_token_seconds,
                "exact_batch": self.exact_batch, "exact_kv": self.exact_kv, "ceiling_speedup": ceiling, "ceiling_tokens_per_round": ceiling_n,
                "verify_chunk": self.chunk(exact_batch) if exact_batch else None,
                "drafters": drafters, "why": self.why(quant)}

    def why(self, quant: str | None = None) -> str | None:
        """One line where verifying costs most of a step per extra token (speculation gains little
        here), saying what would change it; None where a batch is cheap."""
        n = min(4, len(self.target_batch_seconds))
        steps = self.batch_seconds(n) / self.batch_seconds(1)
        extra = (steps - 1) / max(1, n - 1)  # what each verified token beyond the first costs, in steps
        if extra < SLOW_BATCH:
            return None
        what = f"this {quant} target" if quant else "this target"
        change = "the target's layers on a GPU"
        if (quant or "").upper() != "Q8_0":
            change = ("a Q8_0 build of the target (whose CPU kernels batch cheaply: "
                      "`ggufspec bench qwen2.5-coder-1.5b-q8_0` shows one) or its layers on a GPU")
        return (f"a batch of {n} costs {steps:.2f} target steps: each extra verified token costs {extra:.2f} of a step "
                f"with {what} on this machine, so speculation can gain little here; {change} would change that")


# Each extra verified token costing this much of a target step or more is "most of a step" (`Costs.why`):
# the Q4_K_M Qwen target measured 0.44-0.77 on CPUs, its Q8_0 build 0.26-0.33; a GPU's verify batch is nearly free.
SLOW_BATCH = 0.4


def _probe_tokens(ctx: Context, n: int) -> list[int]:
    # Ordinary vocabulary entries, away from the special tokens at either end.
    lo = min(100, ctx.n_vocab // 4)
    return [lo + (i * 7919) % max(1, ctx.n_vocab // 2) for i in range(n)]


def measure_target(ctx: Context, max_batch: int = MAX_BATCH, repeats: int = 3) -> tuple[list[float], int, int | None]:
    """(seconds per batch size 1..max_batch, largest bit-exact batch, the KV length up to which it was
    found exact: None if at every checkpoint the context allows). Leaves the KV cache empty.

    The batch sizes take turns within each repeat, so a machine that slows down part way
    through skews no size against another; each size keeps its fastest time.
    """
    max_batch = max(1, min(max_batch, ctx.n_batch, ctx.n_ctx - 16))
    prefix = _probe_tokens(ctx, 8 + max_batch)
    ctx.clear()
    ctx.decode(prefix[:8], logits="none")
    base = ctx.n_past
    tokens = prefix[8:]
    for x in tokens[:3]:  # warm-up: the first decodes page the mmapped weights in
        ctx.decode([x])
    seconds = [float("inf")] * max_batch
    for _ in range(repeats):
        for b in range(1, max_batch + 1):
            ctx.truncate(base)
            start = time.perf_counter()
            ctx.decode(tokens[:b], logits="all")
            seconds[b - 1] = min(seconds[b - 1], time.perf_counter() - start)
    exact = exact_batch_at(ctx, base, max_batch)
    exact_kv, held = None, base + exact  # held: the longest KV length where exactness was seen
    if exact > 1:
        for kv in KV_CHECKPOINTS:
            if kv > ctx.n_ctx or exact_batch_at(ctx, kv - exact, exact) < exact:
                exact_kv = held  # not seen beyond: verify as inexact there
                break
            held = kv
    ctx.clear()
    return seconds, exact, exact_kv


def exact_batch_at(ctx: Context, n_past: int, max_batch: int) -> int:
    """The largest batch (up to max_batch) whose logits equal one-token decoding's, bit for bit,
    after n_past tokens. Leaves the KV cache empty."""
    tokens = _probe_tokens(ctx, n_past + max_batch)
    ctx.clear()
    ctx.decode(tokens[:n_past], logits="none")
    singles = np.stack([ctx.decode([x])[0].copy() for x in tokens[n_past:]])
    exact = max_batch
    for b in range(2, max_batch + 1):
        ctx.truncate(n_past)
        if not np.array_equal(ctx.decode(tokens[n_past:n_past + b], logits="all"), singles[:b]):
            exact = b - 1
            break
    ctx.clear()
    return exact


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


def _key(ctx: Context) -> str:
    m = ctx.model
    st = m.path.stat()
    return (f"{m.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|t{ctx.n_threads}|ngl{m.n_gpu_layers}|{m.placement}"
            f"|exact@{LONG_KV}kv|b{MAX_BATCH}|machine {machine()['id']}")


def load_cache() -> dict:
    """Every cached entry, this machine's and others' (keys end in `machine <id>`)."""
    try:
        data = json.loads(costs_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _save_cache(data: dict) -> None:
    path = costs_file()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:  # no cache (read-only, full disk): measure again next time, and leave nothing behind
        try:
            tmp.unlink()
        except OSError:
            pass


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def valid_target_entry(entry) -> bool:
    """Whether a cached target entry has the shape this version writes (else it is measured again)."""
    if not isinstance(entry, dict):
        return False
    seconds, exact, kv = entry.get("target_batch_seconds"), entry.get("exact_batch"), entry.get("exact_kv")
    return (isinstance(seconds, list) and len(seconds) >= 1 and all(map(_positive, seconds))
            and isinstance(exact, int) and not isinstance(exact, bool) and exact >= 1
            and (kv is None or (isinstance(kv, int) and not isinstance(kv, bool) and kv >= 1)))


def valid_draft_entry(entry) -> bool:
    return isinstance(entry, dict) and _positive(entry.get("token_seconds"))


def bad_entries(cache: dict) -> list[str]:
    """Keys of cached entries with the wrong shape (ignored and measured again)."""
    return [k for k, v in cache.items() if not (valid_draft_entry(v) if k.endswith("|draft") else valid_target_entry(v))]


def costs_for(target: Context, draft: Context | None = None, *, refresh: bool = False) -> Costs:
    """The costs of this target (and draft), from the cache or measured now."""
    cache = load_cache()
    tkey = _key(target)
    entry = None if refresh else cache.get(tkey)
    if not valid_target_entry(entry):  # absent, or damaged by hand or by another version: measure again
        seconds, exact, exact_kv = measure_target(target)
        entry = {"target_batch_seconds": seconds, "exact_batch": exact, "exact_kv": exact_kv, "machine": machine()["summary"]}
        cache[tkey] = entry
    draft_seconds = None
    if draft is not None:
        dkey = _key(draft) + "|draft"
        d = None if refresh else cache.get(dkey)
        if not valid_draft_entry(d):
            d = {"token_seconds": measure_draft_step(draft), "machine": machine()["summary"]}
            cache[dkey] = d
        draft_seconds = d["token_seconds"]
    _save_cache(cache)
    return Costs(entry["target_batch_seconds"], entry["exact_batch"], draft_seconds, entry.get("exact_kv"))
