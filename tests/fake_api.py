"""A tiny OpenAI-like HTTP server in a thread, for the HTTP tools (``tierserve-load`` and the
benchmarks') without Ray and without a model: ``GET /v1/models``, ``POST /v1/completions``
(JSON or SSE), ``GET /metrics`` (one idle replica, and the requests it finished) and ``GET /``
(the start-up floor's route).

``Behaviour`` says how it answers: the models it lists (and the status of that listing), a
refusal it gives every completion, the one API key it accepts, whether it refuses invalid
requests. A completion naming another model than its own gets 404 ``model_not_found``, as
OpenAI's API answers it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "fake-model"


@dataclass
class Behaviour:
    models: list[str] = field(default_factory=lambda: [MODEL])
    models_status: int = 200  # another: /v1/models answers it with a model_not_found body
    refuse: tuple[int, str] | None = None  # every completion answered with this status, code
    only_key: str | None = None  # a request without this bearer key: 401 invalid_api_key
    validates: bool = True  # max_tokens below 0: 400 invalid_request (else answered)
    tokens: int = 3  # tokens per answer at most


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "code": code, "param": None}}).encode()


class FakeApi:
    """The server, on ``url`` while in a ``with`` block; ``completions`` holds the bodies of the
    completions it was sent."""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.completions: list[dict[str, Any]] = []
        self.finished = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FakeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def metrics(self) -> str:
        gauges = {"requests_waiting": 0, "requests_running": 0, "kv_blocks_free": 16,
                  "kv_blocks_total": 16, "replica_resident_memory_bytes": 100 * 2**20}
        lines = [f'ray_tierserve_{k}{{application="app",replica="r1"}} {v}'
                 for k, v in gauges.items()]
        lines.append('ray_tierserve_requests_finished_total{application="app",replica="r1",'
                     f'reason="length",tier="standard"}} {self.finished}')
        return "\n".join(lines) + "\n"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                b = api.behaviour
                if self.path == "/v1/models":
                    if b.models_status != 200:
                        self.send(b.models_status, error_body("model_not_found", "not here"))
                        return
                    listing = {"object": "list",
                               "data": [{"id": m, "object": "model"} for m in b.models]}
                    self.send(200, json.dumps(listing).encode())
                elif self.path == "/metrics":
                    self.send(200, api.metrics().encode(), "text/plain; version=0.0.4")
                elif self.path == "/":
                    self.send(200, b'"ok"')
                else:
                    self.send(404, error_body("not_found", f"no route {self.path}"))

            def do_POST(self) -> None:
                b = api.behaviour
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with api._lock:
                    api.completions.append(body)
                if self.path != "/v1/completions":
                    self.send(404, error_body("not_found", f"no route {self.path}"))
                elif b.refuse is not None:
                    self.send(b.refuse[0], error_body(b.refuse[1], "refused"))
                elif (b.only_key is not None
                      and self.headers.get("Authorization") != f"Bearer {b.only_key}"):
                    self.send(401, error_body("invalid_api_key", "unknown key"))
                elif body.get("model") != MODEL:
                    self.send(404, error_body("model_not_found",
                                              f"The model {body.get('model')!r} does not exist"))
                elif b.validates and int(body.get("max_tokens") or 0) < 0:
                    self.send(400, error_body("invalid_request", "max_tokens must be >= 0"))
                else:
                    self.answer(body, max(1, min(int(body.get("max_tokens") or 16), b.tokens)))

            def answer(self, body: dict[str, Any], n: int) -> None:
                usage = {"prompt_tokens": len(body.get("prompt") or ()), "completion_tokens": n,
                         "total_tokens": n + len(body.get("prompt") or ())}
                if not body.get("stream"):
                    self.send(200, json.dumps({
                        "object": "text_completion", "model": MODEL, "usage": usage,
                        "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}],
                    }).encode())
                    with api._lock:
                        api.finished += 1
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.close_connection = True
                try:
                    for i in range(n):
                        chunk = {"object": "text_completion", "model": MODEL, "choices": [
                            {"index": 0, "text": "x", "finish_reason": "length" if i == n - 1
                             else None}]}
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                    if (body.get("stream_options") or {}).get("include_usage"):
                        tail = {"object": "text_completion", "choices": [], "usage": usage}
                        self.wfile.write(f"data: {json.dumps(tail)}\n\n".encode())
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):  # the client hung up
                    return
                with api._lock:
                    api.finished += 1

        return Handler
