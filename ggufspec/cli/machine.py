"""`ggufspec costs`, `plan`, `tune`, `doctor` and `rpc-server`: this machine, its devices, and the settings that
suit them."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .options import (cache_type_options, ctx_option, draft_option, int_list, json_option, model_options, moe_option,
                      registry_option, rpc_option, split_options, target_option, user_errors)


@click.command("costs")
@model_options
@click.option("--refresh", "remeasure", is_flag=True, help="Measure again instead of reading the cache.")
@json_option
@user_errors
def costs_command(as_json, remeasure, **options):
    """What a decode costs on this machine, and where speculation can pay.

    Times the target on batches of 1-16, 24, 32, 40, 48 and 64 tokens (a logits row per token, as verification
    needs), finds the largest batch that is bit-identical to one-token decoding, times a draft
    step, and works out from those numbers the acceptance rate each kind of drafting needs
    before `--mode auto` uses it. Measured once per model, threads, offload and machine, then
    cached; --refresh measures again (after the machine's load or clocks changed).

    \b
    Examples:
      ggufspec costs
      ggufspec costs -m target.gguf -md draft.gguf --refresh
    """
    from ..models.resolve import open_engine
    from ..bench.report import costs_text, to_json

    load, _, _ = split_options(options, use_default=True, remeasure=remeasure)
    engine, _ = open_engine(load)
    with engine:
        out = engine.cost_report()
    click.echo(to_json(out) if as_json else costs_text(out))


@click.command("plan")
@click.argument("pair", required=False)
@target_option
@draft_option
@click.option("--vram", default=None, help="GPU memory budget, e.g. 24GiB (default: detected, else 0).")
@click.option("--ram", default=None, help="System memory to plan against (default: this machine's).")
@ctx_option
@moe_option
@cache_type_options[0]
@cache_type_options[1]
@registry_option
@rpc_option
@json_option
@user_errors
def plan_command(pair, target, draft, vram, ram, n_ctx, cpu_moe, type_k, type_v, registry, rpc, as_json):
    """Plan GPU layer offload for a target and draft within a memory budget.

    Reads tensor sizes from the GGUF files (or estimates them from models.toml for files not
    on this machine), adds the KV cache for -c and a compute allowance, puts the draft on the
    GPU first, then as many target layers as fit, and prints the -ngl / -ngld flags. A mixture-of-experts
    target that does not fit keeps the experts of its first layers on the CPU (--n-cpu-moe N), as few as
    it takes for the rest of every layer to go to the GPU.

    \b
    Example:
      ggufspec plan llama-3-70b-instruct --vram 24GiB -c 8192
    """
    from ..models.resolve import plan_offload
    from ..models.offload import cpu_moe_value, parse_size, total_ram
    from ..bench.report import plan_text, to_json

    ram_bytes = parse_size(ram, "--ram") if ram is not None else total_ram()
    p = plan_offload(pair, target, draft, registry=registry, vram_bytes=parse_size(vram) if vram is not None else None,
                     ram_bytes=ram_bytes, n_ctx=n_ctx, rpc=rpc, cpu_moe=cpu_moe_value(cpu_moe), type_k=type_k,
                     type_v=type_v)
    click.echo(to_json(p.to_dict()) if as_json else plan_text(p, p.vram_bytes, ram_bytes, n_ctx))


@click.command("tune")
@click.argument("pair", required=False)
@target_option
@draft_option
@click.option("--vram", default=None, help="GPU memory budget, e.g. 24GiB (default: the free memory llama.cpp reports).")
@ctx_option
@click.option("--draft-max", default="1,2,3,4", show_default=True, help="Draft lengths to try (comma list).")
@click.option("--suite", "suites", default="code", show_default=True, help="Built-in prompt suites to measure on.")
@click.option("--limit", type=int, default=1, show_default=True, help="Prompts per suite.")
@click.option("-n", "--n-predict", "max_tokens", type=int, default=64, show_default=True, help="Tokens per prompt.")
@click.option("--repeats", type=int, default=2, show_default=True, help="Interleaved repeats per setting (median reported).")
@click.option("--step", type=int, default=4, show_default=True,
              help="-ngl values tried (for a mixture of experts whose layers all fit, --n-cpu-moe values): the "
                   "plan's, and this many either side.")
@cache_type_options[0]
@cache_type_options[1]
@click.option("--write", is_flag=True, help="Save the best setting as the pair's defaults in your models.toml.")
@registry_option
@rpc_option
@json_option
@user_errors
def tune_command(pair, target, draft, vram, n_ctx, draft_max, suites, limit, max_tokens, repeats, step, type_k, type_v,
                 write, registry, rpc, as_json):
    """Measure offload and drafting settings around the plan, and pick the fastest here.

    Plans offload for the memory budget (as `ggufspec plan`), then benchmarks -ngl / -ngld around
    the plan (for a mixture of experts whose layers all fit on the GPU, the expert split
    --n-cpu-moe instead of -ngl) and each --draft-max (target alone, the draft model, auto), prints
    the table and the best flags; --write saves them as the pair's defaults in your models.toml.

    \b
    Examples:
      ggufspec tune
      ggufspec tune qwen2.5-coder-1.5b-q8_0 --draft-max 2,4,8 --write
    """
    from ..bench.prompts import load_prompts
    from ..bench.report import to_json, tune_text
    from ..bench.tune import TuneSettings, check_save, measure, save_best
    from ..errors import GGUFSpecError
    from ..models.offload import parse_size
    from ..models.resolve import resolve_models
    from .guard import stopped_by, terminate_as_interrupt
    from .progress import BenchProgress

    lengths = int_list(draft_max, "--draft-max")
    settings = TuneSettings(n_ctx=n_ctx, draft_max=lengths, max_tokens=max_tokens, repeats=repeats, step=step,
                            vram_bytes=parse_size(vram) if vram is not None else None, rpc=rpc, type_k=type_k,
                            type_v=type_v)
    prompts = load_prompts(None, suites, limit)
    existing = registry if registry and Path(registry).exists() else None  # --write may create it
    target_path, draft_path, defaults = resolve_models(pair, target, draft, registry=existing, use_default=True)
    if write:  # before measuring: a result that cannot be saved would be lost
        check_save(defaults.get("name"), registry)
    progress = BenchProgress()
    try:
        with terminate_as_interrupt() as signals:
            result = measure(target_path, draft_path, prompts, settings, pair=defaults.get("name"), progress=progress)
    except KeyboardInterrupt:  # before any row finished: nothing to show
        click.echo(f"\n{stopped_by(signals)[0]}", err=True)
        sys.exit(stopped_by(signals)[1])
    finally:
        progress.close()
    if result.interrupted:
        click.echo(f"{stopped_by(signals)[0]}: showing the finished rows" + (", nothing saved" if write else ""), err=True)
    saved, error = None, None
    if write and not result.interrupted:
        try:
            saved = save_best(result, registry)
        except GGUFSpecError as e:  # the table first: the measurements are not lost with the file
            error = str(e)
    click.echo(to_json({"rows": result.rows, "best": result.best, "flags": result.flags, "gpu": result.gpu,
                        "notes": result.notes, "saved": str(saved) if saved else None,
                        "interrupted": result.interrupted})
               if as_json else tune_text(result, saved))
    if error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(1)
    if result.interrupted:
        sys.exit(stopped_by(signals)[1])


@click.command()
@rpc_option
@json_option
@user_errors
def doctor(rpc, as_json):
    """What this machine is, what this llama-cpp-python build can do, and what is wrong here.

    Python, llama-cpp-python and its build features, the CPU, the devices llama.cpp sees (with
    free memory; RPC servers too, with --rpc), the models directory, this machine's measured costs, and every known problem
    with the command that fixes it. Exits 1 when a problem stops ggufspec from running well.

    \b
    Example:
      ggufspec doctor
    """
    from .doctor import diagnose
    from ..bench.report import doctor_text, to_json

    report = diagnose(rpc)
    click.echo(to_json(report) if as_json else doctor_text(report))
    if any(p["severity"] == "error" for p in report["problems"]):
        sys.exit(1)


@click.command("rpc-server")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but 127.0.0.1 exposes this machine: llama.cpp's RPC has no "
                   "authentication or encryption.")
@click.option("-p", "--port", type=click.IntRange(1, 65535), default=50052, show_default=True, help="Port to listen on.")
@click.option("-t", "--threads", type=int, default=None, help="CPU threads (default: physical cores).")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False), default=None,
              help="Keep received tensors here, so a model is sent only once.")
@user_errors
def rpc_server(host, port, threads, cache_dir):
    """Serve this machine's CPU to another machine's ggufspec through llama.cpp's RPC backend.

    The same server as llama.cpp's own rpc-server, from the same build. Then on the other
    machine: ggufspec generate ... --rpc THIS_HOST:PORT. It serves one client at a time.

    \b
    Example:
      ggufspec rpc-server --port 50052
    """
    from ..llama.rpc import WARNING, serve
    from ..llama.system import check_threads

    check_threads(threads)
    if host != "127.0.0.1":
        click.echo("\n" + WARNING.format(host=host) + "\n", err=True)
    serve(host, port, threads, cache_dir)
