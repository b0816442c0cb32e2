"""The seams: a CLI that only wires, the loop as a generator, one drafter interface, fresh
stream values, the benchmark's progress and table width, and the one registry file."""

import ast
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


def test_the_cli_imports_no_engine_internals():
    tree = ast.parse((ROOT / "ggufspec" / "cli.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level and not node.module
                 for alias in node.names}
    assert imported, "the parse found no relative imports at all"
    assert not imported & {"backend", "compat", "drafters", "auto", "hub", "speculative", "costs"}, imported


def test_every_drafter_is_a_drafter():
    for cls in (ModelDrafter, LookupDrafter, AutoDrafter):
        assert issubclass(cls, Drafter)
    base = Drafter()
    assert base.propose([1, 2], 4, SamplingParams(), np.random.default_rng(0)).tokens == []


class Recorder(Drafter):
    """Proposes the same tokens every round and keeps what the loop tells it back."""

    name = "recorder"

    def __init__(self, tokens):
        self.tokens, self.seen = tokens, []

    def propose(self, history, draft_max, params, rng):
        return Draft(self.tokens[:draft_max], source=self.name, agreement=len(history))

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
               and "target step" not in line) <= 120
    assert "draft-alone" in narrow.stdout and "draft (draft-max 4)" in narrow.stdout
    wide = CliRunner().invoke(cli, args + ["--wide"])
    assert "draft/verify/other" in wide.stdout and "draft/verify/other" not in narrow.stdout
    assert narrow.stderr == ""  # progress only when stderr is a terminal


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
