"""The house and its seams: imports that point down the layers, each heavy dependency in one place, a
pure tier that runs without llama.cpp, small modules; a CLI that only wires, the loop as a generator, one drafter interface, fresh
stream values, the benchmark's progress and table width, and the one registry file."""

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import ggufspec.speculative as speculative
from ggufspec import Engine
from ggufspec.bench.runs import BenchSettings, run
from ggufspec.bench.prompts import Prompt
from ggufspec.cli.main import cli
from ggufspec.core import Draft
from ggufspec.drafters import Drafter, LookupDrafter, ModelDrafter
from ggufspec.auto import AutoDrafter
from ggufspec.verification import Verification
from ggufspec.sampling import SamplingParams

ROOT = Path(__file__).parent.parent


PACKAGE = ROOT / "ggufspec"
# The layers, bottom up: an import may point at its own layer or one below, never above.
CORE = {"errors", "paths", "core", "sampling", "costs", "corrections", "text", "verification", "drafters", "textdraft", "estimates", "auto", "watch", "speculative", "serving", "batching",
        "generation"}  # the decoding core: numpy only


def layer(module: str) -> int:
    top = module.split(".")[0]
    if top in CORE:
        return 0
    return {"llama": 1, "engine": 2, "models": 3, "bench": 4, "llama_draft": 4, "server": 4}.get(top, 5)  # cli, llama_server, ...


