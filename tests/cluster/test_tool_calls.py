"""Tool calling without Ray: the prompt rendering, the call schema and the answer parser."""

from __future__ import annotations

import itertools
import json
import random
import re
from typing import Any

import jsonschema
import pytest

from tierserve.cluster.protocol import ChatMessage, NamedToolChoice, Tool, ToolCallDelta
from tierserve.cluster.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolCallParser,
    ToolMessageError,
    call_schema,
    parse_tool_calls,
    render_messages,
    tool_system_prompt,
)

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
TOOLS = [WEATHER, TIME]
NAMES = ["get_weather", "get_time"]
ID = re.compile(r"^call_[0-9a-f]{24}$")


def msgs(*raw: dict[str, Any]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


def call(name: str, arguments: str, id_: str = "call_1") -> dict[str, Any]:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


HISTORY = msgs(
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [call("get_weather", '{"city": "Paris"}', "call_a"), call("get_time", "{}", "call_b")]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "noon"},
)


# ---------------------------------------------------------------------------------------------
# Rendering


def test_system_prompt_lists_the_tools_and_the_format() -> None:
    text = tool_system_prompt(TOOLS)
    listed = text[text.index("<tools>") + len("<tools>"):text.index("</tools>")]
    assert json.loads(listed) == [t.model_dump(exclude_none=True) for t in TOOLS]
    assert TOOL_CALL_OPEN in text and TOOL_CALL_CLOSE in text
    assert "no other text" in text and "answer normally" in text


def test_plain_template_merges_into_the_first_system_message() -> None:
    messages = msgs({"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"})
    rendered, tools = render_messages(messages, TOOLS, "auto", template_takes_tools=False)
    assert tools is None
    assert rendered == [
        {"role": "system", "content": "Be brief.\n\n" + tool_system_prompt(TOOLS)},
        {"role": "user", "content": "hi"},
    ]


@pytest.mark.parametrize("tool_choice", [None, "auto", "required",
                                         NamedToolChoice.model_validate(
                                             {"type": "function", "function": {"name": "get_time"}})])
def test_plain_template_adds_a_system_message(tool_choice: object) -> None:
    messages = msgs({"role": "user", "content": "hi"})
    rendered, tools = render_messages(messages, TOOLS, tool_choice, template_takes_tools=False)
    assert tools is None
    assert rendered == [{"role": "system", "content": tool_system_prompt(TOOLS)},
                        {"role": "user", "content": "hi"}]


def test_plain_template_renders_calls_and_results() -> None:
    rendered, _ = render_messages(HISTORY, TOOLS, "auto", template_takes_tools=False)
    assert rendered[0]["role"] == "system"
    assistant = rendered[2]
    assert assistant["role"] == "assistant"
    content = assistant["content"]
    assert content.startswith(TOOL_CALL_OPEN) and content.endswith(TOOL_CALL_CLOSE)
    assert json.loads(content[len(TOOL_CALL_OPEN):-len(TOOL_CALL_CLOSE)]) == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": {}},
    ]
    assert rendered[3:] == [{"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"},
                            {"role": "user", "content": "<tool_response>\nnoon\n</tool_response>"}]
    # The rendered call reads back as the same calls.
    text, calls = parse_tool_calls(content, NAMES)
    assert text is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_plain_template_keeps_an_assistant_text_before_its_calls() -> None:
    messages = msgs({"role": "assistant", "content": "Let me look.",
                     "tool_calls": [call("get_time", "{}")]})
    rendered, _ = render_messages(messages, None, None, template_takes_tools=False)
    assert rendered == [{"role": "assistant", "content":
                         'Let me look.\n<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>'}]


@pytest.mark.parametrize("template_takes_tools", [False, True])
@pytest.mark.parametrize("arguments", ['{"city": ', "not json", "[1, 2]", "NaN"])
def test_bad_arguments_name_their_param(template_takes_tools: bool, arguments: str) -> None:
    messages = msgs({"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None,
                     "tool_calls": [call("get_time", "{}"), call("get_weather", arguments)]})
    with pytest.raises(ToolMessageError) as e:
        render_messages(messages, TOOLS, "auto", template_takes_tools)
    assert e.value.param == "messages.1.tool_calls.1.function.arguments"
    assert isinstance(e.value, ValueError)


