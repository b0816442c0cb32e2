"""Rows (lists of dicts) to a terminal table, Markdown, CSV or JSON. The only tabulate importer."""

from __future__ import annotations

import csv
import io
import json
import textwrap
from pathlib import Path

from tabulate import tabulate

from ..costs import HEAD_LABELS, draft_step_text
from ..errors import GGUFSpecError
from ..models.offload import moe_text, size_text
from ..text import plural
from ..verification import DEFAULT_TIE_MARGIN, TIE_SAFETY


def table(rows: list[dict], columns: list[tuple[str, str]] | None = None, fmt: str = "simple") -> str:
    """columns: (key, header) pairs; missing values print as '-'."""
    if not rows:
        return "(nothing to show)"
    columns = columns or [(k, k) for k in rows[0]]
    body = [[_cell(r.get(k)) for k, _ in columns] for r in rows]
    return tabulate(body, headers=[h for _, h in columns], tablefmt=fmt, disable_numparse=True)


def markdown(rows: list[dict], columns=None) -> str:
    return table(rows, columns, fmt="github")


def to_csv(rows: list[dict], columns=None) -> str:
    keys = [k for k, _ in columns] if columns else list(rows[0]) if rows else []
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _plain(r.get(k)) for k in keys})
    return buf.getvalue()


def to_json(obj) -> str:
    return json.dumps(obj, indent=2, default=str)


def _plain(v):
    if isinstance(v, (list, dict)):
        return json.dumps(v)
    return "" if v is None else v


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


# --- the benchmark's table ---------------------------------------------------------------------

BENCH_COLUMNS = [("label", "mode"), ("group", "prompts"), ("tps", "tok/s"), ("range", "min-max"), ("speedup", "speed-up"),
                 ("alpha", "α"), ("tau", "τ"), ("full_accepts", "full"), ("split", "draft/verify/other"),
                 ("prompt_tps", "prompt tok/s"), ("rss", "peak RSS"), ("identical", "= target"),
                 ("predicted", "predicted (paper)"), ("predicted_costs", "predicted (costs)")]
# What fits about 120 columns; --wide, --json and --csv have the rest.
NARROW = ("label", "group", "tps", "range", "speedup", "alpha", "tau", "identical", "rss")


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _identical(r: dict) -> str:
    ident = r["identical_to_target"]
    if ident is None:
        return "-"
    if ident:
        return "yes"
    dv = r["divergence"] or {}
    gap = f", gap {dv['gap']:.3f}" if "gap" in dv else ""
    token = f" token {dv['token']}" if "token" in dv else ""
    return f"no ({dv.get('prompt')}{token}{gap})"


def bench_cells(r: dict) -> dict:
    """One bench row as the strings a table shows."""
    d = dict(r, tps=f"{r['tokens_per_second']:.1f}", speedup=_ratio(r["speedup"]), alpha=_pct(r["acceptance_rate"]))
    if r.get("partial"):  # cut short by an interrupt: fewer prompts than the other rows
        d["label"] = f"{r['label']} (partial)"
    # one repeat, or one llama.cpp run, measures no spread: a range of one value would look like none
    measured = (r.get("repeats") or 1) > 1 if not r.get("reference") else r["tokens_per_second_max"] > r["tokens_per_second_min"]
    d["range"] = f"{r['tokens_per_second_min']:.1f}-{r['tokens_per_second_max']:.1f}" if measured else "-"
    if r.get("reference"):  # llama.cpp's own programs: only what they report, and whether their text was the target's
        d["identical"] = _identical(r)
        return d
    d.update(tau=f"{r['tokens_per_round']:.2f}", prompt_tps=f"{r['prompt_tokens_per_second']:.0f}",
             split="/".join(_pct(r[k]) for k in ("draft_share", "verify_share", "overhead_share")),
             rss=mib(r["peak_rss_bytes"]), identical=_identical(r), predicted=_ratio(r["predicted_speedup"]),
             predicted_costs=_ratio(r["predicted_speedup_costs"]))
    return d


def bench_table(rows: list[dict], *, grouped: bool, wide: bool = False, as_markdown: bool = False) -> str:
    columns = [c for c in BENCH_COLUMNS if (wide or c[0] in NARROW) and (grouped or c[0] != "group")]
    cells = [bench_cells(r) for r in rows]
    return markdown(cells, columns) if as_markdown else table(cells, columns)


