"""Every error path through HTTP: OpenAI-shaped JSON with the right status, never a 500 or a 422.

Bad input is 400 whether the ingress (pydantic, tiers, limits) or the replica's scheduler
(empty, too long, never fits, token ids out of range) refuses it; a bad key is 401. The replicas
survive every one of these requests (none is replaced).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.helpers import KEYS, MODEL, ServeApp, assert_error, headers

pytestmark = [pytest.mark.ray, pytest.mark.slow]

C = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4} | fields


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 4} | fields


# (path, JSON body, expected error code, expected param); the main app's context is 2048 tokens,
# its pool 96 blocks of 16 (1536 tokens), its max_tokens limit 2048.
BAD_BODIES: list[tuple[str, dict[str, Any], str, str | None]] = [
    # empty, too long, never fits (the scheduler's admission errors)
    (C, comp(prompt=""), "empty", "prompt"),
    (C, comp(prompt=[]), "empty", "prompt"),
    (C, comp(prompt="a" * 2100), "too_long", None),
    (C, comp(prompt=[65] * 2048), "too_long", None),
    (C, comp(max_tokens=2000), "never_fits", None),
    (C, comp(prompt=[65] * 1500, max_tokens=100), "never_fits", None),
    (CHAT, chat(messages=[{"role": "user", "content": "x" * 2100}]), "too_long", None),
    (CHAT, chat(max_tokens=2000), "never_fits", None),
    (CHAT, chat(max_tokens=None, max_completion_tokens=2000), "never_fits", None),
    (C, comp(prompt=[65, 300]), "invalid_token", "prompt"),  # token id beyond the vocab
    (C, comp(prompt=[10**30]), "invalid_token", "prompt"),
    (C, comp(stop_token_ids=[300]), "invalid_token", "stop_token_ids"),
    (C, comp(prompt="<|bos|><|eos|><|pad|>"), "only_special_tokens", "prompt"),
    (C, comp(prompt=[256, 257, 257, 258]), "only_special_tokens", "prompt"),
    # wrong types
    (C, comp(max_tokens="16"), "invalid_request", "max_tokens"),
    (C, comp(max_tokens=True), "invalid_request", "max_tokens"),
    (C, comp(max_tokens=4.5), "invalid_request", "max_tokens"),
    (C, comp(temperature="hot"), "invalid_request", "temperature"),
    (C, comp(prompt=123), "invalid_request", None),
    (C, comp(prompt=["a", 2]), "invalid_request", "prompt"),
    (C, comp(prompt=None), "invalid_request", "prompt"),
    (C, comp(stream="yes"), "invalid_request", "stream"),
    (C, comp(stop=[1]), "invalid_request", None),
    (C, comp(seed=1.5), "invalid_request", "seed"),
    (C, comp(top_k=2.5), "invalid_request", "top_k"),
    (C, comp(stream=True, stream_options={"include_usage": "yes"}), "invalid_request",
     "stream_options.include_usage"),
    (C, comp(model=7), "invalid_request", "model"),
    (CHAT, chat(messages="hi"), "invalid_request", "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": None}]), "invalid_request",
     "messages.0.content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                         "image_url": {"url": "http://x/a.png"}}]}]),
     "invalid_request", "messages.0.content.0"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
     "invalid_request", "messages.0.content.0"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "invalid_request", "messages.0.content.0"),
    (CHAT, chat(messages=[{"role": "user"}]), "invalid_request", "messages.0.content"),
    # out of range
    (C, comp(temperature=-0.1), "invalid_request", "temperature"),
    (C, comp(temperature=2.5), "invalid_request", "temperature"),
    (C, comp(top_p=0), "invalid_request", "top_p"),
    (C, comp(top_p=1.5), "invalid_request", "top_p"),
    (C, comp(top_k=-2), "invalid_request", "top_k"),
    (C, comp(top_k=2**40, temperature=1.0), "invalid_request", "top_k"),
    (C, comp(top_k=10**30, temperature=1.0), "invalid_request", "top_k"),
    (C, comp(max_tokens=-1), "invalid_request", "max_tokens"),
    (CHAT, chat(max_tokens=0), "invalid_request", "max_tokens"),
    (C, comp(max_tokens=5000), "max_tokens_too_large", "max_tokens"),
    (C, comp(max_tokens=10**30), "max_tokens_too_large", "max_tokens"),
    (C, comp(seed=-1), "invalid_request", "seed"),
    (C, comp(seed=2**64), "invalid_request", "seed"),
    (C, comp(n=0), "invalid_request", "n"),
    (C, comp(n=9), "n_too_large", "n"),
    (C, comp(presence_penalty=2.5), "invalid_request", "presence_penalty"),
    (C, comp(frequency_penalty=-3), "invalid_request", "frequency_penalty"),
    (C, comp(repetition_penalty=0), "invalid_request", "repetition_penalty"),
    (C, comp(min_p=1.5), "invalid_request", "min_p"),
    (C, comp(min_tokens=-1), "invalid_request", "min_tokens"),
    (C, comp(min_tokens=20, max_tokens=10), "invalid_request", "min_tokens"),
    (C, comp(logit_bias={"5": 101}), "invalid_request", "logit_bias.5"),
    (C, comp(logit_bias={"five": 1}), "invalid_token", "logit_bias"),
    (C, comp(logit_bias={"99999": 1}), "invalid_token", "logit_bias"),
    (C, comp(logprobs=21), "invalid_request", "logprobs"),
    (C, comp(best_of=2), "invalid_request", "best_of"),
    (CHAT, chat(top_logprobs=3), "invalid_request", None),
    (CHAT, chat(logprobs=True, top_logprobs=21), "invalid_request", "top_logprobs"),
    (C, comp(stream=True, stream_options={"continuous_usage_stats": 1}), "invalid_request",
     "stream_options.continuous_usage_stats"),
    (C, comp(prompt=[-1]), "invalid_request", None),
    (C, comp(stop=[""]), "invalid_request", "stop"),
    (C, comp(stop=["a"] * 9), "too_many_stops", "stop"),
    (C, comp(stop_token_ids=[-3]), "invalid_request", "stop_token_ids.0"),
    (CHAT, chat(messages=[]), "invalid_request", "messages"),
    (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), "invalid_request",
     "messages.0.tool_call_id"),
    (CHAT, chat(messages=[{"role": "critic", "content": "x"}]), "invalid_request",
     "messages.0.role"),
    (CHAT, chat(max_completion_tokens=0), "invalid_request", "max_completion_tokens"),
    # unknown model, unknown or unsupported fields
    (C, comp(suffix="x"), "invalid_request", "suffix"),
    (CHAT, chat(tools=[]), "invalid_request", "tools"),
    (CHAT, chat(tool_choice="auto"), "invalid_request", "tool_choice"),
    (CHAT, chat(response_format={"type": "xml"}), "invalid_request", "response_format.type"),
    (CHAT, chat(functions=[{"name": "f"}]), "invalid_request", "functions"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "invalid_request", "audio"),
    (CHAT, chat(modalities=["text", "audio"]), "invalid_request", "modalities"),
    (C, comp(echo="yes"), "invalid_request", "echo"),
    (C, comp(unknown_field=1), "invalid_request", "unknown_field"),
    # a streaming request is refused the same way, before any event is sent
    (C, comp(prompt="a" * 2100, stream=True), "too_long", None),
    (CHAT, chat(max_tokens=2000, stream=True), "never_fits", None),
    (C, comp(prompt="", stream=True), "empty", "prompt"),
]


@pytest.fixture(scope="module")
def http(main_app: ServeApp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=main_app.base_url, timeout=60) as client:
        yield client


@pytest.mark.parametrize(("path", "body", "code", "param"), BAD_BODIES,
                         ids=[f"{i}-{c}" for i, (_, _, c, _) in enumerate(BAD_BODIES)])
def test_bad_input_is_400(http: httpx.Client, path: str, body: dict[str, Any], code: str,
                          param: str | None) -> None:
    err = assert_error(http.post(path, json=body), 400, code)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err


def raw(path: str, text: bytes, tail: bytes = b"") -> bytes:
    """A raw body for ``path`` whose prompt (or one user message) is the JSON value ``text``."""
    what = b'"prompt": ' + text if path == C else (
        b'"messages": [{"role": "user", "content": ' + text + b"}]")
    return b'{"model": "tierserve-tiny", ' + what + tail + b"}"


RAW_BODIES: list[tuple[bytes | None, bytes, str]] = [
    # (text of the prompt or message, or None for the whole body as given; tail or body; code)
    (None, b'{"model": "tierserve-tiny", "prompt": ', "invalid_json"),
    (None, b"", "invalid_json"),
    (None, b"\xff\xfe{}", "invalid_json"),
    (None, b"[1, 2]", "invalid_json"),
    (None, b'"just a string"', "invalid_json"),
    (b'"hi"', b', "temperature": NaN', "invalid_request"),
    (b'"hi"', b', "top_p": Infinity', "invalid_request"),
    (b'"hi"', b', "max_tokens": 1e400', "invalid_request"),
    # A lone surrogate escape: valid JSON, but no tokenizer can encode it.
    (b'"\\ud800"', b"", "invalid_json"),
    (b'"hi \\udfff there"', b"", "invalid_json"),
    (b'"hi"', b', "stop": ["\\udfff"]', "invalid_json"),
    # Bytes that are not UTF-8 inside a string.
    (b'"hi \xff\xfe there"', b"", "invalid_json"),
    (b'"\xc3"', b"", "invalid_json"),
]


@pytest.mark.parametrize(("path", "body"), [(C, comp(model="gpt-4o")),
                                            (CHAT, chat(model="tierserve-huge"))])
def test_an_unknown_model_is_404_model_not_found(http: httpx.Client, path: str,
                                                 body: dict[str, Any]) -> None:
    err = assert_error(http.post(path, json=body), 404, "model_not_found")
    assert err["type"] == "not_found_error" and err["param"] == "model"


@pytest.mark.parametrize(("text", "tail", "code"), RAW_BODIES)
@pytest.mark.parametrize("path", [C, CHAT])
def test_malformed_bodies_are_400(http: httpx.Client, path: str, text: bytes | None,
                                  tail: bytes, code: str) -> None:
    body = tail if text is None else raw(path, text, tail)
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(response, 400, code)


@pytest.mark.parametrize(
    ("hdrs", "code"),
    [
        (headers(priority="high"), "invalid_priority"),
        (headers(priority="1.5"), "invalid_priority"),
        (headers(priority="9" * 400), "invalid_priority"),
        (headers(KEYS["batch"], 10), "invalid_priority"),
        (headers(KEYS["standard"], 4), "invalid_priority"),
    ],
)
def test_bad_priority_header_is_400(http: httpx.Client, hdrs: dict[str, str], code: str) -> None:
    err = assert_error(http.post(C, json=comp(), headers=hdrs), 400, code)
    assert err["param"] == "X-TL-Priority"


@pytest.mark.parametrize("authorization", ["Bearer nope", "Bearer", "Basic dXNlcjpwYXNz",
                                           KEYS["batch"], f"Bearer {KEYS['batch']}x"])
@pytest.mark.parametrize("path", [C, CHAT])
def test_a_bad_api_key_is_401(http: httpx.Client, path: str, authorization: str) -> None:
    body = comp() if path == C else chat()
    err = assert_error(http.post(path, json=body, headers={"Authorization": authorization}),
                       401, "invalid_api_key")
    assert err["type"] == "authentication_error"


def test_http_errors_are_shaped_too(http: httpx.Client, main_app: ServeApp) -> None:
    assert_error(http.get(C), 405)
    assert_error(http.post("/v1/embeddings", json={}), 404)
    assert_error(http.post(C, content=b'{"prompt": "' + b"a" * (1 << 20) + b'"}',
                           headers={"content-type": "application/json"}), 413, "too_large")


def test_the_openai_client_sees_typed_errors(main_app: ServeApp) -> None:
    client = main_app.client(KEYS["standard"])
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="", max_tokens=4)
    assert bad.value.code == "empty" and bad.value.param == "prompt"
    with pytest.raises(openai.NotFoundError) as unknown:  # OpenAI's answer: 404
        client.chat.completions.create(model="gpt-4o", messages=USER)  # type: ignore[arg-type]
    assert unknown.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model=MODEL, prompt="a" * 3000, max_tokens=4, stream=True)
    assert long.value.code == "too_long"
    with pytest.raises(openai.AuthenticationError) as auth:
        main_app.client("wrong").completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert auth.value.status_code == 401


def test_no_replica_was_harmed(main_app: ServeApp) -> None:
    """After every bad request above: the same replicas, idle, with all their blocks."""
    stats = main_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == main_app.baseline
