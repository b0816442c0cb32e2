#!/usr/bin/env python3
"""Install ggufspec (editable) with a llama-cpp-python build that works on this machine.

    python scripts/install.py            # the package, for the GPU backend this machine can build and run
    python scripts/install.py test       # with the test extras (also: plot, or test,plot)
    python scripts/install.py --print    # the build it would run (backend, CMAKE_ARGS, pip), nothing run
    python scripts/install.py --cpu      # the CPU backend whatever is found
    CMAKE_ARGS="-DGGML_CUDA=on" python scripts/install.py     # your own flags: no backend is chosen for you
    python scripts/install.py --vulkan   # Vulkan (any GPU with a Vulkan driver; see docs/install.md)
    python scripts/install.py --vulkan --apt   # ... and first apt-get the Debian/Ubuntu packages it needs

Without CMAKE_ARGS the backend is picked from what is found here (`choose_backend`): CUDA where nvcc (on PATH,
in $CUDA_HOME or /usr/local/cuda) runs (`nvcc --version`) and the NVIDIA driver's library (libcuda.so.1) loads
and answers, ROCm/HIP where hipcc and /dev/kfd are, Metal on Apple silicon, Vulkan where the loader, its
headers, glslc and glslangValidator and a GPU (/dev/dri/renderD*) are, else the CPU; one line says which, why,
and how to choose otherwise. A toolkit without a driver (a CUDA image on a machine with no GPU) builds for the
CPU: a GPU build there would not load. --cpu or --vulkan with CMAKE_ARGS that turn on another backend
(-DGGML_CUDA=on, ...) is refused in one line: give one or the other.

--vulkan needs the Vulkan loader, glslc and Vulkan headers of 1.3.287 or later (llama.cpp's ggml-vulkan.cpp
does not compile against older Vulkan-Hpp headers, such as Debian 12's 1.3.239). Where the system's are
older, the header files of Debian 13's libvulkan-dev are fetched into ~/.cache/ggufspec/vulkan-headers
(apt-get download with a private package list, unpacked with dpkg -x: nothing is installed) and used for
this build only. --apt installs the packages with apt-get; without it a missing one is named with the
command that installs it.

pip compiles llama.cpp for this CPU (-march=native). On x86 CPUs with AMX (Sapphire Rapids and
later) that builds llama.cpp's AMX kernels, which crash on Q4_K/Q6_K weights (llama.cpp issue
20824), so where the compiler knows the flags they are turned off (-mno-amx-*; repacking and
AVX-512 stay). The RPC backend is built in too (`-DGGML_RPC=ON`: layers on other machines).
Your own CMAKE_ARGS come first and are kept. pip caches the wheel by source, not by flags, so
the build is checked afterwards; where it is not the one asked for, the wheel built for these flags on this CPU
before is installed from ~/.cache/ggufspec/wheels (`wheel_dir`), and where there is none it is built (without
pip's cache, which keeps its own) and kept there: a second backend (a Vulkan environment beside a CPU one) is
compiled once, not on every install.
"""

from __future__ import annotations

import argparse
import ctypes.util
import hashlib
import importlib.util
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VULKAN_APT = ("libvulkan-dev", "glslc", "glslang-tools", "spirv-headers", "mesa-vulkan-drivers")
VULKAN_HEADERS_MIN = 287  # VK_HEADER_VERSION ggml-vulkan.cpp needs (it uses vk::LayerSettingEXT)
VULKAN_HEADERS_SUITE = "trixie"  # Debian 13: libvulkan-dev 1.4.309


class Backend:
    """The llama.cpp backend a build is for: its name, its CMAKE_ARGS, and why it was picked."""

    def __init__(self, name: str, cmake: str, why: str):
        self.name, self.cmake, self.why = name, cmake, why

    def line(self) -> str:
        example = "-DGGML_CUDA=on" if self.name == "Vulkan" else "-DGGML_VULKAN=on"
        other = (f'--cpu for the CPU, or CMAKE_ARGS for another backend (e.g. CMAKE_ARGS="{example}")'
                 if self.name != "CPU" else 'CMAKE_ARGS="-DGGML_CUDA=on" (or -DGGML_HIP=on, -DGGML_METAL=on) or --vulkan')
        name = "the CPU" if self.name == "CPU" else self.name
        return f"install.py: building llama.cpp for {name}: {self.why}; to choose otherwise use {other}"


