#!/usr/bin/env python
"""The offload planner, `tune` and greedy verification's margin against a real GPU, in one run of minutes.

A sibling of dev/gpu_figures.py (same bundle, same Run: each step inside a time budget, its rows saved as soon as
they exist). The models are tests/sized.py's: real sizes and quantization mixes, every matrix zero blocks left
unwritten (sparse files: a 70B is written in seconds and takes no disk), so what they allocate and how fast they
decode is a real model's of that shape; chained pairs (tests/shaped.py's Chain) give a chosen acceptance rate.

A budget below the card's memory is emulated by holding the rest: a helper process (PyTorch, plain cudaMalloc)
takes all but the budget, so llama.cpp, ggufspec and llama-fit-params see that much free, and a placement that
does not fit fails to load as it would on the smaller card.

Steps:
- plan: for each case (the seed's 70B Q3_K_S + 8B under 24 GiB, a Qwen3-30B-A3B-shaped mixture of experts + 0.6B
  under 16 GiB, a 32B Q4_K_M + 1B under 12 GiB), `ggufspec plan`'s device bytes per model against what CUDA0
  then lost to a ggufspec load at the plan's flags and a generation (free memory before and after, as llama.cpp
  reads it) and against llama.cpp's own log (model, KV, compute buffers), with llama-fit-params's estimate for the
  same flags (-fitp) and its own fit (-fitt) beside;
- drift: dev/measure_batch_drift.py on a Llama-3.1-8B-shaped Q4_K model with random weights, all on the GPU, at
  several cached lengths: how far batched logits move from one-token decoding there (the tie margin's ground);
- sampler: llama.cpp's backend greedy sampler (llama_set_sampler's way, at context creation) against reading the
  logits row, one token at a time, on the stand-in (Qwen2.5's 151,936-token vocabulary) and the 8B;
- alpha: dev/alpha_figures.py's speed at α 0.5, 0.7, 0.9 (a chained 8B-shaped target, 1B-shaped drafts, all on
  the GPU) beside llama.cpp's speculative-simple, and `ggufspec costs`' forecast beside each measured speed-up;
- tune: the mixture of experts (or, with --tune-case 0, the seed's case) at α 0.7: `ggufspec tune` beside a sweep of the placements around its plan (target -ngl,
  -ngld all / half / none; draft-max 2, 4, 8; target, draft and auto), and llama.cpp's programs at tune's choice.

    python3 dev/gpu_offload.py run --bundle .devcarry --out $OUT        # there (device run, carry .devcarry)
    python dev/gpu_offload.py run --bin ~/.cache/llama-cpp-reference/0.3.36/build/bin --small   # a try here
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "tests")]
from gpu_figures import QWEN_VOCAB, ROOT, Run, gpu_named, prepare  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
# (name, target (shape, quant, chain alpha or None), draft (shape, quant, alpha, overrides), budget GiB, -c)
CASES = (
    ("seed: 70B Q3_K_S + 8B", ("llama-3-70b", "Q3_K_S", 1.0), ("llama-3.1-8b", "Q4_K_M", 0.7, {}), 24, 8192),
    ("MoE: 30B-A3B Q4_K_M + 0.6B", ("qwen3-30b-a3b", "Q4_K_M", 1.0), ("qwen3-0.6b", "Q4_K_M", 0.7, {}), 16, 8192),
    ("32B Q4_K_M + 1B", ("qwen2.5-32b", "Q4_K_M", None), ("llama-3.2-1b", "Q4_K_M", None, {"n_vocab": 152064}), 12,
     8192),
)
SMALL = dict(n_layer=4, n_embd=256, n_ff=512, n_vocab=2048, n_head=4, n_head_kv=2)
SMALL_MOE = dict(n_layer=4, n_embd=256, n_vocab=2048, n_ff_exp=256, n_expert=8, n_expert_used=2)

BLOCKER = r"""
import sys, torch
held = None
for line in sys.stdin:
    held = None
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    keep = int(line)
    if free > keep:
        held = torch.empty(free - keep, dtype=torch.uint8, device="cuda")
    print(torch.cuda.mem_get_info()[0], flush=True)
