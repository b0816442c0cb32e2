"""Machines we do not have: decisions from system-info strings and CPU flags, costs per machine,
any prompt bytes, `ggufspec doctor`, and the declared Python range."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ggufspec.llama import backend, measure as costs, runtime, system
from ggufspec.cli.main import cli

# As llama_print_system_info() prints them: this CPU (AVX-512, no AMX), a Sapphire Rapids
# native build (AMX kernels compiled in), a CUDA build, and an ARM build.
NO_AMX = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
          "AVX512_VBMI = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
AMX = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
       "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ")
CUDA = "CUDA : ARCHS = 890 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | REPACK = 1 | "
ARM = "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | REPACK = 1 | "
QWEN_TYPES = {"F32", "Q4_K", "Q6_K"}


def features(text):
    return system.build_features(system.parse_system_info(text))


def test_system_info_strings_parse_into_build_features():
    assert features(NO_AMX)[:4] == ["SSE3", "SSSE3", "AVX", "AVX2"] and "AMX_INT8" not in features(NO_AMX)
    assert "AMX_INT8" in features(AMX)
    cuda = features(CUDA)
    assert "CUDA" in cuda and "AVX2" in cuda and "USE_GRAPHS" in cuda
    assert features(ARM) == ["NEON", "ARM_FMA", "FP16_VA", "DOTPROD", "REPACK"]
    assert features("") == []


@pytest.mark.parametrize("info, bufts, types, crashes", [
    (AMX, ["AMX", "CPU_REPACK"], QWEN_TYPES, True),  # a Xeon with AMX: a native build on an AMX CPU
    (AMX, ["AMX", "CPU_REPACK"], {"F32"}, False),  # the tiny test models: AMX takes no F32 weights
    (AMX, ["CPU_REPACK"], QWEN_TYPES, False),  # AMX kernels built, but this CPU (or kernel) refuses AMX
    (NO_AMX, ["CPU_REPACK"], QWEN_TYPES, False),  # this machine; or the reinstall with -mno-amx-*
    (ARM, ["CPU_REPACK"], QWEN_TYPES, False),
    (CUDA, ["CPU_REPACK"], {"Q8_0"}, False),
])
def test_the_amx_decision(info, bufts, types, crashes):
    problem = system.amx_problem(features(info), bufts, types, "0.3.36")
    assert (problem is not None) == crashes
    if crashes:
        assert "issue 20824" in problem and "Q4_K/Q6_K" in problem
        assert "-mno-amx-tile" in problem and "--no-cache-dir" in problem and "llama-cpp-python==0.3.36" in problem


def test_cpu_model_and_flags_from_cpuinfo():
    text = ("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
            "flags\t\t: fpu avx avx2 avx512f amx_tile amx_int8\n")
    assert system.cpu_model(text) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert {"amx_tile", "avx512f"} <= system.cpu_flags(text)
    assert system.cpu_flags("Features\t: fp asimd sve\n") == {"fp", "asimd", "sve"}
    # a name that says no model: the core, from the family and model numbers
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {}\nmodel\t\t: {}\nmodel name\t: AMD EPYC\n"
    assert system.cpu_model(amd.format(26, 2)) == "AMD EPYC (Zen 5: family 26, model 2)"
    assert system.cpu_model(amd.format(25, 17)) == "AMD EPYC (Zen 4: family 25, model 17)"
    assert system.cpu_model(amd.format(25, 1)) == "AMD EPYC (Zen 3: family 25, model 1)"
    assert system.cpu_model(amd.format(99, 1)) == "AMD EPYC (family 99, model 1)"
    xeon = "cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Processor\n"
    assert system.cpu_model(xeon) == "Intel(R) Xeon(R) Processor (Sapphire Rapids: family 6, model 143)"
    assert system.cpu_model(text.replace("flags", "cpu family\t: 6\nmodel\t\t: 143\nflags")) == \
        "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"  # a name with a model number stays as it is


def test_gpu_present_with_a_cpu_only_build():
    assert system.gpu_problem(features(NO_AMX), gpu_visible=True)["fix"].startswith("python scripts/install.py")
    assert system.gpu_problem(features(CUDA), gpu_visible=True) is None
    assert system.gpu_problem(features(NO_AMX), gpu_visible=False) is None


def test_this_machine_is_described_by_what_it_reports():
    m = backend.machine()
    assert m["summary"]["cpu"] == system.cpu_model()
    assert set(features(runtime.system_info())) <= set(m["summary"]["features"])
    assert any(d.startswith("CPU") for d in m["summary"]["devices"])
    other = system.describe("Another CPU", m["summary"]["features"], [], m["summary"]["llama_cpp"])
    assert other["id"] != m["id"]


def test_another_machines_costs_are_never_used(tiny, monkeypatch):
    """A cost cache shared between machines (an NFS home): an entry keyed by another machine is ignored."""
    from ggufspec.llama.backend import Context, Model
    from ggufspec.paths import costs_file

    with Model(tiny["target"]) as model, Context(model, n_ctx=128) as ctx:
        here = costs.costs_for(ctx)
        cache = costs.load_cache()
        (key,) = cache
        assert key.endswith(f"machine {backend.machine()['id']}") and cache[key]["machine"]["cpu"] == system.cpu_model()
        # The same file measured on another machine, with absurd numbers, is what the cache now holds.
        fake = {key.replace(backend.machine()["id"], "0123456789abcdef"): {
            "target_batch_seconds": [9.0] * 9, "exact_batch": 9, "machine": {"cpu": "Some Other CPU"}}}
        costs_file().write_text(json.dumps(fake))
        again = costs.costs_for(ctx)
        assert again.target_batch_seconds != [9.0] * 9 and again.exact_batch == here.exact_batch
    report = json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).stdout)
    assert any("Some Other CPU" in p["problem"] and p["severity"] == "warning" for p in report["problems"])


def test_doctor_says_what_this_machine_is():
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 0, r.output
    assert system.cpu_model() in r.stdout and "llama-cpp-python 0.3" in r.stdout and "CPU" in r.stdout
    report = json.loads(CliRunner().invoke(cli, ["doctor", "--json"]).stdout)
    for key in ("python", "llama_cpp_python", "build_features", "cpu", "threads", "devices", "models_dir", "costs",
                "problems"):
        assert key in report
    assert report["devices"][0]["total_bytes"] > 0 and report["build_features"]


def test_doctor_reports_an_amx_build_on_an_amx_cpu(monkeypatch):
    pretend_amx(monkeypatch)
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 0, r.output  # ggufspec itself runs there
    assert "warning: this llama-cpp-python build uses llama.cpp's AMX kernels" in r.stdout and "-mno-amx-int8" in r.stdout


def test_doctor_fails_on_a_gpu_it_cannot_use(monkeypatch):
    monkeypatch.setattr(system, "nvidia_gpu_visible", lambda: True)
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 1 and "error: an NVIDIA GPU is present but this llama-cpp-python build is CPU-only" in r.stdout


class T:
    def __init__(self, name, type_name, shape):
        self.name, self.type_name, self.shape = name, type_name, shape


def test_which_weights_are_repacked_by_hand_where_amx_is_avoided():
    tensors = [T("token_embd.weight", "Q4_K", (1536, 151936)), T("output.weight", "Q6_K", (1536, 151936)),
               T("blk.0.attn_q.weight", "Q4_K", (1536, 1536)), T("blk.0.ffn_down.weight", "Q6_K", (8960, 1536)),
               T("blk.1.attn_q.weight", "Q4_K", (1536, 1536)), T("blk.1.attn_k.weight", "Q4_K", (1536, 4)),
               T("blk.1.ffn_up.weight", "Q2_K", (1536, 8960)), T("blk.1.attn_norm.weight", "F32", (1536,)),
               T("blk.2.ffn_gate.weight", "Q4_0", (1536, 8960))]
    avx512 = features(AMX)
    assert system.repack_patterns(tensors, avx512) == [
        r"^blk\.(0|1)\.attn_q\.weight$", r"^blk\.(2)\.ffn_gate\.weight$", r"^blk\.(1)\.ffn_up\.weight$"]
    assert system.repack_patterns(tensors, ["AVX2"]) == [r"^blk\.(0|1)\.attn_q\.weight$", r"^blk\.(2)\.ffn_gate\.weight$"]
    assert system.repack_patterns(tensors, avx512, first_gpu_layer=1) == [r"^blk\.(0)\.attn_q\.weight$"]
    assert system.repack_patterns(tensors, features(ARM)) == []


def pretend_amx(monkeypatch):
    """This process as a native build on an AMX CPU would see itself (the decision's inputs)."""
    from ggufspec.llama import amx, devices

    for module in (amx, runtime):
        monkeypatch.setattr(module, "build_features", lambda: features(AMX))
    for module in (amx, devices):
        monkeypatch.setattr(module, "cpu_buffer_types", lambda: ["AMX", "CPU_REPACK"])


def test_an_amx_build_loads_models_amx_would_not_touch(tiny, monkeypatch):
    pretend_amx(monkeypatch)
    ok = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-p", "hi", "-n", "2"])
    assert ok.exit_code == 0, ok.output  # F32: AMX takes no such weights


@pytest.mark.slow
def test_where_amx_would_crash_the_weights_are_placed_by_hand(monkeypatch):
    """The decision taken as on an AMX machine, the placement done for real on this one: the same
    tensors repacked (so the same logits, bit for bit) with llama.cpp's extra buffer types off."""
    import numpy as np

    from conftest import real_model
    from ggufspec.llama.backend import Context, Model

    path = real_model("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    rows = {}
    for pretend in (False, True):
        if pretend:
            pretend_amx(monkeypatch)
        with Model(path) as m, Context(m, n_ctx=256) as c:
            assert m.avoids_amx == pretend
            tokens = m.tokenize("def fibonacci(n):")
            c.decode(tokens[:-1], logits="none")
            rows[pretend] = c.decode([tokens[-1], 100, 200, 300], logits="all").copy()
    np.testing.assert_array_equal(rows[False], rows[True])
    out = CliRunner().invoke(cli, ["generate", "-m", str(path), "-p", "def add(a, b):", "-n", "8", "--json"])
    assert out.exit_code == 0, out.output


def test_a_prompt_file_in_any_encoding_is_tokenized_as_bytes(tiny, tmp_path):
    """llama.cpp reads a prompt file as bytes; so does `-f`, whatever the encoding."""
    from ggufspec import Engine

    latin1 = tmp_path / "notes.txt"
    latin1.write_bytes("café naïve\n".encode("latin-1"))
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(1, 256)))
    for f in (latin1, binary):
        r = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-f", str(f), "-n", "3", "--json"])
        assert r.exit_code == 0, r.output
        with Engine(tiny["target"], n_ctx=512, measure=False) as e:
            assert json.loads(r.stdout)["n_prompt"] == len(e.tokenize_prompt(f.read_bytes()))


def test_a_non_utf8_prompts_file_is_one_line(tiny, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"first prompt\nsecond \xe9t\xe9\n")
    r = CliRunner().invoke(cli, ["bench", "-m", str(tiny["target"]), "--prompts", str(f), "-n", "2"])
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.exit_code == 1 and len(lines) == 1
    assert "prompts.txt: not UTF-8 at byte 20 (line 2)" in lines[0]


def test_the_declared_python_range_is_true():
    """pyproject says >=3.10: vermin checks that no module needs more (tomllib is 3.11+, for one)."""
    root = Path(__file__).parent.parent
    assert 'requires-python = ">=3.10"' in (root / "pyproject.toml").read_text()
    vermin = shutil.which("vermin") or str(Path(sys.executable).with_name("vermin"))  # a test extra
    proc = subprocess.run([vermin, "-t=3.10-", "--violations", "--no-tips", "ggufspec", "scripts",
                           "tests"], cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
