"""The benchmark's rows: runs aggregated per configuration (and suite or prompt): the median generation
speed over repeats and its range, the speed-up over target-only decoding, the acceptance statistics, where
the time went, peak memory, whether the text is the target's, and what Leviathan et al.'s formula predicts
from the measured alpha and costs.
"""

from __future__ import annotations

import statistics

from ..core import DRAFT_ALONE_MODES, DRAFTING_MODES, HEAD_MODES, Stats
from ..costs import predicted_speedup
from ..engine import Engine
from ..sampling import top2_gap
from .runs import BenchSettings, Run, prompt_tokens


def divergence_gap(engine: Engine, tokens: list[int], reference: list[int], position: int) -> float:
    """The target's one-token top-1/top-2 logit gap where a greedy run left the target's text."""
    ctx = engine.target_ctx
    ctx.clear()
    ctx.decode(tokens[:-1], logits="none")
    last = tokens[-1]
    for t in reference[:position]:
        ctx.decode([last], logits="none")
        last = t
    gap = top2_gap(ctx.decode([last])[0])
    ctx.clear()
    return gap


def rows(runs: list[Run], engine: Engine, settings: BenchSettings, by: str = "all") -> list[dict]:
    """Aggregate runs into rows: one per configuration (and per suite or prompt if asked)."""
    verification = engine.verification(settings.generation.get("exact"))
    reference = {(r.prompt, r.repeat): r for r in runs if r.config.mode == "target"}
    groups: dict[tuple, list[Run]] = {}
    for r in runs:
        key = "all" if by == "all" else r.prompt.suite if by == "suite" else r.prompt.label
        groups.setdefault((r.config, key), []).append(r)
    target_runs = {key: rs for (config, key), rs in groups.items() if config.mode == "target"}
    most = {}  # per group, the most runs a row finished (fewer: the row was cut short by an interrupt)
    for (config, key), rs in groups.items():
        most[key] = max(most.get(key, 0), len(rs))
    out = []
    costs = engine.costs
    for (config, key), rs in groups.items():
        median, low, high = tps(rs)
        total = Stats.merge([r.stats for r in rs])
        gen = total.generation_seconds
        alpha = total.acceptance_rate if total.n_drafted else None
        row = {
            "mode": config.mode, "label": config.label, "draft_max": config.draft_max, "group": key,
            "n_prompts": len({r.prompt for r in rs}), "repeats": settings.repeats,
            "tokens_per_second": median, "tokens_per_second_min": low, "tokens_per_second_max": high,
            "speedup": speedup(rs, target_runs.get(key, [])), "partial": len(rs) < most[key],
            "prompt_tokens_per_second": total.n_prompt / max(1e-9, total.prompt_seconds),
            "n_generated": total.n_generated,
            "acceptance_rate": alpha,
            "tokens_per_round": total.tokens_per_round,
            "full_accepts": total.full_accepts if total.n_drafted else None,
            "draft_share": total.draft_seconds / gen if gen else None,
            "verify_share": total.target_seconds / gen if gen else None,
            "overhead_share": total.overhead_seconds / gen if gen else None,
            "peak_rss_bytes": max(r.rss for r in rs),
            "identical_to_target": None, "divergence": None,
            "predicted_speedup": None, "predicted_speedup_costs": None,
            # what the planner chose, and the tokens per second its cost table expected against those measured
            "rounds_by_source": total.rounds_by_source, "planned_tokens_per_second": total.predicted_rate,
            "measured_tokens_per_second": total.tokens_per_second,
        }
        if settings.comparable and config.mode in DRAFTING_MODES:
            row["identical_to_target"] = True
            for r in rs:
                ref = reference.get((r.prompt, r.repeat))
                if ref is not None and ref.tokens != r.tokens:
                    pos = next((i for i, (a, b) in enumerate(zip(ref.tokens, r.tokens)) if a != b), min(len(ref.tokens), len(r.tokens)))
                    row["identical_to_target"] = False
                    if row["divergence"] is None:
                        row["divergence"] = {"prompt": r.prompt.label, "token": pos}
        if alpha is not None and config.draft_max and costs is not None and config.mode != "auto":
            draft_cost = (costs.draft_step(config.draft_max) if config.mode == "draft" else
                          costs.head_step(HEAD_MODES[config.mode], config.draft_max) if config.mode in HEAD_MODES
                          else 0.0) or 0.0
            row["predicted_speedup"] = predicted_speedup(alpha, config.draft_max, draft_cost / costs.target_token_seconds)
            # the same expectation with the verify batch's measured cost instead of one step's
            row["predicted_speedup_costs"] = costs.speedup(alpha, config.draft_max, draft_cost, verification.batch_limit())
        out.append(row)
    beside_best_fixed(out)
    return out


def beside_best_fixed(rows_: list[dict]) -> None:
    """Per group, each auto row beside the fastest fixed mode a user could have picked instead (the target alone
    included; not the draft alone, whose text is the draft's): its label and speed-up, and auto's speed over it."""
    for auto in (r for r in rows_ if r["mode"] == "auto" and not r.get("reference")):
        fixed = [r for r in rows_ if r["group"] == auto["group"] and not r.get("reference")
                 and (r["mode"] == "target" or r["mode"] in DRAFTING_MODES and r["mode"] != "auto")]
        if not fixed:
            continue
        best = max(fixed, key=lambda r: (r["speedup"] or 0.0, r["tokens_per_second"]))
        ratio = (auto["speedup"] / best["speedup"] if auto["speedup"] and best["speedup"]
                 else auto["tokens_per_second"] / best["tokens_per_second"] if best["tokens_per_second"] else None)
        auto.update(best_fixed=best["label"], best_fixed_speedup=best["speedup"], vs_best_fixed=ratio)


