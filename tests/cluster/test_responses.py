"""``POST /v1/responses`` (OpenAI's Responses API) without Ray: the real ingress class over a
stand-in engine (``stub_ingress``). Every field reaches the chat request it is served as; the
answer is a ``Response`` object (text, function calls, usage, the length stop); a stream sends the
events in the order the ``openai`` SDK expects, numbered; every bad input is a 400 naming the
Responses field; and the SDK's ``responses.create`` and ``responses.stream`` parse every answer
(through a mock transport onto the stub)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import openai
import pytest
from starlette.requests import Request

from tests.cluster import stub_ingress
from tests.cluster.stub_ingress import ANSWER, StubIngress, _Stream
from tierserve.cluster import ingress
from tierserve.cluster.responses import ResponsesCall, ResponsesRequest
from tierserve.records import (
    GRAMMAR_REJECTED_TOKEN,
    GenerateRequest,
    RequestOutput,
    ServingError,
)

ROUTE = "/v1/responses"
CHAT = "/v1/chat/completions"
CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
WEATHER: dict[str, Any] = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True}
CITY_SCHEMA: dict[str, Any] = {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress()


def body(stub: StubIngress, **kw: Any) -> dict[str, Any]:
    return {"model": stub.model, "input": "What is the weather in Paris?", **kw}


def ok(stub: StubIngress, headers: dict[str, str] | None = None, **kw: Any) -> Any:
    answer = stub.post(ROUTE, body(stub, **kw), headers)
    assert answer.status == 200, answer.body
    return answer.body


def refused(stub: StubIngress, data: dict[str, Any], param: str | None,
            says: str = "") -> dict[str, Any]:
    answer = stub.post(ROUTE, data)
    assert answer.status == 400, answer.body
    error: dict[str, Any] = answer.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert says in error["message"], error
    return error


def prompt(stub: StubIngress) -> str:
    """The text of the last request's prompt, as the replica got it."""
    return str(stub.inst.tokenizer.decode(list(stub.sent[-1].prompt_ids)))


def types(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


# ------------------------------------------------------------------ the answer


def test_a_string_input_answers_a_response_object(stub: StubIngress) -> None:
    out = ok(stub, instructions="Answer in one word.")
    assert out["object"] == "response" and out["id"].startswith("resp_")
    assert out["status"] == "completed" and out["incomplete_details"] is None
    assert out["error"] is None and out["model"] == stub.model
    assert isinstance(out["created_at"], int) and out["completed_at"] >= out["created_at"]
    (message,) = out["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed" and message["id"].startswith("msg_")
    assert message["content"] == [{"type": "output_text", "text": ANSWER, "annotations": [],
                                   "logprobs": []}]
    u = out["usage"]
    assert u["input_tokens"] == len(stub.sent[-1].prompt_ids)
    assert u["output_tokens"] == len(stub.inst.tokenizer.encode(ANSWER))
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"]
    assert u["input_tokens_details"] == {"cached_tokens": 0}
    assert u["output_tokens_details"] == {"reasoning_tokens": 0}
    # The request's settings, echoed; nothing is stored.
    assert out["instructions"] == "Answer in one word."
    assert (out["temperature"], out["top_p"], out["max_output_tokens"]) == (1.0, 1.0, None)
    assert out["tools"] == [] and out["tool_choice"] == "auto"
    assert out["parallel_tool_calls"] is True and out["text"] == {"format": {"type": "text"}}
    assert out["store"] is False and out["metadata"] == {} and out["service_tier"] == "default"
    assert out["previous_response_id"] is None and out["truncation"] == "disabled"


def test_the_input_is_rendered_as_the_chat_route_renders_its_messages(stub: StubIngress) -> None:
    """``instructions`` is a first system message; the items are chat messages; the prompt is
    exactly the chat route's for the same conversation."""
    ok(stub, instructions="Be brief.", input=[
        {"role": "developer", "content": "Use celsius."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "Paris?"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Which day?",
                                           "annotations": []}]},
        {"role": "user", "content": "Today."}])
    responses = list(stub.sent[-1].prompt_ids)
    assert stub.post(CHAT, {"model": stub.model, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use celsius."},
        {"role": "user", "content": "Weather\nParis?"},
        {"role": "assistant", "content": "Which day?"},
        {"role": "user", "content": "Today."}]}).status == 200
    assert list(stub.sent[-1].prompt_ids) == responses


