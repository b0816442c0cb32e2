#!/usr/bin/env python
"""GPU figures in one run of a few minutes, for a machine lent for minutes with no network (an H100, say).

Two halves. Here, where pip and a CUDA build are at hand, `bundle` packs what the GPU machine lacks into one folder
(under 64 MiB): llama.cpp built for CUDA (its libraries and llama-bench / llama-speculative-simple, from the same
source as the installed llama-cpp-python), llama-cpp-python's Python files, and the wheels of the pure-Python
packages the machine lacks. There, `run` unpacks it, writes the models itself (random weights written directly as
Q4_K / Q8_0 blocks by tests/shaped.py: their speed is a real model's of that shape, their text means nothing) and
prints one table, step by step inside a time budget, each step's rows saved as soon as they exist:

1. the GPU (nvidia-smi) and what `ggufspec doctor` says of it, then the GPU tier (tests/test_gpu.py and
   tests/test_offload.py) with the layers on it;
2. EAGLE-3, DFlash and MTP drafts with the target's layers on the GPU: greedy and seeded text against the target
   alone on the same placement, 3 processes each (an abort kills one process, not the run), and llama.cpp's
   speculative-simple with the same draft on the same files;
3. the GPU-speed stand-in (two layers, 64 wide, Qwen2.5's 151,936-token vocabulary): target-only against
   llama-bench, and the model drafting for itself (every draft accepted) against speculative-simple, draft-max 1/4/8;
4. a Llama-3.1-8B-shaped Q4_K target: the same two comparisons at draft-max 4;
5. `ggufspec costs` for that target with a Llama-3.2-1B-shaped draft: a step, verify batches of 2-64, the draft's step;
6. auto with that (unhelpful: random) draft against the target alone: never slower;
7. speed at α 0.5, 0.7, 0.9 (dev/alpha_figures.py): a chained 8B-shaped target and 1B-shaped drafts accepted at a
   chosen rate, ggufspec's draft-max 4 and auto against speculative-simple, and the cost table's forecast at the
   measured α̂ beside the measured speed-up.

    python dev/gpu_figures.py bundle BUILD_DIR .devcarry         # here: BUILD_DIR/bin from a CUDA cmake build
    python3 dev/gpu_figures.py run --bundle .devcarry --out $OUT  # there (device run, carry .devcarry)
    python dev/gpu_figures.py run --bin "$(../shared/tools/llama-cpp-reference)" --small   # a try on a CPU

A Vulkan build works the same way (`--device Vulkan0`): bundle the folder that
`LLAMA_CPP_REFERENCE_CMAKE_ARGS="-DGGML_VULKAN=ON ..." ../shared/tools/llama-cpp-reference` prints the parent of,
and on an NVIDIA machine unpack the Vulkan loader first (libvulkan1 and the glvnd libraries as .deb files, see the
device tool's README; `VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json`). `--tries N` runs
each identity check, and llama.cpp's speculative-simple with the same draft, in N processes per placement (a crash
that comes now and then needs several).

The CUDA build BUILD_DIR, on a machine with nvcc (no GPU or driver needed; 26 minutes on 2 cores for one
architecture): llama.cpp's source as ../shared/tools/llama-cpp-reference unpacks it (SRC), cuBLAS from the
nvidia-cublas wheel where the toolkit has none (`pip download nvidia-cublas`, unzipped: CUBLAS), and a stub
libcuda.so.1 defining the driver functions ggml-cuda calls (cuDeviceGet, cuMemCreate, ...: `nm -D --undefined-only
libggml-cuda.so`), so that the library records its need of the real one; the host code for AVX2, not this CPU:

    cmake -S SRC -B BUILD_DIR -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAMA_CURL=OFF \
      -DCUDA_cublas_LIBRARY=CUBLAS/lib/libcublas.so.13 -DCUDA_cublasLt_LIBRARY=CUBLAS/lib/libcublasLt.so.13 \
      -DCUDA_cuda_driver_LIBRARY=STUB/libcuda.so -DCMAKE_CUDA_FLAGS=-ICUBLAS/include -DCMAKE_CXX_FLAGS=-ICUBLAS/include
    ninja -C BUILD_DIR llama-bench llama-speculative-simple llama mtmd
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN_VOCAB = 151_936
PROGRAMS = ("llama-bench", "llama-speculative-simple", "llama-fit-params")  # dev/gpu_offload.py: fit-params
WHEELS = ("diskcache==5.6.3", "gguf==0.19.0", "tomlkit")  # what the GPU machine's image lacks of ours and llama_cpp's
GREENLET = "greenlet==3.5.6"  # ggufspec's, compiled: one wheel for each Python
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


# ---------------------------------------------------------------------------------------------------- here: bundle

def bundle(build: Path, out: Path) -> None:
    import llama_cpp

    bin_dir = build / "bin"
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "llama.tar.gz", "w:gz") as tar:
        for f in sorted(bin_dir.iterdir()):
            if f.name.startswith("lib") and ".so" in f.name or f.name in PROGRAMS:
                tar.add(f, arcname=f"llama/{f.name}")  # the .so links stay links
    package = Path(llama_cpp.__file__).parent
    shutil.rmtree(out / "llama_cpp", ignore_errors=True)
    shutil.copytree(package, out / "llama_cpp", ignore=shutil.ignore_patterns("lib", "server", "__pycache__"))
    (out / "whl").mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(out / "whl"), *WHEELS], check=True)
    for version in ("3.12", "3.11"):  # greenlet is compiled: the GPU machine's Python and this one's (a try here)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                        str(out / "whl"), "--python-version", version, "--implementation", "cp",
                        *(f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 28)), GREENLET], check=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {size / 2**20:.1f} MiB")


def unpack(src: Path, work: Path) -> tuple[Path, dict]:
    """The bundle unpacked under work: (folder of llama.cpp's programs and libraries, the environment to run in)."""
    lib = work / "llama"
    site = work / "site"
    if not lib.exists():
        with tarfile.open(src / "llama.tar.gz") as tar:
            tar.extractall(work)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--find-links", str(src / "whl"), "--target", str(site),
                        *(w.split("=")[0] for w in (*WHEELS, GREENLET))], check=True)
        shutil.copytree(src / "llama_cpp", site / "llama_cpp")
        (site / "llama_cpp" / "lib").symlink_to(lib)
    cuda_libs = [str(p) for p in (Path("/usr/local/cuda/lib64"),) if p.exists()]
    for path in sys.path:  # cuBLAS from the nvidia-cublas wheel where the toolkit has none
        cuda_libs += [str(p.parent) for p in Path(path or ".").glob("nvidia/*/lib/libcublas.so.*")]
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT), str(ROOT / "tests")]),
           "LD_LIBRARY_PATH": os.pathsep.join([str(lib), *cuda_libs, os.environ.get("LD_LIBRARY_PATH", "")])}
    return lib, env


