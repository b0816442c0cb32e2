"""What a decode costs on this machine, and which batch sizes are bit-exact.

Measured once per (model file, threads, offload, llama.cpp version) and remembered in the cache
directory: target decode time for batches of 1..max_batch tokens, the draft's time per token,
and the largest batch whose logits equal one-token decoding bit for bit. The auto drafting
mode plans with these numbers (Leviathan et al. 2023, section 3.4).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .backend import Context, llama_cpp_version

MAX_BATCH = 9


def best_rate(rates: list[tuple[float, int]]) -> tuple[float, int]:
    """The (rate, length) pair with the highest rate; among equal rates the shortest length."""
    return max(rates, key=lambda r: (round(r[0], 9), -r[1]))


@dataclass
class Costs:
    target_batch_seconds: list[float]  # [i] = seconds to decode a batch of i + 1 tokens
    exact_batch: int  # largest batch bit-identical to one-token decoding
    draft_token_seconds: float | None = None  # one draft step (None: no draft model)

    def batch_seconds(self, n: int) -> float:
        """Seconds to decode a batch of n tokens; beyond what was measured, linear in tokens."""
        t = self.target_batch_seconds
        return t[n - 1] if n <= len(t) else t[-1] / len(t) * n

    def verify_seconds(self, n: int, chunk: int | None = None, alpha: float = 1.0) -> float:
        """Expected seconds to verify n tokens, in one batch or in chunks of `chunk`.

        A chunk starting at row s runs only if the s drafts before it were all accepted
        (probability alpha**s): exact verification stops at the first rejected chunk.
        """
        if not chunk or n <= chunk:
            return self.batch_seconds(n)
        cost, start = 0.0, 0
        while start < n:
            m = min(chunk, n - start)
            cost += alpha ** start * self.batch_seconds(m)
            start += m
        return cost

    def ceiling(self, chunk: int | None = None) -> tuple[float, int]:
        """(best speed-up any drafter could give, tokens per round that give it): every draft
        accepted and drafting free, so a round of n tokens costs one verify of n rows."""
        t1 = self.batch_seconds(1)
        rates = [(n * t1 / self.verify_seconds(n, chunk), n) for n in range(1, len(self.target_batch_seconds) + 1)]
        return best_rate(rates)

    @property
    def target_token_seconds(self) -> float:
        return self.target_batch_seconds[0]


def _probe_tokens(ctx: Context, n: int) -> list[int]:
    # Ordinary vocabulary entries, away from the special tokens at either end.
    lo = min(100, ctx.n_vocab // 4)
    return [lo + (i * 7919) % max(1, ctx.n_vocab // 2) for i in range(n)]


def measure_target(ctx: Context, max_batch: int = MAX_BATCH, repeats: int = 3) -> tuple[list[float], int]:
    """(seconds per batch size 1..max_batch, largest bit-exact batch). Leaves the KV cache empty.

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
    ctx.truncate(base)
    singles = []
    for x in tokens:
        singles.append(ctx.decode([x])[0].copy())
    exact = None
    seconds = [float("inf")] * max_batch
    for _ in range(repeats):
        for b in range(1, max_batch + 1):
            ctx.truncate(base)
            start = time.perf_counter()
            rows = ctx.decode(tokens[:b], logits="all")
            seconds[b - 1] = min(seconds[b - 1], time.perf_counter() - start)
            if exact is None and b > 1 and not np.array_equal(rows, np.stack(singles[:b])):
                exact = b - 1
    ctx.clear()
    return seconds, exact if exact is not None else max_batch


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


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("GGUFSPEC_COSTS_FILE") or base / "ggufspec" / "costs.json")


def _key(ctx: Context) -> str:
    m = ctx.model
    st = m.path.stat()
    return f"{m.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|t{ctx.n_threads}|ngl{m.n_gpu_layers}|llama.cpp {llama_cpp_version()}"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(data: dict) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # no cache: measure again next time


def costs_for(target: Context, draft: Context | None = None, *, refresh: bool = False) -> Costs:
    """The costs of this target (and draft), from the cache or measured now."""
    cache = _load_cache()
    tkey = _key(target)
    entry = None if refresh else cache.get(tkey)
    if entry is None:
        seconds, exact = measure_target(target)
        entry = {"target_batch_seconds": seconds, "exact_batch": exact}
        cache[tkey] = entry
    draft_seconds = None
    if draft is not None:
        dkey = _key(draft) + "|draft"
        d = None if refresh else cache.get(dkey)
        if d is None:
            d = {"token_seconds": measure_draft_step(draft)}
            cache[dkey] = d
        draft_seconds = d["token_seconds"]
    _save_cache(cache)
    return Costs(entry["target_batch_seconds"], entry["exact_batch"], draft_seconds)


def to_dict(costs: Costs) -> dict:
    return asdict(costs)