def test_a_function_call_and_its_output_go_back_as_the_chat_tool_turns(stub: StubIngress) -> None:
    """An earlier answer's ``output`` items sent back (a message and its calls: one assistant
    turn) and the calls' ``function_call_output`` items: the chat route's tool messages."""
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "22 C"},
        {"type": "function_call_output", "call_id": "call_b",
         "output": [{"type": "input_text", "text": "18 C"}]},
    ]
    ok(stub, input=items, tools=[WEATHER], tool_choice="none")
    responses = list(stub.sent[-1].prompt_ids)
    assert "22 C" in prompt(stub) and "Rome" in prompt(stub)
    chat_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                  if k != "type"}}
    assert stub.post(CHAT, {"model": stub.model, "tools": [chat_tool], "tool_choice": "none",
                            "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_b", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_a", "content": "22 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "18 C"}]}).status == 200
    assert list(stub.sent[-1].prompt_ids) == responses


def test_sampling_fields_reach_the_replica(stub: StubIngress) -> None:
    out = ok(stub, max_output_tokens=7, temperature=0.5, top_p=0.9, seed=3, top_k=4,
             min_p=0.1, stop=["\n"], presence_penalty=0.5, frequency_penalty=-0.5,
             repetition_penalty=1.1, user="u1", safety_identifier="s1", prompt_cache_key="k",
             prompt_cache_retention="24h", metadata={"run": "7"}, truncation="auto",
             reasoning={"effort": "low", "summary": "auto"}, store=True, max_tool_calls=2,
             background=False, stream_options=None, text={"verbosity": "low"}, cache_salt="x")
    p = stub.sent[-1].sampling
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.top_k) == (7, 0.5, 0.9, 3, 4)
    assert (p.min_p, p.stop, p.presence_penalty, p.frequency_penalty) == (0.1, ["\n"], 0.5, -0.5)
    assert p.repetition_penalty == 1.1 and p.structured is None
    assert (out["max_output_tokens"], out["temperature"], out["top_p"]) == (7, 0.5, 0.9)
    assert out["metadata"] == {"run": "7"} and out["user"] == "u1"
    assert out["safety_identifier"] == "s1" and out["prompt_cache_key"] == "k"
    assert out["store"] is False  # accepted, nothing stored
    assert out["reasoning"]["effort"] == "low" and out["truncation"] == "auto"
    assert out["max_tool_calls"] == 2 and out["text"]["verbosity"] == "low"


def test_the_request_id_names_the_response(stub: StubIngress) -> None:
    assert ok(stub, request_id="abc-1")["id"] == "resp_abc-1"
    out = ok(stub, {"X-Request-Id": "req-42"})
    assert out["id"] == "resp_req-42" and stub.sent[-1].request_id == "req-42"


def test_a_length_stop_is_an_incomplete_response(stub: StubIngress,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _answer_with(stub, monkeypatch, [_out(stub, ANSWER, "length")])
    out = ok(stub, max_output_tokens=1)
    assert out["status"] == "incomplete"
    assert out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["status"] == "incomplete"
    events = ok(stub, max_output_tokens=1, stream=True)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["status"] == "incomplete"


def test_logprobs_when_included(stub: StubIngress) -> None:
    out = ok(stub, include=["message.output_text.logprobs"], top_logprobs=1)
    assert stub.sent[-1].sampling.logprobs == 1
    lps = out["output"][0]["content"][0]["logprobs"]
    assert len(lps) == len(stub.inst.tokenizer.encode(ANSWER))
    assert lps[0]["logprob"] == -0.5 and len(lps[0]["top_logprobs"]) == 1
    events = ok(stub, include=["message.output_text.logprobs"], stream=True)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert sum(len(e["logprobs"]) for e in deltas) == len(lps)
    # Without the include: none asked, none sent.
    assert ok(stub, top_logprobs=1)["output"][0]["content"][0]["logprobs"] == []
    assert stub.sent[-1].sampling.logprobs is None


def test_a_json_schema_text_format_is_the_structured_output(
        stub: StubIngress, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stub_ingress, "ANSWER", '{"city": "Paris"}')
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True,
           "description": "A city."}
    out = ok(stub, text={"format": fmt})
    structured = stub.sent[-1].sampling.structured
    assert structured is not None and structured.kind == "json"
    assert json.loads(structured.spec) == CITY_SCHEMA
    assert json.loads(out["output"][0]["content"][0]["text"]) == {"city": "Paris"}
    assert out["text"] == {"format": fmt}
    ok(stub, text={"format": {"type": "json_object"}})
    structured = stub.sent[-1].sampling.structured
    assert structured is not None and structured.kind == "json_object"
    ok(stub, text={"format": {"type": "text"}})
    assert stub.sent[-1].sampling.structured is None