def test_tool_choice_none_leaves_the_tools_out() -> None:
    messages = msgs({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"})
    rendered, tools = render_messages(messages, TOOLS, "none", template_takes_tools=False)
    assert rendered == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tools is None
    rendered, tools = render_messages(messages, TOOLS, "none", template_takes_tools=True)
    assert rendered == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tools is None


@pytest.mark.parametrize("template_takes_tools", [False, True])
def test_no_tools_no_prompt(template_takes_tools: bool) -> None:
    messages = msgs({"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]})
    no_tools: list[list[Tool] | None] = [None, []]
    for tools in no_tools:
        assert render_messages(messages, tools, None, template_takes_tools) == (
            [{"role": "user", "content": "a\nb"}], None)


def test_template_with_tools_gets_the_hugging_face_form() -> None:
    messages = [*msgs({"role": "developer", "content": "Be brief."}), *HISTORY]
    rendered, tools = render_messages(messages, TOOLS, "auto", template_takes_tools=True)
    assert tools == [t.model_dump(exclude_none=True) for t in TOOLS]
    assert tools[1] == {"type": "function", "function": {"name": "get_time"}}
    assert rendered == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny", "name": "get_weather"},
        {"role": "tool", "tool_call_id": "call_b", "content": "noon", "name": "get_time"},
    ]


# ---------------------------------------------------------------------------------------------
# The call schema


def valid(schema: dict[str, Any], instance: Any) -> bool:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


W = {"name": "get_weather", "arguments": {"city": "Paris"}}
T = {"name": "get_time", "arguments": {}}


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "instance", "ok"),
    [
        ("required", True, [W], True),
        ("required", True, [T], True),
        ("required", True, [W, T, W], True),
        ("required", True, [], False),
        ("required", True, [{"name": "get_date", "arguments": {}}], False),
        ("required", True, [{"name": "get_weather"}], False),
        ("required", True, [{"name": "get_weather", "arguments": {}}], False),  # city required
        ("required", True, [{"name": "get_time", "arguments": {"x": 1}}], False),  # no parameters
        ("required", True, [W | {"extra": 1}], False),
        ("required", True, W, False),
        ("required", False, [W], True),
        ("required", False, [W, T], False),
        ({"type": "function", "function": {"name": "get_weather"}}, True, [W], True),
        ({"type": "function", "function": {"name": "get_weather"}}, True, [T], False),
        ({"type": "function", "function": {"name": "get_weather"}}, True, [W, W], False),
        ({"type": "function", "function": {"name": "get_time"}}, True, [T], True),
        ({"type": "function", "function": {"name": "get_time"}}, True, [W], False),
    ],
)
def test_call_schema(tool_choice: Any, parallel: bool, instance: Any, ok: bool) -> None:
    choice = (NamedToolChoice.model_validate(tool_choice) if isinstance(tool_choice, dict)
              else tool_choice)
    schema = call_schema(TOOLS, choice, parallel)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert valid(schema, instance) is ok
    # The dict form of a named choice gives the same schema.
    assert call_schema(TOOLS, tool_choice, parallel) == schema


def test_call_schema_shape() -> None:
    schema = call_schema([TIME], "required", parallel=True)
    assert schema == {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "properties": {"name": {"const": "get_time"},
                       "arguments": {"type": "object", "properties": {},
                                     "additionalProperties": False}},
        "required": ["name", "arguments"], "additionalProperties": False}}
    assert [i["properties"]["name"]["const"]
            for i in call_schema(TOOLS, "required", True)["items"]["anyOf"]] == NAMES
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    schema = call_schema(TOOLS, named, parallel=True)
    assert schema["maxItems"] == 1
    assert schema["items"]["properties"]["arguments"] == WEATHER.function.parameters
    assert "maxItems" not in call_schema(TOOLS, "required", True)
    assert call_schema(TOOLS, "required", False)["maxItems"] == 1


