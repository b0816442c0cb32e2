"""The FastAPI app over a `protocol.Server`: the endpoints, a body read within a limit, the API key, and a request
that follows its client: a client that goes away (streamed or not) frees its sequence before the next step."""

# No `from __future__ import annotations` here: FastAPI reads the handlers' annotations (Request) at runtime.
import asyncio
import hmac
import json
import uuid

from ..errors import GGUFSpecError
from ..generation import Chunk
from ..serving import Ticket
from .protocol import BadRequest, Server, error_body, status_of

POLL_SECONDS = 0.2  # how often a request looks whether its client went away
MAX_BODY = 16 * 2**20  # bytes of a request body (llama-server takes whatever comes; a prompt is far smaller)
OPEN_PATHS = ("/health",)  # answered without the API key (a load balancer's probe)


def create_app(server: Server, api_key: str | None = None):
    """The FastAPI app over a started Server (stopped when the app shuts down). api_key: a bearer token every
    endpoint but /health asks for (llama-server's --api-key)."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    @asynccontextmanager
    async def lifespan(app):
        yield
        server.stop()

    app = FastAPI(title="ggufspec", lifespan=lifespan)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)

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


class ApiKey:
    """ASGI middleware: a request without `Authorization: Bearer <key>` gets a 401 (but on OPEN_PATHS)."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                from fastapi.responses import JSONResponse

                body = error_body(401, "this server needs its API key: send `Authorization: Bearer <key>`")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error(status: int, message: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message), status_code=status)


async def read_json(request):
    """The request's body as JSON, read within MAX_BODY: BadRequest (400, or 413 when too large) with one line;
    None where the client went away while sending it."""
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise BadRequest(f"the request body is {int(declared):,} bytes; this server takes {MAX_BODY:,} at most", 413)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > MAX_BODY:
                raise BadRequest(f"the request body is over {MAX_BODY:,} bytes, the most this server takes", 413)
    except ClientDisconnect:
        return None
    try:
        return json.loads(body)
    except RecursionError:
        raise BadRequest("the request body nests too deeply (JSON arrays or objects within each other)") from None
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not JSON") from None


_GONE = object()  # what a request's queue holds once its client has gone away


async def complete(server: Server, request, chat: bool):
    """One completion: parsed, queued, answered whole or streamed (server-sent events)."""
    from fastapi.responses import StreamingResponse

    try:
        body = await read_json(request)
        if body is None:
            return _error(499, "the client closed the request")
        tokens, settings, stream = server.parse(body, chat)
    except BadRequest as e:
        return _error(e.status, str(e))
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
    watch = asyncio.create_task(_follow(request, ticket, items))
    try:
        first = await items.get()  # the prompt evaluated: errors still get their status
        if first is not _GONE and not isinstance(first, BaseException) and stream:
            watch.cancel()  # from here the streaming response notices a client that goes away itself
            return StreamingResponse(_events(server, chat, first, items, ticket, rid, len(tokens)),
                                     media_type="text/event-stream", headers=headers)
        if first is _GONE:
            return _error(499, "the client closed the request")
        if isinstance(first, BaseException):
            return _error(status_of(first), server.public(str(first)))
        return await _whole(server, chat, first, items, rid, len(tokens), headers)
    except BaseException:
        ticket.cancel()
        raise
    finally:
        watch.cancel()


async def _follow(request, ticket: Ticket, items: asyncio.Queue) -> None:
    """Cancel the request once its client has gone away (its sequence is freed before the next step), and wake
    whatever waits on its items."""
    while not await request.is_disconnected():
        await asyncio.sleep(POLL_SECONDS)
    ticket.cancel()
    items.put_nowait(_GONE)


async def _whole(server: Server, chat: bool, first: Chunk, items, rid: str, n_prompt: int, headers: dict):
    from fastapi.responses import JSONResponse

    parts, last, item = [first.text], first, first
    while item is not None:
        item = await items.get()
        if item is _GONE:
            return _error(499, "the client closed the request")
        if isinstance(item, BaseException):
            return _error(status_of(item), server.public(str(item)))
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
            if item is _GONE:
                return
            if item is None or isinstance(item, BaseException):
                break
            last = item
            if item.text:
                yield server.piece(chat, item.text, None, rid)
        if isinstance(item, BaseException):
            yield server.error_piece(item)
        else:
            yield server.piece(chat, None, last.finish_reason or "length", rid, server.usage(last, n_prompt))
        yield "data: [DONE]\n\n"
    finally:
        ticket.cancel()  # a no-op when done; a client gone mid-stream frees its sequence
