"""`ggufspec tune`: the fastest offload and drafting settings for a pair on this machine, measured.

Plans GPU offload for the budget (as `ggufspec plan` does), then runs the benchmark's code on -ngl / -ngld
values around the plan and each --draft-max (target-only, the draft model and auto, greedy, on the same
prompts, interleaved), and picks the fastest. `save_best` writes it as the pair's defaults in the user's
models.toml. With RPC servers the target's layers go there (their free memory is the budget) and the draft
stays on this machine, as in `ggufspec generate --rpc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Engine
from ..errors import GGUFSpecError
from ..llama.backend import supports_gpu_offload
from ..llama.rpc import budgets, devices_for
from ..models.offload import detect_vram, plan, sizes_for, total_ram
from ..models.registry import load_registry, save_pair_defaults
from ..paths import user_registry
from .prompts import Prompt
from .rows import rows
from .runs import BenchSettings, run

TUNE_MODES = ("target", "draft", "auto")  # plain decoding, the draft model at each length, and auto


@dataclass
class TuneSettings:
    n_ctx: int = 4096
    draft_max: tuple[int, ...] = (1, 2, 3, 4)
    max_tokens: int = 64
    repeats: int = 2  # interleaved repeats per setting (median reported)
    step: int = 4  # -ngl values tried: plan - step, plan, plan + step
    vram_bytes: int | None = None  # None: the free memory llama.cpp reports (the RPC servers' with rpc)
    rpc: str | None = None


@dataclass
class TuneResult:
    rows: list[dict]  # one per (ngl, ngld, mode, draft_max)
    best: dict
    pair: str | None  # the pair's name, where one was named (what save_best writes under)
    gpu: bool  # whether layers were placed on a GPU (else only the drafting settings were tuned)
    notes: list[str] = field(default_factory=list)

    @property
    def flags(self) -> str:
        b = self.best
        return (f"-ngl {b['ngl']} -ngld {b['ngld']} --mode {b['mode']}"
                + (f" --draft-max {b['draft_max']}" if b["draft_max"] else ""))


def candidates(planned: int, n_layers: int, step: int) -> list[int]:
    """-ngl values around the planned one, within 0..n_layers + 1 (the output layer counts as one more)."""
    return sorted(v for v in {planned, planned - step, planned + step} if 0 <= v <= n_layers + 1)


def placements(target: Path, draft: Path | None, s: TuneSettings) -> tuple[list[int], list[int], tuple, bool]:
    """(-ngl values, -ngld values, (target devices, draft devices), whether a GPU takes layers)."""
    t_devices, d_devices = devices_for(s.rpc)
    free, d_vram = budgets(t_devices, d_devices) if s.rpc else ({}, None)
    vram = s.vram_bytes if s.vram_bytes is not None else sum(free.values()) if s.rpc else detect_vram()
    if not (supports_gpu_offload() and vram > 0):
        return [0], [0], (t_devices, d_devices), False
    t_sizes, d_sizes = sizes_for(target), sizes_for(draft) if draft else None
    p = plan(t_sizes, d_sizes, vram_bytes=vram, ram_bytes=total_ram(), n_ctx=s.n_ctx, draft_vram_bytes=d_vram)
    ngls = candidates(p.target.n_gpu_layers, t_sizes.n_layers, s.step)
    nglds = sorted({p.draft.n_gpu_layers, d_sizes.n_layers + 1}) if d_sizes and d_vram != 0 else [0]
    return ngls, nglds, (t_devices, d_devices), True


def measure(target: Path, draft: Path | None, prompts: list[Prompt], s: TuneSettings, *, pair: str | None = None,
            progress=None) -> TuneResult:
    """Every placement around the plan, each with the benchmark's target, draft and auto rows. pair: the
    pair's name, where one was named (what `save_best` writes under)."""
    if draft is None:
        raise GGUFSpecError("tune needs a draft model: name a pair or give -md DRAFT")
    ngls, nglds, (t_devices, d_devices), gpu = placements(target, draft, s)
    settings = BenchSettings(TUNE_MODES, s.draft_max, s.max_tokens, s.repeats, 1, True, {}).validate()
    found = []
    for ngl in ngls:
        for ngld in nglds:
            with Engine(target, draft, n_ctx=s.n_ctx, n_gpu_layers=ngl, draft_n_gpu_layers=ngld,
                        devices=t_devices, draft_devices=d_devices) as engine:
                runs = run(engine, prompts, settings, [], progress=progress)
                found += [_row(ngl, ngld, row) for row in rows(runs, engine, settings)]
    return _pick(found, gpu, pair)


def _row(ngl: int, ngld: int, row: dict) -> dict:
    return {"ngl": ngl, "ngld": ngld, "mode": row["mode"], "draft_max": row["draft_max"],
            "tokens_per_second": row["tokens_per_second"], "min": row["tokens_per_second_min"],
            "max": row["tokens_per_second_max"], "speedup": row["speedup"], "alpha": row["acceptance_rate"],
            "identical": row["identical_to_target"]}


def _pick(found: list[dict], gpu: bool, pair: str | None) -> TuneResult:
    best = max(found, key=lambda r: r["tokens_per_second"])
    notes = []
    if not gpu:
        notes.append("this llama.cpp build has no GPU (or no memory budget was found): layers stay on the CPU; "
                     "only the drafting settings were tuned")
    plain = [r for r in found if r["mode"] == "target" and (r["ngl"], r["ngld"]) == (best["ngl"], best["ngld"])]
    if plain and best["mode"] != "target" and best["min"] <= plain[0]["max"]:
        notes.append("the best setting's range overlaps plain decoding's: on this machine the difference is within "
                     "run-to-run noise (more --repeats or -n narrow it)")
    return TuneResult(found, best, pair, gpu, notes)


def save_best(result: TuneResult, registry: str | Path | None = None) -> Path:
    """Write the best setting as the pair's defaults in the user's models.toml (or `registry`)."""
    if not result.pair:
        raise GGUFSpecError("--write needs a pair name (not -m/-md paths) to save the setting under")
    best = result.best
    values = {"n_gpu_layers": best["ngl"], "draft_n_gpu_layers": best["ngld"], "mode": best["mode"]}
    if best["draft_max"] and best["mode"] == "draft":
        values["draft_max"] = best["draft_max"]
    path = save_pair_defaults(Path(registry) if registry else user_registry(), result.pair, values)
    load_registry(path)  # what was written must load
    return path
