"""The with/without-draft benchmark: every mode on the same prompts, in one process.

Models are loaded once. Each configuration (a mode and, for drafting modes, a draft length)
runs every prompt `repeats` times after `warmup` uncounted runs; a row reports the median
generation speed over repeats and its range, the speed-up over target-only decoding, the
acceptance statistics, where the time went, peak memory, whether greedy text is identical to
the target's, and what Leviathan et al.'s formula predicts from the measured alpha and costs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from .costs import expected_tokens
from .core import DRAFTING_MODES, MODEL_MODES, MODES, Stats
from .engine import Engine, GenerationSettings
from .generation import DRAFT_MAX
from .errors import GGUFSpecError
from .outputs import check_outputs_dir, save_outputs
from .prompts import Prompt
from .sampling import top2_gap

# The engine's modes in the order the table shows them.
ALL_MODES = ("target", "draft-alone", "draft", "lookup", "auto")
assert sorted(ALL_MODES) == sorted(MODES)


@dataclass(frozen=True)
class Config:
    """One row's worth of settings."""

    mode: str  # one of ALL_MODES
    draft_max: int | None = None

    @property
    def label(self) -> str:
        return self.mode if self.draft_max is None else f"{self.mode} (draft-max {self.draft_max})"


@dataclass
class Run:
    config: Config
    prompt: Prompt
    repeat: int
    tokens: list[int]
    text: str
    stats: Stats
    rss: int


@dataclass
class BenchSettings:
    modes: tuple[str, ...] = ALL_MODES
    draft_max: tuple[int, ...] | None = None  # None: draft rows at the pair's length (or DRAFT_MAX), auto unbounded
    max_tokens: int = 64
    repeats: int = 1
    warmup: int = 1
    ignore_eos: bool = True
    generation: dict = field(default_factory=dict)  # temperature, seed, top_k, ... for every run
    reuse_prompt: bool = False  # False: every run evaluates its whole prompt (cold prefill)
    draft_length: int = DRAFT_MAX  # the draft rows' length without --draft-max values (a pair may recommend one)

    @property
    def draft_lengths(self) -> tuple[int, ...]:
        """The draft rows' lengths (and llama.cpp's draft-model rows'): --draft-max values, or draft_length."""
        return self.draft_max or (self.draft_length,)

    @property
    def greedy(self) -> bool:
        return (self.generation.get("temperature") or 0.0) <= 0.0

    @property
    def comparable(self) -> bool:
        """Whether every mode must write the target's own tokens: greedy runs, and sampled runs with a
        seed under the coupled rule (the default with a seed)."""
        return self.greedy or (self.generation.get("seed") is not None
                               and GenerationSettings(**self.generation).rule == "coupled")

    def validate(self) -> "BenchSettings":
        """Every bad value in one line, before anything runs."""
        if self.repeats < 1 or self.warmup < 0:
            raise GGUFSpecError("--repeats must be at least 1 and --warmup at least 0")
        if self.max_tokens < 2:
            raise GGUFSpecError(f"bench -n must be at least 2 (got {self.max_tokens}): the first token comes with the "
                                "prompt's batch, so tokens per second are timed from the second on")
        if self.draft_max is not None and (not self.draft_max or min(self.draft_max) < 1):
            raise GGUFSpecError(f"--draft-max values must be at least 1 (got {self.draft_max})")
        for mode in self.modes:
            if mode not in ALL_MODES:
                raise GGUFSpecError(f"--modes: unknown mode {mode!r}; choose from {', '.join(ALL_MODES)}")
        GenerationSettings(max_tokens=self.max_tokens, draft_max=max(self.draft_lengths), **self.generation).validate()
        return self


def plan(settings: BenchSettings, has_draft: bool) -> list[Config]:
    """The rows to run. Without --draft-max values, draft rows draft settings.draft_length tokens (the
    pair's, or DRAFT_MAX) and auto's row drafts as far as the measured costs say pays."""
    configs = []
    for mode in settings.modes:
        if mode in MODEL_MODES and not has_draft:
            continue
        if mode == "lookup":  # its drafts run to --lookup-max whatever --draft-max says: one row
            configs.append(Config(mode))
        elif mode == "auto" and settings.draft_max is None:
            configs.append(Config(mode))  # its model drafts as far as the costs say pays
        elif mode in DRAFTING_MODES:
            configs += [Config(mode, n) for n in settings.draft_lengths]
        else:
            configs.append(Config(mode))
    if not any(c.mode == "target" for c in configs):
        configs.insert(0, Config("target"))  # the baseline every speed-up is measured against
    return configs


