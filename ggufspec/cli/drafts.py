"""`ggufspec drafts`: the drafts a target can use on this machine, checked and ranked."""

from __future__ import annotations

import sys

import click

from ..errors import GGUFSpecError
from .guard import raise_if_stopped, stopped_by, terminate_as_interrupt
from .options import int_list, json_option, registry_option, user_errors


@click.command("drafts")
@click.argument("target")
@click.option("--measure", is_flag=True, help="Measure acceptance, costs and speed-up of each usable candidate here.")
@click.option("--suite", "suites", default="code", show_default=True, help="With --measure: the prompt suites.")
@click.option("--limit", type=int, default=2, show_default=True, help="With --measure: prompts per suite.")
@click.option("-n", "--n-predict", "max_tokens", type=int, default=32, show_default=True,
              help="With --measure: tokens per prompt (greedy).")
@click.option("--draft-max", default="2,4", show_default=True, help="With --measure: draft lengths to try.")
@click.option("--write", is_flag=True, help="With --measure: save the fastest draft as a pair in your models.toml.")
@registry_option
@json_option
@user_errors
def drafts_command(target, measure, suites, limit, max_tokens, draft_max, write, registry, as_json):
    """Which drafts can TARGET use here? Checked, and ranked by the speed-up each should give.

    TARGET is a .gguf path, a registry name, or owner/name/file in the Hugging Face cache. Candidates: the GGUFs
    in the models directory and the Hub cache, the registry's (with the `models pull` line), the target's own
    MTP layers, and prompt lookup. Each is checked as `models check` checks a pair, from headers and
    vocabularies alone (no weights load); a draft step's cost against the target's is predicted from file
    sizes and the speed-up at an assumed acceptance rate, both labelled. --measure measures them; --write
    saves the fastest measured as a pair in your models.toml, target and draft by registry name or absolute
    path; nothing where the fastest needs no draft file (lookup, the target's MTP layers) or none beat the
    target alone.

    \b
    Examples:
      ggufspec drafts qwen2.5-coder-1.5b-instruct-q8_0
      ggufspec drafts ./target.gguf --measure --write
    """
    from ..bench.draft_choice import drafts_text, existing, save_best
    from ..bench.report import to_json
    from ..models.drafts import find_drafts

    if write and not measure:
        raise click.UsageError("--write saves what --measure measured: give both")
    found = find_drafts(target, existing(registry) if write else registry)  # --write may create the file
    saved = nothing_saved = error = None
    signals = []
    if measure:
        found, signals = _measure(found, suites, limit, max_tokens, draft_max, write, registry)
        if write and not found["interrupted"]:
            try:
                saved, nothing_saved = save_best(found, registry)
            except GGUFSpecError as e:  # the table first: the measurements are not lost with the file
                error = str(e)
    click.echo(to_json({**found, "saved": saved, "nothing_saved": nothing_saved}) if as_json
               else drafts_text(found, saved, nothing_saved))
    if error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(1)
    if found.get("interrupted"):
        sys.exit(stopped_by(signals)[1])


def _measure(found, suites, limit, max_tokens, draft_max, write, registry):
    """find_drafts' answer measured, and the signals that stopped it (SIGTERM and SIGHUP stop it as Ctrl-C does:
    the rows measured so far are shown)."""
    from ..bench.draft_choice import MeasureSettings, check_save, measure
    from .progress import BenchProgress

    settings = MeasureSettings(suites, limit, max_tokens, int_list(draft_max, "--draft-max"))
    if write:  # before measuring: a result that cannot be saved would be lost
        check_save(found, registry)
    progress = BenchProgress()
    signals: list[int] = []  # terminate_as_interrupt's, once it has begun

    def tick(done):
        progress(done)
        raise_if_stopped(signals)

    def announce(line):
        raise_if_stopped(signals)
        if progress.live:
            click.echo(f"\r{line:<78}", err=True)
    try:
        with terminate_as_interrupt() as signals:
            found = measure(found, settings, progress=tick, announce=announce)
    except KeyboardInterrupt:  # outside measure's own guard (reading the prompts): nothing measured yet
        found = {**found, "interrupted": True}
    finally:
        progress.close()
    if found["interrupted"]:
        click.echo(f"{stopped_by(signals)[0]}: showing the measured rows" + (", nothing saved" if write else ""),
                   err=True)
    return found, signals
