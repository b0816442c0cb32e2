"""Several requests at once on one target (llama.sequences, serving, ggufspec serve): each request's greedy text is
what `generate` writes for it alone, a seeded one the target's own sampled text, whatever else shares the batch;
drafts really made and batches really shared; a client that goes away frees its sequence; bad requests get a 400
and one message; the server listens on 127.0.0.1 unless told otherwise and stops cleanly on Ctrl-C."""

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import psutil
import pytest
from clirun import INTERRUPTED, free_port, one_line, run
from conftest import real_model
from serverrun import get, metric, post, start_server, stop

from ggufspec import Engine
from ggufspec.costs import Costs
from ggufspec.errors import ContextFullError
from ggufspec.generation import GenerationSettings
from ggufspec.llama.backend import Context, Model
from ggufspec.llama import sequences
from ggufspec.llama.sequences import decode_together, together
from ggufspec.serving import Scheduler, Ticket

PROMPTS = ["hello world", "def f(x):", "The quick brown fox", "zzz zzz zzz zzz", "Once upon a time", "12345 67890"]
# (mode, sampling) per request: every mode a server runs, greedy and seeded side by side in one batch
REQUESTS = [("target", {}), ("draft", {}), ("lookup", {}), ("draft", {"temperature": 0.8, "seed": 7}), ("auto", {}),
            ("auto", {"temperature": 0.8, "seed": 11})]


def test_sequences_decode_together_as_each_alone(tiny):
    """Rows of three sequences decoded in one batch are bit-identical to each decoded in a context of its own, and a
    batch that cannot fit leaves every sequence as it was."""
    model = Model(tiny["target"])
    try:
        alone, several = Context(model, n_ctx=256), Context(model, n_ctx=3 * 256, n_seq=3)
        prompts = [model.tokenize(p) for p in PROMPTS[:3]]
        expected = []
        for p in prompts:
            alone.start(p)
            expected.append(alone.decode(p + [5, 6, 7], logits="all").copy())
        rows = decode_together(several, [(s, p, "all") for s, p in zip(several.sequences, prompts)])
        rows = [np.concatenate([r, s.decode([5, 6, 7], logits="all")]) for r, s in zip(rows, several.sequences)]
        for got, want in zip(rows, expected):
            assert np.array_equal(got, want)
        before = [list(s.tokens) for s in several.sequences]
        with pytest.raises(ContextFullError):
            decode_together(several, [(several.sequences[0], [1], "last"), (several.sequences[1], [1] * 300, "none")])
        assert [s.tokens for s in several.sequences] == before
        several.sequences[2].truncate(2)
        assert several.sequences[2].n_past == 2 and several.sequences[0].n_past == len(prompts[0]) + 3
        several.close(), alone.close()
    finally:
        model.close()


def test_plans_run_together_have_their_decodes_answered_in_one_batch(tiny, monkeypatch):
    """llama.sequences.together: three calls that each decode their sequence three times (a prompt, then a token at a
    time, as a draft model drafts) get the rows each gets run alone (to the last bits: a row of a 3-row batch is
    rounded otherwise), from three decodes of the context instead of nine; a call whose decode cannot fit fails by
    itself and the others go on."""
    model = Model(tiny["target"])
    try:
        ctx = Context(model, n_ctx=3 * 128, n_seq=3)
        prompts = [model.tokenize(p) for p in PROMPTS[:3]]

        def drafts(seq, prompt, steps=([5], [6])):
            def call():
                seq.start(prompt)
                return np.stack([seq.decode(tokens, "last")[0] for tokens in [prompt, *steps]])
            return call

        alone = [drafts(s, p)() for s, p in zip(ctx.sequences, prompts)]
        calls = []
        monkeypatch.setattr(sequences, "decode_together", lambda c, parts: calls.append(len(parts)) or decode_together(c, parts))
        results = together([drafts(s, p) for s, p in zip(ctx.sequences, prompts)])
        assert calls == [3, 3, 3]
        for (got, overcount), want, other in zip(results, alone, alone[1:] + alone[:1]):
            assert np.allclose(got, want, atol=1e-3) and not np.allclose(got, other, atol=1e-3) and overcount >= 0
        results = together([drafts(ctx.sequences[0], prompts[0]), drafts(ctx.sequences[1], prompts[1], [[5], [1] * 200])])
        assert np.allclose(results[0][0], alone[0], atol=1e-3) and isinstance(results[1][0], ContextFullError)
        assert ctx.sequences[1].n_past == len(prompts[1]) + 1  # the decode that failed left nothing behind
    finally:
        model.close()