def bench_footer(meta: dict) -> str:
    """The machine, then the measured costs and the ceiling under the table (for each -ngl value of a sweep)."""
    where = f"{meta['machine']}, {plural(meta['threads'], 'thread')}\n" if meta.get("machine") else ""
    if meta.get("sweep"):
        return where + "\n".join(f"-ngl {m['n_gpu_layers']} ({', '.join(k for k in m['placement']['target'])}): "
                                  + _costs_line(m) for m in meta["sweep"])
    return where + _costs_line(meta)


def auto_footer(rows: list[dict]) -> str:
    """Per auto row (each suite's with --by-suite): which source its rounds drafted from, and the tokens per
    second its cost table expected of them against those measured (Python's work between decodes included)."""
    lines = []
    for r in rows:
        if r["mode"] != "auto" or r.get("reference") or not r.get("rounds_by_source"):
            continue
        where = r["label"] + ("" if r["group"] == "all" else f", {r['group']}")
        chose = ", ".join(f"{'none' if s == 'target' else s} {n}" for s, n in
                          sorted(r["rounds_by_source"].items(), key=lambda kv: -kv[1]))
        rates = ""
        if r.get("planned_tokens_per_second"):
            rates = (f"; predicted {r['planned_tokens_per_second']:.1f} tok/s, "
                     f"measured {r['measured_tokens_per_second']:.1f}")
        lines.append(textwrap.fill(f"{where}: {_beside_best(r)}rounds by source {chose}{rates}", 120,
                                   subsequent_indent="  ", break_on_hyphens=False))  # a 120-column terminal
    return "\n".join(lines)


def _beside_best(r: dict) -> str:
    """'0.97x of the best fixed mode (lookup, 2.52x); ' for an auto row beside the fastest fixed mode of its group."""
    if r.get("vs_best_fixed") is None:
        return ""
    speedup = f", {_ratio(r['best_fixed_speedup'])}" if r.get("best_fixed_speedup") else ""
    return f"{_ratio(r['vs_best_fixed'])} of the best fixed mode ({r['best_fixed']}{speedup}); "


def _prefill_line(meta: dict) -> str:
    if meta.get("prefill") == "reused":
        return (f"prompts: what the KV cache held of a prompt was kept between runs (whole batches of {meta['n_batch']} "
                "tokens; output unchanged), so prompt speed is warm prefill")
    return "prompts: every run evaluated its whole prompt (cold prefill; --reuse-prompt keeps cached batches)"


def _up_to(costs: dict) -> str:
    """Where measured exact batches stop being exact, if they do."""
    return f" up to {costs['exact_kv']} cached tokens" if costs["exact_batch"] > 1 and costs.get("exact_kv") else ""


def _costs_line(meta: dict) -> str:
    c = meta.get("costs")
    if not c:
        return _prefill_line(meta) if "prefill" in meta else ""
    t = c["target_batch_seconds"]
    line = f"target step {1000 * t[0]:.1f} ms"
    if len(t) >= 4:
        line += f"; a batch of 4 costs {t[3] / t[0]:.2f} steps"
    if c["draft_token_seconds"]:
        line += f"; {draft_step_text(c, t[0])}"
    for head in _head_steps(c.get("head_seconds") or {}, t[0]):
        line += f"; {head}"
    line += f"; batches up to {meta['exact_batch']} are bit-identical to one-token decoding{_up_to(c)}"
    if meta["exact_batch"] > 1 and c.get("exact_kv"):
        line += " (beyond: one batch, near-ties re-checked)"
    line += (f"\nceiling: with every draft accepted and drafting free, {c['ceiling_speedup']:.2f}x at most "
             f"here ({c['ceiling_tokens_per_round']} tokens per round; verifying needs a logits row per token)")
    if c.get("ceiling_past_exact_kv", 0) > c["ceiling_speedup"] + 0.005:
        line += (f"; past {c['exact_kv']} cached tokens, where a round is one batch, "
                 f"{c['ceiling_past_exact_kv']:.2f}x ({c['ceiling_past_exact_kv_tokens_per_round']} tokens per round)")
    if c.get("rollback"):
        line += "\n" + rollback_line(c["rollback"], t[0])
    if c.get("routing"):
        line += "\n" + routing_line(c["routing"])
    if c.get("why"):
        line += f"\nwhy: {c['why']}"
    return line + ("\n" + _prefill_line(meta) if "prefill" in meta else "")


