"""Structured outputs and tool calling through the OpenAI-compatible HTTP API, on the main app.

Every way to ask for a constrained output (``response_format``, vLLM's ``structured_outputs``,
the older ``guided_*`` fields) on both routes, streamed and not, with ``n`` samples and seeds;
``tool_choice`` ``required``/named/``none``/``auto``, tool-call round trips and streamed tool
calls (raw SSE and the ``openai`` SDK); every refusal (a 400 naming its ``param``), after which
the cluster still serves and no KV block leaked; and the fields in ``/openapi.json``.

The embedded model has random weights: its free text is gibberish, but every constrained
output must match its constraint. Outputs are kept short: small schemas (enums, bounded
integers, patterns), ``disable_any_whitespace`` where the request can say it, and ``max_tokens``
above the longest output the grammar allows (JSON allows at most 16 whitespace characters
between two tokens) wherever a test asserts that the output ended on its own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.cluster.helpers import KEYS, MODEL, ServeApp, assert_error, headers, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEY = KEYS["standard"]
C = "/v1/completions"
CHAT = "/v1/chat/completions"
PATHS = [C, CHAT]
USER = [{"role": "user", "content": "Describe the weather as JSON."}]
PROMPT = "The weather today, as JSON:"
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

# Whitespace bytes (the embedded model's tokenizer is byte-level: token id == byte) biased away,
# where a test needs a JSON answer short and certain to end (any whitespace stays allowed).
NO_WS = {"9": -100, "10": -100, "13": -100, "32": -100}

# Small enough that with free whitespace (at most 16 characters in each of its ~10 gaps) the
# longest answer is under 200 tokens: 256 always lets it end.
SMALL: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "color": {"enum": ["red", "green", "blue"]}},
    "required": ["n", "color"],
    "additionalProperties": False,
}
SMALL_MAX = 256
# Every kind of value, for requests without free whitespace (at most ~70 tokens).
BIG: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3},
               "maxItems": 2},
    },
    "required": ["n", "ok", "color", "tag", "xs"],
    "additionalProperties": False,
}
BIG_MAX = 128
REGEX = r"[a-c]{2,4}-\d{1,3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "yes" | "no"'
# A JSON object of any shape: '}' biased up (and whitespace away) so that it closes soon.
OBJECT_BIAS = {"125": 6.0} | NO_WS

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},  # no arguments
]
PARAMS_OF: dict[str, dict[str, Any]] = {
    "get_weather": WEATHER_PARAMS,
    "get_time": {"type": "object", "properties": {}, "additionalProperties": False},
}
ASK_TOOL = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


# ----------------------------------------------------------------------------------------------
# Checks and requests


def strict_json(text: str) -> Any:
    """``text`` as JSON, as RFC 8259 reads it (no raw control characters in strings)."""
    return json.loads(text)


def is_object(text: str) -> None:
    assert isinstance(strict_json(text), dict), text


def follows(schema: dict[str, Any]) -> Callable[[str], None]:
    def check(text: str) -> None:
        jsonschema.validate(strict_json(text), schema)
    return check


def matches(regex: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(regex, text), (regex, text)
    return check


def one_of(choices: list[str]) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert text in choices, (choices, text)
    return check


@dataclass(frozen=True)
class Way:
    """One way to ask for a constrained output: the request's fields, what its output must be,
    a ``max_tokens`` that lets it end, whether the grammar makes it end within that."""

    name: str
    fields: dict[str, Any]
    check: Callable[[str], None]
    max_tokens: int
    ends: bool = True


WAYS = [
    Way("response_format.json_object", {"response_format": {"type": "json_object"},
                                        "logit_bias": OBJECT_BIAS}, is_object, 64, ends=False),
    Way("response_format.json_schema", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SMALL,
                                               "strict": True}}}, follows(SMALL), SMALL_MAX),
    Way("structured_outputs.json", {"structured_outputs": {
        "json": BIG, "disable_any_whitespace": True}}, follows(BIG), BIG_MAX),
    Way("structured_outputs.json (text)", {"structured_outputs": {
        "json": json.dumps(SMALL), "disable_any_whitespace": True}}, follows(SMALL), 64),
    Way("structured_outputs.regex", {"structured_outputs": {"regex": REGEX}}, matches(REGEX), 16),
    Way("structured_outputs.choice", {"structured_outputs": {"choice": CHOICES}},
        one_of(CHOICES), 8),
    Way("structured_outputs.grammar", {"structured_outputs": {"grammar": GRAMMAR}},
        one_of(["yes", "no"]), 8),
    Way("structured_outputs.json_object", {"structured_outputs": {
        "json_object": True, "disable_any_whitespace": True}, "logit_bias": OBJECT_BIAS},
        is_object, 64, ends=False),
    Way("guided_json", {"guided_json": SMALL}, follows(SMALL), SMALL_MAX),
    Way("guided_json (text)", {"guided_json": json.dumps(SMALL)}, follows(SMALL), SMALL_MAX),
    Way("guided_regex", {"guided_regex": REGEX}, matches(REGEX), 16),
    Way("guided_choice", {"guided_choice": CHOICES}, one_of(CHOICES), 8),
    Way("guided_grammar", {"guided_grammar": GRAMMAR}, one_of(["yes", "no"]), 8),
]
WAY_IDS = [w.name for w in WAYS]


@pytest.fixture(scope="module")
def http(main_app: ServeApp) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=main_app.base_url, timeout=120, headers=headers(KEY)) as client:
        yield client


def body_of(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    what: dict[str, Any] = {"prompt": PROMPT} if path == C else {"messages": USER}
    return {"model": MODEL, **what, **fields}


def post(http: httpx.Client, path: str, fields: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body_of(path, fields))
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def stream(http: httpx.Client, path: str, fields: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body_of(path, {**fields, "stream": True})) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]", events[-3:]
    assert not any("error" in e for e in events[:-1]), events
    return events[:-1]


def answers(path: str, out: dict[str, Any]) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice, by index."""
    choices = sorted(out["choices"], key=lambda c: c["index"])
    if path == C:
        return [(c["text"], c["finish_reason"]) for c in choices]
    for c in choices:
        assert c["message"]["role"] == "assistant" and c["message"].get("tool_calls") is None
    return [(c["message"]["content"], c["finish_reason"]) for c in choices]