# ------------------------------------------------------------------ tools


def test_a_function_call_answer(stub: StubIngress, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stub_ingress, "ANSWER", CALL)
    out = ok(stub, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert stub.sent[-1].sampling.structured is not None  # a call of the schema, constrained
    assert "get_weather" in prompt(stub)
    (call,) = out["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    assert out["status"] == "completed"
    assert out["tools"] == [WEATHER] and out["tool_choice"] == "required"
    assert out["parallel_tool_calls"] is False
    named = ok(stub, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert named["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert named["output"][0]["name"] == "get_weather"
    # "none": no call is parsed; the text is the answer.
    text = ok(stub, tools=[WEATHER], tool_choice="none")
    assert text["output"][0]["type"] == "message"


def test_a_streamed_function_call(stub: StubIngress, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stub_ingress, "ANSWER", "Let me check. " + CALL)
    events = ok(stub, tools=[WEATHER], stream=True)
    assert types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    added = events[8]
    assert added["output_index"] == 1 and added["item"]["type"] == "function_call"
    assert added["item"]["status"] == "in_progress" and added["item"]["name"] == "get_weather"
    item_id = added["item"]["id"]
    args = "".join(e["delta"] for e in events
                   if e["type"] == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    assert events[10]["arguments"] == args and events[10]["item_id"] == item_id
    assert events[11]["item"]["arguments"] == args
    assert events[11]["item"]["status"] == "completed"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"].strip() == "Let me check."
    assert final["output"][1] == events[11]["item"]


def _no_ids(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items without the ids each answer draws afresh."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


@pytest.mark.parametrize("answer", [CALL, "", " ok"])
def test_streamed_and_whole_outputs_match_with_logprobs(
        stub: StubIngress, monkeypatch: pytest.MonkeyPatch, answer: str) -> None:
    """With tools and the text's logprobs included, a call's tokens (held by the call parser,
    streamed as logprobs with no text) open no message: the streamed ``output`` is the
    non-streamed one (an answer with neither text nor call is one empty message in both)."""
    monkeypatch.setattr(stub_ingress, "ANSWER", answer)
    ask = {"tools": [WEATHER], "include": ["message.output_text.logprobs"], "top_logprobs": 1}
    whole = ok(stub, **ask)["output"]
    events = ok(stub, stream=True, **ask)
    streamed = events[-1]["response"]["output"]
    assert _no_ids(streamed) == _no_ids(whole)
    kinds = [i["type"] for i in whole]
    assert kinds == (["function_call"] if answer == CALL else ["message"])
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == kinds
    if answer == " ok":
        lps = whole[0]["content"][0]["logprobs"]
        assert len(lps) == len(stub.inst.tokenizer.encode(answer)) and lps[0]["logprob"] == -0.5


# ------------------------------------------------------------------ the stream


def test_the_stream_sends_the_sdk_s_events_in_order(stub: StubIngress) -> None:
    events = ok(stub, stream=True, instructions="Be brief.")
    assert types(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert created["instructions"] == "Be brief." and created["usage"] is None
    item = events[2]["item"]
    assert item["type"] == "message" and item["status"] == "in_progress"
    assert all(e.get("item_id", item["id"]) == item["id"] for e in events[3:8])
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == ANSWER and events[5]["text"] == ANSWER
    assert events[6]["part"] == {"type": "output_text", "text": ANSWER, "annotations": [],
                                 "logprobs": []}
    assert events[7]["item"]["status"] == "completed"
    done = events[-1]["response"]
    assert done["id"] == created["id"] and done["status"] == "completed"
    assert done["output"] == [events[7]["item"]]
    assert done["usage"]["output_tokens"] == len(stub.inst.tokenizer.encode(ANSWER))
    assert done["usage"]["input_tokens"] == len(stub.sent[-1].prompt_ids)


def test_the_stream_names_each_event_type(stub: StubIngress) -> None:
    status, raw, headers = stub.post_raw(ROUTE, json.dumps(body(stub, stream=True)).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    blocks = [b for b in raw.decode().split("\n\n") if b]
    for block in blocks:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: "):])["type"] == event[len("event: "):]
    assert "[DONE]" not in raw.decode()


def test_an_error_mid_stream_fails_the_response(stub: StubIngress,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _answer_with(stub, monkeypatch, [
        _out(stub, " par", None),
        _out(stub, "", "error", failure="the grammar refused a token",
             error_code=GRAMMAR_REJECTED_TOKEN)])
    events = ok(stub, stream=True)
    assert types(events)[:5] == ["response.created", "response.in_progress",
                                 "response.output_item.added", "response.content_part.added",
                                 "response.output_text.delta"]
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == GRAMMAR_REJECTED_TOKEN
    assert "grammar" in error["message"]
    assert failed["type"] == "response.failed"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["code"] == GRAMMAR_REJECTED_TOKEN
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


# ------------------------------------------------------------------ bad input


def test_unknown_fields_are_refused_by_name(stub: StubIngress) -> None:
    refused(stub, body(stub, foo=1), "foo", "unknown field 'foo'")
    refused(stub, body(stub, messages=[]), "messages", "unknown field")
    refused(stub, body(stub, input=[{"role": "user", "content": "x", "extra": 1}]),
            "input.0.extra", "unknown field")
    refused(stub, body(stub, tools=[{**WEATHER, "function": {}}]), "tools.0.function",
            "unknown field")


@pytest.mark.parametrize(("extra", "param", "says"), [
    ({"input": 5}, "input", "a string or a list of items"),
    ({"input": []}, "input", "1 to"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0", "role"),
    ({"input": [{"role": "user"}]}, "input.0", "needs its content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0", "only text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input.0.content.0.text", "required"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0", "'reasoning'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0", "stored responses"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0",
     "call_id, name and arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input.0",
     "call_id and output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                 "role": "user"}]}, "input.0", "has no role"),
    ({"instructions": 3}, "instructions", "string"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "above this server's limit"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"include": ["everything"]}, "include", "include.0"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"stop": ["a"] * 100}, "stop", "stop strings"),
    ({"tools": [{"type": "web_search"}]}, "tools", "built-in tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "built-in tools"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.name", "pattern"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "not": {}}}]},
     "tools.0.parameters", "not"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "not supported"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_time"}},
     "tool_choice", "get_time"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call", "call_id": "c", "name": "get_weather",
                 "arguments": "not json"}], "tools": [WEATHER]},
     "input.1.arguments", "JSON"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "'name' and 'schema'"),
    ({"text": {"format": {"type": "json_object", "name": "x"}}}, "text.format",
     "go with type 'json_schema'"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
     "text.format.schema", "not"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type", ""),
    ({"stream": "true"}, "stream", "boolean"),
    ({"store": "no"}, "store", "boolean"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"service_tier": "turbo"}, "service_tier", ""),
    ({"truncation": "middle"}, "truncation", ""),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", ""),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stored responses"),
    ({"conversation": "conv_1"}, "conversation", "stored responses"),
    ({"background": True}, "background", "background responses are not supported"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"moderation": {"model": "omni-moderation-latest"}}, "moderation", "not supported"),
    ({"context_management": [{"type": "compaction"}]}, "context_management", "not supported"),
    ({"background_options": {"completion_window": "2h"}}, "background_options",
     "not supported"),
    ({"image": "auto"}, "image", "dictionary"),
    ({"priority": 10**10}, "priority", ""),
    ({"request_id": "has space"}, "request_id", "pattern"),
])
def test_bad_input_is_a_400_naming_the_field(stub: StubIngress, extra: dict[str, Any],
                                             param: str, says: str) -> None:
    refused(stub, body(stub, **extra), param, says)