def explain_divergences(rows_: list[dict], runs: list[Run], engine: Engine) -> None:
    """Fill in the target's logit gap at each reported divergence (a diagnostic pass, not timed)."""
    by_label = {(r.prompt.label, r.repeat): r for r in runs if r.config.mode == "target"}
    tokens_for = {r.prompt.label: r.prompt for r in runs}
    for row in rows_:
        d = row.get("divergence")
        if d and "gap" not in d:
            ref = by_label.get((d["prompt"], 0))
            if ref is not None:
                d["gap"] = divergence_gap(engine, prompt_tokens(engine, tokens_for[d["prompt"]]), ref.tokens, d["token"])


def speedup(rs: list[Run], target_runs: list[Run]) -> float | None:
    """A row's speed over the target's on the runs (prompt, repeat) both finished: after an interrupt one
    row may hold a prompt another lacks, and prompts differ in speed."""
    both = {(r.prompt, r.repeat) for r in rs} & {(r.prompt, r.repeat) for r in target_runs}
    if not both:
        return None
    mine = tps([r for r in rs if (r.prompt, r.repeat) in both])[0]
    theirs = tps([r for r in target_runs if (r.prompt, r.repeat) in both])[0]
    return mine / theirs if theirs else None


def partial_note(rows_: list[dict]) -> str | None:
    """One line naming the rows an interrupt cut short (their speed-ups are over the runs the target finished)."""
    cut = [r["label"] + ("" if r["group"] == "all" else f" ({r['group']})") for r in rows_ if r.get("partial")]
    if not cut:
        return None
    return (f"{', '.join(cut)} finished fewer runs than the other rows (marked partial): each speed-up compares "
            "only the prompts both it and the target finished")


def noise_notes(rows_: list[dict]) -> list[str]:
    """Lines saying where the table's order is within this run's noise: per group, the rows whose min-max over
    repeats overlaps the fastest row's (their order may change in another run), and the speculating rows whose
    range overlaps target-only's (no measured gain). With one repeat there is no spread to compare: one line says so."""
    mine = [r for r in rows_ if not r.get("reference")]
    if not mine:
        return []
    if max(r["repeats"] for r in mine) < 2:
        return ["one repeat: min-max shows no spread; rows a few percent apart may swap in another run (--repeats 2)"]
    notes = []
    for group in dict.fromkeys(r["group"] for r in mine):
        rs = [r for r in mine if r["group"] == group and r["mode"] not in DRAFT_ALONE_MODES]  # the draft's own text
        where = "" if group == "all" else f"{group}: "
        best = max(rs, key=lambda r: r["tokens_per_second"])
        ties = [r["label"] for r in rs if r is not best and _overlap(r, best)]
        if ties:
            notes.append(f"{where}{', '.join(ties)} within noise of the fastest row, {best['label']} "
                         "(their min-max ranges overlap)")
        target = next((r for r in rs if r["mode"] == "target"), None)
        level = [r["label"] for r in rs if target is not None and r is not target and r is not best
                 and r["label"] not in ties and _overlap(r, target)]
        if level:
            notes.append(f"{where}{', '.join(level)} within noise of target-only")
    return notes


def overshoot_notes(rows_: list[dict]) -> list[str]:
    """Lines naming llama.cpp's rows that decoded well past -n: speculative-simple does not cut its last draft at
    the end (llama-server does, and so does ggufspec). Where its log showed its rounds, its row counts the tokens
    asked over the time until they were out, and the line gives all it decoded over all its time; else the row
    counts them all, and the line gives the tokens asked over the same seconds (charged for that last batch)."""
    out = []
    for r in rows_:
        asked, got = r.get("n_asked"), r.get("n_generated")
        if not (r.get("reference") and asked and got and got > 1.1 * asked and r["tokens_per_second"]):
            continue
        where = "" if r["group"] == "all" else f"{r['group']}: "
        said = f"{where}{r['label']} decoded {got} tokens for the {asked} asked (its last draft runs past -n)"
        if r.get("counted_to_n"):
            out.append(f"{said}; its tok/s counts the {asked} over the time until they were out; all {got} over all "
                       f"its time: {r['tokens_per_second_all']:.1f} tok/s")
            continue
        up_to_n = r["tokens_per_second"] * asked / got
        ratio = f" ({r['speedup'] * asked / got:.2f}x)" if r.get("speedup") else ""
        out.append(f"{said} and its tok/s counts them all; counted up to -n: {up_to_n:.1f} tok/s{ratio}")
    return out


def _overlap(a: dict, b: dict) -> bool:
    return a["tokens_per_second_min"] <= b["tokens_per_second_max"] and b["tokens_per_second_min"] <= a["tokens_per_second_max"]


def tps(rs: list[Run]) -> tuple[float, float, float]:
    """Median, min and max over repeats of (tokens / generation seconds) summed over prompts."""
    per_repeat = {}
    for r in rs:
        tokens, seconds = per_repeat.get(r.repeat, (0, 0.0))
        per_repeat[r.repeat] = (tokens + r.stats.n_timed, seconds + r.stats.generation_seconds)
    values = [t / s for t, s in per_repeat.values() if s > 0] or [0.0]
    return statistics.median(values), min(values), max(values)
