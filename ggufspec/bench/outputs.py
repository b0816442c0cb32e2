"""`bench --save-outputs`: every mode's text per prompt, side by side, for reading what speculation wrote."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import GGUFSpecError
from .prompts import Prompt


def check_outputs_dir(folder: str | Path) -> Path:
    """Make sure the texts can be saved there before anything runs (one line if not)."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".ggufspec-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise GGUFSpecError(f"--save-outputs {folder}: cannot write there ({e.strerror}); choose another folder") from None
    return folder


def save_outputs(runs: list, folder: str | Path) -> None:
    """One Markdown file per prompt with every mode's text under its own heading. Each file is
    written whole or not at all (a full disk leaves no empty file); a failure is one GGUFSpecError."""
    folder = check_outputs_dir(folder)
    by_prompt: dict[Prompt, dict[str, str]] = {}
    for r in runs:
        if r.repeat == 0:
            by_prompt.setdefault(r.prompt, {})[r.config.label] = r.text
    for prompt, texts in by_prompt.items():
        parts = [f"# {prompt.label}\n\n## prompt\n\n{prompt.text or json.dumps(list(prompt.messages))}\n"]
        parts += [f"## {label}\n\n{text}\n" for label, text in texts.items()]
        path = folder / f"{prompt.label}.md"
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text("\n".join(parts))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise GGUFSpecError(f"--save-outputs {folder}: could not write {path.name} ({e.strerror}); "
                                "the results above are complete") from None
