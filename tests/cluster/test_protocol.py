"""The request models and the error ``param`` without Ray (the HTTP side is in test_errors.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from tierserve.cluster.ingress import error_param, validation_error
from tierserve.cluster.protocol import ChatCompletionRequest, CompletionRequest

COMPLETION = {"model": "m", "prompt": "p"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def first_error(model: Any, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return dict(e.value.errors()[0])


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (ChatCompletionRequest, CHAT | {"functions": [{"name": "f"}]}, "functions"),
        (ChatCompletionRequest, CHAT | {"prediction": {"type": "content"}}, "prediction"),
        (ChatCompletionRequest, CHAT | {"audio": {"voice": "x"}}, "audio"),
        (CompletionRequest, COMPLETION | {"suffix": "!"}, "suffix"),
    ],
)
def test_unsupported_fields_are_refused_by_name(model: Any, body: dict[str, Any], field: str) -> None:
    err = first_error(model, body)
    assert err["loc"] == (field,) and "not supported" in err["msg"]
    assert model.model_validate(body | {field: None})


def test_chat_content_may_be_text_parts_and_nothing_else() -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    body = ChatCompletionRequest.model_validate(CHAT | {"messages": [{"role": "user", "content": parts}]})
    assert body.messages[0].text() == "Hello\nthere"
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(CHAT | {"messages": [{"role": "user", "content": image}]})
    msg, param = validation_error(e.value.errors())
    assert param == "messages.0.content.0"
    assert "'image_url' are not supported: only text is" in msg


def test_top_logprobs_needs_logprobs() -> None:
    err = first_error(ChatCompletionRequest, CHAT | {"top_logprobs": 3})
    assert "top_logprobs needs logprobs: true" in err["msg"]
    assert ChatCompletionRequest.model_validate(CHAT | {"top_logprobs": 3, "logprobs": True})


@pytest.mark.parametrize("top_k", [2**31, 2**63, 10**30])
def test_top_k_is_bounded(top_k: int) -> None:
    err = first_error(CompletionRequest, COMPLETION | {"top_k": top_k})
    assert err["loc"] == ("top_k",)
    assert CompletionRequest.model_validate(COMPLETION | {"top_k": 2**31 - 1}).top_k == 2**31 - 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": "hot"}, "temperature"),  # pydantic: ('temperature', 'float')
        ({"prompt": 7}, "prompt"),  # ('prompt', 'str')
        ({"stop": [1]}, "stop"),  # ('stop', 'str')
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
        ({"odd-name": 1}, "odd-name"),  # an unknown field is named as sent
        ({"list": 1}, "list"),
    ],
)
def test_error_param_is_the_field_path(body: dict[str, Any], param: str) -> None:
    err = first_error(CompletionRequest, COMPLETION | body)
    assert error_param(err["loc"], err["type"] == "extra_forbidden") == param


def test_error_param_of_nested_chat_fields() -> None:
    err = first_error(ChatCompletionRequest, CHAT | {"messages": [{"role": "user", "content": 1}]})
    assert error_param(err["loc"]) == "messages.0.content"
    assert error_param(("body", "max_tokens")) == "max_tokens"  # FastAPI's own validation
    assert error_param(()) is None


@pytest.mark.parametrize(("value", "ok"), [(4, True), (4.0, True), (4.5, False), ("4", False),
                                           (True, False), (None, True), (2.0**70, False)])
def test_integers_are_json_schema_integers(value: object, ok: bool) -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": value}
    if ok:
        parsed = CompletionRequest.model_validate(body)
        assert parsed.max_tokens is None or type(parsed.max_tokens) is int
    else:
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)


@pytest.mark.parametrize("text", ["a\u2028b", "\u0085", "x\u2029", "plain, é and 中", "\x1c\x0b"])
def test_sse_events_stay_one_line_for_every_line_splitter(text: str) -> None:
    """Generated text may hold U+0085/U+2028/U+2029, which JSON leaves raw but str.splitlines
    (hence httpx's ``aiter_lines``, the load generator's reader) treats as line ends."""
    from httpx._decoders import LineDecoder

    from tierserve.cluster.ingress import sse_event
    from tierserve.cluster.protocol import CompletionChoice, CompletionResponse

    chunk = CompletionResponse(id="cmpl-1", created=0, model="m",
                               choices=[CompletionChoice(text=text, finish_reason=None)])
    event = sse_event(chunk.model_dump_json())
    lines = LineDecoder().decode(event)
    assert [line for line in lines if line] == [event.strip()]
    assert event.endswith("\n\n") and event.startswith("data: ")
    assert json.loads(lines[0][len("data: "):])["choices"][0]["text"] == text
