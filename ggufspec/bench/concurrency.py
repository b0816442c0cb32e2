"""`ggufspec bench --concurrency 1,2,4,8`: the same prompts sent by N clients at once to ggufspec's server (with
speculation off, each fixed mode and auto, by the request's `mode`) and, with --compare-llama-cpp, to llama.cpp's
own llama-server -np N with and without its draft; aggregate tok/s, per-request tok/s, time to first token and
each request's identity with the target's own text, in one table.

A run at concurrency N sends max(N, prompts) requests, the prompts in turn, N at a time: each client sends its
next request when its last one is answered. Every request streams (time to first token), greedy, -n tokens
(ignore_eos), so every configuration writes the same number of tokens.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from ..batching import identity_price_line
from ..core import HEAD_MODES, MODES
from ..errors import GGUFSpecError
from .reference import LlamaServer
from .runs import BenchSettings, check_modes, prompt_tokens, tokenized_prompts

SERVER_MODES = ("target", "lookup", "draft", "mtp", "eagle3", "dflash", "auto")  # modes a server runs per request


@dataclass
class Answer:
    """One request's result, as its client saw it."""

    prompt: int
    text: str
    tokens: int
    sent: float
    first: float
    done: float
    drafted: int = 0
    accepted: int = 0


def body_for(prompt, max_tokens: int, extra: dict) -> tuple[str, dict]:
    """(path, JSON body) of a streamed, greedy request of max_tokens tokens for a bench Prompt."""
    body = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if prompt.messages is not None:
        return "/v1/chat/completions", {**body, "messages": list(prompt.messages)}
    return "/v1/completions", {**body, "prompt": prompt.text}


