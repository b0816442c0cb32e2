"""From what the user typed (a pair name, model names, or paths) to GGUF files on disk."""

from __future__ import annotations

from pathlib import Path

from .errors import GGUFSpecError
from .hub import ensure_model, local_path
from .registry import PairSpec, Registry, load_registry


def looks_like_path(text: str) -> bool:
    return text.endswith(".gguf") or "/" in text or Path(text).exists()


def resolve_model(name_or_path: str, registry: Registry, *, offline: bool = False) -> Path:
    """A path is taken as it is (checked when loaded); a registry name is found or downloaded."""
    if looks_like_path(name_or_path):
        return Path(name_or_path)
    return ensure_model(registry.model(name_or_path), offline=offline)


def resolve_models(pair: str | None, target: str | None, draft: str | None, *, registry=None, offline: bool = False,
                   use_default: bool = False) -> tuple[Path, Path | None, dict]:
    """Return (target path, draft path or None, the pair's defaults: settings and offload)."""
    if pair is not None and target is not None:
        raise GGUFSpecError("give a pair name or -m TARGET, not both")
    reg = load_registry(registry)
    if pair is None and target is None:
        if not use_default or not reg.default_pair:
            raise GGUFSpecError("name a pair (see `ggufspec models list`) or give -m TARGET (and -md DRAFT)")
        pair = reg.default_pair
    defaults: dict = {}
    if pair is not None:
        if looks_like_path(pair):
            target = pair
        else:
            spec = reg.pair(pair)
            target, draft = spec.target, draft or spec.draft
            defaults = pair_defaults(spec)
    target_path = resolve_model(target, reg, offline=offline)
    draft_path = resolve_model(draft, reg, offline=offline) if draft else None
    return target_path, draft_path, defaults


def pair_defaults(spec: PairSpec) -> dict:
    out = {"settings": dict(spec.settings), "name": spec.name}
    if spec.n_gpu_layers is not None:
        out["n_gpu_layers"] = spec.n_gpu_layers
    if spec.draft_n_gpu_layers is not None:
        out["draft_n_gpu_layers"] = spec.draft_n_gpu_layers
    return out


def status(registry: Registry) -> dict:
    """Where each registry model is on this machine (None if not here), for `models list`."""
    return {name: local_path(spec) for name, spec in registry.models.items()}
