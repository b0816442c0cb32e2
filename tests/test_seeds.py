"""A seed gives the target's own text in every mode (the coupled rule), whatever the drafter did."""

import json

import pytest
from click.testing import CliRunner

from ggufspec import Engine
from ggufspec.cli.main import cli
from ggufspec.costs import Costs

PARAMS = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=0.8, top_p=0.9),
          dict(temperature=1.2, min_p=0.05)]
PROMPTS = ["hello world", "def f(x):", "zzz zzz zzz zzz"]


@pytest.fixture(scope="module", params=["close", "far"])
def engine(request, tiny):
    with Engine(tiny["target"], tiny[request.param], n_ctx=512) as e:
        yield e


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("exact", [True, False])
def test_every_mode_writes_the_targets_seeded_text(engine, params, exact):
    drafted = 0
    for prompt in PROMPTS:
        for seed in (0, 7, 123):
            reference = engine.generate(prompt, max_tokens=40, mode="target", seed=seed, ignore_eos=True, **params)
            for mode in ("draft", "lookup", "auto"):
                for draft_max in (2, 5):
                    out = engine.generate(prompt, max_tokens=40, mode=mode, seed=seed, ignore_eos=True,
                                          draft_max=draft_max, exact=exact, **params)
                    assert out.tokens == reference.tokens, (prompt, seed, mode, draft_max)
                    drafted += out.stats.n_drafted
    assert drafted > 0


def test_seeds_differ_and_repeat(engine):
    runs = [engine.generate("once upon a time", max_tokens=60, temperature=0.8, seed=5, ignore_eos=True).tokens
            for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    other = engine.generate("once upon a time", max_tokens=60, temperature=0.8, seed=6, ignore_eos=True).tokens
    assert other != runs[0]


def test_auto_choosing_differently_still_writes_the_same_text(tiny):
    """Two cost tables that make auto choose differently (drafting nearly free vs. verification
    expensive): the rounds differ, the text does not."""
    texts, sources = [], []
    for verify_factor, draft_cost in ((0.01, 1e-6), (40.0, 1.0)):
        with Engine(tiny["target"], tiny["close"], n_ctx=512) as e:
            step = e.costs.target_batch_seconds[0]
            e.costs = Costs([step * (1 + verify_factor * i) for i in range(9)], e.costs.exact_batch,
                            draft_cost, e.costs.exact_kv)
            out = e.generate("hello world", max_tokens=60, temperature=0.9, seed=11, ignore_eos=True, mode="auto")
            texts.append(out.tokens)
            sources.append(out.stats.rounds_by_source)
    assert texts[0] == texts[1]
    assert sources[0] != sources[1], sources


def test_the_rejection_rule_is_still_there_and_keeps_its_seed_per_mode(engine):
    a = engine.generate("hello", max_tokens=30, temperature=0.9, seed=3, ignore_eos=True, mode="draft",
                        sampling_rule="rejection")
    b = engine.generate("hello", max_tokens=30, temperature=0.9, seed=3, ignore_eos=True, mode="draft",
                        sampling_rule="rejection")
    assert a.tokens == b.tokens  # same drafter, same seed: the same run


def test_cli_seeded_runs_print_the_target_text(tiny):
    def run(*extra):
        r = CliRunner().invoke(cli, ["generate", "-m", str(tiny["target"]), "-md", str(tiny["close"]), "-p",
                                     "once upon a time", "-n", "50", "--temp", "0.8", "--ignore-eos", "-s", "5",
                                     "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["tokens"]

    reference = run("--mode", "target")
    assert all(run() == reference for _ in range(3))  # auto, the default
    assert run("--mode", "draft") == run("--mode", "lookup") == reference
    assert run("--spec-type", "draft-simple") == reference
