"""The HTTP front door: FastAPI under ``@serve.ingress``, an OpenAI-compatible subset.

One request: validate the body (pydantic, strict), resolve the caller's tier, priority and
tenant, pick the model it names (``_Served``: one record per served model, each on its own engine
deployment; a model that is not served, or not to the caller's key, is a 404 ``model_not_found``),
tokenize, pass that model's flow-control gate (``tierserve.cluster.gate``: held while no replica
can start it, fair between tenants, shed from the lowest tier first), then call its engine
deployment's streaming ``generate`` through a handle whose router is
``tierserve.router.free_blocks_router.FreeKVBlocksRouter``. When it ends, whether it met its tier's targets
is counted (goodput). Errors are OpenAI-shaped JSON, every one built by
``tierserve.cluster.protocol.error_body`` (``{"error": {"message", "type", "code", "param"}}``):
400 bad input, 401 bad key, 403 an admin route without an admin key, 404 unknown model, 413 body
too large, 429 full queue or shed load (with
``Retry-After``), 503 no replica can serve; inside a stream, the same body as its last event.
"""


import asyncio
import contextlib
import inspect
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tierserve import __version__
from tierserve.cluster import tracing
from tierserve.cluster.access import (
    AccessLog,
    Exchange,
    access_log_enabled,
    exchange_of,
    setup_access_log,
)
from tierserve.cluster.adapters import (
    Adapter,
    AdapterRegistry,
    AdapterStore,
    DynamicAdapters,
    LocalStore,
    PermissionDenied,
    RayStore,
    open_tiers,
)
from tierserve.cluster.chat_template import render_chat, template_kwargs, template_takes_tools
from tierserve.cluster.config import ClusterConfig, ModelConfig, deployment_of
from tierserve.cluster.edge import (
    PromptBound,
    Tokenizing,
    longest_token_bytes,
    message_texts,
    read_json,
)
from tierserve.cluster.gate import FlowGate, Shed, Ticket
from tierserve.cluster.logprobs import (
    TokenIdNames,
    TokenNames,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs,
)
from tierserve.cluster.metrics import IngressMetrics
from tierserve.cluster.openapi import openapi_schema
from tierserve.cluster.protocol import (
    REQUEST_ID_PATTERN,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    LoRAAdapterAnswer,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    ToolCallDelta,
    UnloadLoRAAdapterRequest,
    Usage,
    VersionResponse,
    dump,
    error_body,
    new_id,
    now,
    usage,
)
from tierserve.cluster.readiness import Readiness, serve_census, together
from tierserve.cluster.responses import (
    ResponsesCall,
    ResponsesRequest,
    stored_responses_refused,
)
from tierserve.cluster.structured import (
    SchemaCheckBusy,
    SchemaChecker,
    Structured,
    StructuredError,
)
from tierserve.cluster.tiers import Caller, TierResolver, cache_partition
from tierserve.cluster.tool_calls import (
    HERMES,
    CallParser,
    ToolMessageError,
    make_parser,
    parse_tool_calls,
    render_messages,
    resolve_tool_format,
)
from tierserve.records import (
    GRAMMAR_REJECTED_TOKEN,
    BadRequest,
    ErrorRecord,
    GenerateRequest,
    NotFound,
    RequestOutput,
    SamplingParams,
    ServerFault,
    ServingError,
    TokenLogprob,
    TooManyRequests,
    Unavailable,
    failed_before_first_token,
    replica_failed,
    share_of,
    targets_kept,
)
from tierserve.replica.config import EngineConfig, context_length
from tierserve.replica.detokenizer import bad_words_ids
from tierserve.replica.models.meta import load_model_config, load_tokenizer
from tierserve.replica.prefix_cache import adapter_partition, block_hashes, partition_root
from tierserve.router import registry

log = logging.getLogger("tierserve.ingress")

_M = TypeVar("_M", bound=BaseModel)


# Characters JSON leaves raw inside strings but common line splitters (Python's str.splitlines,
# hence httpx's aiter_lines) treat as line ends: an SSE event carrying one would reach such a
# client cut in two. Written as JSON escapes, the event is one line and decodes to the same text.
_LINE_BREAKERS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse_event(payload: str) -> str:
    """One SSE ``data:`` event of a JSON ``payload`` that every line splitter keeps whole."""
    return f"data: {payload.translate(_LINE_BREAKERS)}\n\n"


