"""`ggufspec drafts --measure`: each usable candidate of `models.drafts.find_drafts` measured on this machine.

For each, the benchmark's code (`runs.run`, `rows.rows`) runs the target alone and the candidate's mode at each
draft length on a few prompts (greedy, short): the acceptance rate, the measured costs (`Engine.costs`), the speed-up
Leviathan's formula expects from them (`rows`' predicted_speedup_costs) and the measured one, of the length that
measured best. One Engine serves the drafters that need no draft file (prompt lookup, the target's MTP layers).
`save_best` writes the fastest measured candidate as a pair in the user's models.toml (`registry.save_pair`), where
it has a draft file and beat the target alone.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..core import HEAD_MODES, MODES
from ..engine import Engine
from ..errors import GGUFSpecError
from ..models.drafts import rank
from ..models.registry import save_pair
from ..paths import user_registry
from .prompts import load_prompts
from .report import mib, table
from .rows import rows
from .runs import BenchSettings, run


@dataclass
class MeasureSettings:
    suites: str = "code"
    limit: int = 2  # prompts per suite
    max_tokens: int = 32
    draft_max: tuple[int, ...] = (2, 4)
    n_ctx: int = 2048


def measurable(candidate: dict) -> bool:
    return bool(candidate["usable"]) and candidate["mode"] in MODES and (candidate["path"] or candidate["mode"] == "lookup")


def measure(found: dict, s: MeasureSettings, progress=None, announce=None) -> dict:
    """`found` (find_drafts' answer) with each usable candidate's `measured` filled in, ranked again by measured
    speed-up; a Ctrl-C keeps what finished (interrupted=True)."""
    from ..models.drafts import Candidate

    prompts = load_prompts(None, s.suites, s.limit)
    target = Path(found["target"]["path"])
    todo = [c for c in found["candidates"] if measurable(c)]
    by_engine: dict[str | None, list[dict]] = {}
    for c in todo:  # the drafters without a file of their own (lookup, the target's MTP layers) share one engine
        by_engine.setdefault(None if c["mode"] == "lookup" or c["path"] == str(target) else c["path"], []).append(c)
    interrupted = False
    try:
        for i, (draft, group) in enumerate(by_engine.items()):
            if announce:
                announce(f"measuring {', '.join(c['name'] for c in group)} ({i + 1}/{len(by_engine)})")
            _measure_group(target, draft, group, prompts, s, progress)
    except KeyboardInterrupt:
        interrupted = True
    candidates = rank([Candidate(**c) for c in found["candidates"]])
    return {**found, "candidates": [c.to_dict() for c in candidates], "measured": True, "interrupted": interrupted}


def _measure_group(target: Path, draft: str | None, group: list[dict], prompts, s: MeasureSettings, progress) -> None:
    modes = ("target",) + tuple(dict.fromkeys(c["mode"] for c in group))
    settings = BenchSettings(modes, s.draft_max, s.max_tokens, repeats=1, warmup=1, ignore_eos=True).validate()
    try:
        engine = Engine(target, draft, n_ctx=s.n_ctx)
    except GGUFSpecError as e:
        for c in group:
            c["measured"] = {"error": str(e)}
        return
    with engine:
        runs = []
        run(engine, prompts, settings, runs, progress=progress)
        table = rows(runs, engine, settings)
        costs = engine.costs
        for c in group:
            mine = [r for r in table if r["mode"] == c["mode"] and r["speedup"] is not None]
            if not mine:
                continue
            best = max(mine, key=lambda r: r["speedup"])
            step = _step_seconds(costs, c["mode"], best["draft_max"])
            c["measured"] = {"alpha": best["acceptance_rate"], "draft_max": best["draft_max"],
                             "cost_ratio": step / costs.target_token_seconds if step is not None else None,
                             "expected": best["predicted_speedup_costs"], "speedup": best["speedup"],
                             "tokens_per_second": best["tokens_per_second"]}


def _step_seconds(costs, mode: str, draft_max: int | None) -> float | None:
    """Seconds per drafted token of a mode's drafter, from the engine's measured costs: the draft model's step (its
    round's first decode shared over the draft_max tokens it drafts), a
    head's (MTP, EAGLE-3, DFlash: a DFlash block's cost shared over the draft_max tokens it drafts), lookup's none."""
    if mode == "lookup":
        return 0.0
    if mode in HEAD_MODES:
        return costs.head_step(HEAD_MODES[mode], draft_max or 1)
    return costs.draft_step(draft_max or 1) if mode == "draft" else None


def fastest(measured: dict) -> dict | None:
    """The candidate whose measured speed-up is highest (None: none measured)."""
    fast = [c for c in measured["candidates"] if (c.get("measured") or {}).get("speedup")]
    return max(fast, key=lambda c: c["measured"]["speedup"]) if fast else None


def choose(measured: dict) -> tuple[dict | None, str | None]:
    """(the candidate to save as a pair, None) where the fastest measured one has a draft file of its own and beat
    the target alone; else (None, one line saying why nothing is saved)."""
    best = fastest(measured)
    if best is None:
        return None, "nothing saved: no candidate was measured"
    speedup = best["measured"]["speedup"]
    if speedup <= 1.0:
        return None, f"nothing saved: no draft beat the target alone (the fastest, {best['name']}, measured {speedup:.2f}x)"
    if not best["path"] or best["path"] == measured["target"]["path"]:
        return None, (f"nothing saved: {best['name']} measured fastest ({speedup:.2f}x) and needs no pair: "
                      f"--mode {best['mode']}")
    return best, None


