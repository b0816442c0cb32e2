"""scripts/install.py --vulkan: what it needs, found or named in one line (no build, no apt-get run)."""

import ctypes.util
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install.py"


@pytest.fixture
def install():
    spec = importlib.util.spec_from_file_location("install_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def headers(root: Path, version: int) -> Path:
    (root / "vulkan").mkdir(parents=True)
    (root / "vulkan" / "vulkan_core.h").write_text(f"#define VK_API_VERSION_1_3 1\n#define VK_HEADER_VERSION {version}\n")
    return root


def test_header_version_is_read_from_vulkan_core_h(install, tmp_path):
    assert install.header_version(headers(tmp_path / "inc", 239)) == 239
    assert install.header_version(tmp_path / "none") == 0


def test_a_missing_package_is_named_with_the_command_that_installs_it(install, monkeypatch):
    monkeypatch.setattr(install.shutil, "which", lambda name: None if name == "glslc" else f"/usr/bin/{name}")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libvulkan.so.1")
    with pytest.raises(SystemExit) as e:
        install.vulkan_args(apt=False)
    message = str(e.value)
    assert "\n" not in message and "--vulkan needs glslc" in message and "apt-get install" in message and "--apt" in message


def test_recent_system_headers_are_used_as_they_are(install, monkeypatch, tmp_path):
    monkeypatch.setattr(install.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libvulkan.so.1")
    monkeypatch.setenv("VULKAN_SDK", str(tmp_path))
    headers(tmp_path / "include", 309)
    assert install.vulkan_args(apt=False) == "-DGGML_VULKAN=on"


def test_old_headers_without_apt_get_are_one_line(install, monkeypatch, tmp_path):
    monkeypatch.setattr(install.shutil, "which", lambda name: None if name == "apt-get" else f"/usr/bin/{name}")
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libvulkan.so.1")
    monkeypatch.setenv("VULKAN_SDK", str(tmp_path))
    headers(tmp_path / "include", 239)
    with pytest.raises(SystemExit) as e:
        install.vulkan_args(apt=False)
    assert "\n" not in str(e.value) and "older than 1.3.287" in str(e.value) and "VULKAN_SDK" in str(e.value)
