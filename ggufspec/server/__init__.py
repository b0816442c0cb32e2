"""`ggufspec serve`: an OpenAI-compatible HTTP server over one Engine of several sequences.

    ggufspec serve qwen2.5-coder-1.5b -np 4            # http://127.0.0.1:8080/v1

Every request gets a sequence of the target's context (`-np` of them; more wait in a queue) and the requests
running share one target batch per step (`serving.Scheduler`). Endpoints: POST /v1/completions and
/v1/chat/completions (`stream`, the usual sampling fields, `seed`, `stop`, `mode`, `draft_max`), GET /v1/models,
/health and /metrics (Prometheus text). A request's `usage` carries its drafted and accepted tokens and its
speed. Bad requests get a 4xx and one message; a client that goes away frees its sequence at the next step; a
stopping server answers every request still in flight. `protocol`: bodies and answers; `app`: the endpoints;
`runner`: uvicorn, signals and stopping.
"""

from .app import create_app
from .protocol import BadRequest, Server
from .runner import InThread, check_address, is_loopback, serve

__all__ = ["BadRequest", "InThread", "Server", "check_address", "create_app", "is_loopback", "serve"]
