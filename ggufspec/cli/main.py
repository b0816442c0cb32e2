"""The `ggufspec` command: it parses, calls one library function per command, and prints.

Flag names follow llama.cpp. Every user error is one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import errno
import json
import os
import sys

import click

from ..core import MODES
from ..errors import GGUFSpecError, exactly_one
from .guard import stopped_by, terminate_as_interrupt
from .machine import costs_command, doctor, plan_command, rpc_server, tune_command
from .drafts import drafts_command
from .models import models
from .serve import serve_command
from .progress import BenchProgress
from .options import int_list, json_option, model_options, sampling_options, split_options, user_errors, whole_number


class PipeClosed(Exception):
    """The reader of standard output went away (`ggufspec ... | head`). Not an OSError, so click's own
    handler (exit 1, nothing said) lets it through to `main`, which exits 141 as a shell expects."""


class OneLineErrors(click.Group):
    """Usage errors as one line (`Error: ...`), like every other error, instead of click's usage block."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError as e:
            raise PipeClosed() from e

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            click.echo(f"Error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except click.exceptions.Abort:  # a Ctrl-C while click parses the command line: as everywhere else
            click.echo("interrupted", err=True)
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
@click.option("-f", "--file", "prompt_file", type=click.Path(dir_okay=False, allow_dash=True),
              help="Read the prompt from a file ('-' for stdin); its bytes are tokenized as they are, as llama.cpp does.")
@click.option("--chat", "chat_message", help="A user message, sent through the model's chat template.")
@click.option("--stop", multiple=True, help="Stop when this string appears (repeatable).")
@json_option
@user_errors
def generate(prompt, prompt_file, chat_message, stop, as_json, **options):
    """Generate text, with a draft model speculating for the target.

    \b
    Example:
      ggufspec generate -m target.gguf -md draft.gguf -p "def quicksort(a):" -n 64
      ggufspec generate qwen2.5-coder-1.5b --chat "Write a haiku about caches" --json
    """
    from ..models.resolve import merge_pair_settings, open_engine

    exactly_one({"-p PROMPT": prompt, "-f FILE": prompt_file, "--chat MESSAGE": chat_message})
    if prompt_file is not None:
        prompt = read_prompt_file(prompt_file)
    load, settings, draft_max = split_options(options)
    if draft_max is not None:
        settings["draft_max"] = whole_number(draft_max, "--draft-max")
    engine, pair_defaults = open_engine(load, modes=(settings.get("mode", ""),))
    with engine:
        settings, _ = merge_pair_settings(pair_defaults.get("settings", {}), settings)
        if stop:
            settings["stop"] = tuple(stop)
        messages = [{"role": "user", "content": chat_message}] if chat_message is not None else None
        tokens = engine.tokenize_prompt(prompt, messages)
        if as_json:
            click.echo(json.dumps({**engine.generate(prompt_tokens=tokens, **settings).to_dict(),
                                   "placement": engine.weights()}))
            return
        chunk = None
        for chunk in engine.stream(prompt_tokens=tokens, **settings):
            click.echo(chunk.text, nl=False)
            sys.stdout.flush()
        click.echo()
        click.echo(chunk.stats.summary(), err=True)


def read_prompt_file(path: str) -> bytes:
    """The bytes of a prompt file, or of standard input for '-'; one line if neither can be read."""
    if path == "-":
        if sys.stdin is None:
            raise GGUFSpecError("-f -: standard input is closed; pipe the prompt in, or give -p PROMPT or -f FILE")
        try:
            return sys.stdin.buffer.read()
        except (OSError, ValueError) as e:
            raise GGUFSpecError(f"-f -: cannot read standard input ({e})") from None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise GGUFSpecError(f"-f {path}: cannot read the prompt file ({e.strerror})") from None


@cli.command()
@model_options
@sampling_options
@click.option("--modes", default=",".join(MODES), show_default=True,
              help=f"Comma list of --mode values to run: {', '.join(MODES)} (see generate --help).")
@click.option("--suite", "suites", default="code,edit,chat,summarize", show_default=True,
              help="Comma list of built-in prompt suites: code, edit, chat, summarize, fix (bug fixes "
                   "answered with the whole code: where prompt lookup pays).")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="Your own prompts: text (one per line) or JSONL with `prompt` or `messages`.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Counted runs per prompt (median reported; with 2 or more, min-max shows the spread).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Uncounted runs per configuration.")
