"""The whole with/without-draft benchmark: load the models (once per -ngl value of a sweep), run every
configuration on the same prompts in one process (`runs`), aggregate rows (`rows`), add llama.cpp's own
programs' rows on the same work (`reference`), and keep what finished when interrupted.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..engine import Engine
from ..errors import GGUFSpecError
from .outputs import check_outputs_dir, save_outputs
from .prompts import Prompt
from .rows import explain_divergences, noise_notes, overshoot_notes, partial_note, rows, tps
from .runs import BenchSettings, Run, prompt_text, prompt_tokens, run, tokenized_prompts


@dataclass
class BenchResult:
    rows: list[dict]
    meta: dict
    interrupted: bool = False


def benchmark(load, prompts: list[Prompt], settings: BenchSettings, *, by: str = "all",
              llama_cpp_bin: str | None = None, outputs_dir: str | None = None, progress=None) -> BenchResult:
    """Load the models (once per -ngl value of a sweep), run every configuration, return rows and metadata.

    load: a models.resolve.LoadOptions; its n_gpu_layers may be a list (a sweep: a row set per value).
    llama_cpp_bin: a folder with llama.cpp's llama-bench and llama-speculative-simple, for reference
    rows on the same work (greedy, fixed length). Ctrl-C keeps the finished runs (interrupted=True) and
    llama.cpp's finished rows; a reference program that fails, before or after ggufspec's runs, leaves its row
    out with a line in meta["notes"], and ggufspec's rows stand.
    """
    settings.validate()
    if outputs_dir:
        check_outputs_dir(outputs_dir)
    if llama_cpp_bin and (not settings.ignore_eos or not settings.greedy):
        raise GGUFSpecError("--compare-llama-cpp compares greedy fixed-length runs: drop --temp and --natural-stop")
    if llama_cpp_bin:
        from .reference import check_reference

        check_reference(llama_cpp_bin)  # both programs there, the time limit readable: before anything runs
    sweep = load.n_gpu_layers if isinstance(load.n_gpu_layers, list) else [load.n_gpu_layers]
    rows, meta, interrupted, per_ngl, notes = [], {}, False, [], []
    for ngl in sweep:
        with_ngl = replace(load, n_gpu_layers=ngl, use_default=True)
        part, meta, interrupted = _bench_one(with_ngl, prompts, settings, by, llama_cpp_bin,
                                             outputs_dir, progress, notes)
        per_ngl.append({"n_gpu_layers": ngl, **{k: meta[k] for k in ("costs", "exact_batch", "placement")}})
        if len(sweep) > 1:
            for r in part:
                r["n_gpu_layers"] = ngl
                r["label"] = f"{r['label']} (ngl {ngl})"
        rows += part
        if interrupted:
            break
    if len(sweep) > 1:
        meta.update(n_gpu_layers=sweep, sweep=per_ngl)  # each value's own costs and placement
    meta["notes"] = notes
    meta["noise_notes"] = noise_notes(rows) + overshoot_notes(rows)  # the table's order within noise; llama.cpp past -n
    return BenchResult(rows, meta, interrupted)


def _group_key(by: str):
    return (lambda p: p.suite) if by == "suite" else (lambda p: "all")


def _reference_depths(engine: Engine, prompts: list[Prompt], by: str) -> dict[str, int]:
    """Per group of prompts (a suite, or "all"), their mean length in tokens: the cache ggufspec's runs
    generate after, which llama-bench's row is given too (-d)."""
    key, lengths = _group_key(by), {}
    for p in prompts:
        lengths.setdefault(key(p), []).append(len(prompt_tokens(engine, p)))
    return {group: round(sum(n) / len(n)) for group, n in lengths.items()}


def _reference_groups(engine: Engine, prompts: list[Prompt], runs: list[Run], by: str):
    """(prompts by group, ggufspec's target speed by group, the target-only text's bytes per prompt, as llama.cpp
    prints them: special tokens as their text) for llama.cpp's rows: by suite when the table is, else over all
    prompts. A text is compared up to its first end-of-generation token: past it llama.cpp's --ignore-eos
    and ggufspec's part ways (llama.cpp never picks that token; ggufspec writes it and goes on)."""
    key = _group_key(by)
    groups: dict[str, list[Prompt]] = {}
    model = engine.target_model

    def until_end(tokens: list[int]) -> bytes:
        end = next((i for i, t in enumerate(tokens) if model.eog_mask[t]), len(tokens))
        return b"".join(model.token_to_piece(t, special=True) for t in tokens[:end])

    texts = {r.prompt: until_end(r.tokens) for r in runs if r.config.mode == "target" and r.repeat == 0}
    for p in prompts:
        groups.setdefault(key(p), []).append(p)
    target_tps = {}
    for group in groups:
        rs = [r for r in runs if r.config.mode == "target" and key(r.prompt) == group]
        target_tps[group] = tps(rs)[0] if rs else None
    return groups, target_tps, texts