def error_response(
    status: int, message: str, code: str | None = None, param: str | None = None,
    retry_after: int | None = None, request_id: str | None = None,
) -> JSONResponse:
    """An HTTP error (with ``Retry-After`` when given); ``request_id``: the request's
    ``X-Request-Id``, in the body's ``error.request_id`` and the header."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    body = error_body(status, message, code, param)
    if request_id is not None:
        body["error"]["request_id"] = request_id
        headers[REQUEST_ID_HEADER] = request_id
    return JSONResponse(body, status_code=status, headers=headers or None)


# The header a request's id comes in and goes back out in (every response, errors included).
REQUEST_ID_HEADER = "X-Request-Id"
# A replica's refusals before the first token that another replica may not give: its failure,
# and an adapter it could not load at request time (a folder its node lacks, a read that
# failed): each is sent to another replica (the refusing one avoided) while retries allow.
RESENT_CODES = frozenset({"replica_unavailable", "adapter_unavailable"})
_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


def request_id_of(request: Request) -> str | None:
    """The request's id, as ``RequestIds`` set it (None outside the app's middleware)."""
    scope = getattr(request, "scope", None) or {}
    value = (scope.get("state") or {}).get("request_id")
    return value if isinstance(value, str) else None


@dataclass(slots=True)
class _Proxy:
    """Whether a Serve HTTP proxy stands in front of this process's app. Serve's proxy gives
    every request an ``X-Request-Id`` header (the client's, or one it makes) before the app sees
    it, and adds the same id to every response's headers itself: then ``RequestIds`` leaves the
    response header to it (one header, the same id), and uses the id it finds."""

    checked: bool | None = None  # None: not known yet (asked on the first request)

    @property
    def echoes_request_id(self) -> bool:
        if self.checked is None:
            self.checked = _under_serve()
        return self.checked


_proxy = _Proxy()


def _under_serve() -> bool:
    """Whether this process runs a Serve replica (so Serve's proxy fronts the app)."""
    try:
        serve.get_replica_context()
    except Exception:
        return False
    return True


class RequestIds:
    """ASGI middleware: every request gets an id, the client's ``X-Request-Id`` (1 to 128
    visible ASCII characters, as the body's ``request_id``) or a new one; it is in the scope's
    state for the routes (``request_id_of``: to the replica, into the error bodies) and in
    every response's ``X-Request-Id`` (under Serve, its proxy's: ``_Proxy``). A malformed
    header is a 400 ``invalid_request_id`` (under a new id; under Serve, the proxy still echoes
    the header as sent). It also answers an exception no handler took (a 500 naming its type) while
    the response has not started, so that answer carries the id too."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = [v for k, v in scope.get("headers", ()) if k.lower() == b"x-request-id"]
        given = sent[0].decode("latin-1") if sent else None
        ok = given is not None and _REQUEST_ID.fullmatch(given) is not None
        rid = given if ok and given is not None else new_id("req")
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = MutableHeaders(scope=message)
                if _proxy.echoes_request_id:  # the proxy adds it: one header, not two
                    del headers[REQUEST_ID_HEADER]
                else:
                    headers[REQUEST_ID_HEADER] = rid
            await send(message)

        if given is not None and not ok:
            await error_response(
                400, f"the {REQUEST_ID_HEADER} header must be 1 to 128 visible ASCII "
                f"characters (got {len(given)} characters: {given[:32]!r})",
                "invalid_request_id", REQUEST_ID_HEADER, request_id=rid,
            )(scope, receive, send_with_id)
            return
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if started:
                raise
            log.error("request %s %s %s failed: %r", rid, scope.get("method"),
                      scope.get("path"), exc)
            e = internal_error(exc)
            await error_response(e.status, e.message, e.code, request_id=rid)(
                scope, receive, send_with_id)


def _json_bytes(content: Any) -> bytes:
    """``content`` as JSONResponse renders it (compact, UTF-8), to be made off the event loop."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                      separators=(",", ":")).encode("utf-8")


def error_event(error: ServingError, request_id: str | None = None) -> str:
    """The SSE event that ends a stream in ``error``: the body its HTTP error would have had
    (``request_id``: the request's ``X-Request-Id``, in ``error.request_id``)."""
    body = error_body(error.status, error.message, error.code, error.param)
    if request_id:
        body["error"]["request_id"] = request_id
    return sse_event(json.dumps(body))


# Pydantic puts the member type of a union in an error's location ("temperature.float",
# "prompt.str"); the client's ``param`` is the field path only.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
# The tags of a chat message's union (its role, as pydantic names the member in a location).
_MESSAGE_TAGS = frozenset({"system", "developer", "user", "assistant", "tool"})


def validation_error(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The message and ``param`` of a pydantic validation failure: a validator's own complaint
    first (in a union it says more than "Input should be a valid string"), else the first. A
    discriminated union's bad tag names the discriminator (``messages.0.role``)."""
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0] if errors else {})
    extra = first.get("type") == "extra_forbidden"
    param = error_param(first.get("loc", ()), extra)
    tag = str((first.get("ctx") or {}).get("discriminator", "")).strip("'")
    if first.get("type") in ("union_tag_invalid", "union_tag_not_found") and tag:
        param = f"{param}.{tag}" if param else tag
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if extra:
        return f"unknown field {param!r}", param
    return (f"{param}: {msg}" if param else msg), param


def error_param(loc: Sequence[int | str], extra: bool = False) -> str | None:
    """The field path of an error; ``extra``: the location is an unknown field's name, as is.
    A chat message's role, which pydantic puts after its index (its union's tag), is left out:
    ``messages.0.user.content`` is ``messages.0.content``. So is a union's member tag before a
    list's index (``input.list.0.extra`` is ``input.0.extra``)."""
    parts: list[str] = []
    for i, p in enumerate(loc):
        if p == "body":
            continue
        if p in _UNION_TAGS and i + 1 < len(loc) and isinstance(loc[i + 1], int):
            continue
        after_index = i > 0 and isinstance(loc[i - 1], int)
        if isinstance(p, str) and after_index and p in _MESSAGE_TAGS and (
                i + 1 < len(loc) or not extra):
            continue
        if extra or isinstance(p, int) or (p not in _UNION_TAGS and "[" not in p):
            parts.append(str(p))
    return ".".join(parts) or None


def validated(model: type[_M], data: dict[str, Any]) -> _M:
    """``data`` as ``model``; a validation failure a 400 naming the field."""
    try:
        return model.model_validate(data)
    except Exception as e:
        from pydantic import ValidationError

        if not isinstance(e, ValidationError):
            raise
        msg, param = validation_error(e.errors())
        raise BadRequest(msg, "invalid_request", param) from None


@dataclass(slots=True)
class _Served:
    """One served model as the ingress holds it: its name and engine deployment (the handle
    requests go through), what tokenizing, rendering and checking its requests takes (its
    tokenizer, chat template, tool-call format, prompt bound, prefix-cache root, limits), and
    its own readiness and flow-control gate (its replicas are their own capacity). Only the
    tokenizer and the model's config are loaded here, never its weights: a model costs the
    ingress its tokenizer's memory."""

    name: str
    deployment: str
    llm: Any  # its engine deployment's handle, streaming
    engine: EngineConfig
    tokenizer: Any
    special_ids: frozenset[int]
    vocab_size: int
    tokenizer_size: int  # the ids the tokenizer can name: what /detokenize takes
    prompt_bound: PromptBound
    template_takes_tools: bool  # its chat template lists tools itself
    token_text: TokenText
    tool_format: str
    max_tokens_limit: int
    prefix_root: Any  # the replicas' prefix-cache names for prefix affinity (None: cache off)
    readiness: Readiness
    gate: FlowGate | None = None
    control: Any = None  # the same handle, not streaming: the replicas' LoRA methods

    @classmethod
    def load(cls, cfg: ClusterConfig, model: ModelConfig, deployment: str, handle: Any
             ) -> "_Served":
        """``model``'s record (its gate is the caller's to add)."""
        engine = model.engine
        tokenizer = load_tokenizer(engine.model, engine.trust_remote_code)
        mcfg = load_model_config(engine.model, engine.trust_remote_code)
        llm = handle.options(stream=True)
        return cls(
            name=model.name, deployment=deployment, llm=llm, engine=engine,
            tokenizer=tokenizer, special_ids=frozenset(tokenizer.all_special_ids),
            vocab_size=mcfg.vocab_size, tokenizer_size=len(tokenizer),
            prompt_bound=PromptBound(context_length(engine, mcfg.max_position_embeddings),
                                     longest_token_bytes(tokenizer)),
            template_takes_tools=template_takes_tools(tokenizer),
            token_text=TokenText(tokenizer),
            # The format of the model's tool calls: the config's, else its template's markers.
            tool_format=resolve_tool_format(
                model.tool_call_parser, str(getattr(tokenizer, "chat_template", "") or "")),
            max_tokens_limit=model.max_tokens_limit or cfg.max_tokens_limit,
            prefix_root=engine.prefix_root() if engine.enable_prefix_caching else None,
            readiness=Readiness(lambda: serve_census(llm.app_name, llm.deployment_name)),
            control=handle)

    def replica_count(self) -> int:
        """The engine replicas this process's router sees (1 before it has seen any)."""
        views = registry.routers(self.llm.app_name, self.llm.deployment_name)
        return max((v.replica_count() for v in views), default=1)


@dataclass(slots=True)
class _Call:
    """What the ingress needs to answer one request: its shape, not its sampling."""

    chat: bool
    n: int
    ids: list[int]
    served: _Served  # the model it is for
    echo: str | None = None  # completions: the prompt text to return before the completion
    logprobs: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    # Chat: how it may call tools (``tool_mode``) and, unless "none", their names (the answer
    # is parsed for calls).
    tool_mode: str = "none"
    tools: frozenset[str] | None = None
    tool_format: str = HERMES  # the format its calls are written in (``tool_calls.TOOL_FORMATS``)
    cache_partition: str | None = None  # its prompt's prefix-cache partition (``cache_partition``)
    # vLLM's fields: the prompt's log-probabilities in the answer; tokens named by id in
    # log-probabilities (``return_tokens_as_token_ids``).
    prompt_logprobs: bool = False
    token_ids: bool = False
    request_id: str = ""  # the client's (body ``request_id``), in the answer's ``id``
    service_tier: str | None = None  # the one it runs in, where the request named one
    header_id: str = ""  # the HTTP request's id (``X-Request-Id``, sent or made): to the replica
    adapter: Adapter | None = None  # the LoRA adapter its ``model`` named (None: the base model)

    @property
    def model_name(self) -> str:
        """The ``model`` its answer names: the adapter's name, else the served model's."""
        return self.adapter.name if self.adapter is not None else self.served.name

    def parser(self) -> CallParser | None:
        """A fresh parser of one answer's tool calls (None: no tools)."""
        return None if self.tools is None else make_parser(self.tool_format, self.tools)


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """An answer that stopped on its own after calling a tool finished for ``tool_calls``."""
    return "tool_calls" if reason == "stop" and called else reason


@dataclass(slots=True)
class _Route:
    """One request's sends to the replicas: what every send carries, how many more sends a
    replica failure allows, the replicas that failed it, and whether any of its answer has gone
    to the client (then it is not sent again)."""

    sampling: SamplingParams
    caller: Caller
    retries_left: int
    avoid: list[str] = field(default_factory=list)
    committed: bool = False
    # Goodput: when the ingress took the request, its first sample's first and last token
    # times and tokens; the flow-control ticket (None with flow control off).
    arrival: float = field(default_factory=time.monotonic)
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    ticket: Ticket | None = None
    gate: FlowGate | None = None  # its model's flow-control gate (None: flow control off)
    counted: bool = False
    # The HTTP request's record (its server span, its access-log line); None outside AccessLog.
    exchange: Exchange | None = None

    @property
    def can_resend(self) -> bool:
        return self.retries_left > 0 and not self.committed


@dataclass(slots=True)
class _Choice:
    """One of a request's ``n`` samples, as its deltas arrive."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    completion_tokens: int = 0
    failure: str | None = None
    error_code: str | None = None  # an "error" finish that is the request's, not the replica's
    started: bool = False
    cached_tokens: int | None = None  # prompt positions found cached (known once admitted)

    def add(self, item: RequestOutput) -> None:
        self.started = True
        if item.cached_tokens is not None:
            self.cached_tokens = item.cached_tokens
        self.text += item.text
        self.logprobs.extend(item.logprobs or ())
        if item.prompt_logprobs is not None:
            self.prompt_logprobs = item.prompt_logprobs
        self.completion_tokens = max(self.completion_tokens, item.completion_tokens)
        if item.finished:
            self.finish_reason = item.finish_reason
            self.failure = item.failure
            self.error_code = item.error_code


def _engine_failed(choice: _Choice) -> ServingError:
    """The error of a sample whose replica's engine failed once the request had started (see
    ``failed_before_first_token``): an HTTP 503 when none of the answer went out, else the event
    that ends the stream. A token its grammar refused (though its mask allowed it) is the
    server's fault too, not the replica's: a 500 naming it, never a quiet "stop"."""
    if choice.error_code == GRAMMAR_REJECTED_TOKEN:
        return ServerFault(choice.failure or "the structured output's grammar rejected a token",
                           GRAMMAR_REJECTED_TOKEN)
    return Unavailable(choice.failure or "the replica failed", "replica_failed")


def _summed_usage(usages: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The usage of a request of several prompts: each count summed (cached positions where
    every prompt's are known)."""
    known = [u for u in usages if u is not None]
    if not known:
        return None
    prompt = sum(u["prompt_tokens"] for u in known)
    completion = sum(u["completion_tokens"] for u in known)
    cached: int | None = 0
    for u in known:
        part = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        cached = None if cached is None or part is None else cached + int(part)
    return dump(usage(prompt, completion, cached))


async def _close(body: AsyncIterable[Any]) -> None:
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        await aclose()