@pytest.fixture(scope="module")
def references(tiny):
    """What `generate` writes for each request alone: the target's text (greedy), its sampled text (seeded)."""
    with Engine(tiny["target"], tiny["close"], n_ctx=512) as e:
        return [e.generate(p, max_tokens=40, ignore_eos=True, mode="target", **kw)
                for p, (_, kw) in zip(PROMPTS, REQUESTS)]


def run_together(engine, n_slots, requests, max_tokens=40):
    """Every request submitted at once to a Scheduler over the engine's sequences; (tokens, last chunk) of each."""
    scheduler = Scheduler(engine.generation, engine.release, engine.batch(), n_slots,
                          max_queue=len(requests)).start()
    try:
        queues = []
        for prompt, mode, kw in requests:
            q = queue.SimpleQueue()
            scheduler.submit(Ticket(engine.tokenize_prompt(prompt),
                                    GenerationSettings(max_tokens=max_tokens, ignore_eos=True, mode=mode, **kw), q.put))
            queues.append(q)
        out = []
        for q in queues:
            tokens, last = [], None
            while (item := q.get(timeout=120)) is not None:
                assert not isinstance(item, BaseException), item
                tokens += item.tokens
                last = item
            out.append((tokens, last))
        return out, scheduler.totals
    finally:
        scheduler.stop()


@pytest.mark.parametrize("kv_unified", [False, True], ids=["kv-per-sequence", "kv-unified"])
def test_every_request_writes_its_own_text_in_a_shared_batch(tiny, references, kv_unified, monkeypatch):
    """Six requests of every mode, greedy and seeded, through four sequences: each writes what it writes alone
    (one KV stream per sequence: by construction; unified: re-checked near-ties, on this fixture the same), drafts
    were made and kept in shared batches, the draft model's steps of several sequences decoded together, and fewer
    target batches ran than rounds. The costs are pinned to a GPU's shape (a verify batch nearly free): the tiny
    model's measured batch of two costs nearly two steps, where lookup drafts only what the timings of the moment
    say pays, and a busy machine's timings once said nothing did."""
    with Engine(tiny["target"], tiny["close"], n_ctx=4 * 256, n_seq=4, kv_unified=kv_unified) as e:
        step = e.costs.target_batch_seconds[0]
        e.costs = Costs([step * (1 + 0.05 * i) for i in range(9)], e.costs.exact_batch, 0.2 * step, e.costs.exact_kv)
        draft_batches = []
        monkeypatch.setattr(sequences, "decode_together", lambda ctx, parts: (
            ctx is e.draft_ctx and draft_batches.append(len(parts))) or decode_together(ctx, parts))
        results, totals = run_together(e, 4, [(p, mode, kw) for p, (mode, kw) in zip(PROMPTS, REQUESTS)])
        assert max(draft_batches) > 1
        for (tokens, last), want, (mode, _) in zip(results, references, REQUESTS):
            assert tokens == want.tokens, mode
            if mode in ("draft", "lookup"):
                assert last.stats.n_drafted > 0 and last.stats.n_accepted > 0, mode
        assert totals.requests == 6 and totals.errors == 0
        assert totals.steps < sum(last.stats.rounds for _, last in results) - 6
        # a finished request leaves its whole prompt chunks for the next one (one KV cache for all: nothing)
        assert all(len(s.tokens) == (0 if kv_unified else s.canonical) for s in e.target_ctx.sequences)


