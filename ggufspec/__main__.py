"""`python -m ggufspec` is the `ggufspec` command."""

from .cli.entry import main

main()
