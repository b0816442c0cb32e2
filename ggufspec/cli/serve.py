"""`ggufspec serve`: the OpenAI-compatible server (ggufspec.server) with the shared model and sampling flags."""

from __future__ import annotations

import click

from ..errors import GGUFSpecError, check_count
from ..core import PROMPT_CHUNK
from .options import model_options, sampling_options, split_options, user_errors, whole_number


@click.command("serve")
@model_options
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface, reachable from other machines).")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to listen on.")
@click.option("-np", "--parallel", "n_seq", type=int, default=4, show_default=True,
              help="Requests served at once, each on a sequence of its own sharing -c; more wait in a queue.")
@click.option("-kvu", "--kv-unified", "kv_unified", is_flag=True,
              help="One KV cache for every sequence (llama.cpp's -kvu): a batch of several sequences is always one "
                   "ubatch, but a request's text may differ from `generate`'s at near-ties.")
@click.option("--prompt-chunk", type=int, default=PROMPT_CHUNK, show_default=True, metavar="N",
              help="Prompts are evaluated in chunks of N tokens at multiples of N (at most -b): a request whose prompt "
                   "begins like an earlier one's (a chat's next turn, a fixed system prompt) keeps the whole chunks "
                   "they share from the KV cache, and its text stays what a cold start writes.")
@click.option("--alias", default=None, help="The model's name in /v1/models and in answers (default: the target's).")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for a sequence; beyond that a request gets a 503.")
@click.option("--api-key", default=None, envvar="GGUFSPEC_API_KEY", show_envvar=True,
              help="A key every request but /health must send (`Authorization: Bearer KEY`), as llama-server's.")
@click.option("--grace", type=float, default=5.0, show_default=True, metavar="SECONDS",
              help="After Ctrl-C or SIGTERM, how long requests in flight may go on; then each is answered that the "
                   "server stopped.")
@user_errors
def serve_command(host, port, n_seq, kv_unified, prompt_chunk, alias, max_queue, api_key, grace, **options):
    """Serve the target over an OpenAI-compatible HTTP API, several requests at once in one batched verify.

    -c is shared by the -np sequences (as in llama-server); --mode and the sampling flags are the defaults a
    request's own fields override (`mode`, `temperature`, `seed`, `max_tokens`, `stop`, ...). Under load,
    auto drafts less as more requests share a batch, and not at all where drafting would cost more than it
    returns. Ctrl-C stops it.

    \b
    Examples:
      ggufspec serve qwen2.5-coder-1.5b -np 4
      curl http://127.0.0.1:8080/v1/completions -d '{"prompt": "def fib(n):", "max_tokens": 32}'
    """
    from pathlib import Path

    from ..generation import GenerationSettings, resolve_settings
    from ..llama.runtime import on_a_passing_thread
    from ..models.resolve import merge_pair_settings, open_engine
    from ..server import check_address, is_loopback, serve

    check_count(max_queue, "--max-queue", 0)
    if not 0 < port < 65536:
        raise GGUFSpecError(f"--port must be between 1 and 65535 (got {port})")
    if not 0 <= grace <= 3600:
        raise GGUFSpecError(f"--grace must be between 0 and 3600 seconds (got {grace:g})")
    if api_key is not None and (not api_key.strip() or any(c.isspace() for c in api_key)):
        raise GGUFSpecError("--api-key must be one word without spaces (a client sends it as `Bearer KEY`)")
    check_address(host, port)
    if not is_loopback(host):
        click.echo(f"ggufspec serve: listening on {host}, not this machine alone: anyone who can reach port {port} "
                   + ("and has the API key can use it" if api_key else "can use it (no --api-key given)"), err=True)
    check_count(prompt_chunk, "--prompt-chunk", 1)
    load, settings, draft_max = split_options(options, n_seq=n_seq, kv_unified=kv_unified, prompt_chunk=prompt_chunk)
    if draft_max is not None:
        settings["draft_max"] = whole_number(draft_max, "--draft-max")
    if load.n_ctx < 8 * n_seq:
        raise GGUFSpecError(f"-c {load.n_ctx} leaves each of the -np {n_seq} sequences under 8 tokens; raise -c")
    engine, pair_defaults = on_a_passing_thread(  # not the main thread: the scheduler's decodes would be throttled
        lambda: open_engine(load, modes=(settings.get("mode", ""),), measure=True),  # a request may speculate
        close=lambda opened: opened[0].close())
    with engine:
        settings, _ = merge_pair_settings(pair_defaults.get("settings", {}), settings)
        defaults = resolve_settings(GenerationSettings(), settings)
        name = alias or Path(engine.target_model.path).stem

        stopped_by = serve(engine, name, defaults, host=host, port=port, max_queue=max_queue, api_key=api_key,
                           grace=grace, ready=announce(engine, name, n_seq, defaults, kv_unified),
                           say=lambda line: click.echo(line, err=True))
    if stopped_by is not None:  # as a shell reports a command its signal stopped: 130 for Ctrl-C, 143 for SIGTERM
        import signal

        click.echo(f"ggufspec serve: stopped by {signal.Signals(stopped_by).name}", err=True)
        raise SystemExit(128 + stopped_by)


def announce(engine, name: str, n_seq: int, defaults, kv_unified: bool):
    """What the server says once it listens: where, and (by default, where it is dear here) what keeping each answer
    the target's own costs a step of n_seq requests (`batching.identity_price_line`)."""
    from ..batching import identity_price_line

    price = identity_price_line(engine.costs, n_seq, kv_unified) if defaults.exact is None else None

    def ready(url: str) -> None:
        click.echo(f"ggufspec serve: {name} on {url}/v1 ({n_seq} sequences of {engine.n_ctx} tokens, "
                   f"mode {defaults.mode}); Ctrl-C stops it", err=True)
        if price:
            click.echo(f"ggufspec serve: {price}", err=True)

    return ready
