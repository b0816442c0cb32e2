"""scripts/install.py: the backend it picks from what is found, --vulkan's needs, --print's command, each refusal
one line (no build, no apt-get run)."""

import ctypes.util
import importlib.util
import os
import shutil
import subprocess
import sys
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


# -- the backend: a pure function of what is found (fake tool folders, fake /dev) -------------------------------------

def tools(root: Path, *names: str) -> str:
    """A folder of executable stand-ins for `names`, as a PATH."""
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).write_text("#!/bin/sh\nexit 0\n")
        (root / name).chmod(0o755)
    return str(root)


class FakeCuda:
    """The NVIDIA driver's library as ctypes loads it: cuDriverGetVersion answers `status` (0: success; a CUDA
    toolkit's stub answers 34, CUDA_ERROR_STUB_LIBRARY)."""

    def __init__(self, status: int = 0):
        self.status = status

    def cuDriverGetVersion(self, version):
        version._obj.value = 12040
        return self.status


def found(install, tmp_path, *names, dev=(), system="linux", machine="x86_64", loader=False, headers_version=0,
          driver=None):
    """found_here() over fake tools and /dev; driver: a FakeCuda the library `libcuda.so.1` loads as (None: none)."""
    (tmp_path / "dev").mkdir(parents=True, exist_ok=True)
    for name in dev:
        (tmp_path / "dev" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "dev" / name).write_text("")
    include = headers(tmp_path / "inc", headers_version) if headers_version else tmp_path / "no-include"
    libraries = {"vulkan": "libvulkan.so.1" if loader else None, "cuda": "libcuda.so.1" if driver else None}

    def load(name):
        if name != "libcuda.so.1" or driver is None:
            raise OSError(f"{name}: cannot open shared object file")
        return driver

    return install.found_here(tools(tmp_path / "bin", *names), cuda_roots=(), rocm_roots=(), dev=tmp_path / "dev",
                              find_library=libraries.get, load_library=load, include=include, system=system,
                              machine=machine)


@pytest.fixture(autouse=True)
def no_driver_libraries(monkeypatch):
    monkeypatch.delenv("LD_LIBRARY_PATH", raising=False)


def test_nvcc_and_an_nvidia_driver_build_for_cuda(install, tmp_path):
    backend = install.choose_backend(found(install, tmp_path, "nvcc", driver=FakeCuda()))
    assert backend.cmake == "-DGGML_CUDA=on"
    line = backend.line()
    assert str(tmp_path / "bin" / "nvcc") in line and "--cpu" in line and "CMAKE_ARGS" in line and "\n" not in line


def test_nvcc_without_a_driver_builds_for_the_cpu_and_says_why(install, tmp_path):
    backend = install.choose_backend(found(install, tmp_path, "nvcc"))
    assert backend.name == "CPU" and backend.cmake == ""
    assert "nvcc at" in backend.why and "no NVIDIA driver" in backend.why and "-DGGML_CUDA=on" in backend.line()


def test_cuda_needs_the_drivers_library_not_a_device_node_a_stub_or_a_file_of_its_name(install, tmp_path, monkeypatch):
    for i, (dev, driver) in enumerate([(["nvidia0"], None), ([], FakeCuda(status=34))]):
        backend = install.choose_backend(found(install, tmp_path / str(i), "nvcc", dev=dev, driver=driver))
        assert backend.name == "CPU" and "no NVIDIA driver (libcuda.so.1)" in backend.why
    stray = tmp_path / "lib"  # an empty file named like the driver's library, on LD_LIBRARY_PATH
    stray.mkdir()
    (stray / "libcuda.so.1").write_text("")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(stray))
    assert install.cuda_driver(find_library=lambda name: None) is None


def test_an_nvcc_that_does_not_run_is_no_cuda_toolkit(install, tmp_path):
    broken = tools(tmp_path / "bin", "nvcc")
    (Path(broken) / "nvcc").write_text("#!/bin/sh\necho 'nvcc: cannot find libnvvm' >&2\nexit 1\n")
    backend = install.choose_backend(install.found_here(broken, cuda_roots=(), find_library=lambda name: "libcuda.so.1",
                                                        load_library=lambda name: FakeCuda()))
    assert backend.name == "CPU"
    assert f"nvcc at {broken}/nvcc, which does not run (`nvcc --version` failed)" in backend.why


