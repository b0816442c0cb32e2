"""`ggufspec serve`: an OpenAI-compatible HTTP server over one Engine of several sequences.

    ggufspec serve qwen2.5-coder-1.5b -np 4            # http://127.0.0.1:8080/v1

Every request gets a sequence of the target's context (`-np` of them; more wait in a queue) and the requests
running share one target batch per step (`serving.Scheduler`). Endpoints: POST /v1/completions and
/v1/chat/completions (`stream`, the usual sampling fields, `seed`, `stop`, `mode`, `draft_max`), GET /v1/models,
/health and /metrics (Prometheus text). A request's `usage` carries its drafted and accepted tokens and its
speed. Bad requests get a 400 and one message; a client that goes away frees its sequence at the next step.
"""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request) at runtime.
import asyncio
import json
import time
import uuid
from dataclasses import replace

from .errors import GGUFSpecError
from .generation import Chunk, GenerationSettings, resolve_settings
from .serving import Scheduler, Ticket

FINISH = {"stop": "stop", "stop_string": "stop", "length": "length"}  # ours -> OpenAI's
# Request fields and the setting each sets; others (user, logprobs, penalties...) are accepted and ignored.
FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
          "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "mode": "mode",
          "draft_max": "draft_max", "ignore_eos": "ignore_eos", "stop": "stop"}
POLL_SECONDS = 0.2  # how often a waiting request looks whether its client went away
GRACE_SECONDS = 5  # after Ctrl-C, how long requests in flight may go on before the server stops


class BadRequest(Exception):
    """A request this server answers with a 400 and the message."""