def pair_member(name: str | None, path: str, reg) -> str:
    """How a saved pair names one of its models: by its registry name where that model's file is this very file,
    else by the file's absolute path (a relative one would resolve only from the folder it was written in)."""
    from ..models.hub import local_path

    spec = reg.models.get(name) if name else None
    here = local_path(spec) if spec else None
    try:
        if here is not None and os.path.samefile(here, path):
            return name
    except OSError:
        pass
    return os.path.abspath(path)


def pair_values(measured: dict, best: dict, reg) -> tuple[str, dict]:
    """(the pair's name, its table) for the best candidate: target and draft by registry name or absolute path."""
    target = pair_member(measured["target"]["name"], measured["target"]["path"], reg)
    draft = pair_member(best["name"], best["path"], reg)
    name = f"{Path(target).stem}+{Path(best['name']).stem}"
    values = {"target": target, "draft": draft, "mode": best["mode"]}
    if best["measured"].get("draft_max"):
        values["draft_max"] = best["measured"]["draft_max"]
    return name, values


def registry_file(registry) -> Path:
    return Path(registry) if registry else user_registry()


def existing(registry) -> str | None:
    """--registry where the file is there already (else --write creates it: nothing to read yet)."""
    return registry if registry and Path(registry).exists() else None


def check_save(found: dict, registry) -> None:
    """Before measuring: that a pair for this target can be written to the registry file (nothing written)."""
    path = os.path.abspath(found["target"]["path"])
    save_pair(registry_file(registry), f"{Path(path).stem}+check", {"target": path, "draft": path}, check_only=True)


def save_best(measured: dict, registry) -> tuple[dict | None, str | None]:
    """Save the fastest measured candidate as a pair in the registry file: ({"pair", "file"}, None), or (None, one
    line saying why nothing was saved: the fastest needs no draft file, or nothing beat the target alone)."""
    from ..models.registry import load_registry

    best, why = choose(measured)
    if best is None:
        return None, why
    name, values = pair_values(measured, best, load_registry(existing(registry)))
    return {"pair": name, "file": str(save_pair(registry_file(registry), name, values))}, None


def drafts_text(out: dict, saved: dict | None = None, nothing_saved: str | None = None) -> str:
    """`ggufspec drafts`: the ranked candidates, what the figures are, and the next command."""
    t = out["target"]
    measured = out.get("measured")
    body = []
    for i, c in enumerate(out["candidates"], 1):
        m = c.get("measured") or {}
        row = {"rank": i, "draft": c["name"], "mode": c["mode"] if c["usable"] is not False else None, "usable": {True: "yes", False: "no", None: "?"}[c["usable"]],
               "why": c["why"], "size": mib(c["size_bytes"]) if c["size_bytes"] else "-", "quant": c["quant"],
               "cost": f"{c['cost_ratio']:.2f}" if c["cost_ratio"] is not None else None,
               "expected": f"{c['expected']:.2f}x (n={c['draft_max']})" if c["expected"] is not None else None}
        if measured:
            row.update(alpha=_num(m.get("alpha")), cost_measured=_num(m.get("cost_ratio")),
                       expected_measured=f"{m['expected']:.2f}x" if m.get("expected") is not None else None,
                       speedup=f"{m['speedup']:.2f}x (n={m.get('draft_max') or '-'})" if m.get("speedup") else
                       m.get("error"))
        body.append(row)
    columns = [("rank", "#"), ("draft", "draft"), ("mode", "--mode"), ("usable", "usable"), ("why", "why"),
               ("size", "size"), ("quant", "quant"), ("cost", "cost*"), ("expected", "expected*")]
    if measured:
        columns += [("alpha", "alpha"), ("cost_measured", "cost"), ("expected_measured", "expected"),
                    ("speedup", "measured")]
    lines = [f"target: {t['name']} ({mib(t['size_bytes'])}, {t['quant']}, {t['n_vocab']} tokens)", table(body, columns),
             f"* predicted from sizes: cost = a draft step over a target step (the bytes each reads); expected = "
             f"Leviathan's speed-up at the best draft length n, at an assumed alpha of {out['assumed_alpha']} "
             "(a text-level draft's times the share of tokens it writes alike)"
             + ("" if measured else "; `--measure` measures both")]
    if measured:
        lines.append("measured here (greedy): alpha, cost from the measured steps, the speed-up those expect, and the "
                     "measured speed-up over the target alone, of the best draft length"
                     + (" (interrupted: the rows measured so far)" if out.get("interrupted") else ""))
    if saved:
        lines.append(f"saved pair {saved['pair']} in {saved['file']}")
    if nothing_saved:
        lines.append(nothing_saved)
    best = (fastest(out) if measured else None) or next((c for c in out["candidates"] if c["usable"]), None)
    if best:
        draft = f" -md {shlex.quote(best['path'])}" if best["path"] and best["path"] != t["path"] else ""
        lines.append(f"next: ggufspec generate -m {shlex.quote(t['name'])}{draft} --mode {best['mode']} -p \"PROMPT\"")
    return "\n".join(lines)


def _num(v) -> str | None:
    return None if v is None else f"{v:.2f}"
