"""`python -m ggufspec` is the `ggufspec` command."""

from .entry import main

main()