def streamed_answers(path: str, events: list[dict[str, Any]], n: int = 1) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice, its streamed pieces joined."""
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    for e in events:
        for c in e["choices"]:
            i = c["index"]
            assert reasons[i] is None, f"choice {i} went on after its finish_reason: {events}"
            if path == C:
                texts[i] += c["text"]
            else:
                assert not c["delta"].get("tool_calls"), c
                texts[i] += c["delta"].get("content") or ""
            reasons[i] = c["finish_reason"]
    assert all(r is not None for r in reasons), events
    return [(t, str(r)) for t, r in zip(texts, reasons, strict=True)]


def assert_follows(way: Way, got: list[tuple[str, str]]) -> None:
    for text, reason in got:
        if way.ends:
            assert reason == "stop", (way.name, text, reason)
        assert reason in ("stop", "length"), (way.name, text, reason)
        if reason == "stop":  # an answer cut by max_tokens is a prefix of one
            way.check(text)


# ----------------------------------------------------------------------------------------------
# 1. Every way to ask, both routes, streamed and not


@pytest.mark.parametrize("way", WAYS, ids=WAY_IDS)
@pytest.mark.parametrize("path", PATHS)
def test_each_way_constrains_the_answer_streamed_or_not(http: httpx.Client, path: str,
                                                        way: Way) -> None:
    fields = {**way.fields, "max_tokens": way.max_tokens, "temperature": 1.0, "seed": 11}
    whole = answers(path, post(http, path, fields))
    assert_follows(way, whole)
    if not way.ends:  # the biased ones must still have ended here
        assert whole[0][1] == "stop", whole
    streamed = streamed_answers(path, stream(http, path, fields))
    assert_follows(way, streamed)
    assert streamed == whole  # deterministic mode, one seed: the same answer


def test_response_format_text_leaves_the_answer_free(http: httpx.Client) -> None:
    for path in PATHS:
        fields = {"max_tokens": 8, "temperature": 0}
        free = answers(path, post(http, path, fields))
        text = answers(path, post(http, path, fields | {"response_format": {"type": "text"}}))
        assert text == free
    # Nor does "text" count as a constraint beside another one.
    out = post(http, CHAT, {"response_format": {"type": "text"}, "guided_choice": CHOICES,
                            "max_tokens": 8})
    assert answers(CHAT, out)[0][0] in CHOICES


@pytest.mark.parametrize("way", [w for w in WAYS if w.name in (
    "response_format.json_schema", "structured_outputs.json", "structured_outputs.regex",
    "guided_choice", "guided_grammar")], ids=lambda w: w.name)
@pytest.mark.parametrize("path", PATHS)
def test_every_one_of_n_samples_follows_it(http: httpx.Client, path: str, way: Way) -> None:
    fields = {**way.fields, "max_tokens": way.max_tokens, "temperature": 1.0, "seed": 5, "n": 2}
    whole = answers(path, post(http, path, fields))
    assert len(whole) == 2
    assert_follows(way, whole)
    streamed = streamed_answers(path, stream(http, path, fields), n=2)
    assert_follows(way, streamed)
    assert streamed == whole


def test_a_seed_gives_the_same_constrained_answer_twice(http: httpx.Client) -> None:
    for path in PATHS:
        fields = {"structured_outputs": {"json": BIG, "disable_any_whitespace": True},
                  "max_tokens": BIG_MAX, "temperature": 1.5, "seed": 1234}
        first = answers(path, post(http, path, fields))
        again = answers(path, post(http, path, fields))
        assert first == again
        follows(BIG)(first[0][0])
    # Different seeds of a wide regex: still each in the language.
    seen = set()
    for seed in range(4):
        text, reason = answers(C, post(http, C, {"guided_regex": r"[a-z]{8}", "seed": seed,
                                                 "temperature": 2.0, "max_tokens": 12}))[0]
        assert reason == "stop" and re.fullmatch(r"[a-z]{8}", text), text
        seen.add(text)
    assert len(seen) > 1


def test_disable_any_whitespace_leaves_only_the_separators(http: httpx.Client) -> None:
    for seed in range(3):
        text, reason = answers(C, post(http, C, {
            "structured_outputs": {"json": BIG, "disable_any_whitespace": True}, "seed": seed,
            "temperature": 1.5, "max_tokens": BIG_MAX}))[0]
        assert reason == "stop"
        follows(BIG)(text)
        # BIG's strings are [a-z]: any whitespace is between tokens; only ", " and ": " remain.
        assert not re.search(r"\s", re.sub(r"(?<=[,:]) ", "", text)), text


def test_an_echoed_prompt_comes_before_the_constrained_answer(http: httpx.Client) -> None:
    fields = {"guided_regex": REGEX, "echo": True, "max_tokens": 16, "seed": 2,
              "temperature": 1.0}
    text, reason = answers(C, post(http, C, fields))[0]
    assert reason == "stop" and text.startswith(PROMPT)
    matches(REGEX)(text[len(PROMPT):])
    streamed = streamed_answers(C, stream(http, C, fields))
    assert streamed == [(text, reason)]


def test_a_grammar_ends_the_answer_even_with_ignore_eos(http: httpx.Client) -> None:
    for path in PATHS:
        text, reason = answers(path, post(http, path, {
            "guided_choice": CHOICES, "ignore_eos": True, "max_tokens": 16}))[0]
        assert reason == "stop" and text in CHOICES


def test_choices_are_taken_verbatim(http: httpx.Client) -> None:
    odd = ['say "hi"', "back\\slash", "two\nlines", "ünï", "tab\there"]
    for seed in range(3):
        text, reason = answers(C, post(http, C, {"guided_choice": odd, "seed": seed,
                                                 "temperature": 1.0, "max_tokens": 16}))[0]
        assert reason == "stop" and text in odd, text


def test_the_openai_sdk_asks_in_every_way(main_app: ServeApp) -> None:
    client = main_app.client(KEY)

    class Weather(BaseModel):
        n: int = Field(ge=0, le=9)
        color: Literal["red", "green", "blue"]

    parsed = client.chat.completions.parse(model=MODEL, messages=USER,  # type: ignore[arg-type]
                                           response_format=Weather, max_tokens=SMALL_MAX,
                                           seed=3)
    message = parsed.choices[0].message
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Weather) and 0 <= message.parsed.n <= 9

    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=SMALL_MAX,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": SMALL}})
    follows(SMALL)(chat.choices[0].message.content or "")

    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                     extra_body={"guided_regex": REGEX})
    matches(REGEX)(done.choices[0].text)
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, stream=True,
        extra_body={"structured_outputs": {"choice": CHOICES}}) if c.choices]
    assert "".join(pieces) in CHOICES
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, stream=True,  # type: ignore[arg-type]
        extra_body={"guided_grammar": GRAMMAR}) if c.choices)
    assert streamed in ("yes", "no")


MAX_LENGTH: dict[str, Any] = {"type": "object",
                              "properties": {"s": {"type": "string", "maxLength": 5}},
                              "required": ["s"], "additionalProperties": False}


def test_a_string_with_a_max_length_is_still_json(http: httpx.Client) -> None:
    for seed in range(4):
        text, reason = answers(C, post(http, C, {
            "guided_json": MAX_LENGTH, "seed": seed, "temperature": 1.0, "max_tokens": 64,
            "logit_bias": NO_WS}))[0]
        assert reason == "stop"
        follows(MAX_LENGTH)(text)


# ----------------------------------------------------------------------------------------------
# 2. Tools


def chat_tools(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": ASK_TOOL, "tools": TOOLS} | fields
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def assert_calls(calls: list[dict[str, Any]], names: set[str] | None = None) -> None:
    """Each call: a ``call_`` id, a declared name, arguments that are JSON and follow it."""
    assert calls
    assert len({c["id"] for c in calls}) == len(calls)
    for c in calls:
        assert CALL_ID.fullmatch(c["id"]), c
        assert c["type"] == "function"
        name = c["function"]["name"]
        assert name in (names or set(PARAMS_OF)), c
        jsonschema.validate(strict_json(c["function"]["arguments"]), PARAMS_OF[name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_gives_one_call(http: httpx.Client, seed: int) -> None:
    out = chat_tools(http, tool_choice="required", parallel_tool_calls=False, seed=seed,
                     temperature=1.0, max_tokens=128, logit_bias=NO_WS)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1  # parallel_tool_calls false: at most one
    assert_calls(calls)


def test_every_one_of_n_samples_calls_a_tool(http: httpx.Client) -> None:
    fields = {"tool_choice": "required", "parallel_tool_calls": False, "n": 2, "seed": 12,
              "temperature": 1.0, "max_tokens": 96, "logit_bias": NO_WS}
    out = chat_tools(http, **fields)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1]
    for choice in out["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert len(choice["message"]["tool_calls"]) == 1
        assert_calls(choice["message"]["tool_calls"])
    with http.stream("POST", CHAT, json={"model": MODEL, "messages": ASK_TOOL, "tools": TOOLS,
                                         "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))[:-1]
    for i, choice in enumerate(sorted(out["choices"], key=lambda c: c["index"])):
        mine = [{**e, "choices": [c for c in e["choices"] if c["index"] == i]} for e in events]
        calls, reason, _ = _streamed_calls(mine)
        assert reason == "tool_calls"
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [
            json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]


def test_required_tool_choice_with_parallel_calls(http: httpx.Client) -> None:
    for seed in range(3):
        out = chat_tools(http, tool_choice="required", seed=seed, temperature=1.0,
                         max_tokens=200, logit_bias=NO_WS)
        choice = out["choices"][0]
        # The call list has no bound: the answer may run out of tokens; when it ended, it is
        # its calls and nothing else.
        assert choice["finish_reason"] in ("tool_calls", "length"), choice
        if choice["finish_reason"] == "tool_calls":
            assert choice["message"]["content"] is None
            assert_calls(choice["message"]["tool_calls"])


@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_a_named_tool_choice_calls_that_function(http: httpx.Client, name: str) -> None:
    out = chat_tools(http, tool_choice={"type": "function", "function": {"name": name}},
                     temperature=1.0, seed=4, max_tokens=128, logit_bias=NO_WS)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1
    assert_calls(calls, {name})
    if name == "get_time":
        assert json.loads(calls[0]["function"]["arguments"]) == {}


def test_a_named_call_with_free_whitespace_ends(http: httpx.Client) -> None:
    """No bias: the grammar bounds every whitespace run, so a call of ``get_time`` (about a
    dozen gaps of at most 16 characters) ends well within 320 tokens."""
    out = chat_tools(http, tool_choice={"type": "function", "function": {"name": "get_time"}},
                     temperature=1.0, seed=9, max_tokens=320)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert_calls(choice["message"]["tool_calls"], {"get_time"})
    assert out["usage"]["completion_tokens"] <= 320


def test_tool_choice_none_and_auto(http: httpx.Client) -> None:
    plain = http.post(CHAT, json={"model": MODEL, "messages": ASK_TOOL, "max_tokens": 8,
                                  "temperature": 0})
    assert plain.status_code == 200, plain.text
    none = chat_tools(http, tool_choice="none", max_tokens=8, temperature=0)
    choice = none["choices"][0]
    assert choice["message"].get("tool_calls") is None
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    # "none" leaves the tools out of the prompt: the same prompt, the same answer.
    assert none["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    assert choice["message"]["content"] == plain.json()["choices"][0]["message"]["content"]
    for fields in ({"tool_choice": "auto"}, {}):
        auto = chat_tools(http, max_tokens=8, temperature=0, **fields)
        assert auto["usage"]["prompt_tokens"] > none["usage"]["prompt_tokens"]  # listed
        c = auto["choices"][0]
        assert c["finish_reason"] in ("stop", "length", "tool_calls")
        if c["message"].get("tool_calls"):
            assert_calls(c["message"]["tool_calls"])
        else:
            assert isinstance(c["message"]["content"], str)


def test_a_tool_call_round_trip_is_answered(http: httpx.Client, main_app: ServeApp) -> None:
    first = chat_tools(http, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                       seed=2, temperature=1.0, max_tokens=128, logit_bias=NO_WS)
    call = first["choices"][0]["message"]["tool_calls"][0]
    history = [*ASK_TOOL,
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": call["id"], "content": '{"forecast": "sunny"}'}]
    for fields in ({"tool_choice": "auto", "max_tokens": 8}, {"tool_choice": "none",
                                                              "max_tokens": 8}):
        out = chat_tools(http, messages=history, **fields)
        choice = out["choices"][0]
        assert choice["finish_reason"] in ("stop", "length", "tool_calls")
        assert choice["message"]["content"] is not None or choice["message"]["tool_calls"]
        # The history (the call, its answer) is in the prompt.
        assert out["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"] or (
            fields["tool_choice"] == "none")
    # Asked to call again after the answer: a call again.
    again = chat_tools(http, messages=history, tool_choice="required", parallel_tool_calls=False,
                       seed=3, temperature=1.0, max_tokens=128, logit_bias=NO_WS)
    assert again["choices"][0]["finish_reason"] == "tool_calls"
    assert_calls(again["choices"][0]["message"]["tool_calls"])
    # The same history through the SDK, with the tool's name on its message.
    sdk = main_app.client(KEY).chat.completions.create(
        model=MODEL, max_tokens=8, tools=TOOLS,  # type: ignore[arg-type]
        messages=[*history[:2], {**history[2], "name": "get_weather"}])  # type: ignore[list-item]
    assert sdk.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _streamed_calls(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None,
                                                           str]:
    """The calls put together from their deltas, the last finish_reason, the content."""
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    content = ""
    for e in events:
        for c in e["choices"]:
            assert reason is None, "a chunk after the finish_reason"
            content += c["delta"].get("content") or ""
            for d in c["delta"].get("tool_calls") or ():
                i = d["index"]
                if i not in calls:  # its first delta: id, type, name
                    assert d["id"] and d["type"] == "function" and d["function"]["name"], d
                    calls[i] = {"id": d["id"], "type": "function",
                                "function": {"name": d["function"]["name"],
                                             "arguments": d["function"].get("arguments") or ""}}
                else:  # then fragments of its arguments only
                    assert d.get("id") is None and d["function"].get("name") is None, d
                    calls[i]["function"]["arguments"] += d["function"]["arguments"] or ""
            reason = c["finish_reason"]
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], reason, content


def test_streamed_tool_calls_arrive_as_deltas(http: httpx.Client) -> None:
    fields = {"tool_choice": "required", "parallel_tool_calls": False, "seed": 6,
              "temperature": 1.0, "max_tokens": 128, "logit_bias": NO_WS}
    whole = chat_tools(http, **fields)["choices"][0]
    events = []
    with http.stream("POST", CHAT, json={"model": MODEL, "messages": ASK_TOOL, "tools": TOOLS,
                                         "stream": True, **fields}) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    calls, reason, content = _streamed_calls(events[:-1])
    assert reason == "tool_calls" and content == ""
    assert_calls(calls)
    assert len(calls) == 1
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["message"]["tool_calls"]]
    assert got == want  # the same seed: the same call


def test_the_openai_sdk_streams_tool_calls(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=ASK_TOOL, tools=TOOLS, temperature=1.0, seed=8, max_tokens=128,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        logit_bias=NO_WS)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    message = whole.choices[0].message
    assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert CALL_ID.fullmatch(call.id) and call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)  # type: ignore[union-attr]

    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or ():
                if d.id is not None:
                    ids[d.index] = d.id
                if d.function is not None and d.function.name:
                    names[d.index] = d.function.name
                if d.function is not None and d.function.arguments:
                    arguments[d.index] = arguments.get(d.index, "") + d.function.arguments
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])
    assert list(names.values()) == ["get_weather"] and CALL_ID.fullmatch(ids[0])
    assert json.loads(arguments[0]) == json.loads(call.function.arguments)  # type: ignore[union-attr]


LONG_ARGS = [{"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}},
    "required": ["q"], "additionalProperties": False}}}]


def test_a_forced_call_with_a_bounded_string_argument_is_a_call(http: httpx.Client) -> None:
    for seed in range(4):
        out = chat_tools(http, tools=LONG_ARGS, tool_choice="required", seed=seed,
                         temperature=1.0, max_tokens=128, logit_bias=NO_WS,
                         parallel_tool_calls=False)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None, choice


# ----------------------------------------------------------------------------------------------
# 3. Refusals


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4} | fields


def comp(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4} | fields


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def rf_schema(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]}
SO = "invalid_structured_output"
REQ = "invalid_request"

# (path, body, code (None: not checked), param, words the message must hold)
BAD: list[tuple[str, dict[str, Any], str | None, str, tuple[str, ...]]] = [
    # JSON schemas that are not valid, match nothing or use what the grammar cannot enforce
    (CHAT, chat(response_format=rf_schema({"type": "objekt"})), SO,
     "response_format.json_schema.schema", ("objekt",)),
    (C, comp(response_format=rf_schema({"type": "objekt"})), SO,
     "response_format.json_schema.schema", ()),
    (CHAT, chat(response_format=rf_schema(False)), SO, "response_format.json_schema.schema",
     ("false",)),
    (CHAT, chat(guided_json="{not json"), SO, "guided_json", ("not valid JSON",)),
    (C, comp(guided_json="{not json"), SO, "guided_json", ("not valid JSON",)),
    (CHAT, chat(guided_json=False), SO, "guided_json", ("false",)),
    (C, comp(guided_json="false"), SO, "guided_json", ("false",)),
    (CHAT, chat(guided_json="[1, 2]"), SO, "guided_json", ()),
    (CHAT, chat(guided_json={"type": "integer", "minimum": "zero"}), SO, "guided_json", ()),
    (CHAT, chat(structured_outputs={"json": {"type": "objekt"}}), SO, "structured_outputs.json",
     ()),
    (CHAT, chat(guided_json={"not": {"type": "null"}}), SO, "guided_json", ("not",)),
    (C, comp(guided_json={"type": "object", "if": {"required": ["a"]}, "then": {}}), SO,
     "guided_json", ("if",)),
    (CHAT, chat(structured_outputs={"json": {"type": "array", "uniqueItems": True}}), SO,
     "structured_outputs.json", ("uniqueItems",)),
    (CHAT, chat(response_format=rf_schema({"allOf": [{"type": "object"}, {"required": ["a"]}]})),
     SO, "response_format.json_schema.schema", ("allOf",)),
    (CHAT, chat(guided_json={"type": "object", "properties": {
        "a": {"type": "array", "items": {"not": {"const": 1}}}}}), SO, "guided_json",
     ("not", "/properties/a/items")),
    # regexes and grammars that do not compile (the replica's compiler says so)
    (CHAT, chat(structured_outputs={"regex": "("}), SO, "structured_outputs.regex", ("regex",)),
    (C, comp(structured_outputs={"regex": "("}), SO, "structured_outputs.regex", ()),
    (C, comp(guided_regex="("), SO, "guided_regex", ()),
    (CHAT, chat(guided_regex="[a-", stream=True), SO, "guided_regex", ()),
    (CHAT, chat(structured_outputs={"grammar": 'root ::= "yes" |'}), SO,
     "structured_outputs.grammar", ("grammar",)),
    (C, comp(guided_grammar='foo ::= "x"'), SO, "guided_grammar", ("root",)),
    (CHAT, chat(guided_grammar="root ::= bar", stream=True), SO, "guided_grammar", ("bar",)),
    # two constraints at once: the second is named
    (CHAT, chat(response_format={"type": "json_object"}, guided_regex="a+"), SO, "guided_regex",
     ("response_format", "guided_regex")),
    (C, comp(structured_outputs={"choice": ["a"]}, guided_choice=["b"]), SO, "guided_choice",
     ("structured_outputs", "guided_choice")),
    (C, comp(guided_json=SMALL, guided_grammar=GRAMMAR), SO, "guided_grammar", ()),
    (CHAT, chat(response_format=rf_schema(SMALL), tools=[tool("f")], tool_choice="required"),
     SO, "tool_choice", ("response_format", "tool_choice")),
    # structured_outputs with two of its kinds, or none
    (CHAT, chat(structured_outputs={"json": SMALL, "regex": "a"}), REQ, "structured_outputs",
     ("exactly one", "json", "regex")),
    (C, comp(structured_outputs={"choice": ["a"], "grammar": GRAMMAR}), REQ,
     "structured_outputs", ("exactly one",)),
    (CHAT, chat(structured_outputs={}), REQ, "structured_outputs", ("exactly one",)),
    (C, comp(structured_outputs={"disable_any_whitespace": True}), REQ, "structured_outputs",
     ("exactly one",)),
    (CHAT, chat(structured_outputs={"regex": "a", "bogus": 1}), REQ, "structured_outputs.bogus",
     ()),
    (CHAT, chat(guided_choice=[]), REQ, "guided_choice", ()),
    # response_format's own shape
    (CHAT, chat(response_format={"type": "json_schema"}), REQ, "response_format",
     ("json_schema",)),
    (C, comp(response_format={"type": "json_object", "json_schema": {"name": "s", "schema": {}}}),
     REQ, "response_format", ()),
    (CHAT, chat(response_format={"type": "xml"}), REQ, "response_format.type", ()),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "bad name!", "schema": SMALL}}), REQ, "response_format.json_schema.name", ()),
    # tools and tool_choice
    (CHAT, chat(tools=[tool("f"), tool("g")],
                tool_choice={"type": "function", "function": {"name": "nope"}}), REQ,
     "tool_choice", ("nope",)),
    (CHAT, chat(tool_choice="required"), REQ, "tool_choice", ("tools",)),
    (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), REQ,
     "tool_choice", ()),
    (CHAT, chat(tools=[tool("f"), tool("f")]), REQ, "tools", ("'f'",)),
    (CHAT, chat(tools=[tool("f", {"type": "objekt"})]), REQ, "tools.0.function.parameters", ()),
    (CHAT, chat(tools=[tool("f"), tool("g", {"type": "string"})]), REQ,
     "tools.1.function.parameters", ()),
    (CHAT, chat(tools=[tool("f", {"type": "object", "not": {}})]), REQ,
     "tools.0.function.parameters", ("not",)),
    (CHAT, chat(tools=[tool("bad name")]), REQ, "tools.0.function.name", ()),
    # the messages of a tool conversation
    (CHAT, chat(messages=[{"role": "user", "content": "hi"},
                          CALLED | {"tool_calls": [{"id": "call_1", "type": "function",
                                                    "function": {"name": "f",
                                                                 "arguments": "{not json"}}]}]),
     REQ, "messages.1.tool_calls.0.function.arguments", ()),
    (CHAT, chat(messages=[{"role": "user", "content": "hi"},
                          CALLED | {"tool_calls": [CALLED["tool_calls"][0], {
                              "id": "call_2", "type": "function",
                              "function": {"name": "f", "arguments": "[1]"}}]}]),
     REQ, "messages.1.tool_calls.1.function.arguments", ()),
    (CHAT, chat(messages=[{"role": "user", "content": "hi"}, CALLED,
                          {"role": "tool", "content": "42"}]), REQ, "messages.2.tool_call_id",
     ("required",)),
    (CHAT, chat(messages=[{"role": "user", "content": "hi", "tool_call_id": "call_1"}]), REQ,
     "messages.0.tool_call_id", ()),
    (CHAT, chat(messages=[{"role": "user", "content": "hi", "tool_calls": CALLED["tool_calls"]}]),
     REQ, "messages.0.tool_calls", ()),
    (CHAT, chat(messages=[{"role": "assistant", "content": None}]), REQ, "messages.0", ()),
    # a prompt scored (nothing generated to constrain), min_tokens (the grammar ends it)
    (C, comp(echo=True, logprobs=1, max_tokens=0, guided_regex="a+"), REQ, "guided_regex", ()),
    (C, comp(echo=True, logprobs=0, structured_outputs={"choice": ["a", "b"]}), REQ,
     "structured_outputs.choice", ()),
    (C, comp(max_tokens=0, response_format={"type": "json_object"}), REQ, "response_format", ()),
    (C, comp(min_tokens=2, guided_choice=["a", "b"]), REQ, "min_tokens", ()),
    (CHAT, chat(min_tokens=1, structured_outputs={"regex": "a+"}), REQ, "min_tokens", ()),
    (CHAT, chat(min_tokens=1, tools=[tool("f")], tool_choice="required"), REQ, "min_tokens", ()),
]


@pytest.mark.parametrize(("path", "body", "code", "param", "words"), BAD,
                         ids=[f"{i}-{p}" for i, (_, _, _, p, _) in enumerate(BAD)])
def test_a_bad_structured_request_is_a_400_naming_its_param(
        http: httpx.Client, path: str, body: dict[str, Any], code: str | None, param: str,
        words: tuple[str, ...]) -> None:
    err = assert_error(http.post(path, json=body), 400, code)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    for word in words:
        assert word in err["message"], (word, err)


def test_a_false_schema_in_structured_outputs_is_refused(http: httpx.Client) -> None:
    """``{"json": false}`` is a schema nothing matches: a 400 naming it, and not taken for "no
    json given" beside another constraint."""
    err = assert_error(http.post(C, json=comp(structured_outputs={"json": False})), 400)
    assert err["param"] == "structured_outputs.json" and "false" in err["message"], err
    both = comp(structured_outputs={"json": False, "regex": "a"})
    err = assert_error(http.post(C, json=both), 400)
    assert err["param"] == "structured_outputs" and "exactly one" in err["message"], err