def plot_library():
    """matplotlib's pyplot (headless), or one line saying how to install it (checked before a run)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GGUFSpecError("--plot needs matplotlib: pip install 'ggufspec[plot]'") from None
    return plt


def plot_sweep(rows: list[dict], path: str) -> None:
    """PNG of tok/s against --draft-max per mode, with the target alone as a line."""
    plt = plot_library()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    target = [r for r in rows if r["mode"] == "target" and r["group"] == "all"]
    if target:
        ax.axhline(target[0]["tokens_per_second"], color="black", linestyle="--", label="target alone")
    for mode in sorted({r["mode"] for r in rows if r["draft_max"]}):
        pts = sorted((r["draft_max"], r["tokens_per_second"]) for r in rows if r["mode"] == mode and r["group"] == "all")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xlabel("--draft-max")
    ax.set_ylabel("tokens/sec (generation)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --- other commands ------------------------------------------------------------------------------


def costs_text(out: dict) -> str:
    t = out["target_batch_seconds"]
    t1 = t[0]
    rows = [{"batch": n, "ms": f"{1000 * s:.1f}", "steps": f"{s / t1:.2f}", "exact": "yes" if n <= out["exact_batch"] else "no",
             "gain": f"{n * t1 / s:.2f}x"} for n, s in enumerate(t, 1)]
    lines = [table(rows, [("batch", "tokens in batch"), ("ms", "ms"), ("steps", "target steps"),
                          ("exact", "= one-token decoding"), ("gain", "tokens / steps")]), "",
             f"{Path(out['target']).name}, {plural(out['threads'], 'thread')}: one target step {1000 * t1:.1f} ms"]
    if out["draft_token_seconds"]:
        lines.append(draft_step_text(out, t1))
    if out.get("repack"):  # llama.cpp's CPU weight repacking, where it is a choice (llama/repack.py)
        said = ", ".join(f"{role} {('no', 'yes')[on]}" for role, on in out["repack"].items())
        lines.append(f"weights repacked: {said} (--repack / --no-repack; default: whichever was timed faster here)")
    if out.get("text_round_trip"):
        r = out["text_round_trip"]
        lines.append(f"across tokenizers ({r['difference']}): the text round trip costs {1e3 * r['seconds']:.2f} ms a round "
                     f"({r['seconds'] / t1:.3f} of a target step: the new text tokenized for the draft, its draft for "
                     f"the target); sampled drafts use the {r['shared_tokens']:,} tokens both write alike")
    lines += _head_steps(out.get("head_seconds") or {}, t1)
    how = f"in exact chunks of {out.get('verify_chunk') or out['exact_batch']}" if out["exact"] else "in one batch"
    if out["exact"] and out.get("exact_kv"):
        how += f"{_up_to(out)}, in one batch beyond (no batch is exact there)"
    lines.append(f"verification {how}: an always-right, free drafter gains at most {out['ceiling_speedup']:.2f}x "
                 f"({out['ceiling_tokens_per_round']} tokens per round)")
    if out.get("tie_margin") is not None and (not out["exact"] or out.get("exact_kv")):
        drift = out.get("drift")
        why = ("no drift measured: the default margin" if drift is None else
               f"{TIE_SAFETY:g} x the drift measured here, {drift:.3g}" if TIE_SAFETY * drift > DEFAULT_TIE_MARGIN else
               f"the default margin; the drift measured here, {drift:.3g}, asks no more")
        lines.append(f"a batched row whose top-2 gap is under {out['tie_margin']:.3g} is decoded again by itself ({why})")
    if out.get("deep_rows"):
        kv, extra = out["deep_rows"]
        lines.append(f"with {kv} tokens cached a verified row beyond the first costs {extra:.2f}x what it does in an empty "
                     "cache (auto plans a long prompt's rounds with it, growing with the cache)")
    for name, p in out["drafters"].items():
        if p["break_even_alpha"] is None:
            lines.append(f"{name}: never pays here (always right it would run at {p['speedup_if_always_right']:.2f}x); "
                         "auto will not use it")
        else:
            lines.append(f"{name}: auto uses it where its acceptance rate is above {p['break_even_alpha']:.2f} "
                         f"(always right: {p['speedup_if_always_right']:.2f}x drafting {p['draft_max_if_always_right']})")
    if out.get("rollback"):
        lines.append(rollback_line(out["rollback"], t1))
    if out.get("routing"):
        lines.append(routing_line(out["routing"]))
    if out.get("why"):
        lines.append(f"why: {out['why']}")
    return "\n".join(lines)


def routing_line(r: dict) -> str:
    """How a mixture-of-experts target's routing changes what a verify batch costs, in one line (`Costs.routing`)."""
    return (f"routing: this target sends each token to {r['experts_used']} of {r['experts']} experts per layer, so a batch of "
            f"{r['batch']} needs about {r['distinct_experts']:.1f} distinct experts ({r['distinct_experts'] / r['experts_used']:.1f}x "
            f"a step's expert weights, evenly routed); measured here it costs {r['batch_steps']:.2f} steps")


