"""Where ggufspec keeps things: every directory and file it reads or writes by default.

XDG conventions, each overridable by an environment variable (tests point them at a
temporary directory). Read at call time, never cached, so a changed environment is seen.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def config_home() -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def models_dir() -> Path:
    """Where the offline mirror puts GGUF files, and where names are looked up first."""
    env = os.environ.get("GGUFSPEC_MODELS_DIR")
    return Path(env) if env else cache_home() / "ggufspec" / "models"


def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment now (the library reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or cache_home() / "huggingface"
    return Path(home) / "hub"


def costs_file() -> Path:
    """The measured decode costs, keyed by model and machine."""
    return Path(os.environ.get("GGUFSPEC_COSTS_FILE") or cache_home() / "ggufspec" / "costs.json")


def user_registry() -> Path:
    """The user's own models.toml, merged over the built-in one."""
    return config_home() / "ggufspec" / "models.toml"