@click.option("--natural-stop", is_flag=True, help="Stop at end-of-generation tokens instead of generating -n tokens.")
@click.option("--by-suite", is_flag=True, help="A row per mode and suite.")
@click.option("--per-prompt", is_flag=True, help="A row per mode and prompt.")
@click.option("--save-outputs", type=click.Path(file_okay=False), default=None, help="Save the texts side by side here.")
@json_option
@click.option("--csv", "as_csv", is_flag=True, help="CSV rows.")
@click.option("--markdown", "as_markdown", is_flag=True, help="A Markdown table.")
@click.option("--wide", is_flag=True, help="Every column (time split, prompt speed, predictions), not only those that fit 120 columns.")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG of tok/s against --draft-max (needs matplotlib).")
@click.option("--compare-llama-cpp", "llama_cpp_bin", type=click.Path(file_okay=False), default=None,
              help="Folder with llama.cpp's llama-bench and llama-speculative-simple: add their rows on the same work.")
@click.option("--limit", type=int, default=2, show_default=True, help="Prompts per suite (0: all 4).")
@click.option("--concurrency", default=None, metavar="N[,N...]",
              help="Serve the prompts to N clients at once (ggufspec serve, per mode; with --compare-llama-cpp also "
                   "llama-server -np N with and without the draft): aggregate and per-request tok/s, first token.")
@click.option("--reuse-prompt", is_flag=True,
              help="Keep what the KV cache holds of a prompt between runs (whole -b batches; output unchanged): "
                   "warm prefill. Default: every run evaluates its whole prompt.")
@user_errors
def bench(modes, suites, prompts_file, repeats, warmup, natural_stop, by_suite, per_prompt, save_outputs,
          as_json, as_csv, as_markdown, wide, plot, llama_cpp_bin, limit, concurrency, reuse_prompt, **options):
    """Benchmark target-only against speculative decoding (and the draft alone) on the same prompts.

    With no PAIR or -m it runs the default pair of models.toml. Greedy by default, -n tokens per
    prompt; every speed-up is against the target alone, measured in the same process.

    \b
    Examples:
      ggufspec bench
      ggufspec bench --suite edit --draft-max 1,2,3,4,8 --plot sweep.png
      ggufspec bench -m target.gguf -md draft.gguf --temp 0.2 --repeats 3 --json
    """
    from ..bench import benchmark as B
    from ..bench.prompts import load_prompts
    load, given, draft_max = split_options(options, check=False)
    given = {k: v for k, v in given.items() if k not in ("mode", "ignore_eos")}
    settings = B.BenchSettings(tuple(m.strip() for m in modes.split(",") if m.strip()),  # -n 0 is a value, refused
                               int_list(draft_max, "--draft-max"), given.pop("max_tokens", 64),
                               repeats, warmup, not natural_stop, given, reuse_prompt)
    prompts = load_prompts(prompts_file, suites, limit)
    if concurrency is not None:
        given_ctx = click.get_current_context().get_parameter_source("n_ctx") != click.core.ParameterSource.DEFAULT
        return _bench_concurrency(load, prompts, settings, int_list(concurrency, "--concurrency"), llama_cpp_bin,
                                  load.n_ctx if given_ctx else None, as_json)
    if plot:
        from ..bench.report import plot_library

        plot_library()  # before the run, not after it
    by = "prompt" if per_prompt else "suite" if by_suite else "all"
    progress = BenchProgress()
    try:
        with terminate_as_interrupt() as signals:
            result = B.benchmark(load, prompts, settings, by=by, llama_cpp_bin=llama_cpp_bin, outputs_dir=save_outputs,
                                 progress=progress)
    except KeyboardInterrupt:  # before any run finished (while loading): nothing to show
        click.echo(f"\n{stopped_by(signals)[0]}", err=True)
        sys.exit(stopped_by(signals)[1])
    finally:
        progress.close()
    if result.interrupted:
        click.echo(f"{stopped_by(signals)[0]}: showing the finished runs", err=True)
    for note in result.meta.get("notes", []):  # llama.cpp's rows left out, rows cut short
        click.echo(f"note: {note}", err=True)
    _show_bench(result, by, as_json=as_json, as_csv=as_csv, as_markdown=as_markdown, wide=wide)
    if plot:
        from ..bench.report import plot_sweep

        plot_sweep(result.rows, plot)
    if result.meta.get("outputs_error"):
        click.echo(f"Error: {result.meta['outputs_error']}", err=True)
        sys.exit(1)
    if result.interrupted:
        sys.exit(stopped_by(signals)[1])