async def _joined_stream(streams: list[AsyncIterable[Any]], n: int, include_usage: bool
                         ) -> AsyncIterator[str]:
    """The SSE events of several prompts' streams as one stream: every chunk under the first
    chunk's ``id``, prompt ``j``'s choice ``i`` at ``j * n + i``; each stream's usage chunk held
    and sent once, summed, after every choice ended; one ``[DONE]``. An error event ends it."""
    queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

    async def pump(j: int, body: AsyncIterable[Any]) -> None:
        try:
            async for chunk in body:
                queue.put_nowait((j, chunk if isinstance(chunk, str) else bytes(chunk).decode()))
        finally:
            queue.put_nowait((j, None))

    tasks = [asyncio.ensure_future(pump(j, b)) for j, b in enumerate(streams)]
    rid: str | None = None
    usages: list[dict[str, Any] | None] = [None] * len(streams)
    open_streams = len(streams)
    try:
        while open_streams:
            j, chunk = await queue.get()
            if chunk is None:
                open_streams -= 1
                continue
            for line in chunk.split("\n\n"):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    yield sse_event(json.dumps(event))
                    yield "data: [DONE]\n\n"
                    return
                rid = rid or event.get("id")
                event["id"] = rid
                if not event.get("choices") and event.get("usage") is not None:
                    usages[j] = event["usage"]  # a usage chunk: summed at the end
                    continue
                for ch in event.get("choices", []):
                    ch["index"] = j * n + ch["index"]
                yield sse_event(json.dumps(event))
        if include_usage and rid is not None:
            tail = {"id": rid, "object": "text_completion", "created": now(), "choices": [],
                    "usage": _summed_usage(usages)}
            yield sse_event(json.dumps(tail))
        yield "data: [DONE]\n\n"
    finally:
        # A pump is suspended inside its stream's ``async for``: cancelling only asks it to
        # stop. Each is awaited until it has (its stream's own ``finally`` run: its place in
        # flight released) before the streams are closed, or closing one still running would
        # raise.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for b in streams:
            await _close(b)


