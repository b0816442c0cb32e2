"""The cost cache (llama/measure.py): damaged entries measured again, what doctor shows of it, no temporary file
left by a full disk."""

import errno
import json
import os
import time
from pathlib import Path

import pytest

from clirun import run


@pytest.mark.parametrize("damage", ["a string", "missing key", "list", "zeros", "null exact", "rollback", "deep rows"])
def test_a_damaged_cost_entry_is_measured_again_and_doctor_names_the_file(tiny, damage):
    from ggufspec.paths import costs_file

    assert run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 4).exit_code == 0
    cache = json.loads(costs_file().read_text())
    for key in list(cache):
        if damage == "a string":
            cache[key] = "oops"
        elif damage == "missing key":
            cache[key] = {k: v for k, v in cache[key].items() if k not in ("exact_batch", "token_seconds")}
        elif damage == "list":
            cache[key] = []
        elif damage == "rollback":  # a target entry's rewind costs of the wrong shape (the draft's: no such key)
            cache[key] = {**cache[key], "rollback": {"state_bytes": "x", "kept": 0}, "token_seconds": -1}
        elif damage == "deep rows":  # the rows' cost deep in the cache, of the wrong shape
            cache[key] = {**cache[key], "deep_rows": ["x", -1], "token_seconds": -1}
        elif damage == "zeros":
            cache[key] = {**cache[key], "target_batch_seconds": [0.0] * 9, "token_seconds": 0}
        else:
            cache[key] = {**cache[key], "exact_batch": None, "token_seconds": None}
    costs_file().write_text(json.dumps(cache))
    doctor = run("doctor")
    assert str(costs_file()) in doctor.output and "damaged entr" in doctor.output
    r = run("generate", "-m", tiny["target"], "-md", tiny["close"], "-p", "hi", "-n", 4, "--mode", "auto")
    assert r.exit_code == 0, r.output
    assert "damaged entr" not in run("doctor").output  # measured again and rewritten


def test_doctor_shows_only_the_measurements_a_run_would_read(tiny, tmp_path):
    from ggufspec.paths import costs_file

    target = tmp_path / "t.gguf"
    target.write_bytes(Path(tiny["target"]).read_bytes())
    assert run("generate", "-m", target, "-md", tiny["close"], "-p", "hi", "-n", 4).exit_code == 0
    listed = lambda: [c["model"] for c in json.loads(run("doctor", "--json").output)["costs"]]
    assert listed() == [str(target.resolve())]
    cache = json.loads(costs_file().read_text())
    (key,) = [k for k in cache if k.startswith(str(target.resolve())) and not k.endswith("|draft")]
    older = key.replace("|b64|", "|b16|")  # an earlier version's measurement of the same file
    assert older != key
    costs_file().write_text(json.dumps({**cache, older: cache[key]}))
    assert listed() == [str(target.resolve())]
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10**9))  # the file changed since: measured anew when run
    assert listed() == []
    target.unlink()
    assert listed() == [] and "measured costs on this machine: none yet" in run("doctor").output


