"""The progress line of `bench` and `tune` on a terminal."""

from __future__ import annotations

import os
import sys
import time

import click


class BenchProgress:
    """Runs done of total, mode, prompt and time left on one stderr line; silent when stderr is not a terminal."""

    def __init__(self):
        self.live = sys.stderr.isatty() or os.environ.get("GGUFSPEC_STDERR_TTY") == "1"

    def __call__(self, p) -> None:
        if self.live:
            left = time.strftime("%M:%S", time.gmtime(p.seconds_left))
            line = f"bench {p.done}/{p.total}  {p.config.label:<22} {p.prompt.label:<14} {left} left"
            click.echo(f"\r{line:<78}", err=True, nl=False)

    def close(self) -> None:
        if self.live:
            click.echo("\r" + " " * 78 + "\r", err=True, nl=False)
