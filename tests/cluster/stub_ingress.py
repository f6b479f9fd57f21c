"""The ingress without Ray: the real ``Ingress`` class over a stand-in engine handle.

``StubIngress(config)`` builds the deployment's own class (not Serve's wrapper) with the tiny
model's tokenizer and a handle whose ``generate`` answers every sample at once with a fixed
text, so the ingress's parsing, rendering, sampling parameters and answer shapes are tested in
a second, without replicas. ``post`` calls a route's method as FastAPI would and returns the
status, the JSON body (or the SSE events' JSON) and the headers; every ``GenerateRequest`` the
ingress sent is in ``sent``. With a ``models`` config each model has its own handle
(``handles``, by served name, each with its deployment's name and its own ``sent``). ``send`` does the same through the app's own middleware (request
ids, the access log and the server span) as the ASGI app it is, and may hang up part-way.
The handle's LoRA methods (``load_lora_adapter``, ``unload_lora_adapter``,
``list_lora_adapters``) keep the adapters it holds in ``loras`` (name to path) and refuse as a
replica does: a folder without ``adapter_config.json`` or whose ``r`` is above 16 is a 400, a
name in ``busy`` a 409 on unload; a name loaded again under another id replaces the old copy
(``ids``: name to id). The records in ``refuse`` are the first answers of the next
``generate`` calls, one each (a replica refusing a request before its first token).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi.responses import StreamingResponse
from starlette.requests import Request

from tierserve.cluster import ingress
from tierserve.cluster.app import ingress_args, load_config
from tierserve.cluster.config import deployment_of
from tierserve.records import (
    ErrorRecord,
    GenerateRequest,
    LoRARequest,
    RequestOutput,
    ServingError,
    TokenLogprob,
)

ANSWER = " ok"  # every sample's text


class _Stream:
    """One request's deltas: every sample's whole answer in one finished delta."""

    def __init__(self, outputs: list[RequestOutput] | list[ErrorRecord]) -> None:
        self._outputs: list[Any] = list(outputs)

    async def __anext__(self) -> RequestOutput | ErrorRecord:
        if not self._outputs:
            raise StopAsyncIteration
        return self._outputs.pop(0)

    def cancel(self) -> None:
        self._outputs = []


@dataclass
class _Handle:
    """The engine deployment's handle, as far as the ingress uses it."""

    tokenizer: Any
    sent: list[GenerateRequest] = field(default_factory=list)
    app_name: str = "stub"
    deployment_name: str = "LLMServer"
    loras: dict[str, str] = field(default_factory=dict)  # the adapters it holds: name -> path
    busy: set[str] = field(default_factory=set)  # adapters with requests on them (unload: 409)
    calls: list[tuple[Any, ...]] = field(default_factory=list)  # LoRA method calls, in order
    ids: dict[str, int] = field(default_factory=dict)  # the id each held adapter was loaded as
    refuse: list[ErrorRecord] = field(default_factory=list)  # the next requests' refusals

    def options(self, **_: Any) -> _Handle:
        return self

    @property
    def load_lora_adapter(self) -> _Method:
        return _Method(self._load)

    @property
    def unload_lora_adapter(self) -> _Method:
        return _Method(self._unload)

    @property
    def list_lora_adapters(self) -> _Method:
        return _Method(lambda: [LoRARequest(n, 1, p) for n, p in self.loras.items()])

    def _load(self, name: str, path: str, int_id: int = 1) -> ErrorRecord | None:
        self.calls.append(("load", name, path, int_id))
        config = os.path.join(path, "adapter_config.json")
        if not os.path.isfile(config):
            return ErrorRecord(400, "invalid_lora_adapter",
                               f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
        with open(config) as f:
            rank = json.load(f).get("r", 8)
        if rank > 16:
            return ErrorRecord(400, "invalid_lora_adapter",
                               f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank 16")
        self.loras[name] = path  # another id's copy, if any, replaced
        self.ids[name] = int_id
        return None

    def _unload(self, name: str, int_id: int | None = None) -> ErrorRecord | None:
        self.calls.append(("unload", name))
        if int_id is not None and self.ids.get(name, int_id) != int_id:
            return ErrorRecord(404, "lora_not_found", f"LoRA adapter {name!r} is not loaded")
        if name in self.busy:
            return ErrorRecord(409, "lora_in_use", f"LoRA adapter {name!r} is in use")
        self.ids.pop(name, None)
        if self.loras.pop(name, None) is None:
            return ErrorRecord(404, "lora_not_found", f"LoRA adapter {name!r} is not loaded")
        return None

    @property
    def generate(self) -> _Handle:
        return self

    def remote(self, request: GenerateRequest) -> _Stream:
        self.sent.append(request)
        if self.refuse:
            return _Stream([self.refuse.pop(0)])
        ids = list(self.tokenizer.encode(ANSWER, add_special_tokens=False))
        p = request.sampling
        outs = []
        for i in range(request.n):
            lps = ([TokenLogprob(t, -0.5, ((t, -0.5),) * min(p.logprobs, 1)) for t in ids]
                   if p.logprobs is not None else None)
            prompt_lps: list[TokenLogprob | None] | None = None
            if p.prompt_logprobs is not None:
                prompt_lps = [None] + [TokenLogprob(t, -1.0, ((t, -1.0),) * min(
                    p.prompt_logprobs, 1)) for t in request.prompt_ids[1:]]
            outs.append(RequestOutput(
                request_id=i, text=ANSWER, token_ids=ids, finished=True, finish_reason="stop",
                prompt_tokens=len(request.prompt_ids), completion_tokens=len(ids), index=i,
                logprobs=lps, prompt_logprobs=prompt_lps, cached_tokens=0))
        return _Stream(outs)


@dataclass
class _Method:
    """A handle's method: ``remote`` answers as Serve's awaitable response does."""

    fn: Any

    async def _answer(self, *args: Any) -> Any:
        return self.fn(*args)

    def remote(self, *args: Any) -> Any:
        return self._answer(*args)


def _ingress_class() -> type:
    """The ``Ingress`` class as written (Serve's ASGI wrapper subclasses it)."""
    wrapper: Any = cast(Any, ingress.Ingress).func_or_class
    return [c for c in wrapper.__mro__ if c.__name__ == "Ingress"][-1]


@dataclass
class _Route:
    path: str  # the route's path template


@dataclass
class Answer:
    status: int
    body: Any  # the JSON body; for a stream, the list of its events' JSON (without [DONE])
    headers: dict[str, str]


class StubIngress:
    def __init__(self, config: dict[str, Any] | None = None) -> None:
        args = {"flow": {"enabled": False}, **(config or {})}
        cfg = load_config(args)
        from tierserve.replica.models.meta import load_tokenizer

        self.handles = {
            m.name: _Handle(load_tokenizer(m.engine.model, m.engine.trust_remote_code),
                            deployment_name=deployment_of(m, i))
            for i, m in enumerate(cfg.served_models())}
        self.handle = next(iter(self.handles.values()))
        cls = _ingress_class()
        self.cls = cls
        handles = list(self.handles.values())
        self.inst = cls(handles[0] if cfg.models is None else handles, ingress_args(cfg))
        self.model = cfg.model_name

    @property
    def sent(self) -> list[GenerateRequest]:
        return self.handle.sent

    def post(self, route: str, body: dict[str, Any] | str,
             headers: dict[str, str] | None = None) -> Answer:
        """Call the method of ``route`` with ``body``; a ``ServingError`` comes back as the
        answer the app's handler makes of it."""
        method = {"/v1/completions": "completions",
                  "/v1/chat/completions": "chat", "/tokenize": "tokenize",
                  "/detokenize": "detokenize", "/v1/responses": "responses",
                  "/v1/load_lora_adapter": "load_lora_adapter",
                  "/v1/unload_lora_adapter": "unload_lora_adapter"}[route]
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        return asyncio.run(self._call(method, route, data, headers or {}))

    def get(self, route: str, headers: dict[str, str] | None = None) -> Answer:
        """``GET /version``, ``/v1/models``, ``/v1/models/{id}`` or ``/ready``, as ``post``
        calls a route."""
        return asyncio.run(self._get(route, headers or {}))

    async def _get(self, route: str, headers: dict[str, str]) -> Answer:
        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = {"type": "http", "method": "GET", "path": route, "headers": raw,
                 "query_string": b"", "app": ingress.app}
        request = Request(scope)
        response: Any
        cls: Any = self.cls
        try:
            if route == "/version":
                response = await cls.version(self.inst)
            elif route == "/v1/models":
                response = await cls.models(self.inst, request)
            elif route == "/ready":
                response = await cls.ready(self.inst)
            else:
                model_id = route.removeprefix("/v1/models/")
                response = await cls.model(self.inst, request, model_id)
        except ServingError as e:
            response = await ingress._api_error(request, e)
        if isinstance(response, dict):
            return Answer(200, response, {})
        return Answer(response.status_code, json.loads(bytes(response.body)),
                      dict(response.headers))

    def post_raw(self, route: str, data: bytes, headers: dict[str, str] | None = None
                 ) -> tuple[int, bytes, dict[str, str]]:
        """``post`` without parsing: the status, the body as sent (a stream's bytes, whole)
        and the headers; what a client library on a mock transport reads."""
        return asyncio.run(self._raw(route, data, headers or {}))

    async def _raw(self, route: str, data: bytes, headers: dict[str, str]
                   ) -> tuple[int, bytes, dict[str, str]]:
        method = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}[route]
        response = await self._respond(method, route, data, headers)
        if isinstance(response, StreamingResponse):
            body = "".join([c async for c in _chunks(response)]).encode()
        else:
            body = bytes(response.body)
        return response.status_code, body, dict(response.headers)

    def send(self, route: str, body: dict[str, Any] | str,
             headers: dict[str, str] | None = None, hang_up_after: int | None = None,
             fail: BaseException | None = None, client: tuple[str, int] = ("10.1.2.3", 5555)
             ) -> Answer:
        """``post`` as an HTTP request through the app's middleware (``ingress.app``'s, in
        its order) to the route, the response sent as ASGI messages. ``hang_up_after``: the
        client disconnects once that many body messages have arrived; ``fail``: the route
        raises it instead of answering. A stream's ``body`` is its events' JSON."""
        method = {"/v1/completions": "completions",
                  "/v1/chat/completions": "chat", "/tokenize": "tokenize",
                  "/detokenize": "detokenize", "/v1/responses": "responses"}[route]
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        return asyncio.run(self._asgi(method, route, data, headers or {}, hang_up_after, fail,
                                      client))

    async def _asgi(self, method: str, path: str, data: bytes, headers: dict[str, str],
                    hang_up_after: int | None, fail: BaseException | None,
                    client: tuple[str, int]) -> Answer:
        hang_up = asyncio.Event()
        received = False

        async def receive() -> dict[str, Any]:
            nonlocal received
            if not received:
                received = True
                return {"type": "http.request", "body": data, "more_body": False}
            await hang_up.wait()
            return {"type": "http.disconnect"}

        messages: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            messages.append(message)
            bodies = sum(1 for m in messages if m["type"] == "http.response.body")
            if hang_up_after is not None and bodies >= hang_up_after:
                hang_up.set()
                for _ in range(3):  # the disconnect is seen before the next message
                    await asyncio.sleep(0)

        async def endpoint(scope: Any, receive_: Any, send_: Any) -> None:
            scope["route"] = _Route(path)  # what the app's router notes of the route it chose
            request = Request(scope, receive_)
            if fail is not None:
                raise fail
            try:
                response = await getattr(self.cls, method)(self.inst, request)
            except ServingError as e:
                response = await ingress._api_error(request, e)
            await response(scope, receive_, send_)

        app: Any = endpoint
        for m in reversed(ingress.app.user_middleware):
            cls, args, kwargs = m
            app = cls(app, *args, **kwargs)
        raw = [(b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = {"type": "http", "method": "POST", "path": path, "headers": raw,
                 "query_string": b"", "app": ingress.app, "client": client}
        await app(scope, receive, send)
        start = next(m for m in messages if m["type"] == "http.response.start")
        hdrs = {k.decode(): v.decode() for k, v in start.get("headers", ())}
        text = b"".join(m.get("body", b"") for m in messages
                        if m["type"] == "http.response.body").decode()
        if hdrs.get("content-type", "").startswith("text/event-stream"):
            events = [json.loads(line[len("data: "):]) for line in text.split("\n")
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return Answer(int(start["status"]), events, hdrs)
        return Answer(int(start["status"]), json.loads(text) if text else None, hdrs)

    async def _call(self, method: str, path: str, data: bytes,
                    headers: dict[str, str]) -> Answer:
        response = await self._respond(method, path, data, headers)
        hdrs = dict(response.headers)
        if isinstance(response, StreamingResponse):
            events: list[Any] = []
            async for chunk in _chunks(response):
                for line in chunk.split("\n"):
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: "):]))
            return Answer(response.status_code, events, hdrs)
        return Answer(response.status_code, json.loads(bytes(response.body)), hdrs)

    async def _respond(self, method: str, path: str, data: bytes,
                       headers: dict[str, str]) -> Any:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}

        raw = [(b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        # The request's id as the app's middleware (``ingress.RequestIds``) sets it.
        rid = {k.lower(): v for k, v in headers.items()}.get("x-request-id", "req-stub")
        scope = {"type": "http", "method": "POST", "path": path, "headers": raw,
                 "query_string": b"", "app": ingress.app, "state": {"request_id": rid}}
        request = Request(scope, receive)
        try:
            response = await getattr(self.cls, method)(self.inst, request)
        except ServingError as e:
            response = await ingress._api_error(request, e)
        return response


async def _chunks(response: StreamingResponse) -> AsyncIterator[str]:
    async for chunk in response.body_iterator:
        yield chunk if isinstance(chunk, str) else bytes(chunk).decode()
