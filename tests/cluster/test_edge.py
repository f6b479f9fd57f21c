"""The ingress's edge against careless and hostile clients: the caller is resolved before the
body is read, a body has a deadline and a size bound, nesting cannot exhaust the stack, a prompt
that cannot fit is refused before it is tokenized and a large one is tokenized off the event
loop, and a stream that fails in the server's own code still ends with an error event and
``[DONE]``. No Ray: the ingress's logic on stand-ins."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from tierserve.cluster import ingress as ingress_mod
from tierserve.cluster.config import ClusterConfig, TierConfig
from tierserve.cluster.edge import (
    OFF_LOOP_CHARS,
    PromptBound,
    Tokenizing,
    longest_token_bytes,
    message_texts,
    read_json,
)
from tierserve.cluster.ingress import _Call
from tierserve.cluster.tiers import Caller, TierResolver, cache_partition
from tierserve.records import RequestOutput, SamplingParams, ServingError
from tierserve.replica.models.embedded_spec import EMBEDDED_MODEL
from tierserve.replica.models.meta import load_tokenizer


async def chunks(*parts: bytes, pause_s: float = 0.0) -> AsyncIterator[bytes]:
    for p in parts:
        if pause_s:
            await asyncio.sleep(pause_s)
        yield p


def read(*parts: bytes, declared: str | None = None, limit: int = 1 << 20,
         timeout_s: float = 5.0, pause_s: float = 0.0) -> dict[str, Any]:
    return asyncio.run(read_json(chunks(*parts, pause_s=pause_s), declared, limit, timeout_s))


def refused(status: int, code: str, *parts: bytes, **kw: Any) -> ServingError:
    with pytest.raises(ServingError) as e:
        read(*parts, **kw)
    assert (e.value.status, e.value.code) == (status, code), e.value.message
    return e.value


# ------------------------------------------------------------------ the body


def test_a_body_is_read_whole_in_chunks() -> None:
    assert read(b'{"a": ', b'[1, 2]}') == {"a": [1, 2]}


def test_json_nested_past_the_parser_s_stack_is_a_400_not_a_500() -> None:
    for deep in (b"[" * 1200 + b"]" * 1200, b'{"a":' * 1200 + b"1" + b"}" * 1200,
                 b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        err = refused(400, "invalid_json", deep)
        assert "nested too deeply" in err.message


def test_a_body_that_trickles_past_its_deadline_is_a_408() -> None:
    err = refused(408, "body_timeout", b'{"model":', b'"m"}', timeout_s=0.05, pause_s=0.5)
    assert "did not arrive within 0.05 s" in err.message


def test_a_body_over_the_limit_is_a_413_declared_or_read() -> None:
    refused(413, "too_large", b"{}", declared="2048", limit=1024)
    refused(413, "too_large", b'{"a": "' + b"x" * 2000 + b'"}', limit=1024)


@pytest.mark.parametrize("body", [b"[1, 2]", b'"text"', b"not json", b"\xff\xfe"])
def test_a_body_that_is_not_a_json_object_is_a_400(body: bytes) -> None:
    refused(400, "invalid_json", body)


def test_a_lone_surrogate_is_a_400() -> None:
    assert "not valid Unicode" in refused(400, "invalid_json", b'{"p": "\\ud800"}').message


# ------------------------------------------------------------------ the caller first


class NoBody:
    """A request whose body must not be read: its headers already decide the answer."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers
        self.read = False

    async def stream(self) -> AsyncIterator[bytes]:
        self.read = True
        raise AssertionError("the body was read before the caller was resolved")
        yield b""  # pragma: no cover


def keyed_ingress() -> Any:
    cls = next(c for c in ingress_mod.Ingress.func_or_class.__mro__
               if "completions" in c.__dict__)
    self = object.__new__(cls)
    self.cfg = ClusterConfig(tiers=[
        TierConfig(name="paid", base_priority=5, max_priority=9, api_keys=["k-paid"]),
    ], anonymous_tier=None)
    self.tiers = TierResolver(self.cfg)
    return self


@pytest.mark.parametrize("route", ["completions", "chat"])
@pytest.mark.parametrize("auth", [None, "Bearer wrong"])
def test_the_caller_is_resolved_before_the_body_is_read(route: str, auth: str | None) -> None:
    ing = keyed_ingress()
    request = NoBody({"authorization": auth} if auth else {})
    with pytest.raises(ServingError) as e:
        asyncio.run(getattr(ing, route)(request))
    assert e.value.status == 401 and not request.read


