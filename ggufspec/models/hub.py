"""Getting GGUF files: the only module that imports `huggingface_hub`.

Resolution order for a registry model: the models directory ($GGUFSPEC_MODELS_DIR, where the
offline mirror puts files), then the Hub cache (local_files_only), then a download with
hf_hub_download (progress bar on stderr; a dropped connection resumed with a Range request within the
run, a killed run starts over and its leftover is removed; the usual cache,
$HF_TOKEN for gated repositories). Offline mode ($HF_HUB_OFFLINE=1 or --offline) never downloads.
A file whose sha256 differs from the registry's is refused, and the user is told; only a file this
module has just downloaded is deleted for it (its blob and snapshot link in the Hub cache), never a
file that was already there, never through a link that points out of the cache.
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
    """Raise if the file's sha256 is not the expected one; the file is left as it is."""
    if not expected:
        return
    actual = verified_sha256(path)
    if actual != expected.lower():
        raise GGUFSpecError(
            f"{what}: checksum mismatch for {path} (sha256 {actual[:16]}…, models.toml says {expected[:16]}…); "
            "the file was left as it is: correct `sha256` in models.toml, or delete the file and pull it again"
        )


def _delete_download(path: Path) -> None:
    """Remove a file hf_hub_download has just written: its snapshot link and the blob it points to, and
    only inside the Hub cache."""
    cache = hub_cache_dir().resolve()
    real = path.resolve()
    for p in (path, stamp_path(path), real, stamp_path(real)):
        if p.resolve().is_relative_to(cache) or p.parent.resolve().is_relative_to(cache):
            p.unlink(missing_ok=True)


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
        # the environment variable, set elsewhere and forgotten, is the one to name
        why = ("--offline was given" if offline
               else f"HF_HUB_OFFLINE={os.environ['HF_HUB_OFFLINE']} is set: unset it to download")
        raise GGUFSpecError(
            f"{spec.name}: {spec.file} is not on this machine and offline mode is on ({why}); "
            f"run `ggufspec models pull {spec.name}` where the Hub is reachable{hint}"
        )
    return download(spec, endpoint=endpoint, progress=progress)


def _unchecked(spec: ModelSpec) -> str:
    return ("" if spec.checked else f" (the entry {spec.name} is unchecked: written from its publisher's names, never "
            "verified; set repo and file in your own models.toml)")


def download(spec: ModelSpec, *, endpoint: str | None = None, progress: bool = True) -> Path:
    """hf_hub_download into the Hub cache (a dropped connection is resumed within the run; atomic: an
    interrupted download never looks complete)."""
    import huggingface_hub
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    if not progress:
        huggingface_hub.utils.disable_progress_bars()
    where = f"{spec.repo}/{spec.file}"
    _check_cache_dirs()
    _clear_orphans(spec)
    again = "nothing partial was kept; run the command again"
    verbosity = huggingface_hub.utils.logging.get_verbosity()
    huggingface_hub.utils.logging.set_verbosity_error()  # its retry lines: the one line below says what happened
    try:
        path = Path(hf_hub_download(spec.repo, spec.file, revision=spec.revision, endpoint=endpoint,
                                    cache_dir=hub_cache_dir()))
    except GatedRepoError:
        raise GGUFSpecError(f"{where}: the repository is gated; accept its licence on the Hub and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise GGUFSpecError(f"{where}: repository not found (or private: set HF_TOKEN){_unchecked(spec)}") from None
    except RevisionNotFoundError:
        raise GGUFSpecError(f"{where}: revision {spec.revision!r} not found") from None
    except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: first
        hub = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        raise GGUFSpecError(f"{where}: the Hub ({hub}) cannot be reached and the file is not cached; "
                            "check the network or HF_ENDPOINT, or use --offline with a local copy") from None
    except EntryNotFoundError:
        raise GGUFSpecError(f"{where}: no such file in the repository; check `file` in models.toml{_unchecked(spec)}") from None
    except HfHubHTTPError as e:
        raise GGUFSpecError(f"{where}: download failed ({_first_line(e)}); {again}") from None
    except OSError as e:  # connection reset, disk full...
        raise GGUFSpecError(f"{where}: download failed ({type(e).__name__}: {_first_line(e)}); {again}") from None
    except Exception as e:  # httpx transport errors and the like
        raise GGUFSpecError(f"{where}: download failed ({type(e).__name__}: {_first_line(e)}); {again}") from None
    finally:
        huggingface_hub.utils.logging.set_verbosity(verbosity)
    try:
        check_sha256(path, spec.sha256, spec.name)
    except GGUFSpecError:
        _delete_download(path)
        raise GGUFSpecError(f"{spec.name}: checksum mismatch for the file just downloaded from {where} "
                            f"(expected sha256 {spec.sha256[:16]}…); it was deleted: check `sha256` in models.toml") from None
    return path


def _check_cache_dirs() -> None:
    """HF_HOME and HF_HUB_CACHE must name directories (or nothing yet)."""
    for var in ("HF_HOME", "HF_HUB_CACHE"):
        value = os.environ.get(var)
        if value and os.path.exists(value) and not os.path.isdir(value):
            raise GGUFSpecError(f"{var}={value} is not a directory; point it at a folder for the Hub cache")


def _clear_orphans(spec: ModelSpec) -> None:
    """Partial downloads that no process holds any more (a download killed outright leaves its
    process-unique `<etag>.<id>.incomplete` behind; nobody can resume it): deleted before a new one."""
    from filelock import FileLock, Timeout

    from huggingface_hub.file_download import repo_folder_name

    folder = hub_cache_dir() / repo_folder_name(repo_id=spec.repo, repo_type="model")
    for orphan in (folder / "blobs").glob("*.*.incomplete"):
        lock = hub_cache_dir() / ".locks" / folder.name / (orphan.name.split(".")[0] + ".lock")
        try:
            with FileLock(lock, timeout=0):
                orphan.unlink(missing_ok=True)
        except (Timeout, OSError):
            pass  # another process is downloading it now


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def cached_ggufs() -> list[tuple[str, Path]]:
    """Every GGUF in the Hub cache as ("owner/name/file", path): each snapshot's files, newest snapshot first where
    two hold the same file (read from the cache's folders: no network, no lock)."""
    found: dict[str, Path] = {}
    snapshots = sorted(hub_cache_dir().glob("models--*/snapshots/*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for snapshot in snapshots:
        repo = snapshot.parent.parent.name.removeprefix("models--").replace("--", "/")
        for path in sorted(snapshot.rglob("*.gguf")):
            if path.is_file():  # a link to a blob not (or not yet) there is no file
                found.setdefault(f"{repo}/{path.relative_to(snapshot).as_posix()}", path)
    return sorted(found.items())


def cached_hub_file(text: str) -> Path | None:
    """The Hub cache's copy of "owner/name/file.gguf" (a repository and a file in it), or None."""
    parts = text.split("/")
    if len(parts) < 3:
        return None
    return dict(cached_ggufs()).get("/".join(parts))