def prompt_tokens(engine: Engine, prompt: Prompt) -> list[int]:
    """Through the model's chat template when it has one, as a user would send it."""
    if prompt.messages is not None:
        return engine.tokenize_prompt(messages=list(prompt.messages))
    if engine.target_model.chat_template:
        return engine.tokenize_prompt(messages=[{"role": "user", "content": prompt.text}])
    return engine.tokenize_prompt(prompt.text)


def prompt_text(engine: Engine, prompt: Prompt) -> str:
    """The prompt as text, as `prompt_tokens` sees it (chat template applied), for other programs."""
    if prompt.messages is not None:
        return engine.target_model.render_chat(list(prompt.messages))
    if engine.target_model.chat_template:
        return engine.target_model.render_chat([{"role": "user", "content": prompt.text}])
    return prompt.text


def run_one(engine: Engine, config: Config, tokens: list[int], settings: BenchSettings):
    kw = dict(settings.generation, max_tokens=settings.max_tokens, ignore_eos=settings.ignore_eos,
              reuse_prompt=settings.reuse_prompt)
    if config.draft_max:
        kw["draft_max"] = config.draft_max
    return engine.generate(prompt_tokens=tokens, mode=config.mode, **kw)


@dataclass(frozen=True)
class Progress:
    """Where a benchmark is: runs done of total, what just ran, and an estimate of what is left."""

    done: int
    total: int
    config: Config
    prompt: Prompt
    elapsed: float

    @property
    def seconds_left(self) -> float:
        return self.elapsed / self.done * (self.total - self.done) if self.done else 0.0


def run(engine: Engine, prompts: list[Prompt], settings: BenchSettings, runs: list[Run], progress=None) -> list[Run]:
    """Append every counted run to `runs` as it finishes (so an interrupt keeps what was done);
    `progress(Progress)` after each (warm-up runs count in the total)."""
    configs = plan(settings, engine.draft_model is not None)
    tokenized = [(p, prompt_tokens(engine, p)) for p in prompts]
    proc = psutil.Process()
    total = len(configs) * (settings.warmup + settings.repeats * len(prompts))
    start, done = time.perf_counter(), 0

    def one(config, prompt, tokens):
        nonlocal done
        result = run_one(engine, config, tokens, settings)
        done += 1
        if progress:
            progress(Progress(done, total, config, prompt, time.perf_counter() - start))
        return result

    for _ in range(settings.warmup):  # caches, page faults, thread pools: not counted
        for config in configs:
            one(config, tokenized[0][0], tokenized[0][1])
    # Configurations take turns on each prompt, so a machine that speeds up or slows down
    # during the run (other load, clocks) moves every row alike instead of favouring one.
    for repeat in range(settings.repeats):
        for prompt, tokens in tokenized:
            for config in configs:
                result = one(config, prompt, tokens)
                runs.append(Run(config, prompt, repeat, result.tokens, result.text, result.stats, proc.memory_info().rss))
    return runs


# --- rows ----------------------------------------------------------------------------------


def predicted_speedup(alpha: float, draft_max: int, cost_ratio: float) -> float:
    """Leviathan et al. (2023), eq. 1: expected tokens per round over the round's cost in target
    steps, a verify batch costing one step (the paper's assumption)."""
    return expected_tokens(alpha, draft_max) / (draft_max * cost_ratio + 1)


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
    target_tps = {key: tps(rs)[0] for (config, key), rs in groups.items() if config.mode == "target"}
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
            "speedup": median / target_tps[key] if target_tps.get(key) else None,
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
            draft_cost = (costs.draft_token_seconds if config.mode == "draft" else 0.0) or 0.0
            row["predicted_speedup"] = predicted_speedup(alpha, config.draft_max, draft_cost / costs.target_token_seconds)
            # the same expectation with the verify batch's measured cost instead of one step's
            row["predicted_speedup_costs"] = verification.speedup(alpha, config.draft_max, draft_cost)
        out.append(row)
    return out


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


def tps(rs: list[Run]) -> tuple[float, float, float]:
    """Median, min and max over repeats of (tokens / generation seconds) summed over prompts."""
    per_repeat = {}
    for r in rs:
        tokens, seconds = per_repeat.get(r.repeat, (0, 0.0))
        per_repeat[r.repeat] = (tokens + r.stats.n_timed, seconds + r.stats.generation_seconds)
    values = [t / s for t, s in per_repeat.values() if s > 0] or [0.0]
    return statistics.median(values), min(values), max(values)


# --- the whole benchmark -------------------------------------------------------------------


@dataclass
class BenchResult:
    rows: list[dict]
    meta: dict
    interrupted: bool = False