# ------------------------------------------------------------------ the prompt


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(EMBEDDED_MODEL)


TEXTS = ["hello world " * 50, "ＡＢＣ ｆｕｌｌｗｉｄｔｈ" * 40, "😀🚀 emoji " * 60, "a" * 3000,
         "日本語のテキスト" * 80, "\n\t  spaces  \n" * 100, "ﬁﬂﬃ ligatures " * 30]


@pytest.mark.parametrize("text", TEXTS)
def test_the_byte_bound_never_exceeds_the_token_count(tokenizer: Any, text: str) -> None:
    """A prompt refused by its bytes alone could never have fitted: its token count is at least
    its bytes over what one token covers (the bound's arithmetic), whatever the text."""
    per_token = longest_token_bytes(tokenizer)
    tokens = len(tokenizer.encode(text, add_special_tokens=False))
    nbytes = len(text.encode("utf-8"))
    context = max(tokens, 2)  # the tightest context the prompt still fits... almost
    bound = PromptBound(context + 1, per_token)
    bound.check_text(nbytes, "prompt")  # fits (tokens <= context): never refused by bytes
    assert nbytes <= bound.max_bytes


def test_a_prompt_that_cannot_fit_is_refused_by_its_bytes() -> None:
    bound = PromptBound(context=100, token_bytes=4)
    bound.check_text(bound.max_bytes, "prompt")
    with pytest.raises(ServingError) as e:
        bound.check_text(bound.max_bytes + 1, "prompt")
    assert (e.value.status, e.value.code, e.value.param) == (400, "too_long", "prompt")
    assert "context is 100" in e.value.message
    bound.check_ids(99, "prompt")
    with pytest.raises(ServingError, match="at most 99 tokens"):
        bound.check_ids(100, "prompt")


def test_a_large_prompt_is_tokenized_off_the_event_loop() -> None:
    tok = Tokenizing(workers=1)
    where: list[str] = []

    def fn() -> int:
        where.append(threading.current_thread().name)
        return 1

    async def go() -> None:
        await tok.run(10, fn)
        await tok.run(OFF_LOOP_CHARS, fn)

    asyncio.run(go())
    tok.shutdown()
    assert where[0] == threading.main_thread().name
    assert where[1].startswith("tierserve-tokenize")


def test_message_texts_are_the_contents_and_text_parts() -> None:
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
            {"role": "assistant", "content": None}]
    assert message_texts(msgs) == ["be brief", "hi"]


# ------------------------------------------------------------------ prefix-cache partitions


def test_a_tenant_s_prompts_are_cached_in_its_own_partition() -> None:
    tier = ClusterConfig().tiers[0]
    a, b, anon = (Caller(tier, 10, tenant="acme"), Caller(tier, 10, tenant="globex"),
                  Caller(tier, 10))
    assert cache_partition(a, None) != cache_partition(b, None)
    assert cache_partition(anon, None) is None  # callers who name no tenant: the shared one
    assert cache_partition(a, "s1") != cache_partition(a, "s2") != cache_partition(a, None)
    assert cache_partition(anon, "s1") is not None
    # Sharing across tenants is the operator's explicit choice; a salt still separates.
    assert cache_partition(a, None, "shared") == cache_partition(b, None, "shared") is None
    assert cache_partition(a, "s", "shared") == cache_partition(b, "s", "shared")


# ------------------------------------------------------------------ a stream's end