def runs(program: str | None) -> bool:
    """Whether `program --version` runs and exits 0 (a toolkit's compiler that is there but broken does not)."""
    if not program:
        return False
    try:
        return subprocess.run([program, "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def cuda_driver(find_library=ctypes.util.find_library, load_library=ctypes.CDLL) -> str | None:
    """The NVIDIA driver's library a CUDA build loads (libcuda.so.1), where one here loads and answers
    cuDriverGetVersion (a toolkit's stub, or a stray file of that name, does not): its name, else None."""
    names = [find_library("cuda")] + [str(Path(d) / "libcuda.so.1")
                                      for d in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d]
    for name in filter(None, names):
        version = ctypes.c_int(0)
        try:
            if load_library(name).cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value > 0:
                return name
        except (OSError, AttributeError):  # not a library, or not the driver's
            continue
    return None


def found_here(path: str | None = None, *, cuda_roots=None, rocm_roots=("/opt/rocm",), dev: Path = Path("/dev"),
               find_library=ctypes.util.find_library, load_library=ctypes.CDLL, include: Path | None = None,
               system: str | None = None, machine: str | None = None) -> dict:
    """What decides the backend, looked up here: the tools on `path` (default: $PATH) or in the toolkits' usual
    folders (nvcc run once), the NVIDIA driver's library, the AMD GPU's device under `dev`, the Vulkan loader and
    headers, the platform."""
    def which(name: str, roots=()) -> str | None:
        return shutil.which(name, path=path) or next(
            (str(Path(r) / "bin" / name) for r in roots if r and os.access(Path(r) / "bin" / name, os.X_OK)), None)

    if cuda_roots is None:
        cuda_roots = (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")
    render = dev / "dri"
    nvcc = which("nvcc", cuda_roots)
    return {
        "system": system or sys.platform, "machine": machine or platform.machine(),
        "nvcc": nvcc, "nvcc_runs": runs(nvcc),
        "nvidia_driver": cuda_driver(find_library, load_library),
        "hipcc": which("hipcc", rocm_roots), "amd_driver": (dev / "kfd").exists(),
        "glslc": which("glslc"), "glslang": which("glslangValidator"),
        "vulkan_loader": bool(find_library("vulkan")),
        "vulkan_headers": header_version(include or Path(os.environ.get("VULKAN_SDK", "/usr")) / "include"),
        "render_node": render.is_dir() and any(render.glob("renderD*")),
    }


def choose_backend(found: dict, *, vulkan: bool = False, cpu: bool = False) -> Backend:
    """The backend to build for, from what `found_here` found (a pure function of it): CUDA, ROCm/HIP, Metal,
    Vulkan, else the CPU; vulkan / cpu: what --vulkan / --cpu ask for."""
    if cpu:
        return Backend("CPU", "", "--cpu was given")
    if vulkan:
        return Backend("Vulkan", "-DGGML_VULKAN=on", "--vulkan was given")
    if found["nvcc_runs"] and found["nvidia_driver"]:
        return Backend("CUDA", "-DGGML_CUDA=on",
                       f"nvcc found at {found['nvcc']}, and the NVIDIA driver ({found['nvidia_driver']})")
    if found["hipcc"] and found["amd_driver"]:
        return Backend("ROCm/HIP", "-DGGML_HIP=on", f"hipcc found at {found['hipcc']}, and an AMD GPU (/dev/kfd)")
    if found["system"] == "darwin" and found["machine"] == "arm64":
        return Backend("Metal", "-DGGML_METAL=on", "this is Apple silicon")
    vulkan_parts = [found["vulkan_loader"], found["vulkan_headers"], found["glslc"], found["glslang"]]
    if all(vulkan_parts) and found["render_node"]:
        return Backend("Vulkan", "-DGGML_VULKAN=on",
                       f"the Vulkan loader, headers (1.3.{found['vulkan_headers']}), glslc and a GPU (/dev/dri) were found")
    seen = [f"{tool} at {found[tool]} but no {driver}" for tool, driver in
            (("nvcc", "NVIDIA driver (libcuda.so.1): a CUDA build would not load here"), ("hipcc", "AMD GPU (/dev/kfd)"))
            if found[tool] and (tool != "nvcc" or found["nvcc_runs"])]
    if found["nvcc"] and not found["nvcc_runs"]:
        seen.insert(0, f"nvcc at {found['nvcc']}, which does not run (`nvcc --version` failed)")
    if all(vulkan_parts) and not found["render_node"]:
        seen.append("Vulkan's loader, headers and glslc but no GPU (/dev/dri/renderD*)")
    why = "found " + "; ".join(seen) if seen else "no nvcc, hipcc, Apple silicon or Vulkan loader+headers+glslc found"
    return Backend("CPU", "", why)


def _system():
    """ggufspec/llama/system.py on its own (the package itself may not import before this script ends)."""
    spec = importlib.util.spec_from_file_location("ggufspec_system", ROOT / "ggufspec" / "llama" / "system.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiler_accepts(flags: str) -> bool:
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "t.c"
        src.write_text("int main(void) { return 0; }\n")
        try:
            return subprocess.run([cc, *flags.split(), str(src), "-o", str(Path(tmp) / "t")],
                                  capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def cmake_args(user: str, no_amx: str) -> tuple[str, bool]:
    """(CMAKE_ARGS to build with, whether AMX was turned off)."""
    args = user.strip()
    if "GGML_RPC" not in args:
        args += " -DGGML_RPC=ON"
    off = bool(no_amx) and "CMAKE_C_FLAGS" not in args and "CMAKE_CXX_FLAGS" not in args and compiler_accepts(no_amx)
    if off:
        args += f" -DCMAKE_C_FLAGS='{no_amx}' -DCMAKE_CXX_FLAGS='{no_amx}'"
    return args.strip(), off


def built_features() -> list[str]:
    """What the installed llama-cpp-python was built with, as `ggufspec doctor` reads it."""
    code = "from ggufspec.llama.runtime import build_features; print(' '.join(build_features()))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def pip(*args: str, env: dict) -> None:
    print("+ pip " + " ".join(shlex.quote(a) for a in args), file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def wheel_dir(version: str, args: str) -> Path:
    """Where the llama-cpp-python wheel built with these CMAKE_ARGS for this CPU is kept: a folder per (release,
    flags, machine, the CPU's feature flags), since pip builds for -march=native."""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith(("flags", "Features"))), "")
    except OSError:
        cpu = ""
    key = hashlib.sha256("\n".join([version, args, platform.system(), platform.machine(), cpu]).encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "ggufspec" / "wheels" / f"llama-cpp-python-{version}-{key[:16]}"


def install_own_build(version: str, args: str, env: dict) -> None:
    """Install the wheel kept for these flags, building and keeping it first where there is none."""
    where = wheel_dir(version, args)
    wheels = sorted(where.glob("llama_cpp_python-*.whl"))
    if not wheels:
        where.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=where.parent) as tmp:  # beside it, so that the wheel is renamed there
            pip("wheel", "--no-cache-dir", "--no-deps", "-w", tmp, f"llama-cpp-python=={version}", env=env)
            where.mkdir(exist_ok=True)
            for built in Path(tmp).glob("llama_cpp_python-*.whl"):
                os.replace(built, where / built.name)  # whole, or not there: never half a wheel
        wheels = sorted(where.glob("llama_cpp_python-*.whl"))
    else:
        print(f"installing the llama-cpp-python built for these flags before ({where})", file=sys.stderr)
    pip("install", "--force-reinstall", "--no-deps", str(wheels[-1]), env=env)


def header_version(include: Path) -> int:
    """VK_HEADER_VERSION of the Vulkan headers under `include` (0 where there are none)."""
    try:
        m = re.search(r"#define VK_HEADER_VERSION (\d+)", (include / "vulkan" / "vulkan_core.h").read_text())
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def fetch_vulkan_headers(cache: Path) -> Path:
    """Debian 13's libvulkan-dev headers, downloaded and unpacked under `cache` (nothing installed)."""
    include = cache / "root" / "usr" / "include"
    if header_version(include) >= VULKAN_HEADERS_MIN:
        return include
    lists, archives = cache / "lists", cache / "archives"
    for d in (lists / "partial", archives):
        d.mkdir(parents=True, exist_ok=True)
    (cache / "sources.list").write_text(f"deb http://deb.debian.org/debian {VULKAN_HEADERS_SUITE} main\n")
    opts = [f"-oDir::Etc::SourceList={cache / 'sources.list'}", "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={lists}", f"-oDir::Cache={cache / 'apt'}", "-oDir::State::status=/dev/null",
            "-oAPT::Sandbox::User=root", "-oDebug::NoLocking=1"]
    print(f"fetching Debian {VULKAN_HEADERS_SUITE}'s libvulkan-dev headers into {cache}", file=sys.stderr)
    subprocess.run(["apt-get", *opts, "-q", "update"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", *opts, "-q", "download", "libvulkan-dev"], check=True, cwd=archives, stdout=subprocess.DEVNULL)
    debs = sorted(archives.glob("libvulkan-dev_*.deb"))
    subprocess.run(["dpkg", "-x", str(debs[-1]), str(cache / "root")], check=True)
    if header_version(include) < VULKAN_HEADERS_MIN:
        sys.exit(f"install.py: the Vulkan headers fetched into {include} are older than 1.3.{VULKAN_HEADERS_MIN}")
    return include


def vulkan_args(apt: bool, dry: bool = False) -> str:
    """CMAKE_ARGS for llama.cpp's Vulkan backend on this machine, after checking (or, with apt, installing) what it
    needs. dry: what it would install and fetch is said, not done."""
    missing = [p for p, ok in [("glslc", shutil.which("glslc")), ("libvulkan-dev", ctypes.util.find_library("vulkan")),
                               ("glslang-tools", shutil.which("glslangValidator"))] if not ok]
    if missing and apt and shutil.which("apt-get"):
        print(f"+ apt-get install {' '.join(VULKAN_APT)}" + (" (not run: --print)" if dry else ""), file=sys.stderr)
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *VULKAN_APT]
        if not dry and subprocess.run(install, stdout=subprocess.DEVNULL, env=env).returncode != 0:  # stale lists
            subprocess.run(["apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL, env=env)
            subprocess.run(install, check=True, stdout=subprocess.DEVNULL, env=env)
    elif missing:
        hint = f"run `apt-get install {' '.join(VULKAN_APT)}` (or rerun with --apt)" if shutil.which("apt-get") else \
            "install the Vulkan SDK (https://vulkan.lunarg.com), then set VULKAN_SDK"
        sys.exit(f"install.py: --vulkan needs {', '.join(missing)}, which this machine lacks; {hint}")
    system_headers = Path(os.environ.get("VULKAN_SDK", "/usr")) / "include"
    if header_version(system_headers) >= VULKAN_HEADERS_MIN:
        return "-DGGML_VULKAN=on"
    if not shutil.which("apt-get"):
        sys.exit(f"install.py: the Vulkan headers in {system_headers} are older than 1.3.{VULKAN_HEADERS_MIN}, which "
                 "llama.cpp's Vulkan backend needs; install a newer Vulkan SDK and set VULKAN_SDK")
    cache = Path.home() / ".cache" / "ggufspec" / "vulkan-headers"
    include = cache / "root" / "usr" / "include"
    if dry and header_version(include) < VULKAN_HEADERS_MIN:
        print(f"(Debian {VULKAN_HEADERS_SUITE}'s libvulkan-dev headers would be fetched into {cache})", file=sys.stderr)
    elif not dry:
        include = fetch_vulkan_headers(cache)
    return f"-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR={include}"


def backend_conflict(user: str, *, vulkan: bool, cpu: bool) -> str | None:
    """One line where --cpu or --vulkan asks for another backend than the user's CMAKE_ARGS turn on or off
    (CMAKE_ARGS would silently win), else None."""
    asked = asked_backends(user)
    flags = " ".join(re.findall(r"-DGGML_(?:CUDA|HIP|METAL|VULKAN)(?::BOOL)?=\S*", user))
    if cpu and asked:
        return f"--cpu asks for the CPU, but CMAKE_ARGS turns on {', '.join(asked)} ({flags}); drop one or the other"
    other = [name for name in asked if name != "VULKAN"]
    if vulkan and (other or "-DGGML_VULKAN" in flags and "VULKAN" not in asked):
        said = f"turns on {', '.join(other)}" if other else "turns Vulkan off"
        return f"--vulkan asks for Vulkan, but CMAKE_ARGS {said} ({flags}); drop one or the other"
    return None


def build_args(user: str, a: argparse.Namespace) -> str:
    """The user's CMAKE_ARGS as given (with --vulkan's own flags where it asks for them), or the chosen backend's;
    says which in one line."""
    if user.strip():
        print("install.py: CMAKE_ARGS is set, so it is used as given (no backend chosen; only -DGGML_RPC=ON and the "
              "AMX flags below are added where absent); unset it to let install.py choose", file=sys.stderr)
        return f"{user} {vulkan_args(a.apt, a.dry)}" if a.vulkan and "GGML_VULKAN" not in user else user
    backend = choose_backend(found_here(), vulkan=a.vulkan, cpu=a.cpu)
    print(backend.line(), file=sys.stderr)
    return vulkan_args(a.apt, a.dry) if backend.name == "Vulkan" else backend.cmake


# A backend asked for in CMAKE_ARGS, and the build feature that shows it was built (`ggufspec doctor`'s names).
BACKEND_FLAGS = {"CUDA": "CUDA", "HIP": "HIP", "METAL": "METAL", "VULKAN": "VULKAN"}


def asked_backends(args: str) -> list[str]:
    """The backends CMAKE_ARGS turns on (CMake's true values, any case; -DGGML_CUDA=on or -DGGML_CUDA:BOOL=ON)."""
    return [feature for flag, feature in BACKEND_FLAGS.items()
            if re.search(rf"-DGGML_{flag}(:BOOL)?=(on|1|true|yes|y)(?![\w-])", args, re.IGNORECASE)]


def not_asked(features: list[str], args: str, amx_off: bool) -> list[str]:
    """How the installed build differs from what these CMAKE_ARGS ask for (empty: it is that build)."""
    wrong = [why for bad, why in [(amx_off and "AMX_INT8" in features, "it has AMX kernels"),
                                  ("GGML_RPC=ON" in args and "RPC" not in features, "it lacks the RPC backend")]
             if bad]
    return wrong + [f"it lacks the {name} backend" for name in asked_backends(args) if name not in features]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("extras", nargs="?", default="", help="pip extras: test, plot, or test,plot")
    ap.add_argument("--vulkan", action="store_true", help="build llama.cpp's Vulkan backend")
    ap.add_argument("--apt", action="store_true", help="with --vulkan: apt-get the packages it needs")
    ap.add_argument("--cpu", action="store_true", help="build for the CPU alone, whatever GPU tools are found")
    ap.add_argument("--print", dest="dry", action="store_true", help="show the build it would run, and run nothing")
    a = ap.parse_args(argv)
    if a.cpu and a.vulkan:
        ap.error("--cpu and --vulkan ask for different backends: give one")
    conflict = backend_conflict(os.environ.get("CMAKE_ARGS", ""), vulkan=a.vulkan, cpu=a.cpu)
    if conflict:
        ap.exit(2, f"install.py: {conflict}\n")
    extras = a.extras
    system = _system()
    args, amx_off = cmake_args(build_args(os.environ.get("CMAKE_ARGS", ""), a), system.NO_AMX_FLAGS)
    env = dict(os.environ, CMAKE_ARGS=args)
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    if a.dry:  # quoted as a shell reads it: pasted, it runs this very build
        print(f"CMAKE_ARGS={shlex.quote(args)} {shlex.quote(sys.executable)} -m pip install -e {shlex.quote(target)}")
        return 0
    print(f"CMAKE_ARGS={shlex.quote(args)}", file=sys.stderr)
    pip("install", "-e", target, env=env)
    features = built_features()
    wrong = not_asked(features, args, amx_off)
    if wrong:
        # A wheel pip cached from a build with other flags: the one built for these flags instead.
        version = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        print(f"the installed llama-cpp-python is not the build asked for ({'; '.join(wrong)}): installing the "
              "one built for these flags", file=sys.stderr)
        install_own_build(version, args, env)
        features = built_features()
        if not_asked(features, args, amx_off):  # a kept wheel that is not what its folder says: build it again
            shutil.rmtree(wheel_dir(version, args), ignore_errors=True)
            install_own_build(version, args, env)
            features = built_features()
    print(f"llama-cpp-python build: {', '.join(features)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
