"""`ggufspec tune`: the fastest offload and drafting settings for a pair on this machine, measured.

Plans GPU offload for the budget (as `ggufspec plan` does), then runs the benchmark's code on -ngl / -ngld
values around the plan (for a mixture of experts whose layers all fit with some experts on the CPU, the
expert split, --n-cpu-moe, around the plan's instead of -ngl) and each --draft-max (target-only, the draft
model and auto, greedy, on the same prompts, interleaved), and picks the fastest. `save_best` writes it as the pair's
defaults in the user's models.toml (`check_save` first: before measuring, so no result is lost to a file that
cannot take it). With RPC servers the target's layers go there (their free memory is the budget) and the draft
stays on this machine, as in `ggufspec generate --rpc`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..engine import Engine
from ..errors import GGUFSpecError
from ..llama.backend import Model, supports_gpu_offload
from ..llama.gguf_info import read_info
from ..llama.rpc import budgets, devices_for
from ..models.offload import detect_vram, moe_text, plan, sizes_for, total_ram
from ..models.registry import save_pair
from ..paths import user_registry
from .prompts import Prompt
from .rows import rows
from .runs import BenchSettings, prompt_tokens, run

# plain decoding, the draft model and the target's MTP layers (where it has them) at each length, and auto
TUNE_MODES = ("target", "draft", "mtp", "auto")


@dataclass
class TuneSettings:
    n_ctx: int = 4096
    draft_max: tuple[int, ...] = (1, 2, 3, 4)
    max_tokens: int = 64
    repeats: int = 2  # interleaved repeats per setting (median reported)
    step: int = 4  # -ngl (or --n-cpu-moe) values tried: plan - step, plan, plan + step
    vram_bytes: int | None = None  # None: the free memory llama.cpp reports (the RPC servers' with rpc)
    rpc: str | None = None
    type_k: str = "f16"  # the KV caches' types (-ctk, -ctv)
    type_v: str = "f16"


@dataclass
class TuneResult:
    rows: list[dict]  # one per (ngl, ngld, cpu_moe, mode, draft_max)
    best: dict
    pair: str | None  # the pair's name, where one was named (what save_best writes under)
    gpu: bool  # whether layers were placed on a GPU (else only the drafting settings were tuned)
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False  # stopped by Ctrl-C or SIGTERM: the rows are what finished

    @property
    def flags(self) -> str:
        """The best setting as flags: exactly what `save_best` writes (no placement where none was tuned)."""
        b = self.best
        placement = f"{placement_flags(b['ngl'], b['cpu_moe'], b['ngld'])} " if self.gpu else ""
        return f"{placement}--mode {b['mode']}" + (f" --draft-max {b['draft_max']}" if b["draft_max"] else "")


def placement_flags(ngl: int, cpu_moe: int | None, ngld: int) -> str:
    """One placement as llama.cpp's flags (cpu_moe None: a dense target, no expert split)."""
    return f"-ngl {ngl}" + (f" --n-cpu-moe {moe_text(cpu_moe)}" if cpu_moe is not None else "") + f" -ngld {ngld}"


def candidates(planned: int, n_layers: int, step: int) -> list[int]:
    """-ngl values around the planned one, within 0..n_layers + 1 (the output layer counts as one more)."""
    return sorted(v for v in {planned, planned - step, planned + step} if 0 <= v <= n_layers + 1)


@dataclass
class Grid:
    """The settings tune measures: -ngl and -ngld values, the expert splits (None: a dense target, or no GPU)."""

    ngls: list[int]
    nglds: list[int]
    moes: list[int | None]
    devices: tuple
    gpu: bool


def placements(target: Path, draft: Path | None, s: TuneSettings) -> Grid:
    t_devices, d_devices = devices_for(s.rpc)
    free, d_vram = budgets(t_devices, d_devices) if s.rpc else ({}, None)
    vram = s.vram_bytes if s.vram_bytes is not None else sum(free.values()) if s.rpc else detect_vram()
    if not (supports_gpu_offload() and vram > 0):
        return Grid([0], [0], [None], (t_devices, d_devices), False)
    t_sizes, d_sizes = sizes_for(target), sizes_for(draft) if draft else None
    p = plan(t_sizes, d_sizes, vram_bytes=vram, ram_bytes=total_ram(), n_ctx=s.n_ctx, draft_vram_bytes=d_vram,
             type_k=s.type_k, type_v=s.type_v)
    nglds = sorted({p.draft.n_gpu_layers, d_sizes.n_layers + 1}) if d_sizes and d_vram != 0 else [0]
    ngls, moes = candidates(p.target.n_gpu_layers, t_sizes.n_layers, s.step), [None]
    if any(t_sizes.expert_bytes or ()):
        if p.target.n_gpu_layers > t_sizes.n_layers and p.target.cpu_moe < t_sizes.n_layers:
            # every layer fits with the experts of the first few on the CPU: the split is what to measure
            ngls = [p.target.n_gpu_layers]
            moes = sorted({min(max(p.target.cpu_moe + d, 0), t_sizes.n_layers) for d in (-s.step, 0, s.step)})
        else:
            moes = [p.target.cpu_moe or 0]
    return Grid(ngls, nglds, moes, (t_devices, d_devices), True)