def ask(url: str, index: int, path: str, body: dict, timeout: float) -> Answer:
    """One streamed request; its text, its completion tokens (usage), and when its first and last events came."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    sent, first, parts, usage, timings = time.perf_counter(), None, [], {}, {}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise GGUFSpecError(f"{url}: {event['error'].get('message', event['error'])}")
                choice = (event.get("choices") or [{}])[0]
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                parts.append(piece)
                usage = event.get("usage") or usage
                timings = event.get("timings") or timings  # llama-server's, with its draft's counts
    except urllib.error.HTTPError as e:
        raise GGUFSpecError(f"{url}{path}: the server refused the request (HTTP {e.code}): {refusal(e)}") from None
    except OSError as e:
        raise GGUFSpecError(f"{url}{path}: the request failed ({e})") from None
    done = time.perf_counter()
    drafted = usage.get("drafted_tokens", timings.get("draft_n", 0))
    accepted = usage.get("accepted_tokens", timings.get("draft_n_accepted", 0))
    return Answer(index, "".join(parts), int(usage.get("completion_tokens", 0)), sent, first or done, done,
                  int(drafted or 0), int(accepted or 0))


def refusal(error: urllib.error.HTTPError) -> str:
    """What the server said of a refused request: its OpenAI-shaped body's error message, else the status's text."""
    try:
        message = json.loads(error.read())["error"]["message"]
    except (OSError, ValueError, TypeError, KeyError):
        message = None
    return " ".join(message.split()) if isinstance(message, str) and message.strip() else str(error.reason)


def run_clients(url: str, prompts: list, concurrency: int, max_tokens: int, extra: dict,
                timeout: float = 600) -> tuple[list[Answer], float]:
    """max(concurrency, prompts) requests by `concurrency` clients at once; (answers in prompt order, wall seconds)."""
    n_requests = max(concurrency, len(prompts))
    jobs = list(range(n_requests))
    answers: list[Answer | None] = [None] * n_requests
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                if not jobs or errors:
                    return
                i = jobs.pop(0)
            try:
                answers[i] = ask(url, i % len(prompts), *body_for(prompts[i % len(prompts)], max_tokens, extra), timeout)
            except BaseException as e:  # noqa: BLE001 (the run stops; the first error is said)
                with lock:
                    errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0] if isinstance(errors[0], GGUFSpecError) else GGUFSpecError(f"{url}: {errors[0]}")
    return answers, time.perf_counter() - start


def row(label: str, concurrency: int, answers: list[Answer], seconds: float, reference: dict[int, str]) -> dict:
    """A table row: aggregate and per-request speed, time to first token, acceptance, identity."""
    tokens = sum(a.tokens for a in answers)
    per_request = [(a.tokens - 1) / (a.done - a.first) for a in answers if a.tokens > 1 and a.done > a.first]
    drafted, accepted = sum(a.drafted for a in answers), sum(a.accepted for a in answers)
    same = sum(reference.get(a.prompt) == a.text for a in answers) if reference else None
    return {"config": label, "concurrency": concurrency, "requests": len(answers), "tokens": tokens,
            "seconds": round(seconds, 3), "aggregate_tokens_per_second": round(tokens / seconds, 3),
            "request_tokens_per_second": round(statistics.median(per_request), 3) if per_request else None,
            "first_token_seconds": round(statistics.median(a.first - a.sent for a in answers), 3),
            "drafted": drafted, "accepted": accepted, "identical": same}


def cached(settings: BenchSettings) -> dict:
    """Every request to both servers evaluates its whole prompt (llama-server's `cache_prompt`, which ggufspec's
    server honors), unless --reuse-prompt asks both to keep what they hold."""
    return {} if settings.reuse_prompt else {"cache_prompt": False}


def llama_server_rows(bin_dir: Path, target: Path, draft: Path | None, prompts: list, levels: tuple[int, ...],
                      max_tokens: int, n_ctx_slot: int, threads: int, ngl: int, reference: dict[int, str],
                      note, body: dict) -> list[dict]:
    """llama-server -np N, without and (given one of the target's vocabulary) with a draft; `body`: `cached`'s."""
    configs = [("llama-server", [])]
    if draft is not None:
        configs.append(("llama-server + draft", ["-md", str(draft), "--spec-type", "draft-simple"]))
    rows = []
    for label, extra in configs:
        for n in levels:
            layers = str(ngl) if ngl >= 0 else "all"  # the library's -1 is every layer; llama.cpp's programs say all
            args = ["-m", str(target), "-np", str(n), "-c", str(n * n_ctx_slot), "-t", str(threads), "-ngl", layers,
                    *(["-ngld", layers] if extra else []), *extra]
            try:
                with LlamaServer(bin_dir, args) as server:
                    answers, seconds = run_clients(server.url, prompts, n, max_tokens, body)
            except GGUFSpecError as e:
                note(f"{label} at concurrency {n}: {e}; its row is left out")
                continue
            rows.append(row(label, n, answers, seconds, reference))
    return rows


def slot_tokens(prompts: list, max_tokens: int) -> int:
    """A sequence's share of the context that holds any of these prompts and its answer (a token is rarely under
    two characters of text or a chat template's), in whole 256-token blocks."""
    longest = max(len(p.text or json.dumps(list(p.messages))) for p in prompts)
    need = longest // 2 + max_tokens + 128
    return -(-need // 256) * 256


def request_tokens(engine, prompt) -> list[int]:
    """A bench Prompt's tokens as ggufspec's server counts them for `body_for`'s request: chat messages through the
    model's template, text as it is (unlike plain bench's runs, which put text through the template too)."""
    model = engine.target_model
    if prompt.messages is None:
        return model.tokenize(prompt.text)
    return model.tokenize_chat(list(prompt.messages)) if model.chat_template else prompt_tokens(engine, prompt)


def fitted_engine(load, prompts: list, modes: tuple[str, ...], levels: tuple[int, ...], max_tokens: int,
                  slot_ctx: int | None):
    """An Engine of max(levels) sequences, each with room for every prompt and -n tokens, checked before a server
    starts (the server refuses a request that does not fit): slot_ctx tokens each (-c: one line where a prompt does
    not fit), or None: sized from the prompts, and sized again from their tokens where the estimate was short."""
    from ..models.resolve import open_engine
    from ..core import PROMPT_CHUNK

    def opened(slot: int):  # as serve's: the costs measured whatever the modes (which shared rows are exact)
        return open_engine(replace(load, n_seq=max(levels), n_ctx=max(levels) * slot, use_default=True,
                                   prompt_chunk=load.prompt_chunk or PROMPT_CHUNK), modes=modes, measure=True)[0]

    engine = opened(slot_ctx or slot_tokens(prompts, max_tokens))
    try:
        if slot_ctx is None:
            try:
                need = max(len(request_tokens(engine, p)) for p in prompts) + max_tokens
            except GGUFSpecError:
                need = 0  # a prompt the model cannot take: tokenized_prompts says which
            if need > engine.n_ctx:
                engine.close()
                engine = opened(-(-need // 256) * 256)
        tokenized_prompts(engine, prompts, max_tokens, request_tokens)
    except BaseException:
        engine.close()
        raise
    return engine


def concurrency_bench(load, prompts: list, settings: BenchSettings, levels: tuple[int, ...],
                      llama_cpp_bin: str | None = None, slot_ctx: int | None = None, note=lambda line: None) -> dict:
    """Every mode at every concurrency on one ggufspec server (one Engine of max(levels) sequences), then llama.cpp's
    llama-server; {"rows": [...], "meta": {...}}. Each row's vs_off: its aggregate tok/s over ggufspec's with
    speculation off at the same concurrency; identical: requests whose text is the target's own (greedy, alone).
    With settings.repeats R, the whole round (ggufspec's server, then llama-server's) runs R times, every other
    round the other way round (llama-server's first, ggufspec's modes reversed at each N), so a machine whose
    speed drifts moves all alike, and each row is the median of its R runs (`merged`).

    settings: its modes and -n (max_tokens), checked as plain bench checks them (`BenchSettings.validate`,
    `check_modes`) before a server starts; a mode asked for by name that a server does not run for several clients
    (SERVER_MODES) is one line. slot_ctx: each sequence's context (-c), None: sized from the prompts and -n."""
    from ..llama.backend import machine

    settings.validate()
    if not settings.greedy or not settings.ignore_eos:
        raise GGUFSpecError("bench --concurrency sends greedy fixed-length requests: drop --temp and --natural-stop")
    levels = tuple(sorted(set(levels)))
    runs, reference = [], {}

    def theirs(paths, ngl, threads, slot):
        return llama_server_rows(Path(llama_cpp_bin), *paths, prompts, levels, settings.max_tokens, slot, threads,
                                 ngl, reference, note, cached(settings)) if llama_cpp_bin else []

    ran = None  # what llama-server runs at (ggufspec's first round says: the files, -ngl, threads, -c)
    for repeat in range(settings.repeats):
        turned = repeat % 2 == 1  # every other round the other way round: llama-server's first, the modes reversed
        first = theirs(*ran) if turned else []
        rows, ran = ggufspec_rows(load, prompts, settings, levels, slot_ctx, reference, note, reverse=turned)
        runs.append(rows + first + ([] if turned else theirs(*ran)))
    rows, ((target, draft), _, threads, _) = merged(runs), ran
    off = {r["concurrency"]: r["aggregate_tokens_per_second"] for r in rows if r["config"] == "ggufspec target"}
    for r in rows:
        r["vs_off"] = round(r["aggregate_tokens_per_second"] / off[r["concurrency"]], 3) if off.get(r["concurrency"]) else None
    return {"rows": rows, "meta": {"machine": machine()["summary"]["cpu"], "threads": threads, "levels": list(levels),
                                   "max_tokens": settings.max_tokens, "prompts": len(prompts), "target": str(target),
                                   "draft": str(draft) if draft else None, "repeats": settings.repeats}}


def ggufspec_rows(load, prompts: list, settings: BenchSettings, levels: tuple[int, ...], slot_ctx: int | None,
                  reference: dict[int, str], note, reverse: bool = False) -> tuple[list[dict], tuple]:
    """One round of ggufspec's server at every mode and level (reverse: the modes in the other order at each):
    its rows, and what llama-server's round runs at ((target, a draft of its vocabulary or None), -ngl, threads,
    a sequence's context); fills an empty reference."""
    from ..generation import GenerationSettings
    from ..llama.runtime import on_a_passing_thread
    from ..server import InThread

    max_tokens = settings.max_tokens
    modes = ("target",) + tuple(m for m in settings.modes if m in SERVER_MODES and m != "target")
    # the heads' modes are checked below, as plain bench checks them (the Engine loads what the files have)
    engine = on_a_passing_thread(lambda: fitted_engine(load, prompts, tuple(m for m in modes if m not in HEAD_MODES),
                                                       levels, max_tokens, slot_ctx), close=lambda e: e.close())
    rows = []
    with engine:
        check_modes(settings.modes, engine.draft_model is not None, set(engine.heads), engine.target_model.path.name)
        unserved = [m for m in settings.modes if m not in SERVER_MODES]
        if unserved and tuple(settings.modes) != MODES:
            raise GGUFSpecError(f"--modes {','.join(unserved)}: bench --concurrency runs the modes a server runs for "
                                f"several clients at once, {', '.join(SERVER_MODES)}; leave it out")
        modes = tuple(m for m in modes if (m != "draft" or engine.draft_model is not None)
                      and HEAD_MODES.get(m) in (None, *engine.heads))  # a head's mode where the files have it
        served = GenerationSettings(exact=settings.generation.get("exact"))  # --no-exact: one decode a step
        with InThread(engine, "bench", served, max_queue=4 * max(levels)) as server:
            for mode in modes:  # warm-up: the first request of a mode pays for what later ones find ready
                run_clients(server.url, prompts[:1], 1, min(8, max_tokens), {"mode": mode})
            for n in levels:
                for mode in modes[::-1] if reverse else modes:
                    answers, seconds = run_clients(server.url, prompts, n, max_tokens,
                                                   {"mode": mode, **cached(settings)})
                    if not reference:
                        reference.update({a.prompt: a.text for a in answers})
                    rows.append(row(f"ggufspec {mode}", n, answers, seconds, reference))
                    if mode == "target" and served.exact is None:  # what each answer's identity costs these rows
                        rows[-1]["identity_price"] = identity_price_line(engine.costs, n, engine.target_ctx.kv_unified)
                    note(f"{rows[-1]['config']} at concurrency {n}: {rows[-1]['aggregate_tokens_per_second']:.1f} tok/s")
        target, draft = engine.target_model, engine.draft_model
        paths = (target.path, draft.path if draft is not None and engine.bridge is None else None)
        return rows, (paths, target.n_gpu_layers, engine.target_ctx.n_threads, engine.n_ctx)


def merged(runs: list[list[dict]]) -> list[dict]:
    """One row per (config, N) of several rounds' rows, in the first round's order: the median of each rate and of
    the first token, the runs' aggregate tok/s as `aggregate_min` / `aggregate_max`, the counts summed."""
    if len(runs) == 1:
        return runs[0]
    groups: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault((r["config"], r["concurrency"]), []).append(r)
    out = []
    for same in groups.values():
        rates = [r["aggregate_tokens_per_second"] for r in same]
        total = {k: sum(r[k] for r in same) for k in ("requests", "tokens", "seconds", "drafted", "accepted")}
        identical = None if any(r["identical"] is None for r in same) else sum(r["identical"] for r in same)
        per_request = [r["request_tokens_per_second"] for r in same if r["request_tokens_per_second"] is not None]
        out.append({**same[0], **total, "identical": identical, "runs": len(same),
                    "aggregate_tokens_per_second": round(statistics.median(rates), 3),
                    "aggregate_min": min(rates), "aggregate_max": max(rates),
                    "request_tokens_per_second": round(statistics.median(per_request), 3) if per_request else None,
                    "first_token_seconds": round(statistics.median(r["first_token_seconds"] for r in same), 3)})
    return out


def concurrency_table(result: dict) -> str:
    """The rows as a table, with the machine they ran on."""
    from .report import table

    def number(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    repeated = result["meta"].get("repeats", 1) > 1

    cells = [{"config": r["config"], "N": r["concurrency"], "requests": r["requests"],
              "tok/s": number(r["aggregate_tokens_per_second"]),
              **({"min-max": f"{r['aggregate_min']:.1f}-{r['aggregate_max']:.1f}" if r.get("runs", 1) > 1 else "-"}
                 if repeated else {}),
              "vs off": number(r["vs_off"], 2) + "x" if r["vs_off"] is not None else "-",
              "tok/s per request": number(r["request_tokens_per_second"]),
              "first token s": number(r["first_token_seconds"], 2),
              "accepted": f"{r['accepted'] / r['drafted']:.0%} of {r['drafted']}" if r["drafted"] else "-",
              "identical": "-" if r["identical"] is None else f"{r['identical']}/{r['requests']}"}
             for r in result["rows"]]
    meta = result["meta"]
    against = against_llama_server(result["rows"]) + [f"N={r['concurrency']}: {r['identity_price']}"
                                                      for r in result["rows"] if r.get("identity_price")]
    return (table(cells) + ("\n\n" + "\n".join(against) if against else "") + f"\n\n{meta['machine']}, {meta['threads']} threads; {meta['max_tokens']} tokens per "
            "request, greedy; identical: the target's own text, as ggufspec writes it alone"
            + (f"; each row the median of {meta['repeats']} runs taking turns, min-max their aggregate tok/s"
               if repeated else ""))


def against_llama_server(rows: list[dict]) -> list[str]:
    """Per N where llama-server ran: ggufspec's auto over the faster of llama-server with and without its draft,
    speculation off over llama-server without one, and both servers' median first token (auto's and the plain
    llama-server's): the lines a reader compares the two servers by."""
    by = {(r["config"], r["concurrency"]): r for r in rows}
    lines = []
    for n in sorted({r["concurrency"] for r in rows}):
        plain, drafted = by.get(("llama-server", n)), by.get(("llama-server + draft", n))
        served = [r for r in (plain, drafted) if r]
        if not served:
            continue
        best, said = max(served, key=lambda r: r["aggregate_tokens_per_second"]), []
        for mine, theirs, what in ((by.get(("ggufspec auto", n)), best, f"{best['config']} (the faster)"),
                                   (by.get(("ggufspec target", n)), plain, "llama-server")):
            if mine and theirs:
                said.append(f"{mine['config']} {mine['aggregate_tokens_per_second'] / theirs['aggregate_tokens_per_second']:.2f}x "
                            f"of {what}, first token {mine['first_token_seconds']:.2f} s against {theirs['first_token_seconds']:.2f} s")
        if said:
            lines.append(f"N={n}: " + "; ".join(said))
    return lines
