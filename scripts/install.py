#!/usr/bin/env python3
"""Install ggufspec (editable) with a llama-cpp-python build that works on this machine.

    python scripts/install.py            # the package
    python scripts/install.py test       # with the test extras (also: plot, or test,plot)
    CMAKE_ARGS="-DGGML_CUDA=on" python scripts/install.py     # CUDA (likewise -DGGML_METAL=on, -DGGML_VULKAN=on)

pip compiles llama.cpp for this CPU (-march=native). On x86 CPUs with AMX (Sapphire Rapids and
later) that builds llama.cpp's AMX kernels, which crash on Q4_K/Q6_K weights (llama.cpp issue
20824), so where the compiler knows the flags they are turned off (-mno-amx-*; repacking and
AVX-512 stay). The RPC backend is built in too (`-DGGML_RPC=ON`: layers on other machines).
Your own CMAKE_ARGS come first and are kept. pip caches the wheel by source, not by flags, so
the build is checked afterwards and rebuilt without the cache if it is not the one asked for.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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


def built_features(system) -> list[str]:
    code = ("import llama_cpp as C; C.llama_backend_init(); print(C.llama_print_system_info().decode()); "
            "print('RPC' if C.llama_supports_rpc() else '')")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip().splitlines()
    return system.build_features(system.parse_system_info(lines[0] if lines else "")) + (["RPC"] if "RPC" in lines[1:] else [])


def pip(*args: str, env: dict) -> None:
    print("+ pip " + " ".join(shlex.quote(a) for a in args), file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def main(argv: list[str]) -> int:
    extras = argv[0] if argv else ""
    system = _system()
    args, amx_off = cmake_args(os.environ.get("CMAKE_ARGS", ""), system.NO_AMX_FLAGS)
    env = dict(os.environ, CMAKE_ARGS=args)
    print(f"CMAKE_ARGS={args}", file=sys.stderr)
    pip("install", "-e", f"{ROOT}[{extras}]" if extras else str(ROOT), env=env)
    features = built_features(system)
    wrong = [why for bad, why in [(amx_off and "AMX_INT8" in features, "it has AMX kernels"),
                                  ("GGML_RPC=ON" in args and "RPC" not in features, "it lacks the RPC backend")] if bad]
    if wrong:
        # A wheel cached from an earlier build with other flags: build this one afresh.
        version = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True, check=True).stdout.strip()
        print(f"the installed llama-cpp-python is not the build asked for ({'; '.join(wrong)}): rebuilding it "
              "without pip's cache", file=sys.stderr)
        pip("install", "--force-reinstall", "--no-cache-dir", "--no-deps", f"llama-cpp-python=={version}", env=env)
        features = built_features(system)
    print(f"llama-cpp-python build: {', '.join(features)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
