"""How the ingress reads a request's structured-output fields, without Ray (the HTTP answers are
in test_structured_api.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tierserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.cluster.structured import (
    UNSUPPORTED_KEYWORDS,
    StructuredError,
    check_schema,
    structured_output,
    tool_mode,
)
from tierserve.cluster.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "p"}
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOL = {"type": "function", "function": {"name": "get", "parameters": OBJ}}


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(CHAT | kw)


@pytest.mark.parametrize(
    ("body", "kind", "spec_kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "json_object",
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJ}}},
         "json_schema", "json", "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": OBJ}}, "json_schema", "json", "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", "choice",
         "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, "grammar", "grammar",
         "structured_outputs.grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object", "json_object",
         "structured_outputs.json_object"),
        ({"guided_json": json.dumps(OBJ)}, "json_schema", "json", "guided_json"),
        ({"guided_regex": "a+"}, "regex", "regex", "guided_regex"),
        ({"guided_choice": ["x"]}, "choice", "choice", "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", "grammar", "guided_grammar"),
    ],
)
@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_each_way_to_ask_names_its_kind_and_field(model: Any, body: dict[str, Any], kind: str,
                                                  spec_kind: str, param: str) -> None:
    base = CHAT if model is ChatCompletionRequest else COMPLETION
    got = structured_output(model.model_validate(base | body))
    assert got is not None
    assert (got.kind, got.output.kind, got.output.param) == (kind, spec_kind, param)


def test_text_and_nothing_constrain_nothing() -> None:
    assert structured_output(chat()) is None
    assert structured_output(chat(response_format={"type": "text"})) is None
    assert structured_output(chat(tools=[TOOL])) is None  # auto: parsed, not constrained
    assert structured_output(chat(tools=[TOOL], tool_choice="none")) is None


def test_whitespace_can_be_turned_off() -> None:
    got = structured_output(chat(structured_outputs={"json": OBJ, "disable_any_whitespace": True}))
    assert got is not None and got.output.any_whitespace is False


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get"}}])
def test_a_required_or_named_tool_call_is_a_json_call_between_the_tags(choice: Any) -> None:
    got = structured_output(chat(tools=[TOOL], tool_choice=choice, parallel_tool_calls=False))
    assert got is not None and got.kind == "tool_call"
    assert (got.output.prefix, got.output.suffix) == (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    schema = json.loads(got.output.spec)
    assert schema["type"] == "array" and schema["maxItems"] == 1


def test_two_constraints_at_once_are_refused_naming_the_second() -> None:
    with pytest.raises(StructuredError) as e:
        structured_output(chat(response_format={"type": "json_object"}, guided_regex="a"))
    assert e.value.param == "guided_regex" and "both constrain" in str(e.value)
    with pytest.raises(StructuredError) as e:
        structured_output(chat(tools=[TOOL], tool_choice="required", guided_choice=["a"]))
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ('{"type": ', "not valid JSON"),
        (False, "no output can match"),
        ([1], "is an object"),
        ({"type": "objekt"}, "not a valid JSON schema"),
        ({"type": "object", "properties": {"a": {"type": 3}}}, "at /properties/a/type"),
        ({"type": "integer", "minimum": "low"}, "not a valid JSON schema"),
    ],
)
def test_schemas_that_are_not_json_schema_are_refused(schema: Any, said: str) -> None:
    with pytest.raises(StructuredError, match=said) as e:
        check_schema(schema, "guided_json")
    assert e.value.param == "guided_json" and str(e.value).startswith("guided_json: ")


@pytest.mark.parametrize("keyword", sorted(UNSUPPORTED_KEYWORDS - {"then", "else"}))
def test_keywords_the_grammar_cannot_enforce_are_refused_wherever_they_are(keyword: str) -> None:
    value: Any = {"type": "string"} if keyword not in ("dependentRequired", "uniqueItems") else (
        {"a": ["b"]} if keyword == "dependentRequired" else True)
    if keyword.startswith("$") or keyword == "dependencies" or keyword == "dependentSchemas":
        value = {"$dynamicAnchor": "node", "$recursiveAnchor": "node"}.get(
            keyword, "#" if keyword.startswith("$") else {"a": {"required": ["b"]}})
    nested = {"type": "object", "properties": {"x": {"type": "array", "items": {keyword: value}}}}
    with pytest.raises(StructuredError) as e:
        check_schema(nested, "p")
    assert repr(keyword) in str(e.value) and "/properties/x/items" in str(e.value)


def test_allof_with_one_schema_is_taken_and_with_two_refused() -> None:
    one = {"type": "object", "properties": {"a": {"allOf": [{"$ref": "#/$defs/n"}]}},
           "$defs": {"n": {"type": "integer"}}}
    assert json.loads(check_schema(one, "p")) == one
    two = {"allOf": [{"type": "object"}, {"required": ["a"]}]}
    with pytest.raises(StructuredError, match="allOf"):
        check_schema(two, "p")


def test_a_property_named_like_a_keyword_is_a_property() -> None:
    schema = {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}
    assert json.loads(check_schema(schema, "p")) == schema


def test_true_is_any_json() -> None:
    assert check_schema(True, "p") == "{}"


@pytest.mark.parametrize(
    ("kw", "param", "said"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "'nope'"),
        ({"tools": [TOOL, TOOL]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools.0.function.parameters", "not a valid JSON schema"),
        ({"tools": [{"type": "function", "function": {"name": "f",
                                                      "parameters": {"type": "string"}}}]},
         "tools.0.function.parameters", "object schema"),
    ],
)
def test_tool_declarations_the_server_cannot_take(kw: dict[str, Any], param: str, said: str) -> None:
    with pytest.raises(StructuredError, match=said) as e:
        tool_mode(chat(**kw))
    assert e.value.param == param


def test_tool_modes() -> None:
    assert tool_mode(chat()) == "none"
    assert tool_mode(chat(tool_choice="none")) == "none"
    assert tool_mode(chat(tools=[TOOL])) == "auto"
    assert tool_mode(chat(tools=[TOOL], tool_choice="required")) == "required"
    assert tool_mode(chat(tools=[TOOL], tool_choice={"type": "function",
                                                     "function": {"name": "get"}})) == "named"