def measure(target: Path, draft: Path | None, prompts: list[Prompt], s: TuneSettings, *, pair: str | None = None,
            progress=None) -> TuneResult:
    """Every placement around the plan, each with the benchmark's target, draft and auto rows; a placement
    llama.cpp cannot load (out of memory) is left out with a note. pair: the pair's name, where one was
    named (what `save_best` writes under). Ctrl-C (a KeyboardInterrupt) keeps the rows that finished
    (interrupted=True); raised again when none had."""
    has_mtp = read_info(target).n_nextn > 0
    if draft is None and not has_mtp:
        raise GGUFSpecError("tune needs a draft model (name a pair or give -md DRAFT) or a target with MTP layers")
    check_context(target, prompts, s)
    grid = placements(target, draft, s)
    t_devices, d_devices = grid.devices
    modes = tuple(m for m in TUNE_MODES if (m != "draft" or draft is not None) and (m != "mtp" or has_mtp))
    settings = BenchSettings(modes, s.draft_max, s.max_tokens, s.repeats, 1, True, {}).validate()
    found, notes, interrupted = [], [], False
    try:
        for ngl, moe, ngld in ((ngl, moe, ngld) for ngl in grid.ngls for moe in grid.moes for ngld in grid.nglds):
            try:
                engine = Engine(target, draft, n_ctx=s.n_ctx, n_gpu_layers=ngl, draft_n_gpu_layers=ngld,
                                devices=t_devices, draft_devices=d_devices, cpu_moe=moe or 0, type_k=s.type_k,
                                type_v=s.type_v)
            except GGUFSpecError as e:
                notes.append(f"{placement_flags(ngl, moe, ngld)} was left out: {e}")
                continue
            with engine:
                runs = []
                try:
                    run(engine, prompts, settings, runs, progress=progress)
                except KeyboardInterrupt:
                    interrupted = True
                found += [_row(ngl, ngld, moe, row) for row in rows(runs, engine, settings)] if runs else []
            if interrupted:
                break
    except KeyboardInterrupt:  # while a placement loaded
        interrupted = True
    if interrupted and not found:
        raise KeyboardInterrupt
    if not found:
        raise GGUFSpecError("no placement around the plan could be loaded: " + "; ".join(notes))
    result = _pick(found, grid.gpu, pair)
    result.notes[:0] = notes
    result.interrupted = interrupted
    return result


def check_context(target: Path, prompts: list[Prompt], s: TuneSettings) -> None:
    """Each prompt, its -n tokens and a last draft fit the context, or one line naming -c and what to do. Before
    any placement loads (from the vocabulary alone): a context too small is no placement's fault."""
    with Model(target, role="target", vocab_only=True) as model:
        for prompt in prompts:
            n = len(prompt_tokens(_Vocabulary(model), prompt))
            need = n + s.max_tokens + max(s.draft_max)
            if need > s.n_ctx:
                raise GGUFSpecError(f"-c {s.n_ctx} is too small for tune: prompt {prompt.label} is {n} tokens, and -n "
                                    f"{s.max_tokens} with drafts of up to {max(s.draft_max)} need {need}; give -c "
                                    f"{need} or more (or a smaller -n)")


@dataclass
class _Vocabulary:
    """What `prompt_tokens` reads of an Engine (its one rule for templates), from a vocabulary-only load."""

    target_model: Model

    def tokenize_prompt(self, prompt=None, messages=None) -> list[int]:
        return self.target_model.tokenize_chat(messages) if messages is not None else self.target_model.tokenize(prompt)


def _row(ngl: int, ngld: int, cpu_moe: int | None, row: dict) -> dict:
    return {"ngl": ngl, "ngld": ngld, "cpu_moe": cpu_moe, "mode": row["mode"], "draft_max": row["draft_max"],
            "tokens_per_second": row["tokens_per_second"], "min": row["tokens_per_second_min"],
            "max": row["tokens_per_second_max"], "speedup": row["speedup"], "alpha": row["acceptance_rate"],
            "identical": row["identical_to_target"]}


