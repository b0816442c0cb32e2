"""Running the app: uvicorn on an address until a signal stops it (every request in flight answered), or in a thread
of this process for `bench --concurrency`."""

import asyncio
import contextlib
import signal
import sys
import threading
import time

from ..errors import GGUFSpecError
from ..generation import GenerationSettings
from .app import create_app
from .protocol import Server

GRACE_SECONDS = 5.0  # after Ctrl-C or SIGTERM, how long requests in flight may go on before they are ended
ANSWER_SECONDS = 10  # then how long the ended requests have to get their answer out before uvicorn cuts them
STOPPING = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s is not None)


def _runner_class():
    import uvicorn

    class Runner(uvicorn.Server):
        """uvicorn's server, which on a stopping signal lets requests in flight go on for `grace` seconds, then ends
        each with an answer that says the server stopped (an error event, a 503), and which keeps the signal to
        exit by (uvicorn raises it again, which a shell that ignores SIGINT turns into exit 0)."""

        def __init__(self, config, server: Server, say, grace: float):
            super().__init__(config)
            self.app_server, self.say, self.grace, self.stopped_by = server, say, grace, None

        def handle_exit(self, sig, frame) -> None:
            self.stopped_by = self.stopped_by or sig
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {s: signal.signal(s, self.handle_exit) for s in STOPPING}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

        async def shutdown(self, sockets=None) -> None:
            ender = asyncio.ensure_future(self._end_requests())
            try:
                await super().shutdown(sockets=sockets)
            finally:
                ender.cancel()

        async def _end_requests(self) -> None:
            await asyncio.sleep(self.grace)
            ended = await asyncio.to_thread(self.app_server.stop)
            if ended:
                self.say(f"ggufspec serve: {ended} request(s) still running {self.grace:g} s after the stop were "
                         "ended, each told that the server stopped")

    return Runner


def serve(engine, name: str, defaults: GenerationSettings, *, host: str = "127.0.0.1", port: int = 8080,
          max_queue: int = 64, api_key: str | None = None, grace: float = GRACE_SECONDS, ready=None,
          say=None) -> int | None:
    """Serve until Ctrl-C (or SIGTERM, SIGHUP); the Engine stays the caller's to close. grace: seconds requests in
    flight may go on after that; ready(url): called once listening; say(line): where the server's own lines go
    (stderr). Returns the signal that stopped it."""
    import uvicorn

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    server = Server(engine, name, defaults, max_queue=max_queue).start()
    config = uvicorn.Config(create_app(server, api_key), host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=grace + ANSWER_SECONDS)
    runner = _runner_class()(config, server, say, grace)
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
    return runner.stopped_by


def check_address(host: str, port: int) -> None:
    """One line, before any model loads, where nothing can listen on host:port (taken, or not this machine's)."""
    import socket

    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise GGUFSpecError(f"cannot listen on {host}:{port} ({e.strerror or e}); give another --port or --host") from None


def is_loopback(host: str) -> bool:
    """Whether an address (or name) is this machine's alone: 127.0.0.0/8, ::1, localhost."""
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class InThread:
    """The app on 127.0.0.1 in a thread of this process while a `with` block runs (`bench --concurrency`); `url`."""

    def __init__(self, engine, name: str, defaults: GenerationSettings, *, max_queue: int = 64):
        import uvicorn

        self.server = Server(engine, name, defaults, max_queue=max_queue)
        self.runner = uvicorn.Server(uvicorn.Config(create_app(self.server), host="127.0.0.1", port=0,  # any free one
                                                    log_level="warning"))
        self.url = ""

    def __enter__(self) -> "InThread":
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
