"""What `ggufspec serve` says over HTTP, apart from HTTP itself: a request body read into prompt tokens and
settings (or one line why not), the OpenAI-shaped answers, stream pieces and errors, and /metrics."""

import json
import time
from dataclasses import replace

from ..core import DRAFT_ALONE_MODES, HEAD_MODES, MODEL_MODES
from ..errors import GGUFSpecError
from ..generation import Chunk, GenerationSettings, resolve_settings
from ..serving import Scheduler, ServerStopping

FINISH = {"stop": "stop", "stop_string": "stop", "length": "length"}  # ours -> OpenAI's
# Request fields and the setting each sets; others (user, logprobs, penalties...) are accepted and ignored.
FIELDS = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
          "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed", "mode": "mode",
          "draft_max": "draft_max", "ignore_eos": "ignore_eos", "stop": "stop",
          "cache_prompt": "reuse_prompt"}  # llama-server's field: false evaluates the whole prompt again
# What a mode needs that a server may not have (the request's answer says it; the server's flags are not the client's)
NEEDS = {"mtp": "a target with MTP layers", "eagle3": "an EAGLE-3 draft", "dflash": "a DFlash draft"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 503: "unavailable_error"}


def named_as_sent(message: str, body: dict) -> str:
    """A setting's error as the request named it: a value sent as llama-server's `cache_prompt` or OpenAI's
    `max_completion_tokens` is that field's in the message, not the setting's it sets."""
    for field, setting in FIELDS.items():
        if field != setting and field in body and message.startswith(setting + " "):
            return field + message[len(setting):]
    return message