def _bench_one(load, prompts, settings: BenchSettings, by, llama_cpp_bin, outputs_dir, progress, notes: list):
    from ..models.resolve import merge_pair_settings, open_engine
    from .reference import llama_bench_before, placement, reference_rows
    from .reference_runs import ReferenceRunner

    engine, pair_defaults = open_engine(load)
    with engine:
        generation, pair_draft_max = merge_pair_settings(pair_defaults.get("settings", {}), settings.generation,
                                                         bench=True)
        settings = replace(settings, generation=generation)
        if not settings.greedy:
            settings = replace(settings, generation={"seed": 0, **settings.generation})  # sampled runs use fixed seeds
        if pair_draft_max:
            settings = replace(settings, draft_length=int(pair_draft_max))  # the pair's recommended length
        settings.validate()
        tokenized_prompts(engine, prompts, settings.max_tokens)  # every prompt fits, before anything runs
        depths = _reference_depths(engine, prompts, by) if llama_cpp_bin else {}
        before = None  # llama-bench's results before the runs; where it fails, a note, and ggufspec's runs go on
        if llama_cpp_bin:
            before = llama_bench_before(Path(llama_cpp_bin), engine.target_model.path, settings.max_tokens,
                                        engine.target_ctx.n_threads, tuple(depths.values()), notes.append,
                                        placement(engine, "llama-bench"))
        runs: list[Run] = []
        interrupted = False
        others = None  # llama.cpp's speculative-simple configurations, one more turn each on every prompt
        if llama_cpp_bin:
            others = ReferenceRunner(llama_cpp_bin, engine, settings.max_tokens, settings.draft_lengths,
                                     lambda p: prompt_text(engine, p), notes.append)
        try:
            run(engine, prompts, settings, runs, progress=progress, others=others)
        except KeyboardInterrupt:
            interrupted = True
        out = rows(runs, engine, settings, by=by)
        try:  # from here on an interrupt keeps what is done (the rows above, llama.cpp's finished ones)
            explain_divergences(out, runs, engine)
            if llama_cpp_bin:
                groups, target_tps, texts = _reference_groups(engine, prompts, runs, by)
                reference_rows(llama_cpp_bin, engine, list(groups), settings.max_tokens, target_tps, into=out,
                               note=notes.append, llama_bench_before=before,
                               llama_bench_again=before is not None and not interrupted, depths=depths,
                               speculative=lambda g: others.rows(g, groups[g], target_tps.get(g), texts))
        except KeyboardInterrupt:
            interrupted = True
        if interrupted and partial_note(out):
            notes.append(partial_note(out))
        outputs_error = None
        if outputs_dir:
            try:
                save_outputs(runs, outputs_dir)
            except GGUFSpecError as e:  # the table must not be lost with the texts
                outputs_error = str(e)
        meta = _meta(engine, settings, pair_defaults.get("name"), len(prompts))
        meta.update(interrupted=interrupted, outputs_error=outputs_error)
    return out, meta, interrupted


def _meta(engine: Engine, settings: BenchSettings, pair: str | None, n_prompts: int) -> dict:
    """What the table's header and footer say of the run: the models, settings, machine, costs and placement."""
    from ..llama.backend import machine

    verification = engine.verification(settings.generation.get("exact"))
    costs = engine.costs
    return {
        "pair": pair, "target": str(engine.target_model.path),
        "draft": str(engine.draft_model.path) if engine.draft_model else None,
        "n_prompts": n_prompts, "max_tokens": settings.max_tokens, "repeats": settings.repeats,
        "warmup": settings.warmup, "greedy": settings.greedy, "settings": settings.generation,
        "threads": engine.target_ctx.n_threads, "machine": machine()["summary"]["cpu"],
        "exact_batch": verification.exact_batch, "exact": verification.exact,
        "costs": costs.report(verification.batch_limit(), engine.target_model.info.file_type) if costs else None,
        "placement": engine.weights(), "prefill": "reused" if settings.reuse_prompt else "cold",
        "n_batch": engine.target_ctx.n_batch,
    }