def test_the_sdk_sees_a_bad_regex_as_a_bad_request(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER,  # type: ignore[arg-type]
                                       max_tokens=4, extra_body={"guided_regex": "("})
    assert bad.value.code == SO and bad.value.param == "guided_regex"
    with pytest.raises(openai.BadRequestError) as stream_bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True,
                                  extra_body={"structured_outputs": {"grammar": "root ::="}})
    assert stream_bad.value.param == "structured_outputs.grammar"
    with pytest.raises(openai.BadRequestError) as undeclared:
        client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=4, tools=TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "launch"}})
    assert undeclared.value.param == "tool_choice" and "launch" in str(undeclared.value)


def test_a_failed_compile_is_not_kept(http: httpx.Client) -> None:
    """The same bad regex twice: the same 400 both times (a failed compilation is not cached as
    a success), and a good one right after it works."""
    for _ in range(2):
        assert_error(http.post(C, json=comp(guided_regex="(ab")), 400, SO)
    text, reason = answers(C, post(http, C, {"guided_regex": "(ab)+c", "max_tokens": 16}))[0]
    assert re.fullmatch("(ab)+c", text) or reason == "length", text


def test_after_every_refusal_the_cluster_serves_and_no_block_leaked(
        http: httpx.Client, main_app: ServeApp) -> None:
    way = WAYS[WAY_IDS.index("structured_outputs.json")]
    for path in PATHS:
        text, reason = answers(path, post(http, path, {**way.fields,
                                                       "max_tokens": way.max_tokens}))[0]
        assert reason == "stop"
        way.check(text)
    stats = main_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == main_app.baseline
    assert set(stats) == set(main_app.baseline)  # the same replicas: none was replaced


# ----------------------------------------------------------------------------------------------
# 4. The OpenAPI document


def test_the_openapi_document_has_the_fields(http: httpx.Client) -> None:
    r = http.get("/openapi.json")
    assert r.status_code == 200, r.text
    schemas = r.json()["components"]["schemas"]
    guided = {"response_format", "structured_outputs", "guided_json", "guided_regex",
              "guided_choice", "guided_grammar"}
    chat_props = set(schemas["ChatCompletionRequest"]["properties"])
    assert guided | {"tools", "tool_choice", "parallel_tool_calls"} <= chat_props
    assert guided <= set(schemas["CompletionRequest"]["properties"])
    for name in ("ResponseFormat", "StructuredOutputs", "Tool", "ToolCallDelta",
                 "ToolCallOut"):
        assert name in schemas, sorted(schemas)
    assert "tool_calls" in schemas["ChatMessageOut"]["properties"]
    assert "tool_calls" in schemas["ChatDelta"]["properties"]