def test_call_schema_unknown_named_tool() -> None:
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_date"}})
    with pytest.raises(ToolMessageError) as e:
        call_schema(TOOLS, named, parallel=True)
    assert e.value.param == "tool_choice"
    assert "get_date" in str(e.value) and "get_weather" in str(e.value) and "get_time" in str(e.value)


def test_call_schema_needs_a_call_and_tools() -> None:
    with pytest.raises(ToolMessageError) as e:
        call_schema([], "required", parallel=True)
    assert e.value.param == "tool_choice"
    with pytest.raises(ValueError):
        call_schema(TOOLS, "auto", parallel=True)


def test_call_schema_does_not_share_the_tool_parameters() -> None:
    schema = call_schema([WEATHER], "required", parallel=True)
    schema["items"]["properties"]["arguments"]["properties"]["city"]["type"] = "integer"
    assert WEATHER.function.parameters is not None
    assert WEATHER.function.parameters["properties"]["city"]["type"] == "string"


# ---------------------------------------------------------------------------------------------
# The answer parser

CALL_W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL_T = '{"name": "get_time", "arguments": {}}'

# (answer, content, [(name, arguments)])
CASES: list[tuple[str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("Just text.", "Just text.", []),
    ("", "", []),
    (f"<tool_call>[{CALL_W}]</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>{CALL_W}</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>\n[{CALL_W}, {CALL_T}]\n</tool_call>", "",
     [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    (f"Sure.\n<tool_call>{CALL_T}</tool_call>\n<tool_call>[{CALL_W}]</tool_call> done",
     "Sure.\n\n done", [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    # arguments as a JSON string holding an object
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>', "",
     [("get_weather", {"city": "Rome"})]),
    # not a call: the block is content, tags and all
    ('a <tool_call>[{"name": "get_date", "arguments": {}}]</tool_call> b',
     'a <tool_call>[{"name": "get_date", "arguments": {}}]</tool_call> b', []),
    (f"<tool_call>[{CALL_W}, {{\"name\": \"nope\", \"arguments\": {{}}}}]</tool_call>",
     f"<tool_call>[{CALL_W}, {{\"name\": \"nope\", \"arguments\": {{}}}}]</tool_call>", []),
    ('<tool_call>[{"name": "get_time", "arguments": {]</tool_call>x',
     '<tool_call>[{"name": "get_time", "arguments": {]</tool_call>x', []),
    ('<tool_call>{"name": "get_time"}</tool_call>', '<tool_call>{"name": "get_time"}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', []),
    ('<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "get_time", "arguments": {"x": NaN}}</tool_call>', []),
    ("<tool_call>[]</tool_call>", "<tool_call>[]</tool_call>", []),
    # a bad block then a good one: only the good one is a call
    (f"<tool_call>oops</tool_call><tool_call>{CALL_T}</tool_call>", "<tool_call>oops</tool_call>",
     [("get_time", {})]),
    # looks like the beginning of a tag, but is not
    ("use <tools> and <tool_ or <tool_call", "use <tools> and <tool_ or <tool_call", []),
    ("a < b <<tool_call>" + CALL_T + "</tool_call>", "a < b <", [("get_time", {})]),
    # unterminated blocks, read at the end
    (f"Calling: <tool_call>[{CALL_W}]", "Calling: ", [("get_weather", {"city": "Paris"})]),
    (f"<tool_call>[{CALL_W}]</tool_", "", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>[{"name": "get_weather", "argu', '<tool_call>[{"name": "get_weather", "argu', []),
    ("text <tool_call>", "text <tool_call>", []),
    # non-ASCII arguments stay as they are
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>', "",
     [("get_weather", {"city": "Zürich"})]),
]


def run_parser(pieces: list[str]) -> tuple[str, list[ToolCallDelta], ToolCallParser]:
    parser = ToolCallParser(NAMES)
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in [*pieces, None]:
        text, new = parser.feed(piece) if piece is not None else parser.finish()
        content.append(text)
        deltas.extend(new)
    return "".join(content), deltas, parser


def splits(text: str) -> list[list[str]]:
    """The text whole, character by character, and in random chunkings."""
    out = [[text], list(text)]
    rng = random.Random(text)
    for _ in range(20):
        k = min(len(text) - 1, rng.randint(1, 8))
        cuts = sorted(rng.sample(range(1, len(text)), k)) if k > 0 else []
        out.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return out


@pytest.mark.parametrize(("answer", "content", "expected"), CASES)
def test_parser_in_every_split(answer: str, content: str,
                               expected: list[tuple[str, dict[str, Any]]]) -> None:
    for pieces in splits(answer):
        assert "".join(pieces) == answer
        got, deltas, parser = run_parser(pieces)
        assert got == content, pieces
        assert parser.content == content
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in parser.calls]
        assert calls == expected, pieces
        # Two deltas per call: id, type and name first, then the arguments.
        assert len(deltas) == 2 * len(expected)
        for i, c in enumerate(parser.calls):
            head, body = deltas[2 * i], deltas[2 * i + 1]
            assert head.index == body.index == i
            assert head.id == c.id and head.type == "function"
            assert head.function is not None and head.function.name == c.function.name
            assert head.function.arguments == ""
            assert body.id is None and body.type is None
            assert body.function is not None and body.function.name is None
            assert body.function.arguments == c.function.arguments


def test_parser_holds_back_a_possible_tag_only() -> None:
    parser = ToolCallParser(NAMES)
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("s> x") == ("<tools> x", [])
    assert parser.feed(" <") == (" ", [])
    assert parser.feed("tool_call>" + CALL_T[:10]) == ("", [])
    text, deltas = parser.feed(CALL_T[10:] + "</tool_call>!")
    assert text == "!" and len(deltas) == 2
    assert parser.finish() == ("", [])
    assert parser.content == "Hello <tools> x !"


def test_arguments_are_compact_unicode_json() -> None:
    _, calls = parse_tool_calls(
        '<tool_call>{"name": "get_weather", "arguments": {"city":"Zürich","n":[1,2]}}</tool_call>',
        NAMES)
    assert calls[0].function.arguments == json.dumps({"city": "Zürich", "n": [1, 2]},
                                                     ensure_ascii=False)


def test_ids_are_unique_and_well_formed() -> None:
    answer = "".join(f"<tool_call>[{CALL_W}, {CALL_T}]</tool_call>" for _ in range(50))
    _, calls = parse_tool_calls(answer, NAMES)
    ids = [c.id for c in calls]
    assert len(ids) == 100 and len(set(ids)) == 100
    assert all(ID.match(i) for i in ids)
    assert all(c.type == "function" for c in calls)


def test_no_declared_tools_means_no_calls() -> None:
    answer = f"<tool_call>[{CALL_W}]</tool_call>"
    assert parse_tool_calls(answer, []) == (answer, [])


@pytest.mark.parametrize(
    ("answer", "content", "n"),
    [
        (f"<tool_call>[{CALL_W}]</tool_call>", None, 1),
        (f"  \n<tool_call>[{CALL_W}]</tool_call>\n<tool_call>{CALL_T}</tool_call>\n", None, 2),
        (f"Let me check.\n<tool_call>[{CALL_W}]</tool_call>\n", "Let me check.", 1),
        ("  plain text, kept as is \n", "  plain text, kept as is \n", 0),
        ("", "", 0),
        ("<tool_call>[{bad}]</tool_call>", "<tool_call>[{bad}]</tool_call>", 0),
    ],
)
def test_parse_tool_calls(answer: str, content: str | None, n: int) -> None:
    got, calls = parse_tool_calls(answer, NAMES)
    assert got == content
    assert len(calls) == n
