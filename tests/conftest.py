import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from tiny import write_tiny_model  # noqa: E402
from ggufspec.llama.system import busy_elsewhere as REAL_BUSY_ELSEWHERE  # noqa: E402  (quiet_cpus replaces it)

# A shell's background job (`.ci/run &`, nohup) starts with SIGINT ignored, and its children inherit that: the tests
# of Ctrl-C would see ggufspec run on. Restored here, so the processes the tests start take SIGINT as a user's do.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The real models live where scripts/fetch_offline_models.py put them, read before any test
# points GGUFSPEC_MODELS_DIR at a temporary directory.
REAL_MODELS_DIR = Path(os.environ.get("GGUFSPEC_MODELS_DIR") or
                       Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ggufspec" / "models")
# Mesa's shader cache stays where it was, one for every test and subprocess: the software Vulkan device (CI's GPU tier)
# compiles each of llama.cpp's pipelines for seconds to minutes, and the per-test XDG_CACHE_HOME below would start it
# cold in every test (tune's two tests alone took 13 minutes so on a Xeon, 33 seconds with the cache kept).
os.environ.setdefault("MESA_SHADER_CACHE_DIR", str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") /
                                                   "mesa_shader_cache"))
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"


@pytest.fixture(scope="session", autouse=True)
def isolated_session(tmp_path_factory):
    """Module- and session-scoped fixtures (engines that measure costs) are set up before the
    per-test isolation below: they too must not touch the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        base = tmp_path_factory.mktemp("home")
        mp.setenv("XDG_CACHE_HOME", str(base / "cache"))
        mp.setenv("XDG_CONFIG_HOME", str(base / "config"))
        mp.setenv("GGUFSPEC_MODELS_DIR", str(base / "models"))
        mp.setenv("HF_HOME", str(base / "hf"))
        yield base / "cache" / "ggufspec" / "costs.json"


@pytest.fixture(autouse=True)
def quiet_cpus(monkeypatch):
    """In-process, the CPUs read as free of other processes: what a test asserts of measuring must not change with
    what else runs on the machine (tests/test_measure.py reads the real load, and fakes a busy one)."""
    from ggufspec.llama import system

    monkeypatch.setattr(system, "busy_elsewhere", lambda seconds=0.5: 0.0)


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch, request, isolated_session):
    """Every test gets its own cache, models directory and config; nothing touches the user's. But the slow tier's
    tests (the real models) share one cost table per session, as module fixtures do: measuring the real Q8_0 pair
    takes minutes on two cores, and what they prove is the text, not the measuring (tests/test_measure.py's is)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if request.node.get_closest_marker("slow"):
        monkeypatch.setenv("GGUFSPEC_COSTS_FILE", str(isolated_session))
    else:
        monkeypatch.delenv("GGUFSPEC_COSTS_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("GGUFSPEC_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("GGUFSPEC_REGISTRY", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny GGUF models written once per test session, by role."""
    d = tmp_path_factory.mktemp("tiny")
    return {
        "target": write_tiny_model(d / "target.gguf", seed=0, chat_template=CHAT_TEMPLATE),
        "same": write_tiny_model(d / "same.gguf", seed=0),  # the target's weights: an identical draft
        "close": write_tiny_model(d / "close.gguf", seed=0, perturb=0.05),  # agrees most of the time
        "far": write_tiny_model(d / "far.gguf", seed=0, perturb=0.3),  # agrees sometimes
        "other_vocab": write_tiny_model(d / "other_vocab.gguf", seed=0, vocab_shift=3),  # same size, shifted tokens
        # a target that writes its letters' own tokens, and itself with them at other ids: another vocabulary that,
        # in text, drafts the target's own
        "lettered": write_tiny_model(d / "lettered.gguf", seed=0, byte_logits=False),
        "permuted": write_tiny_model(d / "permuted.gguf", seed=0, byte_logits=False, permute=1),
        "letters": write_tiny_model(d / "letters.gguf", seed=5, vocab="letters", logit_scale=1.5),
        "letters_sharp": write_tiny_model(d / "letters_sharp.gguf", seed=5, vocab="letters", logit_scale=1.5, sharpen=3.0),
        "letters_other": write_tiny_model(d / "letters_other.gguf", seed=9, vocab="letters", logit_scale=1.5),
    }


def real_model(filename: str) -> Path:
    """A real GGUF from the models directory; skipped if absent, failed if CI requires it."""
    path = REAL_MODELS_DIR / filename
    if not path.is_file():
        message = f"{path} is missing: run `python scripts/fetch_offline_models.py qwen2.5-coder-1.5b qwen2.5-coder-1.5b-q8_0 gemma-3-270m`"
        if os.environ.get("GGUFSPEC_REQUIRE_REAL") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def pytest_terminal_summary(terminalreporter):
    """The machine, last: what a CI log shows of a run is its end, and a failure's figures depend on the CPU."""
    from ggufspec.llama.system import cpu_flags, cpu_model

    wide = sorted(f for f in cpu_flags() if f in ("avx", "avx2", "avx512f", "avx512_vnni", "avx512_vbmi", "amx_tile"))
    terminalreporter.write_line(f"machine: {cpu_model()} ({', '.join(wide)}), {os.cpu_count()} CPUs")
