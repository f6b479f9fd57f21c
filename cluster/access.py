"""One HTTP request as the ingress sees it whole: its server span and its access-log line.

``AccessLog`` (ASGI middleware, inside ``RequestIds`` so the request's id is known) opens an
``Exchange`` for every HTTP request: the server span (``POST /v1/chat/completions``, the child
of the client's W3C ``traceparent`` when it sent one) is current while the routes run, so the
ingress's own spans (``tierserve.auth``, ``tierserve.gate``, ``tierserve.dispatch``) are its
children; the routes note what only they know (``exchange_of(request)``: tenant, tier, model,
tokens, first token, finish reason, error). When the response's last byte has gone (a stream:
when it ends), or the client hung up (status 499), or the app failed (500), the span ends with
the status and one JSON line goes to the logger ``tierserve.access`` at INFO.

The line and the span never hold a prompt, an answer or an API key: the tenant is the key's
configured name (docs/security.md). ``TIERSERVE_ACCESS_LOG`` (``1``, the default, or ``0``)
turns the line on or off; tracing has its own switch (``tierserve.cluster.tracing``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from starlette.requests import ClientDisconnect
from starlette.routing import get_route_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierserve.cluster import tracing
from tierserve.records import RequestOutput, ServingError

access_log = logging.getLogger("tierserve.access")

ACCESS_LOG_ENV = "TIERSERVE_ACCESS_LOG"
CLIENT_CLOSED = 499  # the client hung up before the answer's end (nginx's code)


class AccessLogConfigError(ValueError):
    """``TIERSERVE_ACCESS_LOG`` holds a value that is neither on nor off."""


def access_log_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``TIERSERVE_ACCESS_LOG`` (default on) asks for the access log."""
    env = os.environ if env is None else env
    raw = env.get(ACCESS_LOG_ENV, "").strip().lower()
    if raw in ("", "1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise AccessLogConfigError(f"{ACCESS_LOG_ENV} must be 1 or 0 (on or off), got {raw[:32]!r}")


def setup_access_log(enabled: bool, own_handler: bool) -> None:
    """Turn the ``tierserve.access`` logger on (INFO) or off. ``own_handler``: in a Serve
    replica, where nothing else prints this logger's INFO lines: one handler of its own writing
    the bare JSON line to stderr (into the replica's log file), not passed on to the root."""
    access_log.disabled = not enabled
    if not enabled:
        return
    access_log.setLevel(logging.INFO)
    if own_handler and not access_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.propagate = False


# The methods a span is named by (OpenTelemetry's HTTP conventions); any other is "_OTHER".
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE",
                      "PATCH"})
# A path parameter's converter (``{model_id:path}``), left out of a span's name.
_CONVERTER = re.compile(r"\{(\w+):\w+\}")


def _route_name(scope: Scope) -> str:
    """The server span's name: the method and the template of the app's route the path matches
    (``POST /v1/chat/completions``, ``GET /v1/models/{model_id}``, ``DELETE
    /v1/responses/{response_id}``), under the app's route prefix; a path no route matches is
    ``unmatched`` and a method outside HTTP's own ``_OTHER``. Nothing the client chose beyond
    that is in a name, so there are as many names as routes (bounded). Named at the start from
    the app's routes, and again at the end from the route the router chose."""
    method = str(scope.get("method", ""))
    template = _template(scope)
    name = ("unmatched" if template is None
            else str(scope.get("root_path") or "") + _CONVERTER.sub(r"{\1}", template))
    return f"{method if method in _METHODS else '_OTHER'} {name}"


def _template(scope: Scope) -> str | None:
    """The path template of the route that takes the request: the router's, where it has
    chosen one, else the first of the app's routes whose pattern matches the path (as the
    router will try them; the routes of an included router too, as Serve's class-based app
    holds them); None where none does."""
    chosen = getattr(scope.get("route"), "path", None)
    if isinstance(chosen, str):
        return chosen
    return _matching(getattr(scope.get("app"), "routes", None) or (), get_route_path(scope))


def _matching(routes: Any, path: str, prefix: str = "") -> str | None:
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's included router
        if inner is not None:
            more = str(getattr(getattr(route, "include_context", None), "prefix", "") or "")
            if path.startswith(prefix + more):
                found = _matching(getattr(inner, "routes", None) or (), path, prefix + more)
                if found is not None:
                    return found
            continue
        pattern, template = getattr(route, "path_regex", None), getattr(route, "path", None)
        if (isinstance(template, str) and pattern is not None and path.startswith(prefix)
                and pattern.match(path[len(prefix):])):
            return prefix + template
    return None


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", ()):
        if k.lower() == name:
            return str(v.decode("latin-1"))
    return None