def _bench_concurrency(load, prompts, settings, levels, llama_cpp_bin, slot_ctx, as_json) -> None:
    """bench --concurrency: ggufspec's server (and llama-server) under N clients at once; one table or --json.
    slot_ctx: -c where given, each sequence's context; None: sized from the prompts and -n."""
    from pathlib import Path

    from ..bench.concurrency import concurrency_bench, concurrency_table
    from ..bench.reference import _program

    if llama_cpp_bin:
        _program(Path(llama_cpp_bin), "llama-server")  # before anything loads
    with terminate_as_interrupt():
        result = concurrency_bench(load, prompts, settings, levels, llama_cpp_bin, slot_ctx,
                                   note=lambda line: click.echo(line, err=True))
    click.echo(json.dumps(result) if as_json else concurrency_table(result))


def _show_bench(result, by: str, *, as_json: bool, as_csv: bool, as_markdown: bool, wide: bool) -> None:
    """The benchmark's rows as JSON, CSV or a table with its footer (costs, auto's choices, the noise notes)."""
    from ..bench.report import auto_footer, bench_footer, bench_table, to_csv, to_json

    if as_json:
        click.echo(to_json({**result.meta, "rows": result.rows}))
    elif as_csv:
        click.echo(to_csv(result.rows, [(k, k) for k in result.rows[0]] if result.rows else None), nl=False)
    else:
        click.echo(bench_table(result.rows, grouped=by != "all", wide=wide, as_markdown=as_markdown))
        noise = "\n".join(f"note: {line}" for line in result.meta.get("noise_notes", []))
        footer = "\n".join(part for part in (bench_footer(result.meta), auto_footer(result.rows), noise) if part)
        if footer:
            click.echo("\n" + footer)


cli.add_command(models)
for command in (drafts_command, costs_command, plan_command, tune_command, doctor, rpc_server, serve_command):
    cli.add_command(command)


def uses_rpc(args: list[str]) -> bool:
    """Whether a command line names RPC servers (`--rpc HOST:PORT` or `--rpc=HOST:PORT`)."""
    return any(a == "--rpc" or a.startswith("--rpc=") for a in args)


def main():
    if sys.stdout is None:  # started with standard output closed (`>&-`): nothing could be shown
        print("Error: standard output is closed; redirect it to a file or /dev/null instead", file=sys.stderr)
        sys.exit(1)
    if (uses_rpc(sys.argv[1:]) or os.environ.get("GGUFSPEC_RPC")) and not os.environ.get("GGUFSPEC_CHILD"):
        from .guard import run_guarded

        sys.exit(run_guarded(sys.argv[1:]))
    try:
        try:
            cli(prog_name="ggufspec")
        finally:
            sys.stdout.flush()  # a full disk or a closed pipe shows here, not at exit
    except (BrokenPipeError, PipeClosed):  # `ggufspec ... | head`: the reader has what it wanted
        _silence_stdout()
        sys.exit(141)
    except OSError as e:
        if e.filename is not None or e.errno not in (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EBADF):
            raise
        _silence_stdout()
        print(f"Error: could not write the output ({e.strerror or e}); check the disk or the pipe it goes to", file=sys.stderr)
        sys.exit(1)


def _silence_stdout() -> None:
    """Point standard output at /dev/null, so the interpreter's last flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
