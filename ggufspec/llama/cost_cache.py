"""The cost cache: one JSON file of measured tables (`measure` writes them), read and written safely.

Readers never fail on it: a file that cannot be read is reported (`cache_problem`, doctor) and moved aside by the
next writer, never overwritten; entries of another shape are measured again. Writers take a lock and merge into
what is there now, so two processes measuring at once both keep their entries.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from .runtime import warn, warn_once
from ..paths import costs_file


def read_cache() -> tuple[dict, str | None]:
    """Every cached entry, this machine's and others' (keys end in `machine <id>`), and why the file cannot be
    read as a cache (None: it can, or there is none yet)."""
    try:
        raw = costs_file().read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no cache yet (whether one can be written is another question)
        return {}, None
    except OSError as e:
        return {}, f"cannot be read ({e.strerror})"
    try:
        data = json.loads(raw)
    except ValueError:  # cut short, binary, not UTF-8
        return {}, "is not JSON (cut short, or not a cache at all)"
    if not isinstance(data, dict):
        return {}, f"holds a JSON {type(data).__name__}, not a table of entries"
    return data, None


def load_cache() -> dict:
    return read_cache()[0]


def cache_problem() -> tuple[str, str] | None:
    """(what is wrong, its fix) where the cost cache cannot serve (a file that cannot be read) or keep what is
    measured (a read-only one); None where it can."""
    path = costs_file()
    unreadable = read_cache()[1]
    if unreadable:
        return (f"the cost cache {path} {unreadable}: none of its measurements can be used",
                "none needed: the next run that measures moves it aside (costs.json.unreadable-DATE) and starts anew")
    unwritable = _cannot_write(path)
    if unwritable:
        return (f"the cost cache {path} cannot be written ({unwritable}): nothing measured is kept, so every run "
                "measures again", "make it and its folder writable, or set GGUFSPEC_COSTS_FILE to a writable file")
    return None


def _cannot_write(path) -> str | None:
    """Why the cache file cannot be written (None: it can), found by trying: opened to append (nothing written), and
    a temporary file made beside it; mode bits alone do not say (root, immutable files, read-only mounts)."""
    try:
        if path.exists():
            open(path, "ab").close()
        folder = next(p for p in (path.parent, *path.parent.parents) if p.exists())
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        return e.strerror or str(e)
    return None


def _save_cache(data: dict) -> str | None:
    """Write the cache; None, or why it could not be written (leaving no temporary file behind)."""
    path = costs_file()
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:  # no cache (read-only, full disk): measure again next time, and leave nothing behind
        try:
            tmp.unlink()
        except OSError:
            pass
        return e.strerror or str(e)
    return None


def update_cache(entries: dict) -> None:
    """Merge new entries into the cache as it is now, under a lock: another process's entries, written
    while this one measured, are kept. A file that cannot be read is moved aside, never overwritten."""
    from filelock import FileLock, Timeout

    if not entries:
        return
    path = costs_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(path.with_name(path.name + ".lock"), timeout=60):
            cache, unreadable = read_cache()
            if unreadable:
                aside = path.with_name(f"{path.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
                os.replace(path, aside)
                warn(f"ggufspec: the cost cache {path} {unreadable}; moved it to {aside} and started a new one")
            failed = _cannot_write(path) or _save_cache({**cache, **entries})
    except (OSError, Timeout) as e:
        failed = getattr(e, "strerror", None) or str(e)
    if failed:
        warn_once(f"ggufspec: cannot write the cost cache {path} ({failed}): every run measures again; make it "
                  "writable, or set GGUFSPEC_COSTS_FILE to a writable file")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < float("inf")


def valid_target_entry(entry) -> bool:
    """Whether a cached target entry has the shape this version writes (else it is measured again)."""
    if not isinstance(entry, dict):
        return False
    seconds, exact, kv = entry.get("target_batch_seconds"), entry.get("exact_batch"), entry.get("exact_kv")
    return (isinstance(seconds, list) and len(seconds) >= 1 and all(map(_positive, seconds))
            and isinstance(exact, int) and not isinstance(exact, bool) and exact >= 1
            and (kv is None or (isinstance(kv, int) and not isinstance(kv, bool) and kv >= 1))
            and isinstance(entry.get("kv_reach", 0), int) and _valid_rollback(entry.get("rollback"))
            and _valid_deep(entry.get("deep_rows")) and _valid_drift(entry.get("drift")))


def _valid_drift(d) -> bool:
    return d is None or valid_seconds(d)


def valid_seconds(x) -> bool:
    """Whether a cached figure is a finite number, 0 or more (not a bool, NaN or infinity)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf")


def _valid_deep(d) -> bool:
    return d is None or (isinstance(d, list) and len(d) == 2 and _positive(d[0]) and isinstance(d[1], (int, float))
                         and 0 <= d[1] < float("inf"))


def _valid_rollback(r) -> bool:
    return r is None or (isinstance(r, dict) and isinstance(r.get("state_bytes"), int) and isinstance(r.get("kept"), int)
                         and all(isinstance(r.get(k), (int, float)) and r[k] >= 0 for k in ("save_seconds", "restore_seconds")))


def valid_draft_entry(entry) -> bool:
    return isinstance(entry, dict) and _positive(entry.get("token_seconds"))


def bad_entries(cache: dict) -> list[str]:
    """Keys of cached entries with the wrong shape (ignored and measured again)."""
    return [k for k, v in cache.items()
            if not (valid_repack_entry(v) if is_choice_key(k) else valid_draft_entry(v) if is_step_key(k)
                    else valid_target_entry(v))]


def valid_repack_entry(entry) -> bool:
    """A weight-repacking choice (llama/repack.py): whether to repack, and the two timings it was made from."""
    return (isinstance(entry, dict) and isinstance(entry.get("repack"), bool)
            and all(isinstance(entry.get(k), dict) and _positive(entry[k].get("step")) and _positive(entry[k].get("batch"))
                    for k in ("on", "off")))


def is_choice_key(key: str) -> bool:
    """Whether a cache key names a choice made from timings (llama/repack.py's), not a table of them."""
    return key.endswith("|repack")


def is_step_key(key: str) -> bool:
    """Whether a cache key names a drafter's step (a draft model's, a head's) rather than a target's table."""
    return key.endswith(("|draft", "|mtp")) or any(f"|{name}:" in key for name in ("eagle3", "dflash"))