class BadRequest(Exception):
    """A request this server answers with `status` (400 unless said) and the message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_body(status: int, message: str) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "code": status}}


def status_of(error: BaseException) -> int:
    """The HTTP status of a request that ended in this error: 503 where the server stopped, 400 for what the
    request can change, else 500."""
    if isinstance(error, ServerStopping):
        return 503
    return 400 if isinstance(error, GGUFSpecError) else 500


class Server:
    """The app's state: the Engine, its scheduler, the defaults every request starts from, the modes it runs."""

    def __init__(self, engine, name: str, defaults: GenerationSettings, *, max_queue: int = 64):
        self.engine, self.name, self.defaults = engine, name, defaults
        self.slot_ctx = engine.n_ctx  # what one request may use: the context's share of each sequence
        self.total_ctx = engine.target_ctx.n_ctx_total
        self.scheduler = Scheduler(engine.generation, engine.release, engine.batch(), engine.n_seq, max_queue,
                                   reusable=engine.reusable)
        self.created = int(time.time())
        self.modes = engine.modes
        # Files of the server's disk, as a client may see them named: the target by the server's name for it.
        paths = [(engine.target_model.path, name)] + [(m.path, "the draft") for m in (engine.draft_model,
                                                                                     engine.head_model) if m]
        self._paths = [(str(p), label) for p, label in paths] + [(str(p.parent) + "/", "") for p, _ in paths]

    def start(self) -> "Server":
        self.scheduler.start()
        return self

    def stop(self) -> int:
        """Stop stepping; every request in flight gets ServerStopping. Returns how many there were."""
        return self.scheduler.stop()

    def public(self, message: str) -> str:
        """A message fit for a client: the server's files named as the client knows them, on one line."""
        for path, label in self._paths:
            message = message.replace(path, label)
        return " ".join(message.split())

    # -- requests -----------------------------------------------------------------------------

    def parse(self, body, chat: bool) -> tuple[list[int], GenerationSettings, bool]:
        """(prompt tokens, settings, stream) of a request body; BadRequest with one line for anything wrong."""
        try:
            return self._parse(body, chat)
        except GGUFSpecError as e:
            raise BadRequest(self.public(str(e))) from None
        except RecursionError:  # nested deeper than Python's repr or the template can follow
            raise BadRequest("the request body nests too deeply") from None

    def _parse(self, body, chat: bool) -> tuple[list[int], GenerationSettings, bool]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("n", 1) != 1:
            raise BadRequest(f"n must be 1 (got {body.get('n')!r}): this server writes one choice per request")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise BadRequest(f"stream must be true or false (got {stream!r})")
        overrides = {FIELDS[k]: v for k, v in body.items() if k in FIELDS and v is not None}
        try:
            settings = resolve_settings(self.defaults, overrides, names="fields")
        except GGUFSpecError as e:
            raise GGUFSpecError(named_as_sent(str(e), body)) from None
        self._check_mode(settings.mode)
        if chat:
            if "prompt" in body:
                raise BadRequest("a chat completion takes `messages`, not `prompt`: send a prompt to /v1/completions")
            if "messages" not in body:
                raise BadRequest("a chat completion needs `messages`: a list of {\"role\", \"content\"}")
            tokens = self.engine.tokenize_prompt(messages=body["messages"], fit=False)
        else:
            if "messages" in body:
                raise BadRequest("a completion takes `prompt`, not `messages`: send messages to /v1/chat/completions")
            tokens = self._prompt_tokens(body.get("prompt"))
        room = self.slot_ctx - len(tokens)
        if room < 1:
            raise BadRequest(f"the prompt is {len(tokens)} tokens; a request may use {self.slot_ctx} on this server: "
                             "shorten it")
        if "max_tokens" in overrides and settings.max_tokens > room:
            raise BadRequest(f"the prompt ({len(tokens)} tokens) and max_tokens ({settings.max_tokens}) do not fit "
                             f"the {self.slot_ctx} tokens a request may use on this server; lower max_tokens to "
                             f"{room} or less")
        if settings.max_tokens > room:  # the server's default: as much of it as fits
            settings = replace(settings, max_tokens=room)
        return tokens, settings, stream

    def _check_mode(self, mode: str) -> None:
        if mode not in self.modes:
            need = NEEDS.get(HEAD_MODES.get(mode, ""), "a draft model" if mode in MODEL_MODES + DRAFT_ALONE_MODES
                             else "what this server has not got")
            raise BadRequest(f"mode {mode!r} needs {need}, which this server was not started with; "
                             f"it runs {', '.join(self.modes)}")

    def _prompt_tokens(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.engine.tokenize_prompt(prompt, fit=False)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return self.engine._check_prompt(prompt, fit=False)
        raise BadRequest("prompt must be a string (or a list of token ids); one prompt per request")

    # -- answers ------------------------------------------------------------------------------

    def usage(self, chunk: Chunk, n_prompt: int) -> dict:
        """A request's `usage`, from its last chunk's running totals."""
        s = chunk.stats
        return {"prompt_tokens": n_prompt, "completion_tokens": s.n_generated, "total_tokens": n_prompt + s.n_generated,
                "prompt_tokens_details": {"cached_tokens": s.n_reused},
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

    def error_piece(self, error: BaseException) -> str:
        """The event that ends a stream cut short by an error (OpenAI's error shape, as llama-server sends it)."""
        return f"data: {json.dumps(error_body(status_of(error), self.public(str(error))))}\n\n"

    def metrics(self) -> str:
        t, s = self.scheduler.totals, self.scheduler
        rows = [("requests_total", "counter", "Requests finished (done, failed or cancelled).", t.requests),
                ("requests_failed_total", "counter", "Requests that ended in an error.", t.errors),
                ("requests_cancelled_total", "counter", "Requests whose client went away.", t.cancelled),
                ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.", t.prompt_tokens),
                ("prompt_tokens_cached_total", "counter", "Of which kept from the KV cache, not evaluated again.",
                 t.cached_tokens),
                ("tokens_predicted_total", "counter", "Tokens generated.", t.completion_tokens),
                ("draft_tokens_total", "counter", "Tokens drafted and verified.", t.drafted),
                ("draft_tokens_accepted_total", "counter", "Drafted tokens accepted.", t.accepted),
                ("steps_total", "counter", "Target batches stepped.", t.steps),
                ("busy_seconds_total", "counter", "Seconds spent stepping.", round(t.busy_seconds, 6)),
                ("requests_processing", "gauge", "Requests holding a sequence.", len(s.active)),
                ("requests_deferred", "gauge", "Requests waiting for a sequence.", len(s.waiting))]
        return "".join(f"# HELP ggufspec_{n} {h}\n# TYPE ggufspec_{n} {k}\nggufspec_{n} {v}\n" for n, k, h, v in rows)