def rollback_line(r: dict, step: float) -> str:
    """What a rewind costs a target whose memory cannot be cut, in one line (`costs.Rollback`)."""
    if r.get("kept"):
        return (f"rollback: this target's recurrent state ({r['state_bytes'] / 2**20:.2f} MiB) cannot be cut like a KV cache, "
                f"but llama.cpp keeps it for the last {r['kept']} positions: a round drafting up to {r['kept']} tokens "
                f"rewinds by a cut where it keeps a draft; each round saves it first ({1e3 * r['save_seconds']:.3f} ms), "
                f"and a rejection of every draft, or any in a longer round, restores it ({1e3 * r['restore_seconds']:.3f} ms) "
                "and decodes the kept tokens again; auto counts both")
    return (f"rollback: this target's recurrent state ({r['state_bytes'] / 2**20:.2f} MiB) cannot be cut like a KV cache: "
            f"saving it before each verify batch takes {1e3 * r['save_seconds']:.3f} ms ({r['save_seconds'] / step:.2f} of a step), "
            f"restoring it at a rejection {1e3 * r['restore_seconds']:.3f} ms plus the kept tokens decoded again; "
            "auto counts both")


def plan_text(p, vram_bytes: int, ram_bytes: int, n_ctx: int) -> str:
    rows = [{"model": m.name + (" (estimated)" if m.estimated else ""), "role": m.role,
             "layers": m.layers_on_gpu + (f", experts of {min(m.cpu_moe, m.n_layers)} on CPU" if m.cpu_moe else ""),
             "gpu": mib(m.gpu_bytes), "cpu": mib(m.cpu_bytes), "kv": mib(m.kv_bytes)} for m in (p.target, p.draft) if m]
    return "\n".join([
        table(rows, [("model", "model"), ("role", "role"), ("layers", "layers on GPU"), ("gpu", "GPU"), ("cpu", "CPU"),
                     ("kv", "KV cache")]), "",
        f"budget {size_text(vram_bytes)} VRAM ({size_text(p.gpu_bytes)} used), {size_text(ram_bytes)} RAM "
        f"({size_text(p.cpu_bytes)} used); context {n_ctx}"
        + (f", KV cache K {p.type_k}, V {p.type_v}" if (p.type_k, p.type_v) != ("f16", "f16") else "")]
        + ([f"target layers by device: {', '.join(f'{d} {n}' for d, n in p.split.items())} (output layer included)"]
           if p.split else [])
        + [f"flags: {p.flags()}"])


def tune_text(result, saved: Path | None = None) -> str:
    """`ggufspec tune`: every setting measured, then the best flags (and where they were saved)."""
    rows = [{**r, "tok/s": f"{r['tokens_per_second']:.2f}", "min-max": f"{r['min']:.1f}-{r['max']:.1f}",
             "cpu_moe": None if r["cpu_moe"] is None else moe_text(r["cpu_moe"]),
             "speed-up": _ratio(r["speedup"]), "alpha": _pct(r["alpha"]),
             "= target": "-" if r["identical"] is None else "yes" if r["identical"] else "no"} for r in result.rows]
    b = result.best
    moe = [("cpu_moe", "--n-cpu-moe")] if any(r["cpu_moe"] is not None for r in result.rows) else []
    lines = [table(rows, [("ngl", "-ngl"), *moe, ("ngld", "-ngld"), ("mode", "mode"), ("draft_max", "draft-max"),
                          ("tok/s", "tok/s"), ("min-max", "min-max"), ("speed-up", "speed-up"), ("alpha", "α"),
                          ("= target", "= target")]), ""]
    lines += [f"note: {n}" for n in result.notes]
    label = "best of the finished rows" if result.interrupted else "best"
    lines.append(f"{label}: {result.flags}  ({b['tokens_per_second']:.2f} tok/s, {_ratio(b['speedup'])})")
    if saved:
        lines.append(f"saved as the defaults of pair {result.pair} in {saved}")
    return "\n".join(lines)


