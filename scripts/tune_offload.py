#!/usr/bin/env python
"""Tune a pair's offload and drafting settings from Python: an example over `ggufspec.bench.tune`,
the API behind `ggufspec tune` (which does the same from the command line, with --write).

    python scripts/tune_offload.py [PAIR] [--vram 24GiB] [--draft-max 1,2,3,4] [--write]
"""

from __future__ import annotations

import argparse
import sys

from ggufspec.bench.prompts import load_prompts
from ggufspec.bench.report import tune_text
from ggufspec.bench.tune import TuneSettings, check_save, measure, save_best
from ggufspec.errors import GGUFSpecError
from ggufspec.models.offload import parse_size
from ggufspec.models.resolve import resolve_models


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pair", nargs="?", help="a pair from models.toml (default: the default pair)")
    ap.add_argument("--vram", default=None, help="GPU memory budget (default: what llama.cpp reports free)")
    ap.add_argument("--draft-max", default="1,2,3,4")
    ap.add_argument("--write", action="store_true", help="save the best setting in the user's models.toml")
    a = ap.parse_args(argv)
    try:
        target, draft, defaults = resolve_models(a.pair, None, None, use_default=True)
        if a.write:  # before measuring: a result the registry cannot take would be lost
            check_save(defaults.get("name"))
        settings = TuneSettings(draft_max=tuple(int(x) for x in a.draft_max.split(",")),
                                vram_bytes=parse_size(a.vram) if a.vram else None)
        result = measure(target, draft, load_prompts(None, "code", 1), settings, pair=defaults.get("name"))
        print(tune_text(result, save_best(result) if a.write else None))
    except (GGUFSpecError, ValueError) as e:
        print(f"tune_offload: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
