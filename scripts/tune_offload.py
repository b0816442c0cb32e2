#!/usr/bin/env python
"""Find the fastest offload and drafting settings for a pair on this machine.

Plans GPU offload for the budget (see `ggufspec plan`), then benchmarks -ngl / -ngld values
around the plan and each --draft-max with the bench code (speculative and auto modes against
target-only, greedy, on the same prompts), prints the table and the best setting, and with
--write saves it as the pair's defaults in the user's models.toml.

    python scripts/tune_offload.py [PAIR] [-m T -md D] [--vram 24GiB] [--rpc HOST:PORT,...] [-c 4096]
                                   [--draft-max 1,2,3,4] [--suite code] [--limit 1] [-n 64] [--repeats 2] [--write]

With --rpc the target's layers go to llama.cpp RPC servers (their free memory is the budget) and
the draft stays on this machine, as in `ggufspec generate --rpc`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ggufspec import bench as B
from ggufspec.backend import supports_gpu_offload
from ggufspec.engine import Engine
from ggufspec.errors import GGUFSpecError
from ggufspec.service import resolve_models
from ggufspec.offload import detect_vram, parse_size, plan, sizes_for, total_ram
from ggufspec.paths import user_registry
from ggufspec.prompts import load_suite
from ggufspec.registry import load_registry, save_pair_defaults
from ggufspec.rpc import budgets, devices_for
from ggufspec.report import table


def candidates(planned: int, n_layers: int, step: int) -> list[int]:
    values = {planned, planned - step, planned + step}
    return sorted(v for v in values if 0 <= v <= n_layers + 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pair", nargs="?")
    ap.add_argument("-m", dest="target")
    ap.add_argument("-md", dest="draft")
    ap.add_argument("--vram", default=None)
    ap.add_argument("--rpc", default=None, help="llama.cpp RPC servers for the target, HOST:PORT[,HOST:PORT]")
    ap.add_argument("-c", dest="n_ctx", type=int, default=4096)
    ap.add_argument("--draft-max", default="1,2,3,4")
    ap.add_argument("--suite", default="code")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("-n", dest="n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats per setting (median reported)")
    ap.add_argument("--step", type=int, default=4, help="-ngl values tried: plan - step, plan, plan + step")
    ap.add_argument("--registry", default=None)
    ap.add_argument("--write", action="store_true", help="save the best setting in the user's models.toml")
    a = ap.parse_args(argv)
    try:
        draft_max = tuple(int(x) for x in a.draft_max.split(","))
        existing = a.registry if a.registry and Path(a.registry).exists() else None  # --write may create it
        target, draft, defaults = resolve_models(a.pair, a.target, a.draft, registry=existing, use_default=True)
        t_devices, d_devices = devices_for(a.rpc)
        free, d_vram = budgets(t_devices, d_devices) if a.rpc else ({}, None)
        vram = parse_size(a.vram) if a.vram else sum(free.values()) if a.rpc else detect_vram()
        t_sizes, d_sizes = sizes_for(target), sizes_for(draft) if draft else None
        p = plan(t_sizes, d_sizes, vram_bytes=vram, ram_bytes=total_ram(), n_ctx=a.n_ctx, draft_vram_bytes=d_vram)
        if supports_gpu_offload() and vram > 0:
            ngls = candidates(p.target.n_gpu_layers, t_sizes.n_layers, a.step)
            nglds = sorted({p.draft.n_gpu_layers, d_sizes.n_layers + 1}) if d_sizes and d_vram != 0 else [0]
        else:
            print("this llama.cpp build has no GPU support (or no VRAM was given): layers stay on the CPU; "
                  "tuning the drafting settings only", file=sys.stderr)
            ngls, nglds = [0], [0]
        prompts = [q for s in a.suite.split(",") for q in load_suite(s)[: a.limit or None]]
        results = []
        for ngl in ngls:
            for ngld in nglds:
                with Engine(target, draft, n_ctx=a.n_ctx, n_gpu_layers=ngl, draft_n_gpu_layers=ngld,
                            devices=t_devices, draft_devices=d_devices) as engine:
                    settings = B.BenchSettings(("target", "draft", "auto"), draft_max, a.n, a.repeats, 1, True, {})
                    runs = B.run(engine, prompts, settings, [])
                    for row in B.rows(runs, engine, settings):
                        results.append({"ngl": ngl, "ngld": ngld, "mode": row["mode"], "draft_max": row["draft_max"],
                                        "tok/s": round(row["tokens_per_second"], 2),
                                        "min-max": f"{row['tokens_per_second_min']:.1f}-{row['tokens_per_second_max']:.1f}",
                                        "_low": row["tokens_per_second_min"], "_high": row["tokens_per_second_max"],
                                        "speed-up": round(row["speedup"], 3),
                                        "alpha": None if row["acceptance_rate"] is None else round(row["acceptance_rate"], 3),
                                        "identical": row["identical_to_target"]})
        print(table([{k: v for k, v in r.items() if not k.startswith("_")} for r in results]))
        best = max(results, key=lambda r: r["tok/s"])
        plain = [r for r in results if r["mode"] == "target" and (r["ngl"], r["ngld"]) == (best["ngl"], best["ngld"])]
        if plain and best["mode"] != "target" and best["_low"] <= plain[0]["_high"]:
            print("note: the best setting's range overlaps plain decoding's: on this machine the difference is "
                  "within run-to-run noise (more --repeats or -n narrow it)")
        mode = "target" if best["mode"] == "target" else "auto" if best["mode"] == "auto" else "draft"
        print(f"\nbest: -ngl {best['ngl']} -ngld {best['ngld']} --mode {mode}"
              + (f" --draft-max {best['draft_max']}" if best["draft_max"] else "") + f"  ({best['tok/s']} tok/s, {best['speed-up']}x)")
        if a.write:
            name = defaults.get("name")
            if not name:
                raise GGUFSpecError("--write needs a pair name (not -m/-md paths) to save the setting under")
            values = {"n_gpu_layers": best["ngl"], "draft_n_gpu_layers": best["ngld"], "mode": mode}
            if best["draft_max"]:
                values["draft_max"] = best["draft_max"]
            path = save_pair_defaults(a.registry or user_registry(), name, values)
            load_registry(path)  # what we wrote must load
            print(f"saved as the defaults of pair {name} in {path}")
    except GGUFSpecError as e:
        print(f"tune_offload: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