def models_text(out: dict) -> str:
    unchecked = " (unchecked)"  # an entry written from its publisher's names, never fetched to verify
    pairs = [dict(r, name=r["name"] + (" (default)" if r["default"] else ""),
                  draft=r["draft"] or ("its MTP layers" if r["mode"] == "mtp" else f"none ({r['mode']})"),
                  status=("ready" if r["ready"] else "not downloaded") + ("" if r["checked"] else unchecked))
             for r in out["pairs"]]
    models = [dict(r, where=(f"{mib(r['size_bytes'])} at {r['path']}" if r["path"] else
                             "offline mirror" if r["mirror"] else "Hub") + ("" if r["checked"] else unchecked))
              for r in out["models"]]
    lines = [
        table(pairs, [("name", "pair"), ("target", "target"), ("draft", "draft"), ("status", "status"),
                      ("draft_max", "draft-max"), ("note", "note")]), "",
        table(models, [("name", "model"), ("quant", "quant"), ("n_layers", "layers"), ("n_params_b", "params (B)"),
                       ("repo", "Hub repository"), ("where", "on this machine")]), ""]
    if not all(r["checked"] for r in out["models"]):
        lines.append("unchecked: repository, file and size as their publishers name them, not verified against the Hub "
                     "(checked = false in models.toml)")
    lines.append(f"models directory: {out['models_dir']}   registries: {', '.join(out['registries'])}")
    return "\n".join(lines)


def doctor_text(r: dict) -> str:
    lines = [f"python          {r['python']}",
             f"llama-cpp-python {r['llama_cpp_python']}: {', '.join(r['build_features']) or '-'}",
             f"CPU             {r['cpu']} ({', '.join(r['cpu_features']) or 'no SIMD flags read'}); "
             f"{plural(r['threads'], 'thread')} used of {r['logical_cpus']}"
             + (f"; other processes keep {r['busy_elsewhere']:.1f} busy now" if r.get("busy_elsewhere") is not None else ""),
             "devices:"]
    for d in r["devices"]:
        lines.append(f"  {d['name']:<10} {d['type']:<6} {d['description']}  "
                     f"{mib(d['free_bytes'])} free of {mib(d['total_bytes'])}"
                     + ("  (software: emulated on the CPU)" if d.get("software") else ""))
    lines.append(f"models in {r['models_dir']}: " + (", ".join(f"{m['file']} ({mib(m['size_bytes'])})" for m in r["models"]) or "none"))
    if r["costs"]:
        lines.append("measured costs on this machine:")
        for c in r["costs"]:
            where = "" if c["placement"] == "default" else f", devices {c['placement']}"
            lines.append(f"  {Path(c['model']).name} ({plural(c['threads'], 'thread')}, -ngl {c['n_gpu_layers']}{where}): "
                         f"target step {1000 * c['target_step_seconds']:.1f} ms, exact batches up to "
                         f"{c['exact_batch']}{_up_to(c)}, ceiling {c['ceiling_speedup']:.2f}x")
            heads = {"mtp": {"token": c["mtp_step_seconds"]}} if c.get("mtp_step_seconds") else {}
            heads |= {k.split(":")[0]: {"token": v} for k, v in (c.get("draft_heads") or {}).items() if v}
            lines += [f"    {line}" for line in _head_steps(heads, c["target_step_seconds"])]
            if c.get("why"):
                lines.append(f"    why: {c['why']}")
    else:
        lines.append("measured costs on this machine: none yet (`ggufspec costs` measures them)")
    lines += [f"{p['severity']}: {p['problem']}\n  fix: {p['fix']}" for p in r["problems"]] or ["no known problems"]
    return "\n".join(lines)


def _head_steps(head_seconds: dict, target_step: float) -> list[str]:
    """A line per head reading the target's hidden states: what a drafted token costs, its catch-up included
    (a DFlash draft: what its block costs, and what following the target costs per verified row)."""
    lines = []
    for name, h in head_seconds.items():
        label = HEAD_LABELS.get(name, name).split()[0]  # MTP, EAGLE-3, DFlash
        if h.get("round"):
            lines.append(f"{label} block {1000 * h['round']:.2f} ms a draft ({h['round'] / target_step:.2f} of a target "
                         f"step) + {1000 * h['token']:.3f} ms a verified row's injection")
        else:
            lines.append(f"{label} step {1000 * h['token']:.2f} ms a drafted token, its context's catch-up included "
                         f"({h['token'] / target_step:.2f} of a target step)")
    return lines