# ---------------------------------------------------------------------------------------------------- there: run

def prepare(a, argv, script: str) -> tuple[Path, dict]:
    """A run's folders (a.out, a.work) made, and (llama.cpp's programs, the environment to run in): a.bundle unpacked
    where given, and `script` begun again under its environment (the loader reads LD_LIBRARY_PATH at start), else
    a.bin with this checkout's packages. Shared by this script and dev/gpu_offload.py."""
    a.out.mkdir(parents=True, exist_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    bin_dir = a.bin
    if a.bundle:
        bin_dir, env = unpack(a.bundle.resolve(), a.work)
        if os.environ.get("GPU_FIGURES_UNPACKED") != "1":
            os.execve(sys.executable, [sys.executable, str(Path(script).resolve()), *(argv or sys.argv[1:])],
                      {**os.environ, **env, "GPU_FIGURES_UNPACKED": "1"})
    sys.path[:0] = env["PYTHONPATH"].split(os.pathsep)
    return bin_dir, env


def gpu_named() -> str:
    """The card as nvidia-smi names it: name, memory, free memory, driver."""
    return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version",
                           "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()


class Run:
    def __init__(self, out: Path, work: Path, budget: float, env: dict, bin_dir: Path, gpu: bool):
        self.out, self.deadline, self.bin, self.gpu = out, time.monotonic() + budget, bin_dir, gpu
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.lines: list[str] = []
        self.table: list[tuple] = []
        self.logs = work / "logs"  # a file each, packed into out/logs.tar.gz (a lent machine returns few files)
        self.logs.mkdir(exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)
        self.save()

    def save(self) -> None:
        rows = ["| what | ggufspec | llama.cpp | ratio |", "| --- | ---: | ---: | ---: |"]
        rows += [f"| {w} | {a} | {b} | {r} |" for w, a, b, r in self.table]
        (self.out / "gpu_figures.md").write_text("\n".join([*self.lines, "", *rows, ""]))
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as tar:
            tar.add(self.logs, arcname="logs")

    def sh(self, cmd: list[str], cap: float, name: str) -> subprocess.CompletedProcess | None:
        """cmd with at most `cap` seconds (less where the budget is nearer); None where the time is gone."""
        limit = min(cap, self.left() - 5)
        if limit < 10:
            self.say(f"- {name}: skipped, {self.left():.0f} s of the budget left")
            return None
        start = time.monotonic()
        try:
            r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=limit, cwd=ROOT)
        except subprocess.TimeoutExpired:
            self.say(f"- {name}: stopped after {limit:.0f} s")
            return None
        (self.logs / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            self.say(f"- {name}: exit {r.returncode} after {time.monotonic() - start:.0f} s: {' / '.join(tail)}")
        return r

    def ggufspec(self, *args: str, cap: float, name: str) -> subprocess.CompletedProcess | None:
        return self.sh([sys.executable, "-m", "ggufspec", *args], cap, name)

    def bench(self, name: str, target: Path, draft: Path, draft_max: str, n: int, repeats: int, cap: float,
              modes: str = "target,draft", compare: bool = True) -> None:
        ngl = ["-ngl", "all", "-ngld", "all"] if self.gpu else []
        prompts = self.logs / "prompt.jsonl"
        prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
        args = ["bench", "-m", str(target), "-md", str(draft), "--modes", modes,
                *(["--draft-max", draft_max] if draft_max else []), "-n", str(n), "--ignore-eos", "--repeats", str(repeats), "--prompts", str(prompts), "--json", *ngl]
        r = self.ggufspec(*args, *(["--compare-llama-cpp", str(self.bin)] if compare else []), cap=cap, name=name)
        if r is None or r.returncode != 0:
            return
        rows = json.loads(r.stdout)["rows"]
        ours = {(x["mode"], x.get("draft_max")): x for x in rows if not x.get("reference")}
        theirs = {(x["mode"], x.get("draft_max")): x for x in rows if x.get("reference")}

        def add(what, a, b):
            ta, tb = a and a["tokens_per_second"], b and b["tokens_per_second"]
            self.table.append((f"{name}: {what}", f"{ta:.1f} tok/s" if ta else "-", f"{tb:.1f} tok/s" if tb else "-",
                               f"{ta / tb:.2f}x" if ta and tb else "-"))

        add("target alone / llama-bench", ours.get(("target", None)), theirs.get(("llama-bench", None)))
        for (mode, dm), row in ours.items():
            if mode == "target":
                continue
            ref = theirs.get(("llama.cpp-draft-simple", dm)) if mode == "draft" else None
            acc = row.get("acceptance_rate")
            extra = f", accepted {acc:.0%}" if acc is not None else ""
            same = {True: ", same text", False: ", TEXT DIFFERS"}.get(row.get("identical_to_target"), "")
            add(f"{row['label']}{extra}{same} / speculative-simple", row, ref)
        self.save()


IDENTITY = r"""
import json, sys
import ggufspec.llama.dflash as dflash, ggufspec.llama.hidden as hidden
from ggufspec import Engine
kind, target, draft, ngl, ngld = sys.argv[1], sys.argv[2], sys.argv[3] or None, int(sys.argv[4]), int(sys.argv[5])
if kind in ("eagle3", "dflash"):  # the probe: what this llama.cpp does with the target's layers on the device
    hidden.check_target_on_host = dflash.check_target_on_host = lambda *a: None
out = {}
with Engine(target, draft, n_ctx=512, n_gpu_layers=ngl, draft_n_gpu_layers=ngld) as e:
    out["placement"] = {k: sorted(v) for k, v in e.weights().items()}
    for prompt in ("def fib(n):", "The quick brown fox"):
        greedy = e.generate(prompt, max_tokens=96, mode="target", ignore_eos=True).tokens
        seeded = e.generate(prompt, max_tokens=96, mode="target", seed=3, temperature=0.8, ignore_eos=True).tokens
        g = e.generate(prompt, max_tokens=96, mode=kind, draft_max=3, ignore_eos=True)
        s = e.generate(prompt, max_tokens=96, mode=kind, draft_max=3, seed=3, temperature=0.8, ignore_eos=True)
        out[prompt] = {"greedy_same": g.tokens == greedy, "seeded_same": s.tokens == seeded,
                       "drafted": g.stats.n_drafted, "accepted": g.stats.n_accepted}
print(json.dumps(out))
"""
# (target -ngl, draft -ngld): all on the GPU, the target split (2 of 4 layers there), the draft on the CPU
PLACEMENTS = ((-1, -1), (2, -1), (-1, 0))


def identity(run: Run, work: Path, tries: int = 2) -> None:
    from tiny_hidden import read_target, write_tiny_dflash, write_tiny_eagle3, write_tiny_target
    from tiny_mtp import write_tiny_glm4moe_mtp

    target = write_tiny_target(work / "hidden-target.gguf")
    files = {"eagle3": (target, write_tiny_eagle3(work / "eagle3.gguf", read_target(target))),
             "dflash": (target, write_tiny_dflash(work / "dflash.gguf", read_target(target))),
             "mtp": (write_tiny_glm4moe_mtp(work / "mtp.gguf"), None)}
    for kind, (t, d) in files.items():
        for ngl, ngld in PLACEMENTS if run.gpu else ((0, 0),):
            if kind == "mtp" and ngld == 0:
                continue  # the MTP head's context follows the target's placement
            results = []
            for i in range(tries):
                r = run.sh([sys.executable, "-c", IDENTITY, kind, str(t), str(d or ""), str(ngl), str(ngld)], 60,
                           f"identity-{kind}-{ngl}-{ngld}-{i}")
                if r is None:
                    break
                results.append(json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
                               {"exit": r.returncode})
            ok = [x for x in results if "exit" not in x]
            same = all(v["greedy_same"] and v["seeded_same"] for x in ok for k, v in x.items() if k != "placement")
            acc = sum(v["accepted"] for x in ok[:1] for k, v in x.items() if k != "placement")
            placement = ok[0]["placement"] if ok else "-"
            died = [str(x["exit"]) for x in results if "exit" in x]
            text = ("none ran" if not ok else "greedy and seeded text " +
                    ("the target alone's" if same else "DIFFERENT") + f"; {acc} accepted (first process)")
            run.say(f"- {kind}, -ngl {ngl} -ngld {ngld}, weights on {placement}: {len(ok)}/{len(results)} processes "
                    f"ran{' (exits ' + ', '.join(died) + ')' if died else ''}; {text}")
        if kind != "mtp":
            reference(run, kind, t, d, tries)


def reference(run: Run, kind: str, target: Path, draft: Path, tries: int) -> None:
    """llama.cpp's own speculative-simple with the same draft on the same files, `tries` processes per placement
    (-ngl/-ngld 99 for all of it on the device): how many ran, and what each that did not died of."""
    cmd = [str(run.bin / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "--spec-type",
           f"draft-{kind}", "-p", "def fib(n):", "-n", "96", "--spec-draft-n-max", "3", "-c", "512", "-t", "4",
           "--temp", "0", "--ignore-eos"]
    for ngl, ngld in PLACEMENTS if run.gpu else ((0, 0),):
        ran, died, accepted = 0, [], "-"
        for i in range(tries):
            r = run.sh([*cmd, "-ngl", str(99 if ngl < 0 else ngl), "-ngld", str(99 if ngld < 0 else ngld)], 60,
                       f"reference-{kind}-{ngl}-{ngld}-{i}")
            if r is None:
                break
            if r.returncode == 0:
                ran += 1
                m = re.search(r"n_accept\s*=\s*(\d+)", r.stdout + r.stderr)
                accepted = m.group(1) if m else accepted
            else:
                died.append(str(r.returncode))
        run.say(f"- {kind}, llama.cpp's speculative-simple, -ngl {ngl} -ngld {ngld}: {ran}/{ran + len(died)} "
                f"processes ran{' (exits ' + ', '.join(died) + ')' if died else ''}; {accepted} accepted")


PROFILE = r"""
import cProfile, pstats, sys
from ggufspec import Engine
model, mode, n, ngl = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with Engine(model, model if mode != "target" else None, n_ctx=2048, n_gpu_layers=ngl, draft_n_gpu_layers=ngl) as e:
    e.generate("def fib(n):", max_tokens=16, mode=mode, draft_max=4, ignore_eos=True)
    p = cProfile.Profile()
    p.enable()
    out = e.generate("def fib(n):", max_tokens=n, mode=mode, draft_max=4, ignore_eos=True)
    p.disable()
    print(f"{mode}: {out.stats.tokens_per_second:.1f} tok/s under the profiler, {out.stats.rounds} rounds")
    pstats.Stats(p).sort_stats("tottime").print_stats(14)
"""


def profile(run: Run, model: Path, n: int) -> None:
    for mode in ("target", "draft"):
        r = run.sh([sys.executable, "-c", PROFILE, str(model), mode, str(n), "-1" if run.gpu else "0"], 60,
                   f"profile-{mode}")
        if r is not None and r.returncode == 0:
            lines = [x for x in r.stdout.splitlines() if x.strip()]
            run.say("```\n" + "\n".join(lines[:1] + lines[-16:]) + "\n```")


STEPS = ("tests", "identity", "standin", "8b", "costs", "auto", "alpha", "profile")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle")
    b.add_argument("build", type=Path)
    b.add_argument("out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--bundle", type=Path, help="the folder `bundle` wrote (unpacked under --work)")
    r.add_argument("--bin", type=Path, help="llama.cpp's programs, where llama_cpp is installed already")
    r.add_argument("--out", type=Path, default=Path("gpu-figures"))
    r.add_argument("--work", type=Path, default=Path("/tmp/gpu-figures"))
    r.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
    r.add_argument("--small", action="store_true", help="small shapes and fewer tokens: a try on a CPU")
    r.add_argument("-n", type=int, default=128, help="tokens per run")
    r.add_argument("--steps", default=",".join(STEPS[:-1]), help=f"which of {', '.join(STEPS)} to run")
    r.add_argument("--device", default="CUDA0", help="the device llama.cpp must see (Vulkan0 for a Vulkan build)")
    r.add_argument("--tries", type=int, default=2, help="processes per placement in the identity step")
    a = ap.parse_args(argv)
    if a.cmd == "bundle":
        bundle(a.build, a.out)
        return 0
    bin_dir, env = prepare(a, argv, __file__)
    smi = shutil.which("nvidia-smi")
    run = Run(a.out, a.work, a.budget, env, bin_dir, gpu=(bool(smi) or a.device != "CUDA0") and not a.small)
    start = time.monotonic()
    run.say("# ggufspec GPU figures")
    if smi:
        run.say(f"GPU (nvidia-smi): {gpu_named()}")
    r = run.ggufspec("doctor", cap=60, name="doctor")
    if r is not None:
        run.say("```\n" + "\n".join(r.stdout.strip().splitlines()[:14]) + "\n```")
    if run.gpu and (r is None or a.device not in r.stdout):  # the build does not reach the GPU: say why, stop early
        lib = Path(run.env["LD_LIBRARY_PATH"].split(os.pathsep)[0])
        backend = a.device.rstrip("0123456789").lower()
        ldd = subprocess.run(["ldd", str(next(lib.glob(f"libggml-{backend}.so*"), lib))], capture_output=True,
                             text=True, env=run.env)
        run.say(f"llama.cpp sees no {a.device}: stopping.\nLD_LIBRARY_PATH={run.env['LD_LIBRARY_PATH']}\n"
                f"{ldd.stdout}{ldd.stderr}\n{r.stderr[-2000:] if r else ''}")
        return 1

    from shaped import write_shaped
    from tiny import write_tiny_model

    steps = set(a.steps.split(","))
    if "tests" in steps:  # the GPU tier with the layers on this GPU (the real pair's test skips: no files travel)
        run.say(f"\n## The GPU tier on {a.device}: tests/test_gpu.py, tests/test_offload.py")
        run.env["GGUFSPEC_REQUIRE_GPU"] = "1"
        r = run.sh([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-rfEs",
                    "tests/test_gpu.py", "tests/test_offload.py"], cap=300, name="tests")
        if r is not None:
            run.say("```\n" + "\n".join(r.stdout.strip().splitlines()[-30:]) + "\n```")
    if "identity" in steps:
        run.say("\n## Hidden-state drafts and MTP with the target on the GPU")
        identity(run, a.work, a.tries)
    small = dict(n_layer=2, n_embd=512, n_ff=1024, n_vocab=8192, n_head=8, n_head_kv=2) if a.small else {}
    n = 32 if a.small else a.n
    standin = write_tiny_model(a.work / "standin.gguf", pad=QWEN_VOCAB - 354, n_embd=64, logit_scale=40.0)
    run.say(f"\n## Rows (median of 3, greedy, {n} tokens, one prompt)")
    if "standin" in steps:
        run.bench("stand-in", standin, standin, "1,4,8", n, 3, cap=150)
    target, draft = a.work / "target-8b.gguf", a.work / "draft-1b.gguf"
    if steps & {"8b", "costs", "auto"} and not (target.exists() and draft.exists()):
        t = time.monotonic()
        write_shaped(target, "llama-3.1-8b", **small)
        write_shaped(draft, "llama-3.2-1b", seed=1, **small)
        run.say(f"- wrote the 8B- and 1B-shaped models in {time.monotonic() - t:.0f} s")
    if "8b" in steps:
        run.bench("8B Q4_K", target, target, "4", n, 3, cap=200)
    ngl = ["-ngl", "all", "-ngld", "all"] if run.gpu else []
    if "costs" in steps:
        r = run.ggufspec("costs", "-m", str(target), "-md", str(draft), "--refresh", *ngl, cap=120, name="costs")
        if r is not None and r.returncode == 0:
            run.say("\n## ggufspec costs, 8B-shaped target, 1B-shaped draft\n```\n" + r.stdout.strip() + "\n```")
    if "auto" in steps:  # the random models' text repeats itself: lookup's ground, against llama.cpp's n-gram rows
        run.bench("8B + 1B draft", target, draft, None, n, 3, cap=200, modes="target,lookup,auto")
    if "alpha" in steps:
        from alpha_figures import speed_at_alpha

        speed_at_alpha(run, a.work, small, 2 * n, PROMPT, threads=1 if a.small else 0)
    if "profile" in steps:
        run.say(f"\n## Where a round's time goes: the stand-in, {4 * n} tokens, cProfile (tottime)")
        profile(run, standin, 4 * n)
    run.say(f"\n(whole run {time.monotonic() - start:.0f} s)")
    print("\n".join(["", "| what | ggufspec | llama.cpp | ratio |", "| --- | ---: | ---: | ---: |"] +
                    [f"| {w} | {x} | {y} | {z} |" for w, x, y, z in run.table]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