def test_an_unknown_model_is_a_404_model_not_found(stub: StubIngress) -> None:
    answer = stub.post(ROUTE, body(stub, model="gpt-4o"))
    assert answer.status == 404, answer.body
    error = answer.body["error"]
    assert (error["code"], error["param"], error["type"]) == (
        "model_not_found", "model", "not_found_error")
    assert "'gpt-4o' does not exist" in error["message"]


def test_a_chat_refusal_names_the_responses_field(stub: StubIngress) -> None:
    """Where the chat request a refusal names came from: each message's input item (or the
    instructions), each call's item, ``max_output_tokens``, a tool's ``parameters``."""
    call = ResponsesCall.of(ResponsesRequest.model_validate(body(stub, instructions="Hi", input=[
        {"role": "user", "content": "a"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "x"}],
        tools=[{"type": "function", "name": "f"}])))
    assert [m["role"] for m in call.chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert [call.param(p) for p in (
        "messages.0.content", "messages.1.content", "messages.2",
        "messages.2.tool_calls.1.function.arguments", "messages.3.content",
        "messages.3.tool_call_id", "messages", "max_tokens", "tools.0.function.parameters",
        "response_format.json_schema.schema", "temperature", None)] == [
        "instructions", "input.0.content", "input.1", "input.2.arguments", "input.3.output",
        "input.3.call_id", "input", "max_output_tokens", "tools.0.parameters",
        "text.format.schema", "temperature", None]
    plain = ResponsesCall.of(ResponsesRequest.model_validate(body(stub)))
    assert plain.param("messages.0.content") == "input"
    # A prompt too long for the context, before it is tokenized.
    error = refused(stub, body(stub, input="word " * 200_000), "input")
    assert error["code"] == "too_long"


def test_a_key_is_needed_where_keys_are_configured() -> None:
    keyed = StubIngress({"tiers": [
        {"name": "standard", "base_priority": 5, "max_priority": 9, "api_keys": ["k-std"]},
        {"name": "batch", "base_priority": 0, "max_priority": 4, "queue_share": 0.5,
         "api_keys": ["k-batch"]}], "anonymous_tier": None})
    assert keyed.post(ROUTE, body(keyed)).status == 401
    answer = keyed.post(ROUTE, body(keyed, service_tier="flex"),
                        {"Authorization": "Bearer k-std"})
    assert answer.status == 200 and answer.body["service_tier"] == "flex"
    assert keyed.sent[-1].tier == "batch"
    events = keyed.post(ROUTE, body(keyed, service_tier="priority", stream=True),
                        {"Authorization": "Bearer k-batch"}).body
    assert events[0]["response"]["service_tier"] == "priority"
    assert (keyed.sent[-1].tier, keyed.sent[-1].priority) == ("batch", 4)
    # OpenAI's "fast" and "ultrafast" run as "priority", and the answer says so.
    for asked in ("fast", "ultrafast"):
        answer = keyed.post(ROUTE, body(keyed, service_tier=asked),
                            {"Authorization": "Bearer k-batch"})
        assert answer.status == 200 and answer.body["service_tier"] == "priority", answer.body
        assert (keyed.sent[-1].tier, keyed.sent[-1].priority) == ("batch", 4)


def test_the_sdks_other_parameters(stub: StubIngress) -> None:
    """SDK 3.63's cache, image and access-program options are accepted without effect (the
    chat request sent is the one without them); null for each refused one, and for
    ``parallel_tool_calls`` (the default, true), is accepted."""
    plain = stub.post(ROUTE, body(stub, tools=[WEATHER]))
    assert plain.status == 200, plain.body
    sent = stub.sent[-1]
    extra = {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
             "image": {"context_compression": "auto"}, "access_programs": {"cyber": "standard"},
             "moderation": None, "context_management": None, "background_options": None,
             "parallel_tool_calls": None}
    answer = stub.post(ROUTE, body(stub, tools=[WEATHER], **extra))
    assert answer.status == 200, answer.body
    assert answer.body["parallel_tool_calls"] is True
    assert stub.sent[-1].sampling == sent.sampling
    assert stub.sent[-1].prompt_ids == sent.prompt_ids


# ------------------------------------------------------------------ the openai SDK


@pytest.fixture
def sdk(stub: StubIngress) -> openai.OpenAI:
    """The SDK's client, its requests answered by the stub (a mock transport)."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        path = request.url.path
        if path.startswith(ROUTE + "/"):
            answer = asyncio.run(_stored(stub, request.method, path))
            return httpx2.Response(answer.status_code, content=bytes(answer.body),
                                   headers={"content-type": "application/json"})
        status, raw, headers = stub.post_raw(path, request.read(), dict(request.headers))
        return httpx2.Response(status, content=raw,
                               headers={"content-type": headers["content-type"]})

    return openai.OpenAI(base_url="http://stub/v1", api_key="sk-any", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def test_the_sdk_parses_a_response_and_its_stream(stub: StubIngress, sdk: openai.OpenAI) -> None:
    r = sdk.responses.create(model=stub.model, input="Hi", instructions="Be brief.",
                             max_output_tokens=8)
    assert r.output_text == ANSWER and r.status == "completed"
    assert r.usage is not None and r.usage.total_tokens > 0
    streamed = list(sdk.responses.create(model=stub.model, input="Hi", stream=True))
    assert [type(e).__name__ for e in streamed] == [
        "ResponseCreatedEvent", "ResponseInProgressEvent", "ResponseOutputItemAddedEvent",
        "ResponseContentPartAddedEvent", "ResponseTextDeltaEvent", "ResponseTextDoneEvent",
        "ResponseContentPartDoneEvent", "ResponseOutputItemDoneEvent", "ResponseCompletedEvent"]
    last = streamed[-1]
    assert last.type == "response.completed" and last.response.output_text == ANSWER
    with sdk.responses.stream(model=stub.model, input="Hi") as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.output_text.delta" in kinds and final.output_text == ANSWER
    with pytest.raises(openai.BadRequestError) as refused_:
        sdk.responses.create(model=stub.model, input="Hi", max_output_tokens=10**6)
    assert "max_output_tokens" in str(refused_.value)


def test_the_sdk_parses_function_calls_and_schemas(stub: StubIngress, sdk: openai.OpenAI,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stub_ingress, "ANSWER", CALL)
    tools: Any = [WEATHER]
    r = sdk.responses.create(model=stub.model, input="Weather?", tools=tools,
                             tool_choice="required")
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    with sdk.responses.stream(model=stub.model, input="Weather?", tools=tools) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments
    # The round trip: the answer's output items (as the SDK returned them) and the call's
    # output, back in the next input; so with parse()'s parsed fields.
    again = sdk.responses.create(model=stub.model, tools=tools, tool_choice="none", input=[
        {"role": "user", "content": "Weather?"}, *r.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}])
    assert again.status == "completed" and "22 C" in prompt(stub)
    parsed = sdk.responses.parse(model=stub.model, input="Weather?", tools=tools,
                                 tool_choice="required")
    assert sdk.responses.create(model=stub.model, tools=tools, tool_choice="none", input=[
        {"role": "user", "content": "Weather?"},
        {**parsed.output[0].model_dump(exclude_none=True, by_alias=True),
         "parsed_arguments": {"city": "Paris"}, "namespace": None, "async": None},
        {"type": "function_call_output", "call_id": call.call_id, "output": "22 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "22 C.",
                                           "annotations": [], "parsed": None}]},
        {"role": "user", "content": "Thanks"}]).status == "completed"
    monkeypatch.setattr(stub_ingress, "ANSWER", '{"city": "Paris"}')
    shaped = sdk.responses.create(model=stub.model, input="A city?", text={"format": {
        "type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}})
    assert json.loads(shaped.output_text) == {"city": "Paris"}


def test_stored_responses_are_a_400(sdk: openai.OpenAI) -> None:
    """Nothing is stored: retrieving, deleting, cancelling a response or listing its input
    items is a 400 saying so."""
    calls: list[Any] = [
        lambda: sdk.responses.retrieve("resp_1"), lambda: sdk.responses.delete("resp_1"),
        lambda: sdk.responses.cancel("resp_1"),
        lambda: list(sdk.responses.input_items.list("resp_1"))]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as refused_:
            call()
        assert refused_.value.code == "stored_responses_unsupported"
        assert "stored responses are not supported" in str(refused_.value)
        assert "'resp_1'" in str(refused_.value)


def test_stored_responses_are_behind_the_key() -> None:
    keyed = StubIngress({"tiers": [{"name": "standard", "base_priority": 5, "max_priority": 9,
                                    "api_keys": ["k-std"]}], "anonymous_tier": None})
    assert asyncio.run(_stored(keyed, "GET", ROUTE + "/resp_1")).status_code == 401
    answer = asyncio.run(_stored(keyed, "GET", ROUTE + "/resp_1", "k-std"))
    assert answer.status_code == 400
    assert json.loads(bytes(answer.body))["error"]["param"] == "response_id"


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_generated_requests_get_documented_answers(stub: StubIngress, mode: str) -> None:
    """Bodies and headers generated from the route's OpenAPI document (schemathesis), sent to
    the stub: never a 5xx; a request that breaks the document is a 400 (a 404
    ``model_not_found`` where the model is outside its enum); some valid ones are served. (The live fuzz of ``test_fuzz.py`` covers the other routes against a cluster.)"""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    generation = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    op = schemathesis.openapi.from_dict(stub.inst.openapi_doc)[ROUTE]["POST"]
    statuses: list[int] = []

    @given(case=op.as_strategy(generation_mode=generation))
    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case: Any) -> None:
        raw = case.body
        data = raw if isinstance(raw, bytes) else (
            raw.encode() if isinstance(raw, str) else json.dumps(raw).encode())
        headers = {k: str(v) for k, v in (case.headers or {}).items()}
        # Through the app's middleware, where X-Request-Id is checked.
        statuses.append(stub.send(ROUTE, data.decode(errors="replace"), headers).status)

    fuzz()
    assert statuses and all(s < 500 for s in statuses), statuses
    if mode == "positive":
        assert 200 in statuses, statuses
    else:
        assert set(statuses) <= {400, 404}, statuses


# ------------------------------------------------------------------ helpers


async def _stored(stub: StubIngress, method: str, path: str, key: str = "") -> Any:
    """The answer of the stored-response route for ``method`` and ``path``."""
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    scope = {"type": "http", "method": method, "path": path, "headers": headers,
             "query_string": b"", "app": ingress.app, "state": {"request_id": "req-stub"}}
    request = Request(scope)
    try:
        return await stub.cls.stored_response(stub.inst, request,
                                              path.removeprefix(ROUTE + "/"))
    except ServingError as e:
        return await ingress._api_error(request, e)



def _out(stub: StubIngress, text: str, reason: str | None, **kw: Any) -> RequestOutput:
    ids = list(stub.inst.tokenizer.encode(text, add_special_tokens=False)) if text else []
    return RequestOutput(request_id=0, text=text, token_ids=ids, finished=reason is not None,
                         finish_reason=reason, completion_tokens=len(ids), cached_tokens=0, **kw)


def _answer_with(stub: StubIngress, monkeypatch: pytest.MonkeyPatch,
                 outputs: list[RequestOutput]) -> None:
    """Every request answered with these deltas."""

    def remote(request: GenerateRequest) -> _Stream:
        stub.handle.sent.append(request)
        return _Stream(list(outputs))

    monkeypatch.setattr(stub.handle, "remote", remote)


def test_the_route_is_in_the_openapi_document(stub: StubIngress) -> None:
    doc = stub.inst.openapi_doc
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "ResponsesRequest")
    assert {"200", "400", "401", "413", "429", "503"} <= set(op["responses"])
    assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    for name in ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
                 "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "store",
                 "metadata", "user", "service_tier", "truncation", "reasoning", "include"):
        assert name in props, name
    assert props["model"]["enum"] == [stub.model]
    assert next(o for o in props["max_output_tokens"]["anyOf"] if o.get("type") == "integer")[
        "maximum"] == stub.inst.cfg.max_tokens_limit
    assert doc["components"]["schemas"]["ResponsesRequest"]["additionalProperties"] is False
    assert "ResponseObject" in doc["components"]["schemas"]
