"""The real download code (huggingface_hub) against a local fake of the Hub on 127.0.0.1."""

import dataclasses
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakehub import FakeHub
from ggufspec.models import hub
from ggufspec.errors import GGUFSpecError
from ggufspec.models.registry import ModelSpec

REPO, FILE = "acme/tiny-GGUF", "tiny-q8_0.gguf"


@pytest.fixture
def fake(tiny):
    with FakeHub() as h:
        h.files[(REPO, FILE)] = Path(tiny["target"]).read_bytes()
        yield h


def spec(sha=None, file=FILE):
    return ModelSpec("tiny-remote", REPO, file, "F32", 2, 0.0, sha)


def cache_files():
    root = Path(os.environ["HF_HOME"])
    return [p for p in root.rglob("*") if p.is_file() and ".lock" not in p.name] if root.exists() else []


def test_download_lands_in_the_hub_cache_and_verifies(fake, tiny):
    content = fake.files[(REPO, FILE)]
    path = hub.ensure_model(spec(hashlib.sha256(content).hexdigest()), endpoint=fake.url, progress=False)
    assert path.read_bytes() == content
    assert "hub" in str(path) and path.name == FILE
    # A second call finds it in the cache without asking the server.
    n = len(fake.requests)
    assert hub.ensure_model(spec(), endpoint=fake.url) == path
    assert len(fake.requests) == n


def test_broken_connection_mid_file_resumes_with_a_range_request(fake):
    # huggingface_hub reads 10 MB chunks: cut the connection after 12 MB so a chunk has landed.
    fake.files[(REPO, FILE)] = os.urandom(24 * 2**20)
    fake.drop_first_get = True
    path = hub.download(spec(), endpoint=fake.url, progress=False)
    assert path.read_bytes() == fake.files[(REPO, FILE)]
    assert any(method == "GET" and rng for method, _, rng in fake.requests), "no resume (Range) request was made"


def test_failed_download_leaves_no_partial_file(fake):
    fake.drop_every_get = True
    with pytest.raises(GGUFSpecError, match="download failed .*; nothing partial was kept; run the command again"):
        hub.download(spec(), endpoint=fake.url, progress=False)
    data = [p for p in cache_files() if "blobs" in p.parts or "snapshots" in p.parts or p.name.endswith(".incomplete")]
    assert not data, data  # no blob, no snapshot entry, no partial download


def test_checksum_mismatch_deletes_the_file_just_downloaded(fake):
    with pytest.raises(GGUFSpecError, match="checksum mismatch for the file just downloaded from acme/tiny-GGUF/tiny-q8_0.gguf .*it was deleted"):
        hub.download(spec("0" * 64), endpoint=fake.url, progress=False)
    assert not [p for p in cache_files() if "blobs" in p.parts or "snapshots" in p.parts]


def test_missing_file_says_so(fake):
    with pytest.raises(GGUFSpecError, match="no such file in the repository; check `file` in models.toml$"):
        hub.download(spec(file="nope.gguf"), endpoint=fake.url, progress=False)
    guessed = dataclasses.replace(spec(file="nope.gguf"), checked=False)  # a name written without the Hub
    with pytest.raises(GGUFSpecError, match=r"check `file` in models.toml \(the entry tiny-remote is unchecked: "
                                            r"written from its publisher's names, never verified;"):
        hub.download(guessed, endpoint=fake.url, progress=False)