def test_nothing_found_builds_for_the_cpu(install, tmp_path):
    backend = install.choose_backend(found(install, tmp_path))
    assert backend.name == "CPU" and "no nvcc, hipcc" in backend.why and "--vulkan" in backend.line()


def test_hipcc_and_an_amd_gpu_build_for_rocm(install, tmp_path):
    assert install.choose_backend(found(install, tmp_path, "hipcc", dev=["kfd"])).cmake == "-DGGML_HIP=on"


def test_apple_silicon_builds_for_metal_and_an_intel_mac_for_the_cpu(install, tmp_path):
    assert install.choose_backend(found(install, tmp_path, system="darwin", machine="arm64")).cmake == "-DGGML_METAL=on"
    assert install.choose_backend(found(install, tmp_path, system="darwin", machine="x86_64")).name == "CPU"


def test_vulkan_needs_its_loader_headers_tools_and_a_gpu(install, tmp_path):
    everything = dict(loader=True, headers_version=309)
    with_gpu = found(install, tmp_path / "a", "glslc", "glslangValidator", dev=["dri/renderD128"], **everything)
    assert install.choose_backend(with_gpu).name == "Vulkan"
    no_gpu = found(install, tmp_path / "b", "glslc", "glslangValidator", **everything)  # a container: llvmpipe at most
    assert install.choose_backend(no_gpu).name == "CPU" and "no GPU" in install.choose_backend(no_gpu).why
    no_glslc = found(install, tmp_path / "c", "glslangValidator", dev=["dri/renderD128"], **everything)
    assert install.choose_backend(no_glslc).name == "CPU"


def test_cuda_comes_before_vulkan_and_the_flags_decide_over_both(install, tmp_path):
    both = found(install, tmp_path, "nvcc", "glslc", "glslangValidator", dev=["dri/renderD128"], driver=FakeCuda(),
                 loader=True, headers_version=309)
    assert install.choose_backend(both).name == "CUDA"
    assert install.choose_backend(both, cpu=True).name == "CPU"
    assert install.choose_backend(both, vulkan=True).name == "Vulkan"


def fake_libcuda(folder: Path) -> Path:
    """A libcuda.so.1 that answers cuDriverGetVersion as the NVIDIA driver's does, built with cc."""
    if not shutil.which("cc"):
        pytest.skip("no C compiler to build a stand-in for the NVIDIA driver's library")
    folder.mkdir(exist_ok=True)
    (folder / "cuda.c").write_text("int cuDriverGetVersion(int *version) { *version = 12040; return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(folder / "cuda.c")], check=True)
    return folder


def run_print(tmp_path, *args, cmake_args=None, driver=True):
    """scripts/install.py --print with a fake nvcc first on PATH (and a fake libcuda where `driver`)."""
    lib = fake_libcuda(tmp_path / "lib") if driver else tmp_path
    env = {k: v for k, v in os.environ.items() if k != "CMAKE_ARGS"}
    env.update(PATH=tools(tmp_path / "bin", "nvcc") + os.pathsep + env["PATH"], LD_LIBRARY_PATH=str(lib))
    if cmake_args is not None:
        env["CMAKE_ARGS"] = cmake_args
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--print"], capture_output=True, text=True, env=env,
                          timeout=120)


def as_a_shell_reads(command: str) -> list[str]:
    """The words of a printed command line as sh reads them, pasted."""
    said = subprocess.run(["sh", "-c", 'eval "set -- $1"; printf "%s\\0" "$@"', "sh", command], capture_output=True,
                          text=True, check=True)
    return said.stdout.split("\0")[:-1]


def test_print_shows_the_cuda_build_and_runs_nothing(tmp_path):
    proc = run_print(tmp_path, "test")
    assert proc.returncode == 0, proc.stderr
    assert "building llama.cpp for CUDA" in proc.stderr and "+ pip" not in proc.stderr
    words = as_a_shell_reads(proc.stdout.strip())
    assert words[0].startswith("CMAKE_ARGS=-DGGML_CUDA=on -DGGML_RPC=ON") and words[-1].endswith("[test]")


def test_a_users_cmake_args_are_used_as_given(tmp_path):
    proc = run_print(tmp_path, cmake_args="-DGGML_VULKAN=on -DGGML_RPC=OFF")
    assert proc.returncode == 0, proc.stderr
    assert "CMAKE_ARGS is set, so it is used as given" in proc.stderr
    assert as_a_shell_reads(proc.stdout)[0].startswith("CMAKE_ARGS=-DGGML_VULKAN=on -DGGML_RPC=OFF")
    assert "GGML_CUDA" not in proc.stdout