"""

LOAD = r"""
import json, sys, time
from ggufspec import Engine
from ggufspec.llama.devices import local_gpus
target, draft, n_ctx, ngl, ngld, moe = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
free = lambda: sum(local_gpus().values())
PROMPT = " ".join(f"w{i}" for i in range(100))
out = {"free_before": free()}
t = time.monotonic()
try:
    e = Engine(target, draft, n_ctx=n_ctx, n_gpu_layers=ngl, draft_n_gpu_layers=ngld, cpu_moe=moe, measure=False)
except Exception as x:
    out["error"] = str(x).splitlines()[0]
    print(json.dumps(out)); sys.exit(0)
out["load_s"] = time.monotonic() - t
out["free_loaded"] = free()
with e:
    for mode in ("target", "draft"):
        g = e.generate(PROMPT, max_tokens=24, mode=mode, draft_max=4, ignore_eos=True)  # a prompt batch of ~100
        out[mode + "_tok_s"] = g.stats.tokens_per_second
    out["free_after"] = free()
    out["buffers"] = {"target": {"model": e.target_model.buffers, **e.target_ctx.buffers},
                      "draft": {"model": e.draft_model.buffers, **e.draft_ctx.buffers}}
print(json.dumps(out))
"""


class Blocker:
    """A process holding all of the card's memory but `keep` bytes (PyTorch, plain cudaMalloc); None without one."""

    def __init__(self, run: Run):
        self.proc = subprocess.Popen([sys.executable, "-c", BLOCKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=run.env)

    def keep(self, n_bytes: int) -> int:
        self.proc.stdin.write(f"{n_bytes}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def mib(n: float) -> str:
    return f"{n / MiB:,.0f}"


def write_case(work: Path, case, small: bool) -> tuple[Path, Path]:
    from shaped import Chain
    from sized import SIZED_SHAPES, write_sized

    _, (t_shape, t_quant, t_alpha), (d_shape, d_quant, d_alpha, d_over), _, _ = case
    size = (SMALL_MOE if "n_expert" in SIZED_SHAPES[t_shape] else SMALL) if small else {}
    dsize = ({**SMALL, "n_layer": 2} if d_shape != "qwen3-0.6b" else
             {"n_layer": 2, "n_vocab": 2048}) if small else {}
    target = write_sized(work / f"{t_shape}.gguf", t_shape, t_quant, chain=t_alpha and Chain(seed=1, alpha=t_alpha),
                         **size)
    draft = write_sized(work / f"{d_shape}.gguf", d_shape, d_quant, chain=d_alpha and Chain(seed=1, alpha=d_alpha),
                        seed=2, **{**d_over, **dsize})
    return target, draft


def plan_step(run: Run, work: Path, small: bool, blocker: Blocker | None, keep: int) -> dict:
    """Each case's plan against what llama.cpp allocated; returns case `keep`'s files and plan (for `tune`)."""
    run.say("\n## The plan against what CUDA allocated (-c 8192, f16 KV)")
    run.say("| case | budget | flags | planned (target + draft) | lost to the load | after 48 tokens | in budget, "
            "left | llama.cpp's buffers on the device | fit-params for these flags | fit-params's own fit |")
    run.say("| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- |")
    seed = {}
    for i, case in enumerate(CASES):
        name, _, _, budget_gib, n_ctx = case
        t = time.monotonic()
        target, draft = write_case(work, case, small)
        wrote = time.monotonic() - t
        budget = (64 * MiB if small else budget_gib * GiB)
        free = blocker.keep(budget + 512 * MiB) if blocker else None  # a new process's own CUDA context: ~0.5 GiB
        vram = [] if blocker else ["--vram", str(budget)]
        r = run.ggufspec("plan", "-m", str(target), "-md", str(draft), "-c", str(n_ctx), *vram, "--json", cap=60,
                         name=f"plan-{i}")
        if r is None or r.returncode != 0:
            continue
        p = json.loads(r.stdout)
        tp, dp = p["models"]
        moe = tp.get("cpu_moe", 0)
        r = run.sh([sys.executable, "-c", LOAD, str(target), str(draft), str(n_ctx), str(tp["n_gpu_layers"]),
                    str(dp["n_gpu_layers"]), str(moe)], 240, f"load-{i}")
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r is not None and r.returncode == 0 else {}
        fit_flags = ["-ngl", str(tp["n_gpu_layers"]), "-c", str(n_ctx)] + (["-ncmoe", str(moe)] if moe else [])
        estimate = run.sh([str(run.bin / "llama-fit-params"), "-m", str(target), *fit_flags, "-fitp", "on"], 60,
                          f"fitp-{i}")
        own = run.sh([str(run.bin / "llama-fit-params"), "-m", str(target), "-c", str(n_ctx)], 60, f"fit-{i}")
        lost = got.get("free_before", 0) - got.get("free_after", got.get("free_before", 0))
        device = {role: {k: round(sum(v for b, v in bufs.items() if b.startswith(("CUDA", "Vulkan"))))
                         for k, bufs in kinds.items()} for role, kinds in got.get("buffers", {}).items()}
        loaded = mib(got["free_before"] - got["free_loaded"]) if "free_loaded" in got else got.get("error", "-")
        left = f"{(p['vram_bytes'] - lost) / p['vram_bytes']:.1%}" if lost else "-"
        run.say(f"| {name} | {mib(p['vram_bytes'])} MiB | `{p['flags']}` | {mib(tp['gpu_bytes'])} + "
                f"{mib(dp['gpu_bytes'])} = {mib(p['gpu_bytes'])} | {loaded} | {mib(lost) if lost else '-'} | {left} | "
                f"{json.dumps(device)} | {_last(estimate)} | {_last(own)} |")
        run.say(f"- {name}: wrote the files in {wrote:.0f} s, loaded in {got.get('load_s', 0):.0f} s; target "
                f"{got.get('target_tok_s', 0):.1f} tok/s, draft-max 4 {got.get('draft_tok_s', 0):.1f} tok/s"
                + (f"; free memory held at {mib(free)} MiB" if free else ""))
        if i == keep:
            seed = {"name": name, "target": target, "draft": draft, "plan": p, "n_ctx": n_ctx, "budget": budget}
        else:
            target.unlink()
            draft.unlink()
    return seed


def _last(r) -> str:
    if r is None:
        return "-"
    lines = [x for x in (r.stdout or "").strip().splitlines() if x.strip()]
    return ("`" + " / ".join(lines[-3:]) + "`") if r.returncode == 0 and lines else f"exit {r.returncode}"


def drift_step(run: Run, work: Path, small: bool) -> None:
    from shaped import write_shaped

    model = work / "drift-8b.gguf"
    if not model.exists():
        write_shaped(model, "llama-3.1-8b", **({"n_layer": 2, "n_embd": 512, "n_ff": 1024, "n_vocab": 8192,
                                                  "n_head": 8, "n_head_kv": 2} if small else {}))
    run.say("\n## Batched logits against one-token decoding (dev/measure_batch_drift.py, 8B-shaped Q4_K)")
    for cached in (0, 300, 1000):
        r = run.sh([sys.executable, str(ROOT / "dev" / "measure_batch_drift.py"), str(model), "-n", "48", "--ngl",
                    "-1" if run.gpu else "0", "--cached", str(cached)], 90, f"drift-{cached}")
        if r is not None and r.returncode == 0:
            run.say("```\n" + r.stdout.strip() + "\n```")
    r = run.ggufspec("costs", "-m", str(model), "--refresh", *(["-ngl", "all"] if run.gpu else []), cap=90,
                     name="costs-8b")
    if r is not None and r.returncode == 0:
        run.say("```\n" + r.stdout.strip() + "\n```")


MARGIN = r"""
import json, sys
from ggufspec import Engine
model, ngl, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
with Engine(model, model, n_ctx=2048, n_gpu_layers=ngl, draft_n_gpu_layers=ngl) as e:
    prompts = ("def fib(n):", "The quick brown fox")
    alone = [e.generate(p, max_tokens=n, mode="target", ignore_eos=True).tokens for p in prompts]
    for margin in (None, 0.5, 0.2, 0.05, 0.0):  # None: the margin ggufspec measures here
        for dm in (4, 8):
            rows = ties = same = 0
            speeds = []
            for p, want in zip(prompts, alone):
                g = e.generate(p, max_tokens=n, mode="draft", draft_max=dm, ignore_eos=True, tie_margin=margin)
                rows += g.stats.n_drafted + g.stats.rounds
                ties += g.stats.ties_settled
                same += g.tokens == want
                speeds.append(g.stats.tokens_per_second)
            out.append({"margin": margin if margin is not None else f"measured {e.verification().tie_margin:.3g}", "draft_max": dm, "rows": rows, "re-decoded": ties, "same texts": same,
                        "tok/s": [round(x, 1) for x in speeds]})
    t = [round(e.generate(p, max_tokens=n, mode="target", ignore_eos=True).stats.tokens_per_second, 1) for p in prompts]
print(json.dumps({"target alone tok/s": t, "rows": out}))
"""


def margin_step(run: Run, work: Path, small: bool) -> None:
    """The model drafting for itself at several tie margins: rows re-decoded, speed, and whether every text stays
    the target's (what the greedy guarantee costs on this device, and how small a margin keeps it)."""
    model = work / "drift-8b.gguf"
    r = run.sh([sys.executable, "-c", MARGIN, str(model), "-1" if run.gpu else "0", "32" if small else "128"], 150,
               "margin")
    if r is None or r.returncode != 0:
        return
    got = json.loads(r.stdout.strip().splitlines()[-1])
    run.say(f"\n## The 8B drafting for itself at several tie margins (target alone {got['target alone tok/s']} tok/s)")
    run.say("| margin | draft-max | rows verified | re-decoded | texts = target alone | tok/s |\n"
            "| ---: | ---: | ---: | ---: | ---: | --- |")
    for x in got["rows"]:
        run.say(f"| {x['margin']} | {x['draft_max']} | {x['rows']} | {x['re-decoded']} ({x['re-decoded'] / max(x['rows'], 1):.0%}) | "
                f"{x['same texts']}/2 | {x['tok/s']} |")


SAMPLER = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp.llama_cpp as C
path, ngl, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
C.llama_backend_init()
mp = C.llama_model_default_params()
mp.n_gpu_layers = ngl
model = C.llama_model_load_from_file(path.encode(), mp)
n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
out = {}
for backend in (False, True, False, True):
    cp = C.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.no_perf = 1024, 512, True
    if backend:
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_greedy())
        seqs = (C.llama_sampler_seq_config * 1)()
        seqs[0].seq_id, seqs[0].sampler = 0, ctypes.cast(chain, ctypes.c_void_p).value
        cp.samplers, cp.n_samplers = seqs, 1
    ctx = C.llama_init_from_model(model, cp)
    batch = C.llama_batch_init(1, 0, 1)
    token, tokens = 1, []
    for i in range(n + 4):
        if i == 4:
            start = time.perf_counter()
        batch.n_tokens, batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = 1, token, i, 1, 1
        batch.seq_id[0][0] = 0
        assert C.llama_decode(ctx, batch) == 0
        if backend:
            token = C.llama_get_sampled_token_ith(ctx, 0)
        else:
            token = int(np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, 0), shape=(n_vocab,)).argmax())
        tokens.append(token)
    key = "backend sampler" if backend else "logits row + numpy argmax"
    out.setdefault(key, []).append(round(n / (time.perf_counter() - start), 1))
    out.setdefault(key + " tokens", tokens)
    C.llama_batch_free(batch)
    C.llama_free(ctx)
