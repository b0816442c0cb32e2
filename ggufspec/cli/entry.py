"""The `ggufspec` command's entry point: a Ctrl-C at any moment, imports included, is one line."""

import sys


def main() -> None:
    try:
        from .main import main as cli_main

        cli_main()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        sys.exit(130)
