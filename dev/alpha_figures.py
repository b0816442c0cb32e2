"""dev/gpu_figures.py's step `alpha`: speed at chosen acceptance rates (issue 62, item 4).

A Llama-3.1-8B-shaped chained Q4_K target and, per α in ALPHAS, a Llama-3.2-1B-shaped draft of the same chain that
follows it on a share α of tokens (tests/shaped.py's Chain): drafts accepted at α per token, at real models' cost.
Both wholly on the device where the run has one (-ngl/-ngld all), on the CPU otherwise. Per α, one process of
ggufspec's Python API (an abort kills it, not the run) times the target alone, `--mode draft` at draft-max 4 and
auto (median of 3, greedy), counts α̂ and the near-ties it decoded again, and puts the measured costs (`ggufspec
costs`' table: a step, the verify batch, the draft's step) through Costs.speedup at that α̂: the forecast the issue
wants within 10 % of the measured speed-up. Then llama.cpp's speculative-simple on the same files, placement,
threads and draft-max (draft-simple), with α̂ from its n_drafted / n_accept as tests/test_chosen_alpha.py derives it.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

ALPHAS = (0.5, 0.7, 0.9)
CHAIN_SEED = 3
DRAFT_MAX = 4
N_CTX = 1024
# --small: the draft narrower and shallower than gpu_figures' small target, as a 1B is beside an 8B
SMALL_DRAFT = dict(n_layer=1, n_embd=256, n_ff=512, n_head=4, n_head_kv=2)

MEASURE = r"""
import json, statistics, sys
from ggufspec import Engine
from ggufspec.core import Stats
target, draft, prompt = sys.argv[1:4]
n, ngl, threads, draft_max, refresh, repeats, n_ctx = map(int, sys.argv[4:11])
out = {}
with Engine(target, draft, n_ctx=n_ctx, n_threads=threads or None, n_gpu_layers=ngl, draft_n_gpu_layers=ngl,
            remeasure=bool(refresh)) as e:
    costs, limit = e.costs, e.verification().batch_limit()
    out["threads"] = e.target_ctx.n_threads
    out["placement"] = {k: sorted(v) for k, v in e.weights().items()}
    out["costs"] = {"step": costs.batch_seconds(1), "verify": costs.verify_seconds(draft_max + 1, limit),
                    "draft_step": costs.draft_token_seconds, "verify_batch": limit}
    tokens, reference = e.tokenize_prompt(prompt), None
    for mode, k in (("target", None), ("draft", draft_max), ("auto", None)):
        kw = dict(mode=mode, ignore_eos=True, temperature=0, **({"draft_max": k} if k else {}))
        e.generate(prompt_tokens=tokens, max_tokens=16, **kw)  # warm-up
        runs = [e.generate(prompt_tokens=tokens, max_tokens=n, **kw) for _ in range(repeats)]
        s = Stats.merge([r.stats for r in runs])
        reference = reference or runs[0].tokens
        # every drafted token decided is a draw; greedy repeats draw the same ones again (draws: per generation)
        draws = s.n_accepted + sum(s.accepted_histogram) - s.full_accepts
        row = out[mode] = {"tokens_per_second": statistics.median(r.stats.tokens_per_second for r in runs),
                           "n_drafted": s.n_drafted, "n_accepted": s.n_accepted, "draws": draws / repeats,
                           "alpha": s.n_accepted / draws if draws else None,
                           "ties": s.ties_settled / (s.n_accepted + s.rounds) if s.rounds else None,
                           "same_text": all(r.tokens == reference for r in runs)}
        if mode == "draft" and draws and costs.draft_token_seconds:
            row["forecast"] = costs.speedup(row["alpha"], k, costs.draft_token_seconds, limit)
            if s.ties_settled:  # the same, its near-ties decoded again at the share it met (Costs.tie_seconds)
                row["forecast_ties"] = costs.corrected(1.0, row["ties"]).speedup(row["alpha"], k,
                                                                                 costs.draft_token_seconds, limit)
