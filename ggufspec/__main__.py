"""`python -m ggufspec` is the `ggufspec` command."""

from .cli import main

main()
