"""Getting GGUF files: the only module that imports `huggingface_hub`.

Resolution order for a registry model: the models directory ($GGUFSPEC_MODELS_DIR, where the
offline mirror puts files), then the Hub cache (local_files_only), then a download with
hf_hub_download (progress bar on stderr, resume of an interrupted download, the usual cache,
$HF_TOKEN for gated repositories). Offline mode ($HF_HUB_OFFLINE=1 or --offline) never downloads.
A file whose sha256 differs from the registry's is deleted, and the user is told.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from ..errors import GGUFSpecError
from ..paths import hub_cache_dir, models_dir
from .registry import ModelSpec


def is_offline(offline: bool = False) -> bool:
    return offline or os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _stamp_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns}"


def stamped_sha256(path: Path) -> str | None:
    """The sha256 remembered beside a file if the file is unchanged since (same size and mtime), else None."""
    stamp = stamp_path(path)
    lines = stamp.read_text().split("\n") if stamp.exists() else []
    return lines[0] if len(lines) >= 2 and lines[1] == _stamp_key(path) else None


def write_stamp(path: Path, digest: str) -> None:
    """Remember a file's sha256 beside it, keyed by its size and mtime now."""
    stamp_path(path).write_text(f"{digest}\n{_stamp_key(path)}\n")


def verified_sha256(path: Path) -> str:
    """sha256 of a file, remembered beside it (keyed by size and mtime) so a second look is free."""
    digest = stamped_sha256(path)
    if digest is not None:
        return digest
    digest = sha256_file(path)
    try:
        write_stamp(path, digest)
    except OSError:
        pass  # a read-only cache still works, just without the shortcut
    return digest


def check_sha256(path: Path, expected: str | None, what: str) -> None:
    """Raise (after deleting the file) if its sha256 is not the expected one."""
    if not expected:
        return
    actual = verified_sha256(path)
    if actual != expected.lower():
        _delete(path)
        raise GGUFSpecError(
            f"{what}: checksum mismatch for {path.name} (sha256 {actual[:16]}…, expected {expected[:16]}…); "
            "the bad file was deleted, download it again"
        )


def _delete(path: Path) -> None:
    real = path.resolve()
    for p in {path, real, stamp_path(path), stamp_path(real)}:
        try:
            p.unlink()
        except FileNotFoundError:
            pass


def local_path(spec: ModelSpec) -> Path | None:
    """Where the model already is on this machine (models dir or Hub cache), or None."""
    candidate = models_dir() / spec.file
    if candidate.is_file():
        return candidate
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(spec.repo, spec.file, cache_dir=hub_cache_dir(), revision=spec.revision)
    if isinstance(cached, str) and Path(cached).is_file():
        return Path(cached)
    return None


def expected_sha256(spec: ModelSpec, path: Path) -> str | None:
    """The checksum that belongs to this copy: the mirror's for files the mirror wrote."""
    if spec.mirror and path.parent == models_dir():
        return spec.mirror.sha256
    return spec.sha256


def ensure_model(spec: ModelSpec, *, offline: bool = False, endpoint: str | None = None, progress: bool = True) -> Path:
    """Return a verified local path for a registry model, downloading it if allowed."""
    path = local_path(spec)
    if path is not None:
        check_sha256(path, expected_sha256(spec, path), spec.name)
        return path
    if is_offline(offline):
        hint = " or `python scripts/fetch_offline_models.py`" if spec.mirror else ""
        raise GGUFSpecError(
            f"{spec.name}: {spec.file} is not on this machine and offline mode is on; "
            f"run `ggufspec models pull {spec.name}` where the Hub is reachable{hint}"
        )
    return download(spec, endpoint=endpoint, progress=progress)


def download(spec: ModelSpec, *, endpoint: str | None = None, progress: bool = True) -> Path:
    """hf_hub_download into the Hub cache (resumable; atomic: an interrupted download never looks complete)."""
    import huggingface_hub
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    if not progress:
        huggingface_hub.utils.disable_progress_bars()
    where = f"{spec.repo}/{spec.file}"
    try:
        path = Path(hf_hub_download(spec.repo, spec.file, revision=spec.revision, endpoint=endpoint,
                                    cache_dir=hub_cache_dir()))
    except GatedRepoError:
        raise GGUFSpecError(f"{where}: the repository is gated; accept its licence on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise GGUFSpecError(f"{where}: repository not found (or private: set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise GGUFSpecError(f"{where}: revision {spec.revision!r} not found") from None
    except EntryNotFoundError:
        raise GGUFSpecError(f"{where}: no such file in the repository; check `file` in models.toml") from None
    except LocalEntryNotFoundError:
        raise GGUFSpecError(f"{where}: the Hub cannot be reached and the file is not cached; check the network or HF_ENDPOINT") from None
    except HfHubHTTPError as e:
        raise GGUFSpecError(f"{where}: download failed ({_first_line(e)}); run the command again to resume") from None
    except OSError as e:  # connection reset, disk full...
        raise GGUFSpecError(f"{where}: download failed ({type(e).__name__}: {_first_line(e)}); run the command again to resume") from None
    except Exception as e:  # httpx transport errors and the like
        raise GGUFSpecError(f"{where}: download failed ({type(e).__name__}: {_first_line(e)}); run the command again to resume") from None
    check_sha256(path, spec.sha256, spec.name)
    return path


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