def test_print_quotes_cmake_args_so_that_pasted_it_is_the_same_build(tmp_path):
    proc = run_print(tmp_path, cmake_args='-DFOO="a b" -DBAR=$HOME')
    assert proc.returncode == 0, proc.stderr
    words = as_a_shell_reads(proc.stdout.strip())
    assert words[0].startswith('CMAKE_ARGS=-DFOO="a b" -DBAR=$HOME -DGGML_RPC=ON'), words
    assert words[1:4] == [sys.executable, "-m", "pip"]


@pytest.mark.parametrize("flag, cmake_args, said", [
    ("--cpu", "-DGGML_CUDA=on", "--cpu asks for the CPU, but CMAKE_ARGS turns on CUDA (-DGGML_CUDA=on)"),
    ("--cpu", "-DGGML_NATIVE=OFF -DGGML_HIP:BOOL=TRUE", "CMAKE_ARGS turns on HIP (-DGGML_HIP:BOOL=TRUE)"),
    ("--vulkan", "-DGGML_CUDA=ON", "--vulkan asks for Vulkan, but CMAKE_ARGS turns on CUDA (-DGGML_CUDA=ON)"),
    ("--vulkan", "-DGGML_VULKAN=OFF", "--vulkan asks for Vulkan, but CMAKE_ARGS turns Vulkan off (-DGGML_VULKAN=OFF)"),
])
def test_cpu_or_vulkan_against_another_backend_in_cmake_args_is_one_line(tmp_path, flag, cmake_args, said):
    proc = run_print(tmp_path, flag, cmake_args=cmake_args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("install.py: ")
    assert said in proc.stderr and "drop one or the other" in proc.stderr


@pytest.mark.parametrize("flag, cmake_args", [("--cpu", "-DGGML_NATIVE=OFF"), ("--cpu", "-DGGML_CUDA=off"),
                                              ("--vulkan", "-DGGML_VULKAN=on")])
def test_cpu_or_vulkan_with_cmake_args_that_agree_are_used(tmp_path, flag, cmake_args):
    proc = run_print(tmp_path, flag, cmake_args=cmake_args)
    assert proc.returncode == 0, proc.stderr
    assert as_a_shell_reads(proc.stdout)[0].startswith(f"CMAKE_ARGS={cmake_args}")


def test_cpu_and_vulkan_together_are_refused(tmp_path):
    proc = run_print(tmp_path, "--cpu", "--vulkan")
    assert proc.returncode == 2 and "--cpu and --vulkan" in proc.stderr


def test_each_build_is_kept_apart_by_its_flags_and_this_cpu(install, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu = install.wheel_dir("0.3.36", "-DGGML_RPC=ON")
    assert cpu.parent == tmp_path / "ggufspec" / "wheels" and cpu == install.wheel_dir("0.3.36", "-DGGML_RPC=ON")
    assert len({cpu, install.wheel_dir("0.3.36", "-DGGML_VULKAN=on -DGGML_RPC=ON"),
                install.wheel_dir("0.3.37", "-DGGML_RPC=ON")}) == 3


def test_a_second_backend_is_built_once_and_then_installed_as_kept(install, monkeypatch, tmp_path):
    """The first time the wheel is built into the cache (whole: moved there when pip wheel is done) and installed
    from it; the second time it is installed from the cache, nothing built."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def pip(*args, env):
        calls.append(args[0])
        if args[0] == "wheel":
            out = Path(args[args.index("-w") + 1])
            (out / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl").write_bytes(b"built")
    monkeypatch.setattr(install, "pip", pip)
    args = "-DGGML_VULKAN=on -DGGML_RPC=ON"
    install.install_own_build("0.3.36", args, {})
    kept = list(install.wheel_dir("0.3.36", args).iterdir())
    assert calls == ["wheel", "install"] and [p.read_bytes() for p in kept] == [b"built"]
    calls.clear()
    install.install_own_build("0.3.36", args, {})
    assert calls == ["install"]
    assert install.not_asked(["CPU", "RPC"], args, False) == ["it lacks the VULKAN backend"]
    assert install.not_asked(["CPU", "RPC", "VULKAN"], args, False) == []