# FastAPI's own server spans (its versions that have them) would double ours: ``AccessLog``'s span
# is the request's, with what only the routes know.
_NO_FASTAPI_SPANS: dict[str, Any] = (
    {"telemetry": {"tracing": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})
# FastAPI's own /openapi.json (and the docs pages built on it) is replaced by the Ingress's route
# below: Serve pickles this app into the replica, so a schema cached on the module's app object
# would not be the one served.
app = FastAPI(title="tierserve", version="0.1.0", openapi_url=None, docs_url=None,
              redoc_url=None, description="OpenAI-compatible LLM serving with priority tiers.",
              **_NO_FASTAPI_SPANS)


app.add_middleware(AccessLog)  # inside RequestIds: it sees the request's id
app.add_middleware(RequestIds)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    response = error_response(exc.status_code, str(exc.detail), code="http_error",
                              request_id=request_id_of(request))
    response.headers.update(exc.headers or {})  # e.g. the Allow header of a 405
    return response


def internal_error(e: BaseException) -> ServingError:
    """The answer to an exception no check expected (a fault of the server's, never the
    client's): a 500 in the API's error shape naming only the exception's type."""
    return ServerFault(f"the server failed to answer this request ({type(e).__name__}); it "
                       "is logged", "internal_error")


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("request %s %s %s failed: %r", request_id_of(request), request.method,
              request.url.path, exc)
    e = internal_error(exc)
    return error_response(e.status, e.message, e.code, request_id=request_id_of(request))


@app.exception_handler(ServingError)
async def _api_error(request: Request, exc: ServingError) -> JSONResponse:
    """Every refusal's answer, in one place: its status, the API's error JSON and, for a
    refusal under load, ``Retry-After``."""
    ex = exchange_of(request)
    if ex is not None:  # its span's exception event, its access-log line's error
        ex.failed(exc)
    retry = exc.retry_after
    if retry is None and (exc.status == 429 or exc.code == "shed"):
        # The config's least Retry-After, set at start on the app that serves the routes; the
        # default where the serving app is not that object (the ASGI app the request came
        # through may be a copy of the module's), so that a refusal never becomes a 500.
        retry = getattr(request.app.state, "retry_after", None)
        if retry is None:
            retry = ClusterConfig.model_fields["retry_after_s"].default
    return error_response(exc.status, exc.message, exc.code, exc.param, retry,
                          request_id_of(request))


@serve.deployment(name="Ingress", max_ongoing_requests=1024)
@serve.ingress(app)
class Ingress:
    def __init__(self, llm: DeploymentHandle | Sequence[DeploymentHandle],
                 config: dict[str, Any]) -> None:
        """``llm``: the engine deployments' handles, one per served model in the config's
        order (``ClusterConfig.served_models``); one handle for a one-model config."""
        self.cfg = ClusterConfig(**config)
        # Tracing (off unless OTEL_TRACES_EXPORTER asks) and the access log, from this process's
        # environment: a bad value fails the start, saying which (tierserve.cluster.access).
        tracing.setup()
        setup_access_log(access_log_enabled(), own_handler=_under_serve())
        self.tiers = TierResolver(self.cfg)
        handles = list(llm) if isinstance(llm, (list, tuple)) else [llm]
        models = self.cfg.served_models()
        if len(handles) != len(models):
            raise ValueError(f"the ingress got {len(handles)} engine deployment handle(s) for "
                             f"{len(models)} served model(s)")
        self.tokenizing = Tokenizing()
        # /tokenize's and /detokenize's own pool (one thread): their work never queues ahead of
        # a generation route's prompt on ``tokenizing``.
        self.utility_tokenizing = Tokenizing(workers=1)
        self.schemas = SchemaChecker(self.cfg.structured_limits)
        self.metrics = IngressMetrics([t.name for t in self.cfg.tiers], [m.name for m in models])
        # Every served model, by the name clients send (in the config's order).
        self.served: dict[str, _Served] = {}
        for i, (m, h) in enumerate(zip(models, handles, strict=True)):
            served = _Served.load(self.cfg, m, deployment_of(m, i), h)
            if self.cfg.flow.enabled:  # each model's replicas are their own capacity
                served.gate = FlowGate(self.cfg, self.metrics, served.replica_count,
                                       served.readiness.holds_count,
                                       policy=m.engine.scheduling_policy, model=m.name)
            self.served[m.name] = served
        # The LoRA adapters requests may name (static from the engines' lora_modules, dynamic
        # in the application's store actor under Serve: ``tierserve.cluster.adapters``).
        self.adapters = AdapterRegistry(
            models, self._adapter_store(models, handles), max_dynamic=self.cfg.max_dynamic_loras,
            path_roots=self.cfg.lora_path_roots,
            tenants=[label for t in self.cfg.tiers for label, _ in t.all_keys()])
        self._warn_public_adapters()
        self.metrics.adapter_labels(list(self.adapters.static),
                                    len(self.adapters.static) + self.cfg.max_dynamic_loras)
        self.inflight = 0  # requests between admission and their last byte
        # Per tier, the bytes its open streams have sent (``TierConfig.max_stream_bytes``).
        self.stream_bytes: dict[str, int] = {t.name: 0 for t in self.cfg.tiers}
        self.created = now()
        every = list(self.served.values())
        # The served names are in the (keyless) document only where no key is limited to some
        # models: else it would tell a caller of models it may not use.
        limited = any(t.models is not None or any(n.models is not None for n in t.tenants)
                      for t in self.cfg.tiers)
        self.openapi_doc = openapi_schema(app, {
            # Nor where adapters may be named (an admin may load one at any time).
            "model": None if limited or self.adapters.enabled else [m.name for m in every],
            "max_tokens": max(m.max_tokens_limit for m in every),
            "vocab_size": max(m.vocab_size for m in every),
            "max_stop_strings": self.cfg.max_stop_strings,
            "max_request_bytes": self.cfg.max_request_bytes, "max_n": self.cfg.max_n,
            "tokenizer_size": max(m.tokenizer_size for m in every)})
        app.state.retry_after = self.cfg.retry_after_s
        self._limits: dict[str, Any] | None = None

    @property
    def first(self) -> _Served:
        """The first (or only) served model."""
        return next(iter(self.served.values()))

    # The first model's parts, by their one-model names (tools and tests of one model).
    @property
    def tokenizer(self) -> Any:
        return self.first.tokenizer

    @property
    def tokenizer_size(self) -> int:
        return self.first.tokenizer_size

    @property
    def prompt_bound(self) -> PromptBound:
        return self.first.prompt_bound

    @property
    def special_ids(self) -> frozenset[int]:
        return self.first.special_ids

    @property
    def token_text(self) -> TokenText:
        return self.first.token_text

    @property
    def tool_format(self) -> str:
        return self.first.tool_format

    @property
    def template_takes_tools(self) -> bool:
        return self.first.template_takes_tools

    def _adapter_store(self, models: Sequence[ModelConfig], handles: Sequence[Any]
                       ) -> AdapterStore:
        """Where the dynamic adapters live: under Serve, with a model that takes adapters, the
        application's store actor (shared by every ingress replica); else this process."""
        static = [a.name for m in models for a in m.engine.lora_modules or ()]
        reserved = [m.name for m in models] + static
        if _under_serve() and any(m.engine.enable_lora for m in models):
            app_name = str(getattr(handles[0], "app_name", "") or "default")
            return RayStore(app_name, self.cfg.max_dynamic_loras, reserved)
        return LocalStore(DynamicAdapters(self.cfg.max_dynamic_loras, reserved))

    def _warn_public_adapters(self) -> None:
        """A warning at start where adapters are served and some callers have no ``models``
        list: a dynamic adapter loaded without ``tenants`` is usable by every one of them."""
        tiers = open_tiers(self.cfg) if self.adapters.enabled else []
        if tiers:
            log.warning("enable_lora is on and tier(s) %s have callers without a models list: "
                        "they may use every static adapter and every dynamic adapter loaded "
                        "without `tenants` (see docs/security.md)", tiers)

    @staticmethod
    def _may_use_adapter(caller: Caller, adapter: Adapter) -> bool:
        """Whether ``caller`` may use (and see) ``adapter``: its allowlist lets it name it, and
        its key identifies one of the adapter's owners where it has any."""
        return caller.may_use(adapter.name) and adapter.open_to(
            caller.tenant if caller.keyed else None)

    def _model(self, caller: Caller, name: str | None) -> _Served:
        """The served model ``name`` if ``caller`` may use it; else a 404 ``model_not_found``
        (OpenAI's answer): a model that is not served and one the caller's key may not use get
        the same answer, naming only the models (and adapters) it may use, so that a key learns
        nothing of the others. None (where a route lets ``model`` out, as vLLM's ``/tokenize``
        does): the first configured model the caller may use."""
        if name is None:
            name = next((m for m in self.served if caller.may_use(m)), "")
        served = self.served.get(name)
        if served is None or not caller.may_use(name):
            raise self._not_found(caller, name)
        return served

    def _not_found(self, caller: Caller, name: str) -> NotFound:
        mine = [m for m in self.served if caller.may_use(m)] + [
            a.name for a in self.adapters.known() if self._may_use_adapter(caller, a)]
        return NotFound(f"model {name[:256]!r} does not exist or this key may not use it; "
                        f"the models it may use: {mine}", "model_not_found", "model")

    async def _resolve(self, caller: Caller, name: str | None) -> tuple[_Served, Adapter | None]:
        """What a request's ``model`` names: a served model (``_model``), or a LoRA adapter the
        caller may use (its name in the caller's ``models`` where it has a list, and its key's
        tenant among the adapter's owners where it has any), as its parent model and the
        adapter. An adapter the caller may not use answers as one that does not exist (the
        same 404, which names only what it may use)."""
        if name is None or name in self.served:
            return self._model(caller, name), None
        adapter = await self.adapters.lookup(name) if caller.may_use(name) else None
        if (adapter is None or adapter.parent not in self.served
                or not self._may_use_adapter(caller, adapter)):
            raise self._not_found(caller, name)
        return self.served[adapter.parent], adapter

    # ------------------------------------------------------------------ routes

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self) -> JSONResponse:
        """The OpenAPI document: every field, limit and error response (``cluster/openapi.py``)."""
        return JSONResponse(self.openapi_doc)

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        """Liveness: the ingress answers (``/ready`` says whether the replicas can take work)."""
        return {"status": "ok"}

    @app.get("/ready", response_model=None)
    async def ready(self) -> JSONResponse:
        """Readiness (``tierserve.cluster.readiness``): 200 once every engine replica of the
        config can take work, then while at least one can; else 503 saying what is missing."""
        states = {name: await m.readiness.current() for name, m in self.served.items()}
        state = together(states)
        body: dict[str, Any] = {"status": "ready" if state.ready else "not_ready",
                                "reason": state.reason, "replicas_ready": state.running}
        if len(states) > 1:
            body["models"] = {name: {"ready": s.ready, "reason": s.reason,
                                     "replicas_ready": s.running}
                              for name, s in states.items()}
        return JSONResponse(body, status_code=200 if state.ready else 503)

    @app.get("/v1/models")
    async def models(self, request: Request) -> dict[str, Any]:
        """The served models the caller may use (behind the key check), then the LoRA adapters
        it may use, each with its ``parent`` (vLLM's listing)."""
        caller = self._caller(request)
        await self.adapters.fresh()
        cards = [self._model_card(m) for m in self.served if caller.may_use(m)]
        cards += [self._model_card(a.name, a) for a in self.adapters.known()
                  if self._may_use_adapter(caller, a) and a.parent in self.served]
        return dump(ModelList(data=cards))

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(self, request: Request, model_id: str) -> JSONResponse:
        """A served model's or adapter's object; an id that is neither, or not to this caller,
        a 404 ``model_not_found`` (OpenAI's)."""
        served, adapter = await self._resolve(self._caller(request), model_id)
        return JSONResponse(dump(self._model_card(model_id if adapter else served.name,
                                                  adapter)))

    def _model_card(self, name: str, adapter: Adapter | None = None) -> ModelCard:
        """A model's card; an adapter's names its parent, and its own name as ``root`` (never
        its folder: the card goes to any caller that may use it)."""
        return ModelCard(id=name, created=self.created, root=name,
                         parent=adapter.parent if adapter is not None else None)

    # ------------------------------------------------------------------ LoRA adapters (admin)

    @staticmethod
    def _admin(caller: Caller, route: str) -> None:
        """403 ``permission_denied`` unless ``caller``'s key is an admin key."""
        if not caller.admin:
            raise PermissionDenied(f"{route} needs an admin key (admin_keys): this key, or a "
                                   "request without one, may not load or unload adapters")

    @app.post("/v1/load_lora_adapter", response_model=None)
    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        """vLLM's ``/v1/load_lora_adapter``, admin keys only: ``lora_name`` from ``lora_path``
        (inside ``lora_path_roots``) for ``model``, owned by ``tenants`` where given (only their
        keys may use or see it). One replica of the parent's loads it first, so a bad adapter
        gets that replica's 4xx and nothing is registered; the others load it on first use. The
        same name from the same path (for the same tenants) again: 200, nothing done."""
        caller = self._caller(request)
        self._admin(caller, "/v1/load_lora_adapter")
        data = await read_json(request.stream(), request.headers.get("content-length"),
                               self.cfg.max_request_bytes, self.cfg.body_timeout_s)
        body = validated(LoadLoRAAdapterRequest, data)
        if body.load_inplace:
            raise BadRequest("load_inplace is not supported: unload the adapter, then load "
                             "the new weights (or load them under a new name)",
                             "invalid_request", "load_inplace")
        adapter, new = await self.adapters.load(body.lora_name, body.lora_path, body.model,
                                                self._load_on_replica, body.tenants)
        if new:
            log.info("LoRA adapter %r loaded for %r (id %d)", adapter.name, adapter.parent,
                     adapter.int_id)
        msg = (f"LoRA adapter {adapter.name!r} loaded for model {adapter.parent!r}" if new else
               f"LoRA adapter {adapter.name!r} is loaded already from that path")
        return JSONResponse(dump(LoRAAdapterAnswer(
            id=adapter.name, parent=adapter.parent,
            status="loaded" if new else "already_loaded", message=msg)))

    async def _load_on_replica(self, adapter: Adapter) -> None:
        """One replica of ``adapter``'s parent loads it under this registration's id: its
        refusal (400 a bad adapter, with the replica's detail: the answer goes to an admin)
        raised as the answer; an unreachable replica 503."""
        control = self.served[adapter.parent].control
        try:
            refused = await control.load_lora_adapter.remote(adapter.name, adapter.path,
                                                             adapter.int_id)
        except Exception as e:
            log.warning("loading LoRA adapter %r: replica call failed: %s", adapter.name,
                        type(e).__name__)
            raise Unavailable(f"no replica of model {adapter.parent!r} could load the adapter "
                              f"({type(e).__name__})", "replica_unavailable") from None
        if refused is not None:
            raise ServingError.of(refused)

    @app.post("/v1/unload_lora_adapter", response_model=None)
    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        """vLLM's ``/v1/unload_lora_adapter``, admin keys only: forget dynamic adapter
        ``lora_name`` (400 a static one, 404 one not loaded). It leaves the registry first, so
        no new request may name it; then its parent's replicas are asked to unload it, best
        effort and only to free their memory sooner (Serve's handle reaches a replica its
        router picks, once per replica it sees): a replica still running requests on it (409)
        keeps it until they end, one not asked keeps it until its cache evicts it. Nothing
        depends on those calls: no request carries that registration's id again (a name loaded
        again gets a new one). The answer is 200 once it is out of the registry."""
        caller = self._caller(request)
        self._admin(caller, "/v1/unload_lora_adapter")
        data = await read_json(request.stream(), request.headers.get("content-length"),
                               self.cfg.max_request_bytes, self.cfg.body_timeout_s)
        body = validated(UnloadLoRAAdapterRequest, data)
        adapter = await self.adapters.unload(body.lora_name)
        busy = await self._unload_on_replicas(adapter)
        log.info("LoRA adapter %r unloaded (%d replica(s) still run requests on it)",
                 adapter.name, busy)
        msg = f"LoRA adapter {adapter.name!r} unloaded"
        if busy:
            msg += (f"; {busy} replica(s) still run requests on it and keep it until they end "
                    "(no new request may name it)")
        return JSONResponse(dump(LoRAAdapterAnswer(id=adapter.name, parent=adapter.parent,
                                                   status="unloaded", message=msg)))

    async def _unload_on_replicas(self, adapter: Adapter) -> int:
        """Ask the parent's replicas to unload ``adapter`` (once per replica the router sees;
        it may pick one twice), to free their memory sooner: how many answered that requests
        still use it (409). Any other answer (done, not loaded there, unreachable) is fine: no
        request carries this registration's key again, so a copy left anywhere is an entry no
        request reaches, which that replica's cache evicts in time."""
        served = self.served.get(adapter.parent)
        if served is None:
            return 0
        busy = 0
        for _ in range(served.replica_count()):
            try:
                # That registration's copy only (a name loaded again has another id).
                refused = await served.control.unload_lora_adapter.remote(adapter.name,
                                                                          adapter.int_id)
            except Exception as e:
                log.warning("unloading LoRA adapter %r: replica call failed: %s", adapter.name,
                            type(e).__name__)
                continue
            if refused is not None and refused.status == 409:
                busy += 1
        return busy

    @app.get("/version")
    async def version(self) -> dict[str, Any]:
        """The server's version (tierserve's package version)."""
        return dump(VersionResponse(version=__version__))

    @app.post("/tokenize", response_model=None)
    async def tokenize(self, request: Request) -> Response:
        """vLLM's ``/tokenize``: a ``prompt``'s ids, or (with ``messages``) the ids the chat
        template renders, exactly as the generation routes make them; behind the same key check,
        body limits and admission (``_utility``). Not bounded by the context (counting a long
        text's tokens is what it is for): ``max_model_len`` says what fits. The tokenizing, the
        token strings and the answer's JSON are made off the event loop when the input is large
        (``utility_tokenizing``, a pool of its own)."""
        caller = self._caller(request)
        data = await read_json(request.stream(), request.headers.get("content-length"),
                               self.cfg.max_request_bytes, self.cfg.body_timeout_s)
        kind: type[TokenizeChatRequest] | type[TokenizeCompletionRequest] = (
            TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
        body = validated(kind, data)
        served, _ = await self._resolve(caller, body.model)
        self._tokenize_bound(body)
        strs = body.return_token_strs
        context = served.prompt_bound.context
        tok = served.tokenizer

        def answer(ids: list[int]) -> bytes:
            names = list(tok.convert_ids_to_tokens(ids)) if strs else None
            return _json_bytes(dump(TokenizeResponse(
                count=len(ids), max_model_len=context, tokens=ids, token_strs=names)))

        with self._utility(caller):
            if isinstance(body, TokenizeChatRequest):
                ids = await self._render_chat(served, body, None, None, self.utility_tokenizing)
                out = await self.utility_tokenizing.run(len(ids), lambda: answer(ids))
            else:
                text, special = body.prompt, body.add_special_tokens
                out = await self.utility_tokenizing.run(len(text), lambda: answer(list(
                    tok.encode(text, add_special_tokens=special)) if text else []))
        return Response(out, media_type="application/json")

    @app.post("/detokenize", response_model=None)
    async def detokenize(self, request: Request) -> Response:
        """vLLM's ``/detokenize``: the text of ``tokens`` (special tokens kept); an id the
        tokenizer cannot name is a 400 ``invalid_token`` naming its place. Admitted as
        ``/tokenize`` is, its decoding and answer off the event loop when large."""
        caller = self._caller(request)
        data = await read_json(request.stream(), request.headers.get("content-length"),
                               self.cfg.max_request_bytes, self.cfg.body_timeout_s)
        body = validated(DetokenizeRequest, data)
        served, _ = await self._resolve(caller, body.model)
        size = served.tokenizer_size
        for i, t in enumerate(body.tokens):
            if t >= size:
                raise BadRequest(f"tokens.{i}: token id {t} is outside the vocabulary (ids "
                                 f"0 to {size - 1})", "invalid_token", f"tokens.{i}")
        ids = body.tokens

        tok = served.tokenizer

        def answer() -> bytes:
            return _json_bytes(dump(DetokenizeResponse(prompt=str(tok.decode(ids)))))

        with self._utility(caller):
            out = await self.utility_tokenizing.run(len(ids), answer)
        return Response(out, media_type="application/json")

    def _tokenize_bound(self, body: TokenizeChatRequest | TokenizeCompletionRequest) -> None:
        """``/tokenize``'s input within ``max_tokenize_chars`` (a prompt's characters, or the
        messages' texts'), else a 400 ``too_long``, before any tokenizer work."""
        limit = self.cfg.max_tokenize_chars
        if isinstance(body, TokenizeChatRequest):
            size = sum(len(t) for t in message_texts([m.model_dump() for m in body.messages]))
            param = "messages"
        else:
            size, param = len(body.prompt), "prompt"
        if size > limit:
            raise BadRequest(f"{param} has {size} characters; /tokenize counts at most {limit} "
                             "(max_tokenize_chars): send it in parts",
                             "too_long", param)

    @contextlib.contextmanager
    def _utility(self, caller: Caller) -> Iterator[None]:
        """``/tokenize``'s and ``/detokenize``'s work, admitted and counted in flight as a
        generation request is (``_admit``: the caller's tier share of ``max_inflight_requests``;
        beyond, a 429), so a tier cannot queue more of it than its share."""
        self._admit(caller)
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1

    @app.post("/v1/completions", response_model=None)
    async def completions(self, request: Request) -> Response:
        caller = self._caller(request)
        body = await self._body(request, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        served, adapter = await self._resolve(caller, body.model)
        caller, tier_named = self._asked(request, caller, body)
        prompts = body.prompts()
        calls = [await self._prompt_call(served, caller, body, prompt, tier_named,
                                          "prompt" if len(prompts) == 1 else f"prompt.{j}")
                 for j, prompt in enumerate(prompts)]
        for c in calls:
            c.adapter = adapter
        if len(calls) == 1:
            return await self._serve(request, body, calls[0], caller)
        return await self._serve_batch(request, body, calls, caller)

    async def _prompt_call(self, served: _Served, caller: Caller, body: CompletionRequest,
                           prompt: str | list[int], tier_named: str | None, param: str) -> _Call:
        """One prompt of a completions request, tokenized and checked (``param``: where it is
        in the request)."""
        # An empty prompt and ids outside the vocabulary are the replica's to refuse (its
        # scheduler and engine own those limits); a prompt of special tokens only is ours (it
        # takes the tokenizer to know), and so is one that cannot fit the context (known before
        # it is tokenized: it is refused before any work).
        keep = body.truncate_prompt_tokens
        tok = served.tokenizer
        if isinstance(prompt, str):
            text = prompt
            if keep is None:  # a prompt cut to its last tokens may be longer than the context
                self._fits(served, caller, len(text.encode("utf-8")), None, param)
            special = body.add_special_tokens
            ids = (await self.tokenizing.run(len(text), lambda: list(
                tok.encode(text, add_special_tokens=special)))) if text else []
        else:
            ids = list(prompt)
        truncated = keep is not None and len(ids) > keep
        if keep is not None:
            ids = ids[-keep:]
        self._fits(served, caller, None, len(ids), param)
        if ids and all(t in served.special_ids for t in ids):
            raise BadRequest("the prompt has only special tokens "
                             f"({tok.decode(ids[:8])!r}...): nothing to complete",
                             "only_special_tokens", param)
        echo = None
        if body.echo:
            echo = (prompt if isinstance(prompt, str) and not truncated
                    else tok.decode(ids))
        return _Call(chat=False, n=body.n, ids=ids, served=served, echo=echo,
                     logprobs=body.logprobs is not None,
                     include_usage=body.include_usage, continuous_usage=body.continuous_usage,
                     prompt_logprobs=body.prompt_logprobs is not None,
                     token_ids=bool(body.return_tokens_as_token_ids),
                     request_id=body.request_id or "", service_tier=tier_named)

    async def _serve_batch(self, request: Request, body: CompletionRequest,
                           calls: list[_Call], caller: Caller) -> Response:
        """A completions request of several prompts: each served as its own request (admitted,
        gated and routed alone), their answers joined as OpenAI joins them: one ``id``, prompt
        ``j``'s sample ``i`` at ``index`` ``j * n + i``, the usage summed. A stream interleaves
        the prompts' chunks as they come, with one usage chunk at its end when asked; a prompt
        that fails fails the whole request (its error ends the stream)."""
        n = body.n
        tasks = [asyncio.ensure_future(self._serve(request, body, c, caller)) for c in calls]
        try:
            responses = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            for t in tasks:  # a stream already made is closed (its slot released)
                if t.done() and not t.cancelled() and t.exception() is None:
                    r = t.result()
                    if isinstance(r, StreamingResponse):
                        await _close(r.body_iterator)
            raise
        if body.stream:
            iters = [r.body_iterator for r in responses if isinstance(r, StreamingResponse)]
            return StreamingResponse(_joined_stream(iters, n, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        answers = [json.loads(bytes(r.body)) for r in responses]
        out = answers[0]
        out["choices"] = [dict(ch, index=j * n + ch["index"])
                          for j, a in enumerate(answers) for ch in a["choices"]]
        out["usage"] = _summed_usage([a["usage"] for a in answers])
        return JSONResponse(out)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(self, request: Request) -> Response:
        caller = self._caller(request)
        body = await self._body(request, ChatCompletionRequest)
        assert isinstance(body, ChatCompletionRequest)
        return await self._chat(request, caller, body)

    async def _chat(self, request: Request, caller: Caller,
                    body: ChatCompletionRequest) -> Response:
        """A chat completion request, validated, from key check to answer (the chat route's
        and, translated, the Responses route's)."""
        served, adapter = await self._resolve(caller, body.model)
        if not getattr(served.tokenizer, "chat_template", None):
            raise BadRequest(
                f"model {served.name!r} has no chat template (a base model, which continues "
                "text): send a prompt to /v1/completions instead",
                "no_chat_template", "messages")
        caller, tier_named = self._asked(request, caller, body)
        try:
            mode = await self.schemas.tool_mode(body)
            messages, tools = render_messages(body.messages, body.tools, body.tool_choice,
                                              served.template_takes_tools, served.tool_format)
        except StructuredError as e:  # in a chat, a tool's schema is the request's to mend
            raise ToolMessageError(str(e), e.param) from None
        except SchemaCheckBusy:
            self.metrics.rejected("busy", caller.tier.name)
            raise
        texts = message_texts(messages)
        if body.truncate_prompt_tokens is None:
            self._fits(served, caller, sum(len(t.encode("utf-8")) for t in texts), None,
                       "messages")
        ids = await self._render_chat(served, body, messages, tools)
        if body.truncate_prompt_tokens is not None:
            ids = list(ids)[-body.truncate_prompt_tokens:]
        self._fits(served, caller, None, len(ids), "messages")
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        names = (frozenset(t.function.name for t in body.tools or ())
                 if mode != "none" else None)
        call = _Call(chat=True, n=body.n, ids=list(ids), served=served, logprobs=body.logprobs,
                     include_usage=body.include_usage, continuous_usage=body.continuous_usage,
                     tool_mode=mode, tools=names, tool_format=served.tool_format,
                     prompt_logprobs=body.prompt_logprobs is not None,
                     token_ids=bool(body.return_tokens_as_token_ids),
                     request_id=body.request_id or "", service_tier=tier_named,
                     adapter=adapter)
        return await self._serve(request, body, call, caller)

    @app.post("/v1/responses", response_model=None)
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, served as the chat completion request it means
        (``tierserve.cluster.responses``): the same key check, tiers, flow control, limits,
        tool calls and structured outputs; the answer a ``Response`` object, or its events.
        A refusal names the Responses field (``max_output_tokens``, ``input.2.content``)."""
        caller = self._caller(request)
        data = await read_json(request.stream(), request.headers.get("content-length"),
                               self.cfg.max_request_bytes, self.cfg.body_timeout_s)
        call = ResponsesCall.of(validated(ResponsesRequest, data))
        try:
            answer = await self._chat(request, caller,
                                      validated(ChatCompletionRequest, call.chat))
        except ServingError as e:
            raise call.error(e) from None
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(call.events(answer.body_iterator),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        chat = json.loads(bytes(answer.body))
        return JSONResponse(dump(call.response(chat)))

    @app.get("/v1/responses/{response_id:path}", response_model=None)
    @app.post("/v1/responses/{response_id:path}", response_model=None)
    @app.delete("/v1/responses/{response_id:path}", response_model=None)
    async def stored_response(self, request: Request, response_id: str) -> JSONResponse:
        """Retrieving, cancelling or deleting a response, or listing its input items: a 400,
        since nothing is stored (behind the key check, as every route that reads a body)."""
        self._caller(request)
        raise stored_responses_refused(response_id)

    # ------------------------------------------------------------------ helpers

    async def _render_chat(self, served: _Served,
                           body: ChatCompletionRequest | TokenizeChatRequest,
                           messages: list[dict[str, Any]] | None, tools: Any,
                           pool: Tokenizing | None = None) -> list[int]:
        """The ids ``body``'s chat template renders (``messages``, ``tools``: as
        ``render_messages`` made them; None: ``body``'s messages, no tools), on the pool
        (``pool``, else ``tokenizing``) when the messages are large; a template that fails on
        them is a 400 ``bad_messages``."""
        if messages is None:
            try:
                messages, tools = render_messages(body.messages, None, None,
                                                  served.template_takes_tools, served.tool_format)
            except StructuredError as e:
                raise ToolMessageError(str(e), e.param) from None
        tok = served.tokenizer
        if not getattr(tok, "chat_template", None):
            raise BadRequest(
                f"model {served.name!r} has no chat template (a base model, which "
                "continues text): send a prompt instead", "no_chat_template", "messages")
        rendered = messages
        size = sum(len(t) for t in message_texts(rendered))
        extra = self._template_kwargs(tok, body)

        def render() -> list[int]:
            return render_chat(tok, rendered, tools, extra, body.add_special_tokens)

        try:
            ids = await (pool or self.tokenizing).run(size, render)
        except Exception as e:
            raise BadRequest(f"the chat template could not render these messages: {e}",
                             "bad_messages", "messages") from e
        return ids

    async def _body(self, request: Request, model: type[CompletionRequest] | type[ChatCompletionRequest]
                    ) -> CompletionRequest | ChatCompletionRequest:
        data = await read_json(request.stream(), request.headers.get("content-length"),
                               self.cfg.max_request_bytes, self.cfg.body_timeout_s)
        return validated(model, data)

    @staticmethod
    def _template_kwargs(tokenizer: Any, body: ChatCompletionRequest | TokenizeChatRequest
                         ) -> dict[str, Any]:
        """What the chat template is rendered with besides the messages and tools
        (``tierserve.cluster.chat_template.template_kwargs``: a name the renderer takes itself
        is a 400)."""
        return template_kwargs(tokenizer, add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message,
                               documents=body.documents,
                               chat_template_kwargs=body.chat_template_kwargs)

    def _asked(self, request: Request, caller: Caller,
               body: CompletionRequest | ChatCompletionRequest) -> tuple[Caller, str | None]:
        """The caller as the body asks to run: its ``priority`` (vLLM's field: lower first, 0 the
        default) moves it from its key's or ``X-TL-Priority``'s priority within its tier's range
        (``TierResolver.shifted``), in the tier its ``service_tier`` picks (``TierResolver.
        for_service_tier``); and the ``service_tier`` its answer names (None: not asked)."""
        header = (request.headers.get("x-tl-priority") or "").strip(" \t")
        if body.priority:
            caller = self.tiers.shifted(caller, body.priority)
        if body.service_tier is None:
            return caller, None
        return self.tiers.for_service_tier(caller, body.service_tier,
                                           bool(header) or bool(body.priority))

    def _names(self, call: _Call) -> TokenNames:
        """How ``call``'s log-probabilities name tokens."""
        return TokenIdNames() if call.token_ids else call.served.token_text

    def _caller(self, request: Request) -> Caller:
        header = self.cfg.flow.tenant_header
        with tracing.span("tierserve.auth"):
            caller = self.tiers.resolve(request.headers.get("authorization"),
                                        request.headers.get("x-tl-priority"),
                                        request.headers.get(header) if header else None)
        ex = exchange_of(request)
        if ex is not None:
            ex.caller(caller.tenant, caller.tier.name)
        return caller

    def _fits(self, served: _Served, caller: Caller, nbytes: int | None, ntokens: int | None,
              param: str) -> None:
        """400 ``too_long`` (counted) for a prompt of ``nbytes`` of text or ``ntokens`` ids that
        cannot fit ``served``'s context (``PromptBound``)."""
        try:
            if nbytes is not None:
                served.prompt_bound.check_text(nbytes, param)
            if ntokens is not None:
                served.prompt_bound.check_ids(ntokens, param)
        except ServingError:
            self.metrics.rejected("too_long", caller.tier.name)
            raise

    def _sampling(self, body: CompletionRequest | ChatCompletionRequest,
                  structured: Structured | None = None, served: _Served | None = None,
                  ) -> SamplingParams:
        """The request's sampling parameters, checked against the limits (``served``: the
        model it is for, whose ``max_tokens_limit`` applies; None: the config's)."""
        stops = body.stop_list()
        if len(stops) > self.cfg.max_stop_strings:
            raise BadRequest(f"stop has {len(stops)} strings; at most "
                             f"{self.cfg.max_stop_strings} are allowed", "too_many_stops", "stop")
        limit = served.max_tokens_limit if served is not None else self.cfg.max_tokens_limit
        max_tokens = body.max_tokens if body.max_tokens is not None else limit
        if "max_tokens" not in body.model_fields_set:  # a default (completions: 16) is no ask
            max_tokens = min(max_tokens, limit)
        if max_tokens > limit:
            raise BadRequest(f"max_tokens {max_tokens} is above this server's limit "
                             f"({limit})", "max_tokens_too_large", "max_tokens")
        if body.n > self.cfg.max_n:
            raise BadRequest(f"n {body.n} is above this server's limit ({self.cfg.max_n})",
                             "n_too_large", "n")
        bias: dict[int, float] = {}
        for key, value in (body.logit_bias or {}).items():
            if not key.isdigit():  # its range is the replica's to check, like every token id
                raise BadRequest(f"logit_bias key {key[:32]!r} is not a token id",
                                 "invalid_token", "logit_bias")
            bias[int(key)] = float(value)
        if isinstance(body, CompletionRequest):
            logprobs = body.logprobs
            prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        else:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs = None
        if body.prompt_logprobs is not None:  # vLLM's field; with echo's, the more alternatives
            if body.stream:
                raise BadRequest("prompt_logprobs is not supported with stream yet: send the "
                                 "request without stream", "invalid_request", "prompt_logprobs")
            prompt_logprobs = max(prompt_logprobs or 0, body.prompt_logprobs)
        if structured is not None and (prompt_logprobs is not None or max_tokens == 0):
            raise BadRequest(f"{structured.output.param}: a request that scores its "
                             "prompt (echo with logprobs, prompt_logprobs, or max_tokens 0) "
                             "generates nothing to constrain: leave the structured output out",
                             "invalid_request", structured.output.param)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=float(body.temperature),
                top_p=float(body.top_p),
                top_k=body.top_k,
                min_p=float(body.min_p),
                seed=body.seed,
                stop=stops or None,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                presence_penalty=float(body.presence_penalty),
                frequency_penalty=float(body.frequency_penalty),
                repetition_penalty=float(body.repetition_penalty),
                logit_bias=bias or None,
                allowed_token_ids=body.allowed_token_ids,
                bad_words_ids=(self._bad_words_ids(served, body.bad_words)
                               if body.bad_words else None),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                structured=structured.output if structured is not None else None,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except ServingError:  # the record checks how the fields go together
            raise
        except ValueError as e:  # the request models bound every field alone; a last guard
            raise BadRequest(str(e), "invalid_sampling") from None

    def _bad_words_ids(self, served: _Served | None, words: Sequence[str]) -> list[list[int]]:
        """The token sequences of ``bad_words`` in ``served``'s tokenizer (``tierserve.replica.
        detokenizer.bad_words_ids``: a word of no token or too many is a 400 naming it)."""
        return bad_words_ids((served or self.first).tokenizer, words)

    async def _serve(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                     call: _Call, caller: Caller) -> Response:
        call.header_id = request_id_of(request) or ""
        if call.header_id and not call.request_id and request.headers.get(REQUEST_ID_HEADER):
            # The body's request_id names the answer; else the header's id (under Serve the
            # proxy always sets one, so the header alone cannot say the client chose it).
            call.request_id = call.header_id
        try:
            structured = await self.schemas.structured_output(
                body, call.tool_mode if call.chat else None, call.tool_format)
        except SchemaCheckBusy:
            self.metrics.rejected("busy", caller.tier.name)
            raise
        served = call.served
        sampling = self._sampling(body, structured, served)
        if structured is not None:
            self.metrics.structured(caller.tier.name, structured.kind)
        call.cache_partition = cache_partition(caller, body.cache_salt,
                                               self.cfg.prefix_cache_scope)
        route = _Route(sampling, caller, self.cfg.replica_retries, gate=served.gate)
        route.exchange = exchange_of(request)
        if route.exchange is not None:  # as it runs (service_tier may have moved it)
            route.exchange.caller(caller.tenant, caller.tier.name)
            route.exchange.requested(body.model, len(call.ids))
        try:
            self._admit(caller, served.gate)
        except ServingError:
            self._count_slo(route, failed=True)
            raise
        self.metrics.model_request(served.name, caller.tier.name)
        if call.adapter is not None:
            self.metrics.adapter_request(served.name, call.adapter.name, caller.tier.name)
        self.inflight += 1
        handed_off = False
        try:
            if served.gate is not None:
                try:
                    with tracing.span("tierserve.gate",
                                      {"tierserve.tier": caller.tier.name}):
                        route.ticket = await served.gate.enter(caller, len(call.ids) * call.n)
                except Shed:
                    self._count_slo(route, failed=True)
                    raise
            response = await self._generate(body.stream, call, route)
            if isinstance(response, StreamingResponse):  # in flight until its stream ends
                response.body_iterator = self._release_after(response.body_iterator,
                                                             caller.tier.name)
                handed_off = True
            return response
        finally:
            if not handed_off:
                self.inflight -= 1

    def _admit(self, caller: Caller, gate: FlowGate | None = None) -> None:
        """Bound the requests in flight through this ingress (``max_inflight_requests``; a tier
        may use its ``queue_share`` of it) and the bytes a tier's open streams have sent
        (``max_stream_bytes``): beyond, 429 at once, before any replica is asked (all models
        together; ``gate``: the request's model's, which estimates its ``Retry-After``)."""
        tier = caller.tier
        if self.stream_bytes.get(tier.name, 0) >= tier.max_stream_bytes:
            self.metrics.rejected("stream_budget", tier.name)
            raise TooManyRequests(f"tier {tier.name!r}'s open streams have sent "
                                  f"{self.stream_bytes[tier.name]} bytes, its max_stream_bytes "
                                  f"({tier.max_stream_bytes}): read them, or wait until they end",
                                  "stream_budget", retry_after=max(self.cfg.retry_after_s, 1))
        tier_inflight_limit = share_of(self.cfg.max_inflight_requests, caller.tier.queue_share)
        if self.inflight >= tier_inflight_limit:
            reason = "shed" if caller.tier.queue_share < 1.0 else "queue_full"
            self.metrics.rejected(reason, caller.tier.name)
            retry = (gate.retry_after(gate.band_of[caller.tier.name])
                     if gate is not None else None)
            raise TooManyRequests(f"the server is busy: {self.inflight} requests in flight; tier "
                                  f"{caller.tier.name!r} may have at most {tier_inflight_limit}",
                                  reason, retry_after=retry)

    async def _release_after(self, body: AsyncIterable[Any], tier: str) -> AsyncIterator[Any]:
        """``body``, counted in flight and against ``tier``'s stream bytes until it ends."""
        sent = 0
        try:
            async for chunk in body:
                n = len(chunk.encode()) if isinstance(chunk, str) else len(chunk)
                sent += n
                self.stream_bytes[tier] = self.stream_bytes.get(tier, 0) + n
                yield chunk
        finally:
            self.stream_bytes[tier] = self.stream_bytes.get(tier, 0) - sent
            self.inflight -= 1
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    def _count_slo(self, route: _Route, failed: bool = False) -> None:
        """Count the request against its tier's targets, once (``failed``: it got no answer)."""
        if route.counted:
            return
        route.counted = True
        tier = route.caller.tier
        if tier.ttft_target_s is None and tier.tpot_target_s is None:
            return
        ttft_s = tpot_s = None
        if not failed and route.first is not None:
            ttft_s = route.first - route.arrival
            if route.tokens > 1:
                assert route.last is not None
                tpot_s = (route.last - route.first) / (route.tokens - 1)
        ttft_met, tpot_met = targets_kept(ttft_s, tpot_s, tier.ttft_target_s,
                                          tier.tpot_target_s)
        both = not failed and ttft_met is not False and tpot_met is not False
        self.metrics.slo(tier.name, ttft_met, tpot_met, both)

    def _release(self, route: _Route) -> None:
        """The request's dispatch-window slot, if it still holds one."""
        if route.gate is not None and route.ticket is not None:
            route.gate.started(route.ticket)

    async def _generate(self, stream_out: bool, call: _Call, route: _Route) -> Response:
        try:
            stream, first = await self._start(call, route)
        except ServingError as e:
            if e.status in (429, 503):
                self._count_slo(route, failed=True)
            raise
        finally:
            self._release(route)
        rid = new_id("chatcmpl" if call.chat else "cmpl")
        if call.request_id:
            rid = f"{'chatcmpl' if call.chat else 'cmpl'}-{call.request_id}"
        if stream_out:
            gen = self._sse(self._items(call, route, stream, first), rid, call, route)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        choices = [_Choice() for _ in range(call.n)]
        async with contextlib.aclosing(self._items(call, route, stream, first)) as items:
            async for item in items:
                if item is None:  # sent again: start over
                    choices = [_Choice() for _ in range(call.n)]
                    continue
                choices[item.index].add(item)
                if all(c.finish_reason is not None for c in choices):
                    break
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise _engine_failed(failed)
        u = self._usage(call, choices)
        out: Any
        if call.chat:
            out = ChatCompletionResponse(
                id=rid, created=now(), model=call.model_name, usage=u,
                choices=[self._chat_choice(call, i, c) for i, c in enumerate(choices)],
                prompt_logprobs=self._prompt_logprobs(call, choices[0]),
                service_tier=call.service_tier)
        else:
            out = CompletionResponse(
                id=rid, created=now(), model=call.model_name, usage=u,
                choices=[CompletionChoice(index=i, text=(call.echo or "") + c.text,
                                          finish_reason=c.finish_reason,
                                          logprobs=self._completion_logprobs(call, c, 0, True),
                                          prompt_logprobs=self._prompt_logprobs(call, c))
                         for i, c in enumerate(choices)],
                service_tier=call.service_tier)
        return JSONResponse(dump(out))

    def _prompt_logprobs(self, call: _Call, c: _Choice) -> Any:
        """vLLM's ``prompt_logprobs`` of ``c``'s prompt, where the request asked for them."""
        if not call.prompt_logprobs:
            return None
        return prompt_logprobs(c.prompt_logprobs or [None] * len(call.ids), self._names(call))

    def _chat_choice(self, call: _Call, index: int, c: _Choice) -> ChatChoice:
        """One answer of a chat request, its tool calls parsed out when it had tools."""
        logprobs = chat_logprobs(c.logprobs, self._names(call)) if call.logprobs else None
        if call.tools is None:
            return ChatChoice(index=index, message=ChatMessageOut(content=c.text),
                              finish_reason=c.finish_reason, logprobs=logprobs)
        content, calls = parse_tool_calls(c.text, call.tools, call.tool_format)
        return ChatChoice(index=index,
                          message=ChatMessageOut(content=content, tool_calls=calls or None),
                          finish_reason=_finish_reason(c.finish_reason, bool(calls)),
                          logprobs=logprobs)

    @staticmethod
    def _usage(call: _Call, choices: Sequence[_Choice]) -> Usage:
        """The prompt once, every sample's tokens; the cached positions of the first sample's
        prompt (the others share its blocks)."""
        cached = choices[0].cached_tokens if choices else None
        return usage(len(call.ids), sum(c.completion_tokens for c in choices), cached)

    def _completion_logprobs(self, call: _Call, c: _Choice, offset: int, first: bool) -> Any:
        """The legacy shape of ``c``'s new log-probabilities (with the echoed prompt's on the
        choice's first chunk)."""
        if not call.logprobs:
            return None
        entries: list[Any] = list(c.logprobs)
        if call.echo is not None and first:
            entries = list(c.prompt_logprobs or [None] * len(call.ids)) + entries
        return completion_logprobs(entries, self._names(call), offset,
                                   call.ids if first else ())

    async def _start(self, call: _Call, route: _Route) -> tuple[Any, RequestOutput]:
        """Send the request and wait for its first delta. A replica that fails before it (its
        actor died or is unreachable, or its engine has failed) has produced nothing for this
        request, so the request is sent again while ``route`` allows (Serve's router drops a dead
        actor; a replica whose engine failed names itself and is avoided). A refusal
        (``ErrorRecord``) is raised as the HTTP error it names."""
        served = call.served
        prefixes: tuple[int, ...] = ()
        if served.prefix_root is not None and route.sampling.prompt_logprobs is None:
            # An adapter's blocks are its own (the replica's ``adapter_partition`` of its key,
            # name and id): the router never takes a base-model prefix for an adapter request's,
            # nor another adapter's, nor those of older weights once under the same name.
            partition = adapter_partition(
                call.cache_partition, call.adapter.key if call.adapter is not None else None)
            prefixes = tuple(block_hashes(call.ids, served.engine.block_size,
                                          partition_root(served.prefix_root, partition)))
        caller = route.caller
        while True:
            # The send, until its first delta (the router picks the replica inside the handle
            # call; the replica's span, a child of this one, names it).
            span = tracing.tracer().start_span("tierserve.dispatch", attributes={
                "tierserve.attempt": self.cfg.replica_retries - route.retries_left + 1,
                "tierserve.avoided_replicas": len(route.avoid)})
            try:
                stream = served.llm.generate.remote(GenerateRequest(
                    prompt_ids=tuple(call.ids), sampling=route.sampling,
                    priority=caller.priority, tier=caller.tier.name,
                    queue_share=caller.tier.queue_share, n=call.n, latency=caller.latency,
                    prefix_hashes=prefixes, avoid_replicas=tuple(route.avoid),
                    ttft_target_s=caller.tier.ttft_target_s,
                    tpot_target_s=caller.tier.tpot_target_s,
                    waited_s=time.monotonic() - route.arrival, tenant=caller.tenant,
                    cache_partition=call.cache_partition, request_id=call.header_id,
                    traceparent=tracing.traceparent(span),
                    lora=call.adapter.request() if call.adapter is not None else None))
            except BaseException as e:  # the handle refused it: nothing was sent
                if isinstance(e, Exception):
                    tracing.failed(span, e)
                span.end()
                raise
            try:
                first = await self._next(stream)
                if first is None:
                    raise Unavailable("the replica ended the request without an answer",
                                      "no_answer")
                if isinstance(first, ErrorRecord):
                    if first.code in RESENT_CODES and first.replica:
                        route.avoid.append(first.replica)
                    raise ServingError.of(first)
                if failed_before_first_token(first):
                    raise Unavailable(str(first.failure), "replica_unavailable")
                span.end()
                return stream, first
            except ServingError as e:
                tracing.failed(span, e)
                span.end()
                stream.cancel()
                if e.code not in RESENT_CODES or route.retries_left <= 0:
                    raise
                route.retries_left -= 1
                attempt = self.cfg.replica_retries - route.retries_left
                log.warning("sending again a request whose replica failed before answering "
                            "(send %d of %d): %s", attempt + 1, self.cfg.replica_retries + 1,
                            e.message)
                # Give the router and Serve time to see the failure (a report, a health check).
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            except BaseException:
                span.end()
                stream.cancel()
                raise

    async def _items(self, call: _Call, route: _Route, stream: Any, first: RequestOutput
                     ) -> AsyncGenerator[RequestOutput | None, None]:
        """The request's deltas, ``first`` first. When its replica fails (the actor dies or the
        engine fails) before any of the answer has gone to the client, the request is sent
        again while ``route`` allows, and None is yielded: the answer starts over. Otherwise a
        failed actor raises ``ServingError`` and a failed engine's delta (``finish_reason`` "error")
        is yielded as it is."""
        item: RequestOutput | ErrorRecord | None = first
        ended = False  # a sample finished cleanly (not a client that left)
        errored = False
        try:
            while True:
                if item is None:
                    raise Unavailable("the replica stopped streaming", "replica_failed")
                if not isinstance(item, RequestOutput):
                    raise Unavailable("the replica sent a malformed stream", "replica_failed")
                if replica_failed(item) and route.can_resend:
                    stream, item = await self._resend(call, route, stream, str(item.failure))
                    yield None
                    continue
                self._timed(route, item)
                if route.exchange is not None:
                    route.exchange.output(item, id(call))
                if item.finished:
                    ended = True
                    errored = errored or item.finish_reason == "error"
                yield item
                try:
                    item = await self._next(stream)
                except ServingError as e:
                    if e.code != "replica_unavailable" or not route.can_resend:
                        raise
                    stream, item = await self._resend(call, route, stream, e.message)
                    yield None
        except ServingError:
            errored = True
            raise
        finally:
            stream.cancel()
            # Counted when it ended or failed; a client that left is not the server's miss.
            if errored or ended:
                self._count_slo(route, failed=errored)

    def _timed(self, route: _Route, item: RequestOutput) -> None:
        """Note a delta's tokens: the first sample's token times (goodput), every sample's
        tokens to its tenant (fair share)."""
        n = len(item.token_ids)
        if not n:
            return
        now = time.monotonic()
        if item.index == 0:
            if route.first is None:
                route.first = now
                route.tokens = 0
            route.last = now
            route.tokens += n
        if route.gate is not None and route.ticket is not None:
            route.gate.charge(route.ticket, n)

    async def _resend(self, call: _Call, route: _Route, stream: Any, why: str
                      ) -> tuple[Any, RequestOutput]:
        stream.cancel()
        route.retries_left -= 1
        route.first = route.last = None  # the answer starts over
        route.tokens = 0
        if route.exchange is not None:
            route.exchange.restart(id(call))
        log.warning("sending again a request whose replica failed before any of its answer "
                    "went out: %s", why)
        return await self._start(call, route)

    async def _next(self, stream: Any) -> RequestOutput | ErrorRecord | None:
        try:
            item: RequestOutput | ErrorRecord = await stream.__anext__()
            return item
        except StopAsyncIteration:
            return None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("replica call failed: %s", type(e).__name__)
            raise Unavailable(f"no replica could serve the request ({type(e).__name__})",
                              "replica_unavailable") from None

    async def _sse(self, items: AsyncGenerator[RequestOutput | None, None], rid: str, call: _Call,
                   route: _Route) -> AsyncIterator[str]:
        """One SSE event per delta, as each engine step makes it: the text and (when asked)
        the log-probabilities of that step's tokens, per choice; usage in every chunk with
        ``continuous_usage_stats``, in a last chunk with ``include_usage``. Until the first of
        them goes out, a failed replica's request may be sent again (``_items``)."""
        created = now()
        model = call.model_name
        choices = [_Choice() for _ in range(call.n)]
        parsers = [call.parser() for _ in range(call.n)]
        try:
            if call.chat:
                for i in range(call.n):
                    head = ChatCompletionChunk(
                        id=rid, created=created, model=model, service_tier=call.service_tier,
                        choices=[ChatChunkChoice(index=i,
                                                 delta=ChatDelta(role="assistant", content=""))],
                        usage=self._usage(call, choices) if call.continuous_usage else None)
                    yield sse_event(head.model_dump_json())
            async for item in items:
                if item is None:  # sent again before any of the answer went out: start over
                    choices = [_Choice() for _ in range(call.n)]
                    parsers = [call.parser() for _ in range(call.n)]
                    continue
                index = item.index
                c = choices[index]
                first_of_choice = not c.started
                offset = len(c.text) + (len(call.echo or "") if c.started else 0)
                new_logprobs = len(c.logprobs)
                c.add(item)
                reason = c.finish_reason
                if reason == "error":
                    route.committed = True
                    if route.exchange is not None:
                        route.exchange.failed(_engine_failed(c))
                    yield error_event(_engine_failed(c), call.header_id)
                    break
                lps = c.logprobs[new_logprobs:]
                echo = (call.echo or "") if first_of_choice and not call.chat else ""
                text = item.text
                calls: list[ToolCallDelta] = []
                parser = parsers[index]
                if parser is not None:  # the answer's tool calls go out as deltas of their own
                    text, calls = parser.feed(item.text)
                    if reason is not None:
                        rest, more = parser.finish()
                        text, calls = text + rest, calls + more
                        reason = _finish_reason(reason, bool(parser.calls))
                if text or calls or echo or reason is not None or (call.logprobs and lps):
                    chunk: Any
                    u = self._usage(call, choices) if call.continuous_usage else None
                    if call.chat:
                        chunk = ChatCompletionChunk(
                            id=rid, created=created, model=model, usage=u,
                            service_tier=call.service_tier,
                            choices=[ChatChunkChoice(
                                index=index, delta=ChatDelta(content=text or None,
                                                             tool_calls=calls or None),
                                finish_reason=reason,
                                logprobs=(chat_logprobs(lps, self._names(call))
                                          if call.logprobs else None))])
                    else:
                        part = _Choice(logprobs=lps, prompt_logprobs=c.prompt_logprobs)
                        chunk = CompletionResponse(
                            id=rid, created=created, model=model, usage=u,
                            service_tier=call.service_tier,
                            choices=[CompletionChoice(
                                index=index, text=echo + item.text, finish_reason=reason,
                                logprobs=self._completion_logprobs(
                                    call, part, offset, first_of_choice))])
                    route.committed = True
                    yield sse_event(chunk.model_dump_json(exclude_none=False))
                if all(ch.finish_reason is not None for ch in choices):
                    if call.include_usage:
                        tail: Any = (ChatCompletionChunk if call.chat else CompletionResponse)(
                            id=rid, created=created, model=model, choices=[],
                            usage=self._usage(call, choices), service_tier=call.service_tier)
                        yield sse_event(tail.model_dump_json())
                    break
            yield "data: [DONE]\n\n"
        except ServingError as e:
            if route.exchange is not None:
                route.exchange.failed(e)
            yield error_event(e, call.header_id)
            yield "data: [DONE]\n\n"
        except Exception as e:  # a fault of ours: the client still gets an end it can read
            log.exception("a stream failed after its first byte")
            if route.exchange is not None:
                route.exchange.failed(internal_error(e))
            yield error_event(internal_error(e), call.header_id)
            yield "data: [DONE]\n\n"
        finally:
            await items.aclose()