def _pick(found: list[dict], gpu: bool, pair: str | None) -> TuneResult:
    best = max(found, key=lambda r: r["tokens_per_second"])
    notes = []
    if not gpu:
        notes.append("this llama.cpp build has no GPU (or no memory budget was found): layers stay on the CPU; "
                     "only the drafting settings were tuned")
    same = ("ngl", "ngld", "cpu_moe")
    plain = [r for r in found if r["mode"] == "target" and all(r[k] == best[k] for k in same)]
    if plain and best["mode"] != "target" and best["min"] <= plain[0]["max"]:
        notes.append("the best setting's range overlaps plain decoding's: on this machine the difference is within "
                     "run-to-run noise (more --repeats or -n narrow it)")
    return TuneResult(found, best, pair, gpu, notes + (why(found, best) if gpu else []))


def why(found: list[dict], best: dict) -> list[str]:
    """What the measured placements say, in a line each: what a target layer (or a layer's experts) moved to the
    CPU costs per token, from the target alone at the best's other settings, and what the draft's place is worth,
    from the fastest drafting row at each -ngld."""
    lines = []
    moved = "ngl" if len({r["ngl"] for r in found}) > 1 else "cpu_moe" if len({r["cpu_moe"] for r in found}) > 1 else None
    if moved:
        fixed = [k for k in ("ngl", "cpu_moe", "ngld") if k != moved]
        plain = sorted((r[moved], r["tokens_per_second"]) for r in found
                       if r["mode"] == "target" and all(r[k] == best[k] for k in fixed))
        if len(plain) > 1 and plain[0][1] > 0 and plain[-1][1] > 0:
            (low, slow), (high, fast) = plain[0], plain[-1]
            ms = (1 / slow - 1 / fast) * 1000 / (high - low)
            if moved == "cpu_moe":  # more layers' experts on the CPU is the slower end
                ms, (low, slow), (high, fast) = -ms, (high, fast), (low, slow)
            what = "a target layer on the CPU instead of the GPU" if moved == "ngl" else "a layer's experts on the CPU"
            lines.append(f"{what} costs {ms:.2f} ms a token here (the target alone: {slow:.2f} tok/s at "
                         f"{_flag(moved, low)}, {fast:.2f} at {_flag(moved, high)})")
    drafting = {}
    for r in found:
        if r["mode"] != "target" and r["tokens_per_second"] > drafting.get(r["ngld"], 0.0):
            drafting[r["ngld"]] = r["tokens_per_second"]
    if len(drafting) > 1:
        on, off = max(drafting), min(drafting)
        lines.append(f"the draft with -ngld {on}: {drafting[on]:.2f} tok/s at best, with -ngld {off}: "
                     f"{drafting[off]:.2f} (the plan puts the draft on the GPU first, then the target's layers)")
    return lines


def _flag(key: str, value: int) -> str:
    return f"-ngl {value}" if key == "ngl" else f"--n-cpu-moe {moe_text(value)}"


def check_save(pair: str | None, registry: str | Path | None = None) -> None:
    """That `save_best` can write under this pair's name: a name was given, and the registry file takes a value
    for it and can be written (every check of `save_pair`, nothing written). Before measuring."""
    save_pair(_registry_file(pair, registry), pair, {"mode": "target"}, check_only=True)


def best_values(result: TuneResult) -> dict:
    """The pair's table entries for the best setting: exactly its flags (`TuneResult.flags`). No layer counts
    where no placement was tuned (a CPU-only build): a registry shared with a GPU machine keeps its own."""
    best = result.best
    values = {"n_gpu_layers": best["ngl"], "draft_n_gpu_layers": best["ngld"]} if result.gpu else {}
    if result.gpu and best["cpu_moe"] is not None:
        values["n_cpu_moe"] = "all" if best["cpu_moe"] < 0 else best["cpu_moe"]
    values["mode"] = best["mode"]
    if best["draft_max"]:
        values["draft_max"] = best["draft_max"]  # draft mode's length; with mode = "auto", auto's cap
    return values


def save_best(result: TuneResult, registry: str | Path | None = None) -> Path:
    """Write the best setting as the pair's defaults in the user's models.toml (or `registry`), the rest of the
    file as it was; returns the file written (a link's target)."""
    return save_pair(_registry_file(result.pair, registry), result.pair, best_values(result))


def _registry_file(pair: str | None, registry: str | Path | None) -> Path:
    if not pair:
        raise GGUFSpecError("--write needs a pair name (not -m/-md paths) to save the setting under")
    return Path(registry) if registry else user_registry()