def test_a_full_disk_leaves_no_temporary_cost_file(tiny, monkeypatch):
    from ggufspec.llama import cost_cache as costs
    from ggufspec.paths import costs_file

    def full(self, data, *a, **kw):
        with open(self, "w") as f:
            f.write(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    costs._save_cache({"k": {"token_seconds": 1.0}})
    monkeypatch.undo()
    assert not list(costs_file().parent.glob("*.tmp"))


def measured(tiny, n_ctx=128, **kw):
    """costs_for on the tiny target in a context of n_ctx: (Costs, how many times its table was measured)."""
    from ggufspec.llama import measure
    from ggufspec.llama.backend import Context, Model

    calls = []
    real = measure.measure_target

    def counting(ctx, *a, **k):
        calls.append(ctx.n_ctx)
        return real(ctx, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(measure, "measure_target", counting)
        with Model(tiny["target"]) as model, Context(model, n_ctx=n_ctx) as ctx:
            return measure.costs_for(ctx, **kw), len(calls)


def test_a_table_measured_in_a_small_context_is_measured_again_in_a_larger_one(tiny):
    small, n = measured(tiny, n_ctx=20)
    # (n: measured once, or twice where a scheduler hiccup made the tiny model's sub-millisecond step time again at
    # over 3x and a millisecond more: measured again quietly, as it should be)
    assert len(small.target_batch_seconds) == 4 and n in (1, 2)  # -c 20: room for batches of 4
    large, n = measured(tiny, n_ctx=4096)
    assert len(large.target_batch_seconds) == 64 and n in (1, 2)  # not the 4-row table: measured again
    # what rows cost deep in the cache: none measured where the context is too short, at 512 tokens where it is not
    assert small.deep_rows is None and large.deep_rows[0] == 512 and 0 <= large.deep_rows[1] < 100
    again, n = measured(tiny, n_ctx=20)
    assert n == 0 and len(again.target_batch_seconds) == 64  # the larger table serves the smaller context
    assert measured(tiny, n_ctx=4096)[1] == 0


def test_entries_written_by_another_process_while_measuring_are_kept(tiny, monkeypatch):
    """Two `ggufspec costs --refresh` at once: the cache's writers merge under a lock instead of each
    writing back what it read before measuring."""
    from ggufspec.llama import cost_cache, measure

    real = measure.measure_target

    def meanwhile(ctx, *a, **k):
        cost_cache.update_cache({"another model|draft": {"token_seconds": 0.5}})  # another process saves first
        return real(ctx, *a, **k)

    monkeypatch.setattr(measure, "measure_target", meanwhile)
    measured(tiny, refresh=True)
    cache = measure.load_cache()
    assert "another model|draft" in cache and any(k.startswith(str(Path(tiny["target"]).resolve())) for k in cache)


def test_concurrent_refreshes_of_two_models_keep_both(tiny):
    import subprocess
    import sys

    from ggufspec.llama import measure

    procs = {name: subprocess.Popen([sys.executable, "-m", "ggufspec", "costs", "-m", tiny[name], "--refresh"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for name in ("target", "close")}
    errs = {name: p.communicate(timeout=300)[1] for name, p in procs.items()}
    assert [p.returncode for p in procs.values()] == [0, 0], errs
    files = {k.split("|")[0] for k in measure.load_cache()}
    for name, err in errs.items():
        # two measurements at once on two cores may each see the other's load: one whose times stayed erratic says
        # so and is (rightly) not cached; every other one is kept beside the other process's
        assert str(Path(tiny[name]).resolve()) in files or "not cached" in err, (name, err)


def test_writers_at_once_keep_every_entry(tmp_path):
    """The cache's lock and merge, without timing: eight processes each write their own entry at the same moment."""
    import subprocess
    import sys

    env = {**os.environ, "GGUFSPEC_COSTS_FILE": str(tmp_path / "costs.json")}
    code = ("import sys, time; from ggufspec.llama import cost_cache; time.sleep(max(0, float(sys.argv[2]) - time.time()));"
            " cost_cache.update_cache({f'model {sys.argv[1]}|draft': {'token_seconds': 0.5}})")
    start = time.time() + 2
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(start)], env=env) for i in range(8)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 8
    cache = json.loads((tmp_path / "costs.json").read_text())
    assert {f"model {i}|draft" for i in range(8)} <= set(cache)


@pytest.mark.parametrize("stays_erratic", [False, True])
def test_a_table_that_does_not_add_up_is_measured_again_and_never_cached(tiny, monkeypatch, capfd, stays_erratic):
    """A loaded machine: one token timed at 156 ms, two at 0.27 ms. Such a table would make every later
    footer say "a batch of 4 costs 0.00 steps"; it is measured again, and if it stays so, not cached."""
    from ggufspec.llama import measure

    real, tables = measure.measure_target, []

    def busy(ctx, *a, **k):
        measured = real(ctx, *a, **k)
        if stays_erratic or not tables:
            measured["seconds"] = [0.156] + [0.00027] * (len(measured["seconds"]) - 1)
        tables.append(measured["seconds"])
        return measured

    monkeypatch.setattr(measure, "measure_target", busy)
    costs, _ = measured(tiny)
    err = capfd.readouterr().err
    cached = [v for k, v in measure.load_cache().items() if not k.endswith("|draft")]
    if stays_erratic:  # one line, after the last try
        assert len(tables) == 3 and cached == [], err
        assert err.count("the measured decode times do not add up (one token 156.00 ms") == 1, err
        assert "used for this run, not cached" in err
    else:  # a hiccup measured again, quietly
        assert "do not add up" not in err, err
        # the erratic table, then a real one (twice where a hiccup of the scheduler made the first look wrong too)
        assert len(tables) in (2, 3) and cached[0]["target_batch_seconds"] == tables[-1] == costs.target_batch_seconds
        assert measure.sane(costs.target_batch_seconds, costs.target_batch_seconds[0])


def test_sanity_of_a_table():
    from ggufspec.llama.measure import sane

    assert sane([1.0, 1.1, 1.9, 2.0], 1.2) and sane([1.0, 0.9, 1.0], 0.6) and sane([0.1, 0.2], 0.25)
    assert not sane([0.156, 0.00027, 0.0003], 0.0003)  # a batch far cheaper than one token
    assert not sane([1.0, 2.0, 0.9, 4.0], 1.0)  # far cheaper than a smaller batch
    assert not sane([1.0, 2.0], 3.5) and not sane([1.0, 2.0], 0.3)  # the step timed again is another time
    # a tiny model's sub-millisecond steps: jitter of 3x is noise, not a busy machine
    assert sane([0.00005, 0.00002, 0.0001], 0.00016)


def test_doctor_on_an_entry_whose_machine_cpu_is_not_text(tiny):
    from ggufspec.paths import costs_file

    key = f"{tiny['target']}|1|2|t1|ngl0|default|exact@x|b64|machine elsewhere"
    costs_file().parent.mkdir(parents=True, exist_ok=True)
    costs_file().write_text(json.dumps({key: {"target_batch_seconds": [0.01], "exact_batch": 1, "machine": {"cpu": [1]}}}))
    r = run("doctor")
    assert r.exit_code == 0 and "a machine this version cannot name" in r.output, r.output


@pytest.mark.parametrize("content", [b'{"a|machine x": {"target_batch', b"[1, 2]", b"\x00\xff\xfe binary"])
def test_a_cost_cache_that_cannot_be_read_is_named_and_moved_aside_never_overwritten(tiny, content):
    """doctor once said "no known problems" and the next run replaced the file with its own entries alone."""
    from ggufspec.paths import costs_file

    costs_file().parent.mkdir(parents=True, exist_ok=True)
    costs_file().write_bytes(content)
    doctor = run("doctor")
    assert f"the cost cache {costs_file()}" in doctor.output and "none of its measurements can be used" in doctor.output
    r = run("costs", "-m", tiny["target"], "-c", 64)
    assert r.exit_code == 0 and "moved it to" in r.stderr, r.output
    (aside,) = costs_file().parent.glob("costs.json.unreadable-*")
    assert aside.read_bytes() == content and json.loads(costs_file().read_text())  # kept as it was; a new cache beside


def test_a_cost_cache_that_cannot_be_written_is_named(tiny, tmp_path, monkeypatch):
    """Every run then measures again: doctor says so, and so does the run, once."""
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("GGUFSPEC_COSTS_FILE", str(tmp_path / "a-file" / "costs.json"))
    assert "cannot be written (Not a directory)" in run("doctor").output
    r = run("costs", "-m", tiny["target"], "-c", 64)
    assert r.exit_code == 0 and r.stderr.count("cannot write the cost cache") == 1, r.output


def test_a_table_from_a_busier_moment_is_measured_again(tiny, capfd):
    """A table cached while the machine was busy (here: every batch 500 ms, where the tiny target decodes in well
    under a millisecond) would put auto's choices and every footer's figures off by that factor: at load a few
    one-token steps are timed, and a table off by 1.5x or more is measured again, the draft's step too, and cached."""
    from ggufspec.llama import cost_cache, measure

    first, n = measured(tiny)
    assert n == 1
    cache = measure.load_cache()
    (key,) = [k for k in cache if not cost_cache.is_step_key(k)]
    cache[key]["target_batch_seconds"] = [0.5] * len(cache[key]["target_batch_seconds"])
    cost_cache._save_cache(cache)
    capfd.readouterr()
    again, n = measured(tiny)
    assert n == 1 and again.target_batch_seconds[0] < 0.01
    assert "measuring them again" in capfd.readouterr().err
    assert measure.load_cache()[key]["target_batch_seconds"][0] < 0.01
    assert measured(tiny)[1] == 0  # as measured now: used as it is


def pair_costs(tiny):
    """costs_for on the tiny target and its close draft, each load anew: a function of no arguments."""
    from ggufspec.llama import measure
    from ggufspec.llama.backend import Context, Model

    def costs():
        with Model(tiny["target"]) as t, Context(t, n_ctx=128) as tc, Model(tiny["close"]) as d, \
                Context(d, n_ctx=128) as dc:
            return measure.costs_for(tc, dc)
    return costs


def test_a_draft_step_from_a_busier_moment_is_measured_again(tiny, capfd):
    from ggufspec.llama import cost_cache, measure

    def draft_step():
        return pair_costs(tiny)().draft_token_seconds

    assert draft_step() < 0.01
    cache = measure.load_cache()
    (key,) = [k for k in cache if k.endswith("|draft")]
    cache[key]["token_seconds"] = 0.5
    cost_cache._save_cache(cache)
    capfd.readouterr()
    assert draft_step() < 0.01 and "measuring them again" in capfd.readouterr().err
    assert measure.load_cache()[key]["token_seconds"] < 0.01


def test_a_table_from_a_somewhat_slower_moment_is_read_at_todays_speed(tiny, monkeypatch):
    """A cached table whose one-token step is 1.1-1.5x off the step timed at load (a busier or quieter day on the
    same machine) keeps its shape and is read at today's speed, the draft's step and round too, without measuring
    again or rewriting the cache; within 1.1x it is read as it is. (The tiny models decode in well under the timer's
    noise, so the step timed at load is given here.)"""
    from ggufspec.llama import cost_cache, measure

    costs = pair_costs(tiny)
    costs()
    cache = measure.load_cache()
    (key,) = [k for k in cache if not cost_cache.is_step_key(k) and not k.endswith("|draft")]
    (dkey,) = [k for k in cache if k.endswith("|draft")]
    assert cache[dkey]["round_seconds"] >= 0.0  # measured beside the draft's step
    n = len(cache[key]["target_batch_seconds"])
    cache[key]["target_batch_seconds"] = [0.050 * (1 + i / 4) for i in range(n)]
    cache[dkey].update(token_seconds=0.050, round_seconds=0.010)
    cost_cache._save_cache(cache)
    before = measure.load_cache()
    monkeypatch.setattr(measure, "measure_target", lambda *a, **k: pytest.fail("measured again"))
    for now, factor in [(0.065, 1.3), (0.0525, 1.0), (0.040, 0.8)]:
        monkeypatch.setattr(measure, "measure_draft_step", lambda ctx, n=6, repeats=2, now=now: now)
        c = costs()
        assert c.target_batch_seconds[:3] == pytest.approx([0.050 * factor, 0.0625 * factor, 0.075 * factor])
        assert (c.draft_token_seconds, c.draft_round_seconds) == pytest.approx((0.050 * factor, 0.010 * factor))
        assert measure.load_cache() == before
    # an entry without the round's cost, 1.3x off: the round is timed at today's speed (against today's step) and
    # cached at the speed of the step it sits beside
    del before[dkey]["round_seconds"]
    cost_cache._save_cache(before)
    monkeypatch.setattr(measure, "measure_draft_step", lambda ctx, n=6, repeats=2: 0.065)
    monkeypatch.setattr(measure, "measure_draft_round", lambda ctx, target, step: 0.2 * step)
    assert costs().draft_round_seconds == pytest.approx(0.013)
    assert measure.load_cache()[dkey]["round_seconds"] == pytest.approx(0.010)


@pytest.mark.parametrize("damage", ["missing", float("nan"), True, -1.0])
def test_a_draft_entry_without_its_rounds_cost_gets_it_and_keeps_its_step(tiny, damage):
    """A draft entry cached before rounds were timed (no round_seconds), or with one that is no time, keeps its step
    and gains the round's cost."""
    from ggufspec.llama import cost_cache, measure

    costs = pair_costs(tiny)
    costs()
    cache = measure.load_cache()
    (dkey,) = [k for k in cache if k.endswith("|draft")]
    step = cache[dkey]["token_seconds"]
    if damage == "missing":
        del cache[dkey]["round_seconds"]
    else:
        cache[dkey]["round_seconds"] = damage
    cost_cache._save_cache(cache)
    assert costs().draft_token_seconds == step
    assert measure.load_cache()[dkey]["round_seconds"] >= 0.0 and measure.load_cache()[dkey]["token_seconds"] == step


def test_other_processes_busy_on_the_cpus_are_seen():
    """busy_elsewhere counts the CPU time of every other process (a busy loop: about one CPU), not this one's."""
    import subprocess
    import sys

    from conftest import REAL_BUSY_ELSEWHERE as busy_elsewhere
    from ggufspec.llama.system import shared_cores_advice

    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert busy_elsewhere(0.5) >= 0.7
    finally:
        spin.kill()
        spin.wait()
    assert "-t 1 would fit the CPUs left" in shared_cores_advice(2, 1.0, n_cpus=2)
    assert shared_cores_advice(1, 1.0, n_cpus=2) is None and shared_cores_advice(2, 0.2, n_cpus=2) is None
    assert "-t 6 would fit" in shared_cores_advice(8, 2.0, n_cpus=8)


def test_shared_cpus_are_said_once_and_not_measured_again_and_again(tiny, monkeypatch, capfd):
    """Where the CPUs are shared the decode times are erratic whatever is measured: one line names the -t that
    fits, the table is measured once (not three times), used uncached, and not measured again by the next Engine
    of this process; doctor shows the load."""
    from ggufspec import Engine
    from ggufspec.llama import measure

    from ggufspec.llama import system

    monkeypatch.setattr(system, "busy_elsewhere", lambda seconds=0.5: float(os.cpu_count()))
    monkeypatch.setattr(measure, "sane", lambda seconds, again: False)
    monkeypatch.setattr(system, "_SAID_SHARED", [])
    monkeypatch.setattr(measure, "_UNCACHED", {})
    calls = []
    real = measure.measure_target
    monkeypatch.setattr(measure, "measure_target", lambda ctx, *a, **k: calls.append(1) or real(ctx, *a, **k))
    for _ in range(2):
        with Engine(tiny["target"], n_ctx=256, n_threads=2) as e:
            assert e.generate("hi", max_tokens=4, mode="auto").stats.n_generated == 4
    err = capfd.readouterr().err
    assert len(calls) == 1, err
    assert err.count("the CPUs are shared") == 1 and "-t 1 would fit" in err, err
    assert "used for this run, not cached" in err
    doctor = run("doctor")
    assert "other processes keep" in doctor.output and "the CPUs are shared" in doctor.output


def test_the_drift_of_inexact_batches_is_measured_cached_and_sets_the_tie_margin(tiny):
    """The tiny F32 target's batches are not bit-exact on CPU: how far they move a pick's gap is measured with the
    table, cached with it, and raises greedy verification's tie margin where TIE_SAFETY times it is larger."""
    from ggufspec.llama import measure
    from ggufspec.verification import DEFAULT_TIE_MARGIN, TIE_SAFETY, Verification, margin_for

    costs, _ = measured(tiny, n_ctx=4096)
    entry = next(v for k, v in measure.load_cache().items() if not k.endswith("|draft"))
    assert costs.drift is not None and entry["drift"] == costs.drift
    assert costs.exact_batch < 16 and 0 < costs.drift < 1  # float rounding: small, not nothing
    assert Verification.of(costs).tie_margin == margin_for(costs) == max(DEFAULT_TIE_MARGIN, TIE_SAFETY * costs.drift)


def clocked(monkeypatch, measure, cost):
    """A context whose decodes take cost(call number from 1, tokens) seconds on measure's clock; (it, [calls])."""
    clock, calls = [0.0], [0]

    class Ctx:
        def truncate(self, n):
            pass

        def decode(self, tokens, logits="last"):
            calls[0] += 1
            clock[0] += cost(calls[0], len(tokens))

    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    return Ctx(), calls


def test_batch_times_are_read_against_a_step_beside_them_not_each_sizes_luckiest_moment(monkeypatch):
    """A VM's speed moves: here the machine runs 30% slower for the second half of the timing, and one decode of
    3 rows catches a moment at 0.6x its time. Each size's fastest time (the old rule) set that batch at 0.6 of what
    it costs (auto then drafts for a batch that cheap); the paired median reads the true shape through both."""
    from ggufspec.llama import measure

    true = {b: 1.0 + 0.3 * (b - 1) for b in (1, 2, 3, 4, 16, 64)}  # steps per batch of b

    def cost(call, n):
        slow = 1.3 if call > 18 else 1.0  # from the middle of the second repeat on (of 33 decodes: 11 a repeat)
        lucky = 0.6 if (n, call) == (3, 5) else 1.0  # the first repeat's batch of 3
        return 0.1 * true[n] * slow * lucky

    ctx, calls = clocked(monkeypatch, measure, cost)
    seconds = measure.paired_batches(ctx, 0, list(range(64)), sorted(true), repeats=3)
    ratios = {b: seconds[b] / seconds[1] for b in true}
    assert all(abs(ratios[b] / true[b] - 1) < 0.01 for b in true), ratios
    assert calls[0] == 3 * (2 * len(true) - 1)  # each batch beside its own step; the step itself once a size


def test_a_tiny_models_sub_millisecond_batches_are_timed_more_and_each_sizes_fastest_kept(monkeypatch):
    """Where a step takes a fraction of a millisecond, a hiccup of the scheduler lasts as long as a batch: here the
    step beside the batch of 64 catches one in two of the first three repeats, so its paired ratio reads 64 rows
    cheaper than 16 (measure.sane refuses such a table). A quick model is timed QUICK_REPEATS times and each size's
    fastest kept: the true shape."""
    from ggufspec.llama import measure

    true = {b: 1.0 + 0.3 * (b - 1) for b in (1, 2, 3, 4, 16, 64)}

    def cost(call, n):
        return 2e-4 * true[n] + (2e-3 if call in (10, 21) else 0.0)  # the step before the 64, repeats 1 and 2

    ctx, calls = clocked(monkeypatch, measure, cost)
    seconds = measure.paired_batches(ctx, 0, list(range(64)), sorted(true), repeats=3)
    ratios = {b: seconds[b] / seconds[1] for b in true}
    assert all(abs(ratios[b] / true[b] - 1) < 0.01 for b in true), ratios
    assert calls[0] == measure.QUICK_REPEATS * (2 * len(true) - 1)


@pytest.mark.slow
def test_weight_repacking_is_chosen_from_timings_both_ways_once_then_read_from_the_cache(monkeypatch, tiny):
    """llama.cpp repacks a Q4_K_M model's weights on x86 (CPU_REPACK); whether to keep that is timed once, repacked
    before and after the load without (its faster timings count: a VM's slow spell during one load once turned off a
    repacking 20% faster), cached, and read back without timing again; a model whose weights llama.cpp repacks none
    of is not timed."""
    from conftest import real_model
    from ggufspec.llama import repack
    from ggufspec.llama.cost_cache import bad_entries, load_cache, update_cache

    gemma = real_model("gemma-3-270m-q4_k_m.gguf")
    with repack.load(gemma, repack=True, measure=False, n_threads=None, role="target") as model:
        if "CPU_REPACK" not in model.buffers:
            pytest.skip("this llama.cpp build repacks none of this model's weights here")
    timed, loads = repack.timed, []
    monkeypatch.setattr(repack, "timed", lambda model, *a, **k: loads.append(model.repacks) or timed(model, *a, **k))
    with repack.load(gemma, repack=None, measure=True, n_threads=None, role="target") as model:
        (key, entry), = [(k, v) for k, v in load_cache().items() if k.startswith(f"{gemma.resolve()}|")
                         and k.endswith("|repack")]
        assert loads == [True, False, True]
        first, again = entry["on_timings"]
        assert entry["on"] == {k: min(first[k], again[k]) for k in ("step", "batch")}
        assert model.repacks == entry["repack"] == repack.prefers_repack(entry["on"], entry["off"])
        assert ("CPU_REPACK" in model.buffers) == model.repacks
        assert model.devices_key.endswith(",no-repack") != model.repacks  # a cost table of its own
        assert not bad_entries(load_cache())
    monkeypatch.setattr(repack, "timed", lambda *a, **k: pytest.fail("timed again"))
    with repack.load(gemma, repack=None, measure=True, n_threads=None, role="target") as again:
        assert again.repacks == entry["repack"]
    update_cache({key: dict(entry, repack=not entry["repack"])})  # a choice cached under an earlier rule
    with repack.load(gemma, repack=None, measure=True, n_threads=None, role="target") as again:
        assert again.repacks == entry["repack"] == load_cache()[key]["repack"]  # made again, and the entry says so
    with repack.load(tiny["target"], repack=None, measure=True, n_threads=None, role="target") as f32:
        assert f32.repacks and "CPU_REPACK" not in f32.buffers  # nothing of it repacked: loaded as it is, not timed
    with repack.load(gemma, repack=not entry["repack"], measure=True, n_threads=None, role="target") as asked:
        assert asked.repacks != entry["repack"]  # --repack / --no-repack as asked, whatever was measured


def test_repacking_stays_unless_without_it_a_step_is_level_and_a_batch_no_slower():
    from ggufspec.llama.repack import prefers_repack

    on = {"step": 0.030, "batch": 0.70}
    assert not prefers_repack(on, {"step": 0.0303, "batch": 0.45})  # level (within 2%), batches faster
    assert prefers_repack(on, {"step": 0.031, "batch": 0.45})  # Gemma 270M on Zen 5: a step 3% slower, now kept
    assert prefers_repack(on, {"step": 0.040, "batch": 0.45})  # Qwen 1.5B Q4_K_M on Zen 5: a step 30% slower
    assert prefers_repack(on, {"step": 0.030, "batch": 0.80})
    # Qwen 1.5B Q4_K_M on Emerald Rapids: a step 4% slower at load (7% as it generated), batches faster: kept
    assert prefers_repack({"step": 0.0620, "batch": 0.78}, {"step": 0.0646, "batch": 0.61})