def benchmark(load, prompts: list[Prompt], settings: BenchSettings, *, by: str = "all",
              llama_cpp_bin: str | None = None, outputs_dir: str | None = None, progress=None) -> BenchResult:
    """Load the models (once per -ngl value of a sweep), run every configuration, return rows and metadata.

    load: a models.LoadOptions; its n_gpu_layers may be a list (a sweep: a row set per value).
    llama_cpp_bin: a folder with llama.cpp's llama-bench and llama-speculative-simple, for reference
    rows on the same work (greedy, fixed length). Ctrl-C keeps the finished runs (interrupted=True).
    """
    settings.validate()
    if outputs_dir:
        check_outputs_dir(outputs_dir)
    if llama_cpp_bin and (not settings.ignore_eos or not settings.greedy):
        raise GGUFSpecError("--compare-llama-cpp compares greedy fixed-length runs: drop --temp and --natural-stop")
    sweep = load.n_gpu_layers if isinstance(load.n_gpu_layers, list) else [load.n_gpu_layers]
    rows, meta, interrupted, per_ngl = [], {}, False, []
    for ngl in sweep:
        with_ngl = replace(load, n_gpu_layers=ngl, use_default=True)
        part, meta, interrupted = _bench_one(with_ngl, prompts, settings, by, llama_cpp_bin,
                                             outputs_dir, progress)
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
    """(prompt texts by group, ggufspec's target speed by group, (label, target-only text) by group)
    for llama.cpp's rows: by suite when the table is, else over all prompts."""
    key = _group_key(by)
    groups: dict[str, list[str]] = {}
    texts: dict[str, list[tuple[str, str | None]]] = {}
    mine = {r.prompt: r.text for r in runs if r.config.mode == "target" and r.repeat == 0}
    for p in prompts:
        groups.setdefault(key(p), []).append(prompt_text(engine, p))
        texts.setdefault(key(p), []).append((p.label, mine.get(p)))
    target_tps = {}
    for group in groups:
        rs = [r for r in runs if r.config.mode == "target" and key(r.prompt) == group]
        target_tps[group] = tps(rs)[0] if rs else None
    return groups, target_tps, texts


def _bench_one(load, prompts, settings: BenchSettings, by, llama_cpp_bin, outputs_dir, progress):
    from .service import open_engine
    from .reference import llama_bench, reference_rows

    engine, pair_defaults = open_engine(load)
    with engine:
        pair_settings = dict(pair_defaults.get("settings", {}))
        pair_settings.pop("mode", None)
        pair_draft_max = pair_settings.pop("draft_max", None)
        settings = replace(settings, generation={**pair_settings, **settings.generation})
        if not settings.greedy:
            settings = replace(settings, generation={"seed": 0, **settings.generation})  # sampled runs use fixed seeds
        if pair_draft_max:
            settings = replace(settings, draft_length=int(pair_draft_max))  # the pair's recommended length
        settings.validate()
        depths = _reference_depths(engine, prompts, by) if llama_cpp_bin else {}
        before = llama_bench(Path(llama_cpp_bin), engine.target_model.path, settings.max_tokens,
                             engine.target_ctx.n_threads, tuple(depths.values())) if llama_cpp_bin else None
        runs: list[Run] = []
        interrupted = False
        try:
            run(engine, prompts, settings, runs, progress=progress)
        except KeyboardInterrupt:
            interrupted = True
        out = rows(runs, engine, settings, by=by)
        explain_divergences(out, runs, engine)
        if llama_cpp_bin and not interrupted:
            groups, target_tps, texts = _reference_groups(engine, prompts, runs, by)
            out += reference_rows(llama_cpp_bin, engine, groups, settings.max_tokens, settings.draft_lengths, target_tps,
                                  llama_bench_before=before, depths=depths, target_texts=texts)
        outputs_error = None
        if outputs_dir:
            try:
                save_outputs(runs, outputs_dir)
            except GGUFSpecError as e:  # the table must not be lost with the texts
                outputs_error = str(e)
        verification = engine.verification(settings.generation.get("exact"))
        meta = {
            "pair": pair_defaults.get("name"), "target": str(engine.target_model.path),
            "draft": str(engine.draft_model.path) if engine.draft_model else None,
            "n_prompts": len(prompts), "max_tokens": settings.max_tokens, "repeats": settings.repeats,
            "warmup": settings.warmup, "greedy": settings.greedy, "settings": settings.generation,
            "threads": engine.target_ctx.n_threads, "exact_batch": verification.exact_batch, "exact": verification.exact,
            "costs": verification.report(engine.target_model.info.file_type) if engine.costs else None,
            "placement": engine.weights(), "interrupted": interrupted, "outputs_error": outputs_error,
            "prefill": "reused" if settings.reuse_prompt else "cold", "n_batch": engine.target_ctx.n_batch,
        }
    return out, meta, interrupted