class Server:
    """The app's state: the Engine, its scheduler, the defaults every request starts from."""

    def __init__(self, engine, name: str, defaults: GenerationSettings, *, max_queue: int = 64):
        self.engine, self.name, self.defaults = engine, name, defaults
        self.slot_ctx = engine.n_ctx  # what one request may use: the context's share of each sequence
        self.total_ctx = engine.target_ctx.n_ctx_total
        self.scheduler = Scheduler(engine.generation, engine.release, engine.batch(), engine.n_seq, max_queue)
        self.created = int(time.time())

    def start(self) -> "Server":
        self.scheduler.start()
        return self

    def stop(self) -> None:
        self.scheduler.stop()

    # -- requests -----------------------------------------------------------------------------

    def parse(self, body, chat: bool) -> tuple[list[int], GenerationSettings, bool]:
        """(prompt tokens, settings, stream) of a request body; BadRequest with one line for anything wrong."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise BadRequest(f"n must be 1 (got {body.get('n')!r}): this server writes one choice per request")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream must be true or false (got {stream!r})")
        overrides = {FIELDS[k]: v for k, v in body.items() if k in FIELDS and v is not None}
        try:
            if chat:
                if "messages" not in body:
                    raise BadRequest("a chat completion needs `messages`: a list of {\"role\", \"content\"}")
                tokens = self.engine.tokenize_prompt(messages=body["messages"])
            else:
                tokens = self._prompt_tokens(body.get("prompt"))
            given = "max_tokens" in overrides
            settings = resolve_settings(self.defaults, overrides)
        except GGUFSpecError as e:
            raise BadRequest(str(e)) from None
        room = self.slot_ctx - len(tokens)
        if room < 1:
            raise BadRequest(f"the prompt is {len(tokens)} tokens; a request may use {self.slot_ctx} (the context "
                             f"-c {self.total_ctx} shared by -np {self.engine.n_seq}): shorten it")
        if given and settings.max_tokens > room:
            raise BadRequest(f"the prompt ({len(tokens)} tokens) and max_tokens ({settings.max_tokens}) do not fit "
                             f"the {self.slot_ctx} tokens a request may use (-c {self.total_ctx} shared by -np "
                             f"{self.engine.n_seq}); lower max_tokens to {room} or less")
        if settings.max_tokens > room:  # the server's default: as much of it as fits
            settings = replace(settings, max_tokens=room)
        return tokens, settings, stream

    def _prompt_tokens(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.engine.tokenize_prompt(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self.engine._check_prompt(prompt)
        raise BadRequest("prompt must be a string (or a list of token ids); one prompt per request")

    # -- answers ------------------------------------------------------------------------------

    def usage(self, chunk: Chunk, n_prompt: int) -> dict:
        """A request's `usage`, from its last chunk's running totals."""
        s = chunk.stats
        return {"prompt_tokens": n_prompt, "completion_tokens": s.n_generated, "total_tokens": n_prompt + s.n_generated,
                "drafted_tokens": s.n_drafted, "accepted_tokens": s.n_accepted,
                "tokens_per_second": round(s.tokens_per_second, 3), "prompt_seconds": round(s.prompt_seconds, 4),
                "mode": s.mode}

    def answer(self, chat: bool, text: str, finish: str | None, usage: dict, rid: str) -> dict:
        choice = {"index": 0, "finish_reason": FINISH.get(finish, finish) or "length", "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "choices": [choice], "usage": usage}

    def piece(self, chat: bool, text: str | None, finish: str | None, rid: str, usage: dict | None = None,
              first: bool = False) -> str:
        choice = {"index": 0, "finish_reason": FINISH.get(finish, finish) if finish else None}
        if chat:
            choice["delta"] = ({"role": "assistant", "content": text or ""} if first else
                               {"content": text} if text else {})
        else:
            choice.update(text=text or "", logprobs=None)
        out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
               "created": int(time.time()), "model": self.name, "choices": [choice]}
        if usage is not None:
            out["usage"] = usage
        return f"data: {json.dumps(out)}\n\n"

    def metrics(self) -> str:
        t, s = self.scheduler.totals, self.scheduler
        rows = [("requests_total", "counter", "Requests finished (done, failed or cancelled).", t.requests),
                ("requests_failed_total", "counter", "Requests that ended in an error.", t.errors),
                ("requests_cancelled_total", "counter", "Requests whose client went away.", t.cancelled),
                ("prompt_tokens_total", "counter", "Prompt tokens evaluated.", t.prompt_tokens),
                ("tokens_predicted_total", "counter", "Tokens generated.", t.completion_tokens),
                ("draft_tokens_total", "counter", "Tokens drafted and verified.", t.drafted),
                ("draft_tokens_accepted_total", "counter", "Drafted tokens accepted.", t.accepted),
                ("steps_total", "counter", "Target batches stepped.", t.steps),
                ("busy_seconds_total", "counter", "Seconds spent stepping.", round(t.busy_seconds, 6)),
                ("requests_processing", "gauge", "Requests holding a sequence.", len(s.active)),
                ("requests_deferred", "gauge", "Requests waiting for a sequence.", len(s.waiting))]
        return "".join(f"# HELP ggufspec_{n} {h}\n# TYPE ggufspec_{n} {k}\nggufspec_{n} {v}\n" for n, k, h, v in rows)


def create_app(server: Server):
    """The FastAPI app over a started Server (stopped when the app shuts down)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.stop()

    app = FastAPI(title="ggufspec", lifespan=lifespan)

    @app.get("/health")
    async def health():
        s = server.scheduler
        return {"status": "ok", "slots_idle": s.idle_slots, "slots_processing": len(s.active),
                "requests_queued": len(s.waiting)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "ggufspec"}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(server, request, chat=True)

    return app


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def complete(server: Server, request, chat: bool):
    """One completion: parsed, queued, answered whole or streamed (server-sent events)."""
    from fastapi.responses import StreamingResponse

    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return _error(400, "the request body is not JSON")
    try:
        tokens, settings, stream = server.parse(body, chat)
    except BadRequest as e:
        return _error(400, str(e))
    loop, items = asyncio.get_running_loop(), asyncio.Queue()

    def deliver(item) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the loop closed: the server is stopping
            pass

    ticket = Ticket(tokens, settings, deliver)
    try:
        ahead = server.scheduler.submit(ticket)
    except GGUFSpecError as e:
        return _error(503, str(e))
    headers = {"x-ggufspec-queued": str(ahead)}
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    try:
        first = await _next(items, request, ticket)  # the prompt evaluated: errors still get their status
    except BaseException:
        ticket.cancel()
        raise
    if first is _GONE:
        return _error(499, "the client closed the request")
    if isinstance(first, BaseException):
        return _error(400 if isinstance(first, GGUFSpecError) else 500, str(first))
    if stream:
        return StreamingResponse(_events(server, chat, first, items, ticket, rid, len(tokens)),
                                 media_type="text/event-stream", headers=headers)
    return await _whole(server, chat, first, items, request, ticket, rid, len(tokens), headers)