same = out["backend sampler tokens"] == out["logits row + numpy argmax tokens"]
print(json.dumps({k: v for k, v in out.items() if not k.endswith("tokens")} | {"same tokens": same}))
"""


def sampler_step(run: Run, work: Path, small: bool) -> None:
    from tiny import write_tiny_model

    standin = work / "standin.gguf"
    if not standin.exists():
        write_tiny_model(standin, pad=QWEN_VOCAB - 354, n_embd=64, logit_scale=40.0)
    run.say("\n## Backend greedy sampler against reading the logits row (tok/s, one token at a time, two runs each)")
    for model in (standin, work / "drift-8b.gguf"):
        if not model.exists():
            continue
        r = run.sh([sys.executable, "-c", SAMPLER, str(model), "-1" if run.gpu else "0", "64" if small else "256"],
                   90, f"sampler-{model.stem}")
        if r is not None and r.returncode == 0:
            run.say(f"- {model.stem}: {r.stdout.strip().splitlines()[-1]}")


def tune_step(run: Run, seed: dict, small: bool) -> None:
    """tune as a user runs it, then the sweep's other placements with the same settings; one table."""
    if not seed:
        return
    target, draft, n_ctx = seed["target"], seed["draft"], seed["n_ctx"]
    tp, dp = seed["plan"]["models"]
    vram = [] if run.gpu else ["--vram", str(seed["budget"])]
    same = ["--draft-max", "2,4,8", "-n", "16" if small else "32", "--repeats", "1", "--suite", "code", "--limit", "1",
            "-c", str(n_ctx)]
    run.say(f"\n## tune against a sweep: {seed['name']}, draft accepted at 0.7 per token, plan `{seed['plan']['flags']}`")
    r = run.ggufspec("tune", "-m", str(target), "-md", str(draft), *same, *vram, "--json", cap=240, name="tune")
    if r is None or r.returncode != 0:
        return
    tuned = json.loads(r.stdout)
    rows = [dict(x, source="tune") for x in tuned["rows"]]
    done = {(x["ngl"], x["cpu_moe"] or 0, x["ngld"]) for x in rows}
    ngl, moe, full = tp["n_gpu_layers"], tp.get("cpu_moe", 0), dp["n_layers"] + 1
    if moe:  # every layer on the card, the experts of the first `moe` on the CPU: the split is what moves
        sweep = [(ngl, moe + 8, full), (ngl, moe, full // 2), (ngl, moe, 0), (ngl, max(moe - 8, 0), full)]
    else:
        sweep = [(ngl - 8, 0, full), (ngl, 0, full // 2), (ngl - 4, 0, full // 2), (ngl, 0, 0)]
    for t_ngl, t_moe, ngld in sweep:
        if (t_ngl, t_moe, ngld) in done or t_ngl < 0 or run.left() < 60:
            continue
        b = run.ggufspec("bench", "-m", str(target), "-md", str(draft), "--modes", "target,draft,auto", "-ngl", str(t_ngl),
                         "--n-cpu-moe", str(t_moe), "-ngld", str(ngld), *same, "--json", cap=120,
                         name=f"sweep-{t_ngl}-{t_moe}-{ngld}")
        if b is None or b.returncode != 0:
            run.say(f"- -ngl {t_ngl} --n-cpu-moe {t_moe} -ngld {ngld}: did not run")
            continue
        done.add((t_ngl, t_moe, ngld))
        for x in json.loads(b.stdout)["rows"]:
            rows.append({"ngl": t_ngl, "cpu_moe": t_moe, "ngld": ngld, "mode": x["mode"], "draft_max": x.get("draft_max"),
                         "tokens_per_second": x["tokens_per_second"], "alpha": x.get("acceptance_rate"),
                         "source": "sweep"})
    best = max(rows, key=lambda x: x["tokens_per_second"])
    pick = tuned["best"]
    run.say("| -ngl | --n-cpu-moe | -ngld | mode | draft-max | tok/s | α | measured by |\n"
            "| ---: | ---: | ---: | --- | ---: | ---: | ---: | --- |")
    for x in sorted(rows, key=lambda x: -x["tokens_per_second"]):
        alpha = f"{x['alpha']:.2f}" if x.get("alpha") is not None else "-"
        run.say(f"| {x['ngl']} | {x.get('cpu_moe') or 0} | {x['ngld']} | {x['mode']} | {x.get('draft_max') or '-'} | "
                f"{x['tokens_per_second']:.2f} | {alpha} | {x['source']} |")
    run.say(f"- tune chose `{tuned.get('flags', pick)}` at {pick['tokens_per_second']:.2f} tok/s: "
            f"{pick['tokens_per_second'] / best['tokens_per_second']:.1%} of the fastest measured "
            f"({best['ngl']}/{best.get('cpu_moe') or 0}/{best['ngld']} {best['mode']} {best.get('draft_max')}, "
            f"{best['tokens_per_second']:.2f}); tune measured {len({(x['ngl'], x['cpu_moe'], x['ngld']) for x in tuned['rows']})} "
            f"placements, the table {len(done)}")
    if tuned.get("notes"):
        run.say("- tune's notes: " + " / ".join(tuned["notes"]))
    c = run.ggufspec("bench", "-m", str(target), "-md", str(draft), "--modes", "target,draft", "-ngl", str(pick["ngl"]),
                     "--n-cpu-moe", str(pick["cpu_moe"] or 0), "-ngld", str(pick["ngld"]), "--draft-max",
                     str(pick.get("draft_max") or 4), *same[2:], "--compare-llama-cpp", str(run.bin), cap=150,
                     name="llama-cpp-at-tuned")
    if c is not None and c.returncode == 0:
        run.say("```\n" + c.stdout.strip() + "\n```")


STEPS = ("plan", "drift", "sampler", "alpha", "tune")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=["run"])
    ap.add_argument("--bundle", type=Path, help="the folder `gpu_figures.py bundle` wrote")
    ap.add_argument("--bin", type=Path, help="llama.cpp's programs, where llama_cpp is installed already")
    ap.add_argument("--out", type=Path, default=Path("gpu-offload"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu-offload"))
    ap.add_argument("--budget", type=float, default=420, help="seconds for the whole run")
    ap.add_argument("--small", action="store_true", help="small shapes: a try on a CPU")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"which of {', '.join(STEPS)} to run")
    ap.add_argument("--tune-case", type=int, default=1, help="which case tune sweeps (0: the seed's; 1: the MoE)")
    a = ap.parse_args(argv)
    bin_dir, env = prepare(a, argv, __file__)
    gpu = bool(shutil.which("nvidia-smi")) and not a.small
    run = Run(a.out, a.work, a.budget, env, bin_dir, gpu=gpu)
    start = time.monotonic()
    run.say("# ggufspec offload, tune and margin on a GPU")
    if gpu:
        run.say(f"GPU (nvidia-smi): {gpu_named()}")
    r = run.ggufspec("doctor", cap=60, name="doctor")
    if r is not None:
        run.say("```\n" + "\n".join(r.stdout.strip().splitlines()[:12]) + "\n```")
    if gpu and (r is None or "CUDA0" not in r.stdout):
        run.say("llama.cpp sees no CUDA0: stopping")
        return 1
    steps = set(a.steps.split(","))
    blocker = Blocker(run) if gpu else None
    try:
        seed = plan_step(run, a.work, a.small, blocker, a.tune_case) if steps & {"plan", "tune"} else {}
        if blocker:
            blocker.keep(1 << 50)  # holds nothing: the 8B all on the card
        if "drift" in steps:
            drift_step(run, a.work, a.small)
            margin_step(run, a.work, a.small)
        if "sampler" in steps:
            sampler_step(run, a.work, a.small)
        if "alpha" in steps:  # item 4: dev/alpha_figures.py's chained 8B and 1B drafts, all on the card
            from alpha_figures import speed_at_alpha
            from gpu_figures import PROMPT

            speed_at_alpha(run, a.work, SMALL if a.small else {}, 64 if a.small else 256, PROMPT,
                           threads=1 if a.small else 0, repeats=2)
        if blocker and seed:
            blocker.keep(seed["budget"] + 512 * MiB)
        if "tune" in steps:
            tune_step(run, seed, a.small)
    finally:
        if blocker:
            blocker.close()
    run.say(f"\n(whole run {time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
