"""`ggufspec drafts`: the drafts a target can use on this machine, checked and ranked."""

from __future__ import annotations

import sys

import click

from .options import int_list, json_option, registry_option, user_errors


@click.command("drafts")
@click.argument("target")
@click.option("--measure", is_flag=True, help="Measure acceptance, costs and speed-up of each usable candidate here.")
@click.option("--suite", "suites", default="code", show_default=True, help="With --measure: the prompt suites.")
@click.option("--limit", type=int, default=2, show_default=True, help="With --measure: prompts per suite.")
@click.option("-n", "--n-predict", "max_tokens", type=int, default=32, show_default=True,
              help="With --measure: tokens per prompt (greedy).")
@click.option("--draft-max", default="2,4", show_default=True, help="With --measure: draft lengths to try.")
@click.option("--write", is_flag=True, help="With --measure: save the best draft as a pair in your models.toml.")
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
    saves the best as a pair in your models.toml.

    \b
    Examples:
      ggufspec drafts qwen2.5-coder-1.5b-instruct-q8_0
      ggufspec drafts ./target.gguf --measure --write
    """
    from ..bench.draft_choice import drafts_text
    from ..bench.report import to_json
    from ..models.drafts import find_drafts

    if write and not measure:
        raise click.UsageError("--write saves what --measure measured: give both")
    found = find_drafts(target, registry)
    saved = None
    if measure:
        found, saved = _measure(found, suites, limit, max_tokens, draft_max, write, registry)
    click.echo(to_json({**found, "saved": saved}) if as_json else drafts_text(found, saved))
    if found.get("interrupted"):
        sys.exit(130)


def _measure(found, suites, limit, max_tokens, draft_max, write, registry):
    from ..bench.draft_choice import MeasureSettings, check_save, measure, save_best
    from .progress import BenchProgress

    settings = MeasureSettings(suites, limit, max_tokens, int_list(draft_max, "--draft-max"))
    if write:  # before measuring: a result that cannot be saved would be lost
        check_save(found, registry)
    progress = BenchProgress()

    def announce(line):
        if progress.live:
            click.echo(f"\r{line:<78}", err=True)
    try:
        found = measure(found, settings, progress=progress, announce=announce)
    finally:
        progress.close()
    saved = None
    if write and not found["interrupted"]:
        result = save_best(found, registry)
        saved = {"pair": result[0], "file": str(result[1])} if result else None
    return found, saved