async def _whole(server: Server, chat: bool, first: Chunk, items, request, ticket: Ticket, rid: str, n_prompt: int,
                 headers: dict):
    from fastapi.responses import JSONResponse

    parts, last, item = [first.text], first, first
    while item is not None:
        item = await _next(items, request, ticket)
        if item is _GONE:
            return _error(499, "the client closed the request")
        if isinstance(item, BaseException):
            return _error(500, str(item))
        if item is not None:
            parts.append(item.text)
            last = item
    return JSONResponse(server.answer(chat, "".join(parts), last.finish_reason, server.usage(last, n_prompt), rid),
                        headers=headers)


async def _events(server: Server, chat: bool, first: Chunk, items, ticket: Ticket, rid: str, n_prompt: int):
    last, item = first, first
    try:
        yield server.piece(chat, item.text, None, rid, first=True)
        while True:
            item = await items.get()
            if item is None or isinstance(item, BaseException):
                break
            last = item
            if item.text:
                yield server.piece(chat, item.text, None, rid)
        if isinstance(item, BaseException):
            yield f"data: {json.dumps({'error': {'message': str(item), 'type': 'server_error'}})}\n\n"
        else:
            yield server.piece(chat, None, last.finish_reason or "length", rid, server.usage(last, n_prompt))
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel()  # a no-op when done; a client gone mid-stream frees its sequence


_GONE = object()


async def _next(items: asyncio.Queue, request, ticket: Ticket):
    """The request's next item, or _GONE (its sequence freed) once its client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(items.get(), POLL_SECONDS)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                ticket.cancel()
                return _GONE


def serve(engine, name: str, defaults: GenerationSettings, *, host: str = "127.0.0.1", port: int = 8080,
          max_queue: int = 64, ready=None) -> None:
    """Serve until Ctrl-C (or SIGTERM); the Engine stays the caller's to close. ready(url): called once listening."""
    import uvicorn

    server = Server(engine, name, defaults, max_queue=max_queue).start()
    config = uvicorn.Config(create_app(server), host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=GRACE_SECONDS)
    runner = uvicorn.Server(config)
    if ready is not None:
        original = runner.startup

        async def startup(sockets=None):
            await original(sockets=sockets)
            if runner.started:
                ready(f"http://{host}:{port}")

        runner.startup = startup
    try:
        runner.run()
    except SystemExit:  # uvicorn exits when it cannot bind (it has said why in its own line)
        if runner.started:
            raise
    finally:
        server.stop()
    if not runner.started:
        raise GGUFSpecError(f"could not listen on {host}:{port} (in use? try another --port)")


def check_address(host: str, port: int) -> None:
    """One line, before any model loads, where nothing can listen on host:port (taken, or not this machine's)."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise GGUFSpecError(f"cannot listen on {host}:{port} ({e.strerror or e}); give another --port or --host") from None


class InThread:
    """The app on 127.0.0.1 in a thread of this process while a `with` block runs (`bench --concurrency`); `url`."""

    def __init__(self, engine, name: str, defaults: GenerationSettings, *, max_queue: int = 64):
        import uvicorn

        self.server = Server(engine, name, defaults, max_queue=max_queue)
        self.runner = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=0,  # any free one
                                                    log_level="warning"))
        self.url = ""

    def __enter__(self) -> "InThread":
        import threading

        self.server.start()
        self.thread = threading.Thread(target=self.runner.run, name="ggufspec-http", daemon=True)
        self.thread.start()
        while not self.runner.started and self.thread.is_alive():
            time.sleep(0.05)
        if not self.runner.started:
            self.server.stop()
            raise GGUFSpecError("could not listen on 127.0.0.1")
        self.url = "http://127.0.0.1:%d" % self.runner.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        self.runner.should_exit = True
        self.thread.join(timeout=30)
        self.server.stop()

