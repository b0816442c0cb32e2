"""From what the user typed (a pair name, model names, or paths) to GGUF files on disk."""

from __future__ import annotations

from pathlib import Path

from .errors import GGUFSpecError


def resolve_models(pair: str | None, target: str | None, draft: str | None, *, registry=None,
                   offline: bool = False) -> tuple[Path, Path | None, dict]:
    """Return (target path, draft path or None, the pair's defaults)."""
    if pair is None and target is None:
        raise GGUFSpecError("name a pair or give -m TARGET (and -md DRAFT)")
    if pair is not None and target is not None:
        raise GGUFSpecError("give a pair name or -m TARGET, not both")
    if pair is not None:
        target = pair
    return Path(target), (Path(draft) if draft else None), {}