def imports(path: Path) -> set[str]:
    """Every module a file imports, anywhere in it (functions too): ggufspec's as dotted names under the
    package ("llama.backend"), others as given ("llama_cpp.server")."""
    module = path.relative_to(PACKAGE).with_suffix("").parts
    package = list(module[:-1]) if module[-1] != "__init__" else list(module[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - node.level + 1]
            names = [".".join(base + [node.module])] if node.module else [".".join(base + [a.name]) for a in node.names]
            found |= {"ggufspec:" + n for n in names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"), path


def test_every_import_points_down_the_layers():
    """core <- llama <- engine <- models <- bench, llama_draft <- cli, llama_server: nothing imports upwards."""
    upward = []
    for name, path in modules():
        for target in imports(path):
            inner = target.removeprefix("ggufspec:").removeprefix("ggufspec.")
            if target.startswith(("ggufspec:", "ggufspec.")) and inner and layer(inner) > layer(name):
                upward.append(f"{name} -> {inner}")
    assert not upward, upward
    assert layer("llama.backend") == 1 and layer("cli.main") == 5  # the table knows the packages


def package_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules a module imports, anywhere in it (functions too), by their names in `known`
    ("llama.runtime"; "" for the package itself): `from ..llama import backend` is llama.backend."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    package = here if is_package else here[:-1]
    found = set()

    def add(parts: list[str], names: list[str]) -> None:
        for alias in names:  # a submodule by name, else the module the names come from
            module = ".".join(parts + [alias])
            found.add(module if module in known else ".".join(parts))

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ggufspec" or alias.name.startswith("ggufspec."):
                    found.add(alias.name.removeprefix("ggufspec").removeprefix("."))
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                parts = base + (module.split(".") if module else [])
            elif module == "ggufspec" or module.startswith("ggufspec."):
                parts = module.split(".")[1:]
            else:
                continue
            add(parts, [alias.name for alias in node.names])
    return (found & known) - {name}


def test_no_modules_import_each_other():
    """No import circle anywhere in the package, lazy imports in functions included: of two modules that need
    each other, one owns what both need."""
    names = {("" if name == "__init__" else name): path for name, path in modules()}
    graph = {name: package_imports(name, path, set(names)) for name, path in names.items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {name: reachable(name) for name in graph}
    circles = sorted({tuple(sorted(m for m in reach[name] if name in reach[m])) for name in graph if name in reach[name]})
    assert not circles, circles  # each: the modules of one circle
    assert "llama.devices" in graph["llama.backend"] and "llama.runtime" in graph["llama.devices"]  # the parse sees them


@pytest.mark.parametrize("dependency, owners", [
    ("llama_cpp", "llama."), ("gguf", "llama.gguf_info"), ("huggingface_hub", "models.hub"),
    ("tabulate", "bench.report"), ("click", "cli."), ("tomlkit", "models.registry"), ("fastapi", "server"),
    ("uvicorn", "server"), ("greenlet", "llama.sequences"),
])
def test_each_heavy_dependency_is_imported_in_one_place(dependency, owners):
    users = {name for name, path in modules()
             if any(t == dependency or t.startswith(dependency + ".") for t in imports(path))}
    assert users and all(u == owners or u.startswith(owners) for u in users), users


def test_the_pure_tier_runs_with_llama_cpp_absent(tmp_path):
    """tests/pure (the decoding core on a numpy fake target, the math, text, registry downloads) needs no
    llama.cpp: it runs, and passes, with every import of llama_cpp refused."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class NoLlama:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'llama_cpp':\n"
        "            raise ImportError('llama_cpp is absent here')\n"
        "sys.meta_path.insert(0, NoLlama())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    # -m "not slow": the Hub's retries (23 s) import no llama.cpp either; the suite runs them once, beside this
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                           str(ROOT / "tests" / "pure")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout.splitlines()[-1]
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True, env=env)
    assert "llama_cpp is absent here" in probe.stderr  # the block held


def test_modules_and_functions_stay_small_enough_to_read():
    long_modules, long_functions = [], []
    for name, path in modules():
        source = path.read_text()
        if len(source.splitlines()) > 400:
            long_modules.append(name)
        long_functions += [f"{name}.{node.name}" for node in ast.walk(ast.parse(source))
                           if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and node.end_lineno - node.lineno + 1 > 60]
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_the_readme_is_a_five_minute_read():
    """A front door: under 1,100 words (about five minutes), with the quick start, headline, commands and links."""
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) < 1100, len(text.split())
    for heading in ("## Quick start", "## Headline", "## Commands", "## More"):
        assert heading in text, heading


def test_a_mode_name_is_spelled_only_in_the_table_of_modes():
    """Which mode decodes on the draft alone is a field of core.MODE_TABLE, not a name compared in each module."""
    spelled = [name for name, path in modules() if '"draft-alone"' in path.read_text()]
    assert spelled == ["core"], spelled


def test_the_cli_imports_no_engine_internals():
    forbidden = {"llama.backend", "llama.compat", "drafters", "auto", "models.hub", "speculative", "costs"}
    for command in ("main", "machine", "models"):
        found = {t.removeprefix("ggufspec:") for t in imports(PACKAGE / "cli" / f"{command}.py") if t.startswith("ggufspec:")}
        assert found, f"the parse found no relative imports in cli/{command}.py"
        assert not found & forbidden, (command, found & forbidden)


def test_every_drafter_is_a_drafter():
    for cls in (ModelDrafter, LookupDrafter, AutoDrafter):
        assert issubclass(cls, Drafter)
    base = Drafter()
    assert base.propose([1, 2], 4, SamplingParams(), np.random.default_rng(0)).tokens == []


def test_the_engine_asks_no_drafter_what_it_is():
    """What a drafter can do is declared on the Drafter seam (lazy_model, heads), with defaults every drafter has:
    the engine asks none with hasattr or getattr."""
    tree = ast.parse((PACKAGE / "engine.py").read_text())
    asked = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in ("hasattr", "getattr") and n.args and "drafter" in ast.unparse(n.args[0])]
    assert not asked, asked
    assert Drafter.lazy_model is False and dict(Drafter.heads) == {}


class Recorder(Drafter):
    """Proposes the same tokens every round and keeps what the loop tells it back."""

    name = "recorder"

    def __init__(self, tokens):
        self.tokens, self.seen = tokens, []

    def propose(self, history, draft_max, params, rng):
        return Draft(tokens=self.tokens[:draft_max], source=self.name, agreement=len(history))

    def observe(self, round_):
        self.seen.append((round_.draft.agreement, round_.draft.source, round_.source))


@pytest.fixture(scope="module")
def engine(tiny):
    with Engine(tiny["target"], tiny["close"], n_ctx=256) as e:
        yield e


def test_a_drafter_hears_back_through_its_own_draft(engine):
    ctx = engine.target_ctx
    prompt = engine.tokenize_prompt("hello")
    logits, _ = speculative.prefill(ctx, prompt)
    assert ctx.n_past == len(prompt)  # the last prompt token is in the prompt's batch, as in llama.cpp
    drafter = Recorder([5, 6, 7])
    out = list(speculative.rounds(ctx, drafter, prompt, logits, SamplingParams(), np.random.default_rng(0),
                                  max_tokens=12, draft_max=3))
    assert sum(len(r.tokens) for r in out) == 12
    assert out[0].tokens == [int(np.argmax(logits))] and out[0].n_drafted == 0  # the prompt's own token
    assert len(drafter.seen) == len(out) - 1  # every round but the prompt's
    history_lengths = [len(prompt) + sum(len(r.tokens) for r in out[:i]) for i in range(1, len(out))]
    proposed = [(seen[0], n) for seen, n in zip(drafter.seen, history_lengths) if seen[1] == "recorder"]
    assert len(proposed) == len(out) - 2  # the last round has one token left: nothing to draft
    assert all(agreement == n for agreement, n in proposed)  # each round returned the drafter's own Draft


def test_an_exception_inside_a_round_leaves_the_cache_as_before(engine, monkeypatch):
    ctx = engine.target_ctx
    prompt = engine.tokenize_prompt("hello")
    history = prompt + [speculative.first_token(speculative.prefill(ctx, prompt)[0], SamplingParams(), None)]

    def broken(*args):
        raise RuntimeError("verification failed")

    import ggufspec.verification as verification

    monkeypatch.setattr(verification, "verify_greedy", broken)
    with pytest.raises(RuntimeError):
        speculative.speculative_step(ctx, Recorder([5, 6, 7]), history, 3, SamplingParams(), np.random.default_rng(0))
    assert ctx.n_past == len(history) - 1  # the batch [last] + 3 drafts was decoded, then rewound


def test_a_stream_yields_a_fresh_value_each_round(engine):
    chunks = list(engine.stream("hello", max_tokens=20, ignore_eos=True, mode="draft"))
    counts = [c.stats.n_generated for c in chunks]
    assert counts == sorted(counts) and len(set(counts)) == len(counts) and counts[-1] == 20
    assert counts == list(np.cumsum([len(c.tokens) for c in chunks]))
    assert len({id(c.stats) for c in chunks}) == len(chunks)
    assert all(c.source in ("draft", "target") and c.n_accepted <= c.n_drafted for c in chunks)


def test_draft_alone_is_the_draft_models_own_text(tiny, engine):
    alone = engine.generate("hello", max_tokens=16, ignore_eos=True, mode="draft-alone")
    with Engine(tiny["close"], n_ctx=256, measure=False) as draft_only:
        assert alone.tokens == draft_only.generate("hello", max_tokens=16, ignore_eos=True, mode="target").tokens
    assert alone.stats.n_drafted == 0


def test_bench_reports_progress_per_run(engine):
    events = []
    settings = BenchSettings(("target", "draft"), (2,), 4, 1, 1, True, {})
    run(engine, [Prompt("t", 0, text="hi"), Prompt("t", 1, text="ho")], settings, [], progress=events.append)
    assert [e.done for e in events] == list(range(1, 7)) and {e.total for e in events} == {6}
    assert events[-1].seconds_left == 0 and all(e.seconds_left >= 0 for e in events)
    assert {e.config.mode for e in events} == {"target", "draft"}


def test_the_default_bench_table_fits_120_columns(tiny):
    args = ["bench", "-m", str(tiny["target"]), "-md", str(tiny["close"]), "--suite", "code", "--limit", "1", "-n", "8"]
    narrow = CliRunner().invoke(cli, args)
    assert narrow.exit_code == 0, narrow.output
    assert max(len(line) for line in narrow.stdout.splitlines() if "|" not in line and "ceiling" not in line
               and "target step" not in line) <= 120, narrow.stdout
    assert "draft-alone" in narrow.stdout and "draft (draft-max 4)" in narrow.stdout
    wide = CliRunner().invoke(cli, args + ["--wide"])
    assert "draft/verify/other" in wide.stdout and "draft/verify/other" not in narrow.stdout
    # progress only when stderr is a terminal (a busy machine's "do not add up" warning may come all the same)
    assert [line for line in narrow.stderr.splitlines() if not line.startswith("ggufspec: ")] == []


def test_the_installed_registry_is_the_top_level_file(tmp_path):
    """Editable installs read models.toml at the top of the repository; a wheel carries its bytes."""
    from ggufspec.models.registry import BUILTIN

    assert BUILTIN.resolve() == (ROOT / "models.toml").resolve()
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("ggufspec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("ggufspec/models.toml") == (ROOT / "models.toml").read_bytes()


def test_exact_batches_end_where_the_measured_kv_length_ends():
    v = Verification(3, True, 0.5, exact_kv=256)
    assert [v.exact_here(n) for n in (4, 256, 257, 1000)] == [3, 3, 1, 1]
    assert Verification(3, True).exact_here(10_000) == 3  # exact at every length measured