def test_streams_past_the_exact_batch_size_decode_in_exact_groups_and_keep_their_text(tiny, references, monkeypatch):
    """Where batches are bit-identical only up to 2 rows (pinned here; a Q4_K_M target's repacked CPU kernels: 3),
    four streams' rows decode in groups of at most 2, and each request of every mode, greedy and seeded, writes its
    own text."""
    with Engine(tiny["target"], tiny["close"], n_ctx=4 * 256, n_seq=4) as e:
        step = e.costs.target_batch_seconds[0]
        e.costs = Costs([step * (1 + 0.05 * i) for i in range(9)], 2, 0.2 * step, e.costs.exact_kv)
        sizes = []
        monkeypatch.setattr(e, "decode_together", lambda parts: sizes.append(sum(len(t) for _, t, _ in parts))
                            or Engine.decode_together(e, parts))
        results, totals = run_together(e, 4, [(p, mode, kw) for p, (mode, kw) in zip(PROMPTS, REQUESTS)])
        assert [tokens for tokens, _ in results] == [r.tokens for r in references]
        assert sizes and max(sizes) == 2 and totals.errors == 0, sizes


def test_an_engine_of_one_sequence_serves_its_requests_in_turn(tiny, references):
    """-np 1: the Engine's own context (where the heads follow), requests one after another, each its own text."""
    with Engine(tiny["target"], tiny["close"], n_ctx=256, n_seq=1) as e:
        results, totals = run_together(e, 1, [(p, mode, kw) for p, (mode, kw) in zip(PROMPTS[:3], REQUESTS[:3])])
        assert [tokens for tokens, _ in results] == [r.tokens for r in references[:3]]
        assert totals.requests == 3


def test_memory_stays_flat_over_many_requests(tiny):
    proc = psutil.Process()
    requests = [(PROMPTS[i % len(PROMPTS)], REQUESTS[i % len(REQUESTS)][0], REQUESTS[i % len(REQUESTS)][1])
                for i in range(300)]
    with Engine(tiny["target"], tiny["close"], n_ctx=3 * 128, n_seq=3) as e:
        run_together(e, 3, requests[:30])
        before = proc.memory_info().rss
        run_together(e, 3, requests)
        growth = proc.memory_info().rss - before
    assert growth < 8 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB over 300 requests"


@pytest.mark.slow
def test_the_real_pair_writes_each_requests_own_text_in_shared_batches():
    """Qwen2.5-Coder 1.5B Q8_0 with its 0.5B draft, three requests at once in draft mode and auto, greedy and seeded:
    each is what `generate` writes alone, on the real quantized kernels (where batches of up to 16 rows are
    bit-identical to one-token decoding on a CPU, a step decodes at most that many rows together)."""
    target, draft = real_model("qwen2.5-coder-1.5b-instruct-q8_0.gguf"), real_model("qwen2.5-coder-0.5b-instruct-q4_0.gguf")
    prompts = ["def quicksort(a):", "The three laws of thermodynamics are", "import numpy as np\n# a 3x3 identity"]
    kinds = [("draft", {}), ("auto", {}), ("draft", {"temperature": 0.7, "seed": 3})]
    with Engine(target, draft, n_ctx=3 * 256, n_seq=3) as e:
        want = [e.generate(p, max_tokens=32, ignore_eos=True, mode="target", **kw).tokens
                for p, (_, kw) in zip(prompts, kinds)]
        results, totals = run_together(e, 3, [(p, mode, kw) for p, (mode, kw) in zip(prompts, kinds)], max_tokens=32)
    assert [tokens for tokens, _ in results] == want
    assert totals.drafted > 0 and totals.accepted > 0