print(json.dumps(out))
"""
HEADER = ("| α | target tok/s | draft-max 4 tok/s | α̂ | near-ties | auto tok/s | speculative-simple tok/s | "
          "n_drafted / n_accept | its α̂ | ggufspec / llama.cpp | speed-up | forecast | forecast / speed-up |")


def speculative_simple(run, target: Path, draft: Path, prompt: str, n: int, threads: int, name: str) -> dict | None:
    """llama.cpp's speculative-simple (draft-simple, greedy) on the run's placement: tok/s, n_drafted, n_accept and
    α̂; None where it failed. Its log thread can lose the last lines at exit: run again, up to 3 times."""
    from shaped import alpha_from_rounds
    layers = "all" if run.gpu else "0"
    cmd = [str(run.bin / "llama-speculative-simple"), "-m", str(target), "-md", str(draft), "--spec-type",
           "draft-simple", "--spec-draft-n-max", str(DRAFT_MAX), "-p", prompt, "-n", str(n), "-t", str(threads),
           "--temp", "0", "-c", str(N_CTX), "--ignore-eos", "--no-escape", "-ngl", layers, "-ngld", layers]
    for attempt in range(3):
        r = run.sh(cmd, 120, f"{name}-{attempt}")
        if r is None or r.returncode != 0:
            return None
        text = r.stdout + r.stderr
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
        drafted, accepted = (re.search(rf"{key}\s*=\s*(\d+)", text) for key in ("n_drafted", "n_accept"))
        if decoded and drafted and accepted:
            n_generated, n_accepted = int(decoded.group(1)), int(accepted.group(1))
            rounds = n_generated - n_accepted  # a round writes its accepted drafts and one of the target's
            alpha = alpha_from_rounds(n_accepted / rounds, DRAFT_MAX) if rounds else None
            seconds = float(decoded.group(2))
            return {"tokens_per_second": n_generated / seconds if seconds else None, "n_drafted": int(drafted.group(1)),
                    "n_accepted": n_accepted, "alpha": alpha}
    run.say(f"- {name}: printed no counts in 3 runs")
    return None


def write_pair(run, work: Path, small: dict) -> tuple[Path, dict[float, Path]]:
    """The chained target and a draft per α (written once per work folder and size)."""
    from shaped import Chain
    from sized import write_sized  # zero blocks left unwritten: a chained model computes nothing else, in no time

    size = "-small" if small else ""
    target = work / f"target-8b-chained{size}.gguf"
    drafts = {alpha: work / f"draft-1b-chained{size}-{alpha}.gguf" for alpha in ALPHAS}
    draft_small = {**small, **SMALL_DRAFT} if small else {}
    start = time.monotonic()
    if not target.exists():
        write_sized(target, "llama-3.1-8b", "Q4_K_M", seed=0, chain=Chain(CHAIN_SEED), **small)
    for alpha, path in drafts.items():
        if not path.exists():
            write_sized(path, "llama-3.2-1b", "Q4_K_M", seed=1, chain=Chain(CHAIN_SEED, alpha=alpha), **draft_small)
    run.say(f"- the chained 8B-shaped target and 1B-shaped drafts ready in {time.monotonic() - start:.0f} s")
    return target, drafts


def speed_at_alpha(run, work: Path, small: dict, n: int, prompt: str, threads: int = 0, repeats: int = 3) -> None:
    """The step: per α a row as soon as it exists (run.say saves it), and the 4-column table's row.
    threads: 0 for ggufspec's default (llama.cpp then gets the same count)."""
    where = "all layers on the GPU" if run.gpu else "the CPU"
    run.say(f"\n## Speed at α {', '.join(map(str, ALPHAS))}: chained 8B-shaped Q4_K target, 1B-shaped draft, {where}, "
            f"{n} tokens, greedy (ggufspec: median of {repeats})")
    if run.left() < 60:  # writing the models alone takes a while at full size
        run.say(f"- skipped, {run.left():.0f} s of the budget left")
        return
    target, drafts = write_pair(run, work, small)
    shown = False
    for i, (alpha, draft) in enumerate(drafts.items()):
        args = [str(target), str(draft), prompt, str(n), "-1" if run.gpu else "0", str(threads), str(DRAFT_MAX),
                "1" if i == 0 else "0", str(repeats), str(N_CTX)]  # the costs measured afresh once, then cached
        r = run.sh([sys.executable, "-c", MEASURE, *args], 240, f"alpha-{alpha}-ggufspec")
        if r is None or r.returncode != 0:
            continue
        ours = json.loads(r.stdout.strip().splitlines()[-1])
        if not shown:
            c = ours["costs"]
            batches = f"in batches of at most {c['verify_batch']}" if c["verify_batch"] else "in one batch"
            run.say(f"- weights on {ours['placement']}, {ours['threads']} threads; costs: a step "
                    f"{c['step'] * 1e3:.2f} ms, verifying {DRAFT_MAX + 1} rows {c['verify'] * 1e3:.2f} ms ({batches}), "
                    f"a draft step {fmt(c['draft_step'] and c['draft_step'] * 1e3, '.2f', ' ms')}\n\n{HEADER}\n"
                    + "| ---: " * (HEADER.count("|") - 1) + "|")
            shown = True
        theirs = speculative_simple(run, target, draft, prompt, n, ours["threads"], f"alpha-{alpha}-llama.cpp")
        run.say(row(alpha, ours, theirs))
        spec = ours["draft"]
        alphas = f"{fmt(spec['alpha'], '.3f')} / {fmt(theirs and theirs['alpha'], '.3f')}"
        run.table.append((f"α {alpha}: draft-max 4, α̂ {alphas} / speculative-simple",
                          fmt(spec["tokens_per_second"], ".1f", " tok/s"),
                          fmt(theirs and theirs["tokens_per_second"], ".1f", " tok/s"),
                          fmt(over(spec, theirs), ".2f", "x")))
        run.save()


def fmt(x, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def over(a: dict | None, b: dict | None) -> float | None:
    """a's tok/s over b's (None where either is missing)."""
    x, y = (r and r["tokens_per_second"] for r in (a, b))
    return x / y if x and y else None


def row(alpha: float, ours: dict, theirs: dict | None) -> str:
    """One α's line of the step's table."""
    tgt, spec, auto = ours["target"], ours["draft"], ours["auto"]
    speedup = over(spec, tgt)
    forecast, with_ties = spec.get("forecast"), spec.get("forecast_ties")
    differs = "" if spec["same_text"] and auto["same_text"] else " (TEXT DIFFERS)"
    cells = [str(alpha), fmt(tgt["tokens_per_second"], ".1f"), fmt(spec["tokens_per_second"], ".1f") + differs,
             f"{fmt(spec['alpha'], '.3f')} ({spec['draws']:.0f} draws)", fmt(spec["ties"], ".1%"),
             f"{fmt(auto['tokens_per_second'], '.1f')} (α̂ {fmt(auto['alpha'], '.3f')})",
             fmt(theirs and theirs["tokens_per_second"], ".1f"),
             f"{theirs['n_drafted']} / {theirs['n_accepted']}" if theirs else "-",
             fmt(theirs and theirs["alpha"], ".3f"),
             fmt(over(spec, theirs), ".2f", "x"),
             fmt(speedup, ".2f", "x"),
             fmt(forecast, ".2f", "x") + (f" ({with_ties:.2f}x with its near-ties)" if with_ties else ""),
             fmt(forecast and speedup and forecast / speedup, ".2f")]
    return "| " + " | ".join(cells) + " |"