@dataclass(slots=True)
class Exchange:
    """What one HTTP request did, for its span and its access-log line (see the module
    docstring). Times: ``started`` (``time.time()``) and ``t0`` (``time.monotonic()``) at
    arrival; ``first_token``: monotonic, when its first token reached the ingress."""

    method: str
    path: str
    span: Span
    client: str | None = None
    request_id: str = ""
    started: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.monotonic)
    status: int | None = None
    tenant: str | None = None
    tier: str | None = None
    model: str | None = None
    prompt_tokens: int = 0
    # Each finished sample's tokens, by (send, sample index): a batched completions request has
    # one send per prompt, and a send made again after a replica failed starts its count over.
    samples: dict[tuple[int, int], int] = field(default_factory=dict)
    cached_tokens: int | None = None
    first_token: float | None = None
    finish_reason: str | None = None
    error: str | None = None  # the error's code (an HTTP error's, or one that ended a stream)
    done: bool = False

    # -------------------------------------------------------- what the routes note

    def caller(self, tenant: str, tier: str) -> None:
        self.tenant, self.tier = tenant, tier
        self.span.set_attribute("tierserve.tenant", tenant)
        self.span.set_attribute("tierserve.tier", tier)

    def requested(self, model: str, prompt_tokens: int) -> None:
        """A prompt of ``prompt_tokens`` for ``model`` goes to the replicas (a batched
        completions request: once per prompt, summed)."""
        self.model = model
        self.prompt_tokens += prompt_tokens
        self.span.set_attribute("gen_ai.request.model", model)

    @property
    def completion_tokens(self) -> int:
        return sum(self.samples.values())

    def output(self, item: RequestOutput, send: int = 0) -> None:
        """A delta of the send ``send`` (a key of one prompt's sends, the same while the request
        lives, e.g. the id of its record at the ingress): the first token's time; a sample's end
        (its tokens, the first sample's finish reason); the cached prompt positions."""
        if self.first_token is None and item.token_ids:
            self.first_token = time.monotonic()
            self.span.add_event("first_token")
        if item.cached_tokens is not None and item.index == 0:
            self.cached_tokens = item.cached_tokens
        if item.finished:
            self.samples[(send, item.index)] = item.completion_tokens
            if self.finish_reason is None or item.index == 0:
                self.finish_reason = item.finish_reason

    def restart(self, send: int = 0) -> None:
        """The send ``send`` goes again after a replica failed it: its answer starts over."""
        self.samples = {k: v for k, v in self.samples.items() if k[0] != send}
        self.first_token = None
        self.finish_reason = None

    def failed(self, error: ServingError) -> None:
        """An error answered the request (an HTTP error, or the event that ends a stream)."""
        self.error = error.code
        # Its type and code, not its message: a message may quote the request (a template's
        # complaint), and neither span nor line holds what the client sent.
        self.span.add_event("exception", {"exception.type": type(error).__name__,
                                          "http.response.status_code": error.status,
                                          "error.type": error.code or ""})
        self.span.set_status(Status(StatusCode.ERROR, error.code or type(error).__name__))

    # -------------------------------------------------------- the end

    def finish(self) -> None:
        """End the span and write the log line (once)."""
        if self.done:
            return
        self.done = True
        status = self.status if self.status is not None else 500
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if self.request_id:
            span.set_attribute("tierserve.request_id", self.request_id)
        if self.model is not None:
            span.set_attribute("gen_ai.usage.input_tokens", self.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", self.completion_tokens)
        if self.finish_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [self.finish_reason])
        if status >= 500 or status == CLIENT_CLOSED:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        span.end()
        if access_log.disabled or not access_log.isEnabledFor(logging.INFO):
            return
        line = self.line(status)
        access_log.info(json.dumps(line, separators=(",", ":")))

    def line(self, status: int) -> dict[str, Any]:
        """The access-log record (docs/observability.md lists its fields)."""
        now = time.monotonic()
        ctx = self.span.get_span_context()
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(self.started, UTC).isoformat(timespec="milliseconds"),
            "request_id": self.request_id or None,
            "method": self.method,
            "path": self.path,
            "status": status,
            "tenant": self.tenant,
            "tier": self.tier,
            "model": self.model,
            "prompt_tokens": self.prompt_tokens if self.model is not None else None,
            "completion_tokens": self.completion_tokens if self.model is not None else None,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": (None if self.first_token is None
                        else round((self.first_token - self.t0) * 1000, 1)),
            "duration_ms": round((now - self.t0) * 1000, 1),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "client": self.client,
        }
        if ctx.is_valid:
            out["trace_id"] = format(ctx.trace_id, "032x")
        return out


def exchange_of(request: Any) -> Exchange | None:
    """The request's ``Exchange`` (None outside ``AccessLog``: a route called directly)."""
    scope = getattr(request, "scope", None) or {}
    value = (scope.get("state") or {}).get("exchange")
    return value if isinstance(value, Exchange) else None


class AccessLog:
    """ASGI middleware: every HTTP request's ``Exchange`` (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = str(scope.get("method", "")), str(scope.get("path", ""))
        parent = tracing.context_of(_header(scope, b"traceparent"),
                                    _header(scope, b"tracestate"))
        span = tracing.tracer().start_span(
            _route_name(scope), context=parent, kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path})
        client = scope.get("client")
        state = scope.setdefault("state", {})
        ex = Exchange(method, path, span, client=str(client[0]) if client else None,
                      request_id=str(state.get("request_id") or ""))
        state["exchange"] = ex
        ended = False  # the response's last body message went out

        async def send_noted(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                ex.status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                ended = True  # (after the send: one that fails is a client gone)

        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            await self.app(scope, receive, send_noted)
        except (asyncio.CancelledError, ClientDisconnect, OSError):
            ended = False  # the client went away (the call cancelled, or a send that failed)
            raise
        except Exception as exc:  # RequestIds answers it: a 500, unless the answer had started
            span.add_event("exception", {"exception.type": type(exc).__name__})  # (as failed)
            ex.error = ex.error or "internal_error"
            ex.status = ex.status or 500
            ended = True
            raise
        finally:
            otel_context.detach(token)
            span.update_name(_route_name(scope))  # the route the router chose, now it has
            if not ended:  # its end never went out: the client hung up
                ex.status = CLIENT_CLOSED
                ex.error = ex.error or "client_closed"
            ex.finish()