def test_what_serve_cannot_do_is_one_line_before_it_listens(tiny, tmp_path):
    """Bad flags, a taken port, and an EAGLE-3 draft for several sequences: one line each, exit 1, nothing
    listening; bench --concurrency's bad levels and a folder without llama-server likewise."""
    from tiny_hidden import write_tiny_eagle3, write_tiny_target

    trunk = write_tiny_target(tmp_path / "trunk.gguf")
    eagle3 = write_tiny_eagle3(tmp_path / "eagle3.gguf", trunk)
    target = ["-m", tiny["target"], "-ngl", "0", "-ngld", "0"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [(["serve", *target, "-np", "0"], "-np/--parallel must be at least 1"),
                 (["serve", *target, "--port", "70000"], "--port must be between 1 and 65535"),
                 (["serve", *target, "--prompt-chunk", "0", "--port", str(free_port())], "--prompt-chunk must be at least 1"),
                 (["serve", *target, "-c", "16", "-np", "4"], "under 8 tokens"),
                 (["serve", *target, "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
                 (["bench", *target, "--concurrency", "0"], "--concurrency values must be at least 1"),
                 (["bench", *target, "--concurrency", "1", "--compare-llama-cpp", tmp_path], "llama-server not found")]
        for args, needle in cases:
            one_line(run(*args), needle)


# -- the HTTP server ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny):
    proc, port = start_server("-m", tiny["target"], "-md", tiny["close"], "-np", "3", "-c", "6144", "-ngl", "0",
                              "-ngld", "0", "--prompt-chunk", "32")  # PROMPTS fit in one chunk: as `references` have them
    yield proc, port
    stop(proc)


def test_clients_at_once_each_get_generates_text(server, references):
    """Six clients at once (three sequences, so three wait in the queue): each answer is its request's own text,
    with usage counting its tokens and drafts."""
    _, port = server
    answers = [None] * len(PROMPTS)

    def ask(i):
        mode, kw = REQUESTS[i]
        answers[i] = post(port, "/v1/completions", {"prompt": PROMPTS[i], "max_tokens": 40, "ignore_eos": True,
                                                    "mode": mode, "temperature": 0, **kw})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (status, body, _), want, (mode, _) in zip(answers, references, REQUESTS):
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 40 and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["mode"] == mode
        assert body["choices"][0]["text"] == want.text, mode
    metrics = get(port, "/metrics")
    assert "ggufspec_requests_processing 0" in metrics and "ggufspec_draft_tokens_accepted_total 0" not in metrics


def test_a_chats_next_turn_keeps_its_cached_prompt(server, tiny):
    """A chat's second turn keeps whole chunks of the first from a sequence's cache: usage's
    prompt_tokens_details.cached_tokens and /metrics count them, and the text is what a cold start writes."""
    _, port = server
    turn1 = [{"role": "user", "content": "hello there, how are the caches today?"}]
    body = {"max_tokens": 12, "ignore_eos": True, "mode": "target", "temperature": 0}
    status, first, _ = post(port, "/v1/chat/completions", {"messages": turn1, **body})
    assert status == 200, first
    turn2 = turn1 + [first["choices"][0]["message"], {"role": "user", "content": "and tomorrow?"}]
    before = metric(port, "prompt_tokens_cached_total")
    status, second, _ = post(port, "/v1/chat/completions", {"messages": turn2, **body})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32 and cached % 32 == 0
    assert metric(port, "prompt_tokens_cached_total") == before + cached
    with Engine(tiny["target"], n_ctx=512, prompt_chunk=32, measure=False) as e:
        want = e.generate(messages=turn2, max_tokens=12, ignore_eos=True, mode="target")
    assert second["choices"][0]["message"]["content"] == want.text
    status, again, _ = post(port, "/v1/chat/completions", {"messages": turn2, **body, "cache_prompt": False})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, again  # llama-server's field
    assert again["choices"][0]["message"]["content"] == want.text


def test_chat_streams_and_whole_answers_agree(server):
    """A streamed chat answer (server-sent events, the role first, usage in the last event) is the whole answer's text."""
    _, port = server
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 24, "ignore_eos": True}
    status, whole, _ = post(port, "/v1/chat/completions", body)
    assert status == 200 and whole["object"] == "chat.completion"
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps({**body, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 24 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert json.loads(get(port, "/v1/models"))["data"][0]["id"] == "target"


STOP_TYPES = "stop must be a string or a list of strings"


def test_bad_requests_get_a_4xx_with_one_message_and_the_server_goes_on(server, tiny):
    """Each body a client can get wrong is a 4xx with one line in OpenAI's error shape, naming the request's field
    and none of the server's files or flags (the model by its name); the server's log stays clean (checked when it
    stops, last in this file)."""
    _, port = server
    lone = b'"\\ud800x"'  # JSON's escape of a lone surrogate: valid JSON, not text
    cases = [("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "lower max_tokens to"),
             ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be a finite number"),
             ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens must be a whole number"),
             ("/v1/completions", {"prompt": "hi", "max_completion_tokens": "many"}, 400,
              "max_completion_tokens must be a whole number"),
             ("/v1/completions", {"prompt": "hi", "cache_prompt": "yes"}, 400, "cache_prompt must be true or false"),
             ("/v1/completions", {"prompt": "hi", "mode": "mtp"}, 400, "needs a target with MTP layers"),
             ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n must be 1"),
             ("/v1/completions", {"prompt": {"x": 1}}, 400, "prompt must be a string"),
             ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream must be"),
             ("/v1/completions", b"not json", 400, "not JSON"),
             *[("/v1/completions", {"prompt": "hi", "stop": stop}, 400, STOP_TYPES) for stop in (5, True, 1.5, {"a": 1})],
             ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nests too deeply"),
             ("/v1/completions", b'{"a":' * 5_000 + b"1" + b"}" * 5_000, 400, "nests too deeply"),
             ("/v1/completions", b'{"prompt": ' + lone + b"}", 400, "the prompt holds a lone surrogate (U+D800"),
             ("/v1/completions", b'{"prompt": "hi", "stop": [' + lone + b"]}", 400, "stop holds a lone surrogate"),
             ("/v1/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "send messages to /v1/chat"),
             ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + lone + b"}]}", 400,
              "messages[0].content holds a lone surrogate"),
             ("/v1/chat/completions", {"prompt": "hi"}, 400, "messages"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}, 400,
              "takes `messages`, not `prompt`"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]}, 400,
              "messages[0].content[0] is a part of type 'image_url'")]
    for path, body, status, needle in cases:
        got, answer, _ = post(port, path, body)
        assert got == status, (body[:80], answer)
        message = answer["error"]["message"]
        assert answer["error"]["code"] == status and answer["error"]["type"] == "invalid_request_error", answer
        assert needle in message and "\n" not in message and "Traceback" not in message, message
        assert str(tiny["target"].parent) not in message and " -md" not in message and " -c " not in message, message
    status, answer, _ = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n{")
        answer = b""
        while b"}}" not in answer and (part := sock.recv(4096)):
            answer += part
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 413") and "this server takes 16,777,216 at most" in answer, answer


def test_chat_content_parts_are_their_text(server):
    """OpenAI's content parts, as clients send them, render as the text they hold (one part a line, as llama-server
    joins them), not as Python's text of a list."""
    _, port = server

    def ask(content):
        status, answer, _ = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                                "max_tokens": 6, "ignore_eos": True})
        assert status == 200, answer
        return answer["usage"]["prompt_tokens"], answer["choices"][0]["message"]["content"]

    assert ask([{"type": "text", "text": "Say hi"}]) == ask("Say hi")
    assert ask([{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]) == ask("Say\nhi")


@pytest.mark.parametrize("streamed", [True, False])
def test_a_client_that_goes_away_frees_its_sequence_at_once(server, streamed):
    """A client that closes its connection (streamed: after the first event; whole: once it is generating): its
    request is cancelled long before its 2,000 tokens were written, and the sequence serves the next request. (The
    tiny target writes over 3,000 tokens a second on a Zen 5: a client waiting 0.4 s more saw 1,987 written.)"""
    _, port = server
    before, written = metric(port, "requests_cancelled_total"), metric(port, "tokens_predicted_total")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        body = json.dumps({"prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "stream": streamed,
                           "mode": "target"}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        if streamed:
            seen = b""
            while b"data: " not in seen:
                seen += sock.recv(4096)
                assert seen, "the server closed the stream"
        else:
            while metric(port, "requests_processing") == 0:
                time.sleep(0.02)
    deadline = time.monotonic() + 30
    while metric(port, "requests_cancelled_total") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(port, "requests_cancelled_total") == before + 1
    assert metric(port, "requests_processing") == 0
    assert metric(port, "tokens_predicted_total") - written < 1500
    status, answer, _ = post(port, "/v1/completions", {"prompt": "hi", "max_tokens": 4})
    assert status == 200


def test_listens_on_127_0_0_1_and_ctrl_c_ends_it_cleanly(server):
    proc, port = server
    addresses = {c.laddr for c in psutil.Process(proc.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    assert addresses == {("127.0.0.1", port)}, addresses
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) in INTERRUPTED  # as every command ends on Ctrl-C
    err = proc.stderr.read()
    assert "on http://127.0.0.1:" in err, err
    for needle in ("Traceback", "Exception", "Error"):  # the bad requests above left nothing in the log
        assert needle not in err, err