class Items:
    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self) -> Items:
        self._left = [RequestOutput("r", "Hel", [1], completion_tokens=1),
                      RequestOutput("r", "lo", [2], completion_tokens=2)]
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._left:
            raise StopAsyncIteration
        return self._left.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def test_a_stream_that_fails_in_the_server_s_code_ends_with_an_error_event_and_done() -> None:
    cls = next(c for c in ingress_mod.Ingress.func_or_class.__mro__ if "_sse" in c.__dict__)
    ing = object.__new__(cls)
    ing.cfg = ClusterConfig()
    real = ing._usage
    made: list[int] = []

    def flaky(*args: Any) -> Any:
        made.append(1)
        if len(made) == 2:
            raise KeyError("a bug of ours")
        return real(*args)

    ing._usage = flaky  # the second chunk's usage fails (continuous usage: every chunk has one)
    route = ingress_mod._Route(SamplingParams(max_tokens=4), Caller(ClusterConfig().tiers[0], 10), 0)
    items = Items()

    async def go() -> list[str]:
        served: Any = SimpleNamespace(name=ing.cfg.model_name)  # what _sse reads of its model
        call = _Call(chat=False, n=1, ids=[1], served=served, continuous_usage=True)
        return [e async for e in ing._sse(items, "cmpl-1", call, route)]

    out = asyncio.run(go())
    assert json.loads(out[0][len("data: "):])["choices"][0]["text"] == "Hel"
    err = json.loads(out[1][len("data: "):])["error"]
    assert err["code"] == "internal_error" and "KeyError" in err["message"]
    assert "a bug of ours" not in err["message"]  # what failed inside is the log's, not the client's
    assert out[2] == "data: [DONE]\n\n" and len(out) == 3 and items.closed


def test_an_unexpected_exception_outside_a_stream_is_the_api_s_json_500() -> None:
    request: Any = SimpleNamespace(method="POST", url=SimpleNamespace(path="/v1/completions"))
    r = asyncio.run(ingress_mod._internal_error(request, RecursionError("deep")))
    assert r.status_code == 500
    body = json.loads(r.body)["error"]
    assert body["code"] == "internal_error" and "RecursionError" in body["message"]


# ------------------------------------------------------------------ a reader that does not read


def test_a_tier_s_open_streams_are_bounded_in_bytes_sent() -> None:
    """What a tier's open streams have sent is bounded (``max_stream_bytes``): Serve's proxy
    keeps what a client does not read, so past the budget the tier's new requests are refused
    until its streams end; another tier is not touched."""
    cls = next(c for c in ingress_mod.Ingress.func_or_class.__mro__ if "_admit" in c.__dict__)
    ing = object.__new__(cls)
    ing.cfg = ClusterConfig(tiers=[
        TierConfig(name="paid", base_priority=5, max_priority=9, max_stream_bytes=1000),
        TierConfig(name="free", base_priority=0, max_priority=0, max_stream_bytes=1000),
    ], anonymous_tier="free")
    ing.stream_bytes = {"paid": 0, "free": 0}
    ing.inflight = 0
    ing.gate = None
    refusals: list[tuple[str, str]] = []
    ing.metrics = SimpleNamespace(rejected=lambda reason, tier: refusals.append((reason, tier)))
    free, paid = (Caller(t, t.base_priority) for t in reversed(ing.cfg.tiers))

    async def body() -> AsyncIterator[str]:
        for _ in range(3):
            yield "x" * 400

    async def go() -> None:
        ing.inflight += 1
        stream = ing._release_after(body(), "free")
        chunks = [await stream.__anext__() for _ in range(3)]  # 1,200 bytes out, unread
        assert sum(map(len, chunks)) == 1200 == ing.stream_bytes["free"]
        with pytest.raises(ServingError) as e:
            ing._admit(free)
        assert (e.value.status, e.value.code) == (429, "stream_budget")
        assert "max_stream_bytes (1000)" in e.value.message
        ing._admit(paid)  # another tier's budget is its own
        await stream.aclose()  # the stream ends: its bytes come back
        assert ing.stream_bytes["free"] == 0 and ing.inflight == 0
        ing._admit(free)

    asyncio.run(go())
    assert refusals == [("stream_budget", "free")]


def test_a_default_max_tokens_above_the_limit_is_the_limit_not_a_400() -> None:
    """A completions request that leaves ``max_tokens`` out asked for nothing: its default (16)
    is cut to ``max_tokens_limit``; one that asks for more is refused."""
    from tierserve.cluster.protocol import CompletionRequest

    cls = next(c for c in ingress_mod.Ingress.func_or_class.__mro__
               if "_sampling" in c.__dict__)
    ing = object.__new__(cls)
    ing.cfg = ClusterConfig(max_tokens_limit=4)
    model = ing.cfg.model_name
    assert ing._sampling(CompletionRequest(model=model, prompt="x")).max_tokens == 4
    with pytest.raises(ServingError) as e:
        ing._sampling(CompletionRequest(model=model, prompt="x", max_tokens=16))
    assert (e.value.code, e.value.param) == ("max_tokens_too_large", "max_tokens")