def test_offline_without_a_cached_copy_refuses(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(GGUFSpecError, match=r"offline mode is on \(HF_HUB_OFFLINE=1 is set: unset it to download\)"):
        hub.ensure_model(spec())
    with pytest.raises(GGUFSpecError, match=r"offline mode is on \(--offline was given\)"):
        hub.ensure_model(spec(), offline=True)


def test_offline_with_a_cached_copy_works_without_the_server(fake):
    path = hub.download(spec(), endpoint=fake.url, progress=False)
    fake.__exit__()  # the "Hub" is gone
    assert hub.ensure_model(spec(), offline=True) == path


def test_models_dir_copy_wins_and_is_checked(tiny):
    d = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    d.mkdir(parents=True)
    (d / FILE).write_bytes(Path(tiny["target"]).read_bytes())
    assert hub.ensure_model(spec(), offline=True) == d / FILE
    with pytest.raises(GGUFSpecError, match="checksum mismatch .*the file was left as it is: correct `sha256` in models.toml"):
        hub.ensure_model(spec("f" * 64), offline=True)
    assert (d / FILE).exists()  # the user's own file: never deleted for a mismatch


def test_a_mismatch_through_a_link_never_deletes_the_file_it_points_to(tiny, tmp_path):
    """The models directory may hold links to the user's files elsewhere: a wrong sha256 leaves both."""
    real = tmp_path / "elsewhere" / "mine.gguf"
    real.parent.mkdir()
    real.write_bytes(Path(tiny["target"]).read_bytes())
    d = Path(os.environ["GGUFSPEC_MODELS_DIR"])
    d.mkdir(parents=True)
    (d / FILE).symlink_to(real)
    with pytest.raises(GGUFSpecError, match="checksum mismatch"):
        hub.ensure_model(spec("f" * 64), offline=True)
    assert real.exists() and (d / FILE).is_symlink()


def test_a_cached_copy_with_a_stale_checksum_is_kept_and_named(fake):
    path = hub.download(spec(), endpoint=fake.url, progress=False)
    with pytest.raises(GGUFSpecError, match=f"checksum mismatch for {path} "):
        hub.ensure_model(spec("e" * 64), offline=True)
    assert path.exists()


@pytest.mark.slow  # huggingface_hub retries five times over 23 s before it gives up
def test_an_unreachable_hub_is_one_line_that_says_so(tmp_path):
    from clirun import free_port

    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.tiny-remote]\nrepo = "{REPO}"\nfile = "{FILE}"\n')
    env = dict(os.environ, HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    out = subprocess.run([sys.executable, "-m", "ggufspec", "models", "pull", "tiny-remote", "--registry", str(reg)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.splitlines() == [f"Error: {REPO}/{FILE}: the Hub ({env['HF_ENDPOINT']}) cannot be reached and the "
                                       "file is not cached; check the network or HF_ENDPOINT, or use --offline with a local copy"]


def test_hf_home_that_is_a_file_is_named(fake, tmp_path, monkeypatch):
    (tmp_path / "hf").write_text("")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(GGUFSpecError, match=r"^HF_HOME=.*/hf is not a directory; point it at a folder for the Hub cache$"):
        hub.download(spec(), endpoint=fake.url, progress=False)


def test_a_killed_downloads_leftover_is_removed_and_nothing_promises_a_resume(fake):
    """huggingface_hub downloads into a file unique to the process: a run killed outright leaves it, and no
    later run can resume it. The next download removes it; a failed one keeps nothing and says so."""
    path = hub.download(spec(), endpoint=fake.url, progress=False)
    blobs = path.resolve().parent
    orphan = blobs / "0123abcd.1a2b3c4d.incomplete"
    orphan.write_bytes(b"half")
    old_style = blobs / "4567.incomplete"  # an older huggingface_hub resumes these: left alone
    old_style.write_bytes(b"half")
    path.unlink()
    path.resolve().unlink(missing_ok=True)
    hub.download(spec(), endpoint=fake.url, progress=False)
    assert not orphan.exists() and old_style.exists()
    fake.files[(REPO, "other.gguf")] = os.urandom(1000)
    fake.drop_every_get = True
    with pytest.raises(GGUFSpecError, match="download failed") as e:
        hub.download(spec(file="other.gguf"), endpoint=fake.url, progress=False)
    assert "resume" not in str(e.value) and list(blobs.glob("*.incomplete")) == [old_style]


def test_cli_pull_through_hf_endpoint(fake, tmp_path):
    reg = tmp_path / "models.toml"
    reg.write_text(f'[models.tiny-remote]\nrepo = "{REPO}"\nfile = "{FILE}"\nn_layers = 2\n')
    env = dict(os.environ, HF_ENDPOINT=fake.url)
    out = subprocess.run([sys.executable, "-m", "ggufspec.cli.main", "models", "pull", "tiny-remote", "--registry", str(reg)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(FILE)
    missing = subprocess.run([sys.executable, "-m", "ggufspec.cli.main", "models", "pull", "tiny-remote", "--registry", str(reg)],
                             capture_output=True, text=True, env=dict(env, HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1"))
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
