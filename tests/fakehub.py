"""A local stand-in for the Hugging Face Hub's file endpoint, on 127.0.0.1.

Serves /{repo}/resolve/{revision}/{filename} with the headers huggingface_hub reads
(X-Repo-Commit, ETag, Content-Length) and byte ranges, and can misbehave on purpose.
"""

from __future__ import annotations

import hashlib
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self):
        self.files: dict[tuple[str, str], bytes] = {}
        self.drop_first_get = False  # send half the body, then cut the connection (once)
        self.drop_every_get = False  # cut every body before any byte
        self.requests: list[tuple[str, str, str | None]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _lookup(self):
                m = re.match(r"^/(.+?/.+?)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
                if not m:
                    return None
                return hub.files.get((m.group(1), m.group(3)))

            def _headers(self, body: bytes, status=200, start=0):
                self.send_response(status)
                self.send_header("X-Repo-Commit", "0123456789abcdef0123456789abcdef01234567")
                self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
                self.send_header("Content-Length", str(len(body) - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.end_headers()

            def do_HEAD(self):
                hub.requests.append(("HEAD", self.path, None))
                body = self._lookup()
                if body is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self._headers(body)

            def do_GET(self):
                rng = self.headers.get("Range")
                hub.requests.append(("GET", self.path, rng))
                body = self._lookup()
                if body is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start = int(re.match(r"bytes=(\d+)-", rng).group(1)) if rng else 0
                self._headers(body, 206 if start else 200, start)
                if hub.drop_every_get:
                    self.close_connection = True
                    return
                if hub.drop_first_get:
                    hub.drop_first_get = False
                    self.wfile.write(body[start:start + (len(body) - start) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
