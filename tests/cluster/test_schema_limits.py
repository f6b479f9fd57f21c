"""The ingress's bounds on JSON schemas, the keywords the grammar cannot enforce together, and
the checks off the event loop (``SchemaLimits``, ``SchemaChecker``), without Ray."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import jsonschema
import pytest

from tierserve.cluster import structured as st
from tierserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.cluster.structured import (
    SchemaCheckBusy,
    SchemaChecker,
    SchemaLimits,
    StructuredError,
    check_schema,
    structured_output,
    tool_mode,
)
from tierserve.replica.structured import strip_annotations

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(CHAT | kw)


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "p"} | kw)


def props(n: int, value: Any = None) -> dict[str, Any]:
    """An object schema of ``n`` properties."""
    return {"type": "object",
            "properties": {f"p{i}": value or {"type": "integer"} for i in range(n)}}


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def refused(schema: Any, limits: SchemaLimits | None = None, param: str = "guided_json") -> str:
    with pytest.raises(StructuredError) as e:
        check_schema(schema, param, limits)
    assert e.value.param == param and str(e.value).startswith(f"{param}: ")
    return str(e.value)


# ---------------------------------------------------------------------- the limits


def test_the_limits_are_a_frozen_model_that_takes_no_unknown_field() -> None:
    limits = SchemaLimits()
    assert (limits.max_bytes, limits.max_properties, limits.max_depth) == (65536, 512, 16)
    with pytest.raises(ValueError, match="extra"):
        SchemaLimits.model_validate({"max_bytez": 1})
    with pytest.raises(ValueError, match="frozen"):
        limits.max_bytes = 1
    with pytest.raises(ValueError):
        SchemaLimits(max_depth=1000)  # the replica reads schemas recursively


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_over_max_bytes_is_refused(as_text: bool) -> None:
    schema = props(40, {"type": "string", "maxLength": 40})
    size = len(json.dumps(schema).encode())
    check_schema(json.dumps(schema) if as_text else schema, "p", SchemaLimits(max_bytes=size))
    msg = refused(json.dumps(schema) if as_text else schema, SchemaLimits(max_bytes=size - 1))
    assert f"{size} bytes" in msg and "structured_limits.max_bytes" in msg


def test_annotations_are_not_counted_and_never_reach_the_replica() -> None:
    """100 schemas that differ only in a long ``description`` are one schema to the replica:
    the text it compiles and caches is the schema without its annotations."""
    schema = props(40, {"type": "string", "maxLength": 40, "title": "t"})
    bare = json.dumps(strip_annotations(schema), ensure_ascii=False)
    size = len(bare.encode())
    texts = set()
    for i in range(5):
        noisy = {**schema, "description": f"{i}" + "x" * 200_000, "$comment": "c" * i,
                 "examples": [{"a": i}]}
        texts.add(check_schema(noisy, "p", SchemaLimits(max_bytes=size)))
    assert texts == {bare}
    # A property named like an annotation is a name: it stays.
    named = {"type": "object", "properties": {"description": {"type": "string",
                                                              "description": "the text"}}}
    assert json.loads(check_schema(named, "p")) == {
        "type": "object", "properties": {"description": {"type": "string"}}}


def test_the_request_s_schemas_together_are_bounded_by_max_total_bytes() -> None:
    schema = props(20)
    size = len(json.dumps(schema).encode())
    limits = SchemaLimits(max_bytes=size, max_total_bytes=2 * size)
    body = chat(tools=[tool(f"f{i}", schema) for i in range(3)])
    assert tool_mode(chat(tools=[tool(f"f{i}", schema) for i in range(2)]), limits) == "auto"
    with pytest.raises(StructuredError, match=r"structured_limits\.max_total_bytes") as e:
        tool_mode(body, limits)
    assert e.value.param == "tools.2.function.parameters"


def test_max_properties_counts_every_subschema_s_properties() -> None:
    check_schema(props(512), "p")
    msg = refused(props(513))
    assert "more than 512 properties" in msg and "structured_limits.max_properties" in msg
    split = {"type": "object", "properties": {"a": props(300), "b": props(300)}}
    assert "structured_limits.max_properties" in refused(split)


def test_max_subschemas() -> None:
    check_schema({"anyOf": [{"type": "integer"} for _ in range(2047)]}, "p")
    msg = refused({"anyOf": [{"type": "integer"} for _ in range(2048)]})
    assert "more than 2048 subschemas" in msg and "structured_limits.max_subschemas" in msg


def test_max_depth() -> None:
    check_schema(nested(16), "p")
    msg = refused(nested(17))
    assert "more than 16 deep" in msg and "structured_limits.max_depth" in msg
    assert "/properties/a" * 17 in msg  # where
    assert "structured_limits.max_depth" in refused(nested(3), SchemaLimits(max_depth=2))


@pytest.mark.parametrize("how", ["object", "text", "const"])
def test_a_schema_1200_levels_deep_is_refused_not_a_recursion_error(how: str) -> None:
    schema: Any = nested(1200)
    if how == "text":
        schema = '{"type": "object", "properties": {"a": ' * 1200 + "{}" + "}}" * 1200
    elif how == "const":  # deep JSON that is not a subschema: a value
        value: Any = 1
        for _ in range(1200):
            value = [value]
        schema = {"const": value}
    msg = refused(schema)
    assert "structured_limits.max_depth" in msg


@pytest.mark.parametrize("key", ["const", "default", "examples", "x-vendor", "enum"])
def test_a_value_in_a_schema_nests_at_most_twice_max_depth(key: str) -> None:
    def value(levels: int) -> Any:  # ``levels`` arrays and objects, one in the other
        outer = key in ("examples", "enum")  # an array of values
        v: Any = "leaf"
        for i in range(levels - outer):
            v = [v] if i % 2 else {"k": v}
        return [v] if outer else v

    check_schema({key: value(32)}, "p")
    msg = refused({"type": "object", "properties": {"a": {key: value(33)}}})
    assert f"the value of {key!r} (at /properties/a) nests more than 32 levels" in msg
    assert "structured_limits.max_depth" in msg


def test_a_deep_chain_of_refused_keywords_stops_at_the_first() -> None:
    schema: Any = {"type": "string"}
    for _ in range(400):
        schema = {"not": schema}
    assert "'not'" in refused(schema)


def test_max_enum() -> None:
    check_schema({"enum": list(range(256))}, "p")
    msg = refused({"type": "object", "properties": {"e": {"enum": list(range(257))}}})
    assert ("the enum at /properties/e has 257 values" in msg
            and "structured_limits.max_enum" in msg)


@pytest.mark.parametrize("keyword", ["minLength", "maxLength"])
def test_max_length_bound(keyword: str) -> None:
    check_schema({"type": "string", keyword: 1024}, "p")
    msg = refused({"type": "string", keyword: 1025})
    assert f"{keyword} 1025" in msg and "structured_limits.max_length_bound" in msg


@pytest.mark.parametrize("pattern", ["^a{2000}$", "^[a-z]{1,5000}$", "^(ab){0,1025}$"])
def test_a_pattern_s_repetition_is_bounded_like_a_length(pattern: str) -> None:
    assert "structured_limits.max_length_bound" in refused({"type": "string", "pattern": pattern})
    pp = {"type": "object", "patternProperties": {pattern: {}}, "additionalProperties": False}
    assert "structured_limits.max_length_bound" in refused(pp)


def test_an_escaped_brace_is_no_repetition() -> None:
    check_schema({"type": "string", "pattern": r"^\{5000\}$"}, "p")
    check_schema({"type": "string", "pattern": "^a{1024}$"}, "p")


@pytest.mark.parametrize("keyword", ["minItems", "maxItems", "minProperties", "maxProperties"])
def test_max_count_bound(keyword: str) -> None:
    kind = "array" if "Items" in keyword else "object"
    check_schema({"type": kind, keyword: 4096}, "p")
    msg = refused({"type": kind, keyword: 4097})
    assert f"{keyword} 4097" in msg and "structured_limits.max_count_bound" in msg


def test_max_tools() -> None:
    body = chat(tools=[tool(f"f{i}", OBJ) for i in range(3)])
    assert tool_mode(body, SchemaLimits(max_tools=3)) == "auto"
    with pytest.raises(StructuredError, match=r"structured_limits\.max_tools") as e:
        tool_mode(body, SchemaLimits(max_tools=2))
    assert e.value.param == "tools"


def test_a_schema_of_an_older_draft_is_checked_by_jsonschema_within_its_own_bound() -> None:
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#"}
    check_schema(draft4 | props(100), "p")
    msg = refused(draft4 | props(130))
    assert "structured_limits.max_legacy_subschemas" in msg
    # jsonschema judges what draft-04 allows and 2020-12 does not, and the reverse.
    check_schema(draft4 | {"type": "number", "minimum": 1, "exclusiveMinimum": True}, "p")
    assert "not a valid JSON schema" in refused(draft4 | {"type": "string", "minLength": -1})


def test_the_20000_property_schema_is_refused_by_max_bytes_before_any_walk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    walked: list[int] = []
    monkeypatch.setattr(st._Inspector, "run", lambda self, pause_every=0: walked.append(1))
    schema = props(20000, {"type": "string", "description": "a property of the record"})
    assert len(json.dumps(schema)) > 900 * 1024
    for given in (schema, json.dumps(schema)):
        assert "structured_limits.max_bytes" in refused(given)
    body = chat(response_format={"type": "json_schema",
                                 "json_schema": {"name": "r", "schema": schema}})
    checker = SchemaChecker()
    with pytest.raises(StructuredError, match=r"structured_limits\.max_bytes") as e:
        asyncio.run(checker.structured_output(body))
    assert e.value.param == "response_format.json_schema.schema"
    assert walked == [] and checker.offloaded == 0


# ---------------------------------------------------------------------- what the grammar enforces

# Schemas refused, with the keyword the message names and an output that breaks the schema
# which the grammar (xgrammar, as the replica compiles it) lets through: the reason each is
# refused. ``None``: the output is not valid JSON, or jsonschema cannot tell (see the test).
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "'maxLength' together with 'pattern'",
     '"aaaaa"'),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "'minLength' together with 'pattern'",
     '"a"'),
    ({"type": "string", "format": "email", "maxLength": 8}, "'maxLength' together with 'format'",
     '"abcdef@example.com"'),
    ({"type": "string", "format": "date", "pattern": "^x"}, "'format' together with 'pattern'",
     '"2020-01-01"'),
    ({"type": "string", "enum": ["abcdef", "ab"], "maxLength": 3},
     "'maxLength' together with 'enum'", '"abcdef"'),
    ({"type": "integer", "minimum": 5, "const": 3}, "'minimum' together with 'const'", "3"),
    ({"type": "string", "enum": ["a", 1]}, "'type' together with 'enum'", "1"),
    ({"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "minimum": 5},
     "'minimum' together with '$ref'", "3"),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "type": "integer"},
     "'type' together with 'anyOf'", '"x"'),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}], "maximum": 2},
     "'maximum' together with 'oneOf'", "3"),
    ({"allOf": [{"type": "integer"}], "minimum": 5}, "'minimum' together with 'allOf'", "3"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "anyOf": [{"required": ["b"]}, {"required": ["c"]}]}, "together with 'anyOf'", '{"a":1}'),
    ({"minimum": 5}, "'minimum' (at /) needs a 'type'", "3"),
    ({"maxLength": 2}, "'maxLength' (at /) needs a 'type'", '"abc"'),
    ({"pattern": "^a+$"}, "'pattern' (at /) needs a 'type'", '"b"'),
    ({"format": "date"}, "'format' (at /) needs a 'type'", '"xx"'),
    ({"maxItems": 1}, "'maxItems' (at /) needs a 'type'", "[1,2]"),
    ({"required": ["a"]}, "'required' (at /) needs a 'type'", "{}"),
    ({"maxProperties": 1}, "'maxProperties' (at /) needs a 'type'", '{"a":1,"b":2}'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}},
     "'contains'", "[1]"),
    ({"type": "array", "contains": {"type": "string"}, "maxContains": 1}, "'contains'",
     '["a","b"]'),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf' on a number", "1.3"),
    ({"type": ["number", "null"], "multipleOf": 3}, "'multipleOf' on a number", "4"),
    ({"type": "integer", "multipleOf": 2.5}, "multipleOf 2.5", "3"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "'multipleOf' together with 'minimum'",
     "4"),
    ({"type": "integer", "multipleOf": 4, "exclusiveMaximum": 12},
     "'multipleOf' together with 'exclusiveMaximum'", "5"),
    ({"type": "string", "format": "idn-email"}, "the format 'idn-email'", '"not an email"'),
    ({"type": "string", "format": "regex"}, "the format 'regex'", '"(("'),
    ({"$defs": {"n": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"}, "the $ref '#num'",
     '"x"'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "'required' (at /) naming 'b'", '{"a":1}'),
    ({"type": "object", "properties": {"a": {"type": "string"}},
      "patternProperties": {"^n_.*$": {"type": "integer"}}},
     "'patternProperties' together with 'properties'", '{"a":1}'),
    ({"type": "object", "properties": {"a": {"type": "string"}},
      "propertyNames": {"type": "string", "pattern": "^[a-z]$"}, "additionalProperties": True},
     "'propertyNames' together with 'properties' and 'additionalProperties'", '{"a":1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
     "unevaluatedProperties false", '{"b":1}'),
]

# Schemas taken, with outputs that break them: the grammar refuses each.
TAKEN: list[tuple[dict[str, Any], list[str]]] = [
    # A bounded string's characters are plain (the compile worker's ``plain_bounded_strings``):
    # no raw control character, in a list of types and in property names too.
    ({"type": ["string", "null"], "maxLength": 3}, ['"a\x01"', '"abcd"']),
    ({"type": "object", "propertyNames": {"maxLength": 3},
      "additionalProperties": {"type": "integer"}}, ['{"a\x01":1}', '{"abcd":1}']),
    ({"type": "string", "minLength": 1, "maxLength": 4}, ['"a\tb"', '""', '"abcde"']),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"a"', '"abcd"', '"a\x01"']),
    ({"type": "integer", "multipleOf": 3}, ["4", "-5"]),
    ({"type": "integer", "minimum": -5, "maximum": 100}, ["-6", "101"]),
    ({"type": "number", "exclusiveMinimum": 0.5, "maximum": 2}, ["0.5", "2.5", "0.4"]),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 6}, ["3", "6"]),
    ({"type": "string", "format": "date"}, ['"yesterday"']),
    ({"type": "string", "format": "email"}, ['"not an email"']),
    ({"type": "string", "format": "uuid"}, ['"xyz"']),
    ({"type": ["string", "null"], "format": "date"}, ['"b"']),
    ({"type": "string", "pattern": "^a.$"}, ['"b"', '"a"']),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"},
      "minItems": 2, "maxItems": 3}, ["[1]", "[1,2]", '[1,"a","b","c"]']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, ["[1]"]),
    ({"items": {"type": "integer"}, "maxItems": 1}, ["[1,2]", '["x"]']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "minProperties": 1}, ["{}"]),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     ['{"a":1,"b":2}', '{"a":"x"}']),
    ({"type": "object", "properties": {"a": {"type": "string"}},
      "additionalProperties": {"type": "integer"}}, ['{"a":1}', '{"b":"x"}']),
    ({"type": "object", "propertyNames": {"pattern": "^a"},
      "additionalProperties": {"type": "integer"}}, ['{"b":1}']),
    ({"type": "object", "properties": {"a": {"type": "string"}},
      "propertyNames": {"type": "string", "maxLength": 1}}, ['{"a":1}', '{"bb":"x"}']),
    ({"type": "object", "patternProperties": {"^n_.*$": {"type": "integer"}},
      "additionalProperties": False}, ['{"n_a":"x"}', '{"b":1}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False,
      "unevaluatedProperties": False}, ['{"b":1}']),
    ({"properties": {"a": {"type": "integer"}}, "required": ["a"]}, ["{}", '{"a":"x"}']),
    ({"$defs": {"n": {"type": "integer", "minimum": 3}}, "allOf": [{"$ref": "#/$defs/n"}],
      "description": "x"}, ["1", '"x"']),
    ({"anyOf": [{"type": "integer", "maximum": 3}, {"type": "null"}]}, ["4", '"x"']),
    ({"type": "string", "enum": ["a", "bb"]}, ['"c"']),
    ({"type": ["string", "null"], "enum": ["a", None]}, ['"b"']),
    ({"type": ["integer", "null"], "minimum": 3}, ["2"]),
    ({"type": "object", "properties": {"c": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
      "required": ["c"]}, ['{"c":1}', '{"c":{"c":1}}']),
    ({"type": "object", "properties": {"a": {"$ref": "#/properties/b"},
                                       "b": {"type": "integer"}}}, ['{"a":"x"}']),
    ({"$defs": {"a/b c": {"type": "integer"}}, "$ref": "#/$defs/a~1b%20c"}, ['"x"']),
]


def _breaks(schema: dict[str, Any], text: str) -> bool:
    """``text`` is not a JSON value valid against ``schema`` (formats checked)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return True
    cls = jsonschema.validators.validator_for(schema)
    return not cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(value)


def _grammar_accepts(schema: dict[str, Any], text: str) -> bool:
    """Whether the grammar the replica compiles from ``schema`` (``enforceable``, its bounded
    strings made plain as the compile worker does) takes ``text`` whole."""
    xgr = pytest.importorskip("xgrammar")
    from tierserve.replica.grammar_worker import plain_bounded_strings
    from tierserve.replica.structured import MAX_WHITESPACE, enforceable

    grammar = plain_bounded_strings(xgr.Grammar.from_json_schema(
        json.dumps(enforceable(schema)), any_whitespace=True, strict_mode=False,
        max_whitespace_cnt=MAX_WHITESPACE))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(
        grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and bool(matcher.is_terminated())


@pytest.mark.parametrize(("schema", "said", "breaking"), REFUSED,
                         ids=[said for _, said, _ in REFUSED])
def test_keywords_the_grammar_cannot_enforce_together_are_refused(
        schema: dict[str, Any], said: str, breaking: str) -> None:
    msg = refused(schema)
    assert said in msg
    assert "not supported" in msg or "needs a 'type'" in msg
    wrapped = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    if "$defs" not in schema and "$ref" not in schema:  # the pointers are the root's
        assert "/properties/x" in refused(wrapped)


@pytest.mark.parametrize(("schema", "said", "breaking"), REFUSED,
                         ids=[said for _, said, _ in REFUSED])
def test_each_refusal_is_an_output_the_grammar_would_let_through(
        schema: dict[str, Any], said: str, breaking: str) -> None:
    assert _breaks(schema, breaking), "the output should break the schema"
    assert _grammar_accepts(schema, breaking), (
        f"the grammar now enforces {said}: take it (cluster/structured.py)")


@pytest.mark.parametrize(("schema", "breaking"), TAKEN, ids=[json.dumps(s)[:60] for s, _ in TAKEN])
def test_what_the_grammar_enforces_is_taken(schema: dict[str, Any], breaking: list[str]) -> None:
    assert json.loads(check_schema(schema, "p")) == strip_annotations(schema)
    for text in breaking:
        assert _breaks(schema, text), text
        assert not _grammar_accepts(schema, text), text


def test_formats_the_standard_does_not_define_are_annotations() -> None:
    for fmt in ("binary", "password", "int32", "my-format"):
        check_schema({"type": "string", "format": fmt}, "p")
    check_schema({"type": "integer", "format": "int64"}, "p")  # a string keyword, on integers


def test_the_array_form_of_items_is_refused_with_what_to_write() -> None:
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#"}
    msg = refused(draft7 | {"type": "array", "items": [{"type": "integer"}]})
    assert "prefixItems" in msg


@pytest.mark.parametrize("ref", ["http://example.com/s.json", "other.json#/a", "#/$defs/nope",
                                 "#/$defs/n/properties"])
def test_a_reference_must_resolve_inside_the_schema(ref: str) -> None:
    msg = refused({"$defs": {"n": {"type": "integer"}}, "$ref": ref})
    assert repr(ref) in msg


def test_a_referenced_schema_is_checked_wherever_it_is() -> None:
    # The target sits under a keyword the walk does not know: the reference brings it in.
    schema = {"x-lib": {"n": {"type": "string", "pattern": "^a$", "maxLength": 3}},
              "$ref": "#/x-lib/n"}
    assert "'maxLength' together with 'pattern'" in refused(schema)


# ---------------------------------------------------------------------- well-formed JSON Schema


@pytest.mark.parametrize("schema", [
    {"type": "objekt"}, {"type": []}, {"type": ["string", "string"]}, {"type": 3},
    {"minimum": "low", "type": "integer"}, {"type": "string", "minLength": -1},
    {"type": "string", "maxLength": True}, {"type": "string", "pattern": "(("},
    {"type": "object", "required": ["a", "a"], "properties": {"a": {}}},
    {"type": "object", "properties": {"a": 3}}, {"type": "object", "properties": []},
    {"anyOf": []}, {"oneOf": {}}, {"$ref": 5}, {"type": "integer", "multipleOf": 0},
    {"enum": "ab"}, {"title": 5}, {"description": ["x"]}, {"examples": 5}, {"format": 5},
    {"$defs": {"a": 5}}, {"deprecated": "yes"}, {"$anchor": "1bad"},
    {"type": "array", "items": 3}, {"type": "array", "prefixItems": []},
    {"type": "object", "patternProperties": {"((": {}}},
])
def test_what_jsonschema_refuses_the_walk_refuses(schema: dict[str, Any]) -> None:
    with pytest.raises(jsonschema.SchemaError):
        jsonschema.Draft202012Validator.check_schema(schema)
    assert "not a valid JSON schema at /" in refused(schema)


@pytest.mark.parametrize("schema", [
    {}, OBJ, {"type": "string", "minLength": 2.0}, {"enum": [1, "a", None]},
    {"type": "integer", "minimum": -5, "maximum": 1e3},
    {"type": "object", "properties": {"a": True, "b": {}}, "additionalProperties": False},
    {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "string"},
    {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
     "definitions": {"n": {"type": "integer"}}, "properties": {"n": {"$ref": "#/definitions/n"}}},
    {"type": "array", "items": False, "prefixItems": [{"type": "integer"}]},
    {"type": "string", "contentMediaType": "text/plain", "contentSchema": {"not": {}}},
])
def test_what_jsonschema_takes_the_walk_takes(schema: dict[str, Any]) -> None:
    jsonschema.validators.validator_for(schema).check_schema(schema)
    assert json.loads(check_schema(schema, "p")) == schema


ANNOTATIONS = {"title": "T", "description": "d", "default": {"a": 1}, "examples": [{"a": 1}],
               "$comment": "c", "deprecated": False, "readOnly": True, "x-vendor": {"not": 1},
               "discriminator": {"propertyName": "kind"}, "nullable": True, "$id": "urn:x"}


@pytest.mark.parametrize("schema", [
    OBJ,
    {"type": "string", "enum": ["a", "b"]},
    {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n"},
    {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    {"allOf": [{"type": "integer"}]},
    {"const": "a"},
])
def test_schemas_that_differ_only_in_annotations_are_taken_alike(schema: dict[str, Any]) -> None:
    plain = check_schema(schema, "p")
    annotated = schema | ANNOTATIONS
    # Taken, and sent to the replica as the replica's cache would key it: without them.
    assert json.loads(check_schema(annotated, "p")) == strip_annotations(annotated)
    if "$ref" not in schema:  # a pointer is the root's
        inner = {"type": "object", "properties": {"x": annotated}}
        assert json.loads(check_schema(inner, "p")) == strip_annotations(inner)
    assert json.loads(plain) == strip_annotations(schema)


# ---------------------------------------------------------------------- off the event loop


def test_the_checker_answers_as_the_synchronous_functions() -> None:
    bodies: list[CompletionRequest | ChatCompletionRequest] = [
        chat(), chat(response_format={"type": "json_object"}),
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": OBJ}}),
        completion(guided_json=json.dumps(OBJ)),
        completion(structured_outputs={"json": OBJ, "disable_any_whitespace": True}),
        chat(tools=[tool("get", OBJ)], tool_choice="required"),
        chat(tools=[tool("get", OBJ)]),
    ]
    checker = SchemaChecker()
    for body in bodies:
        assert asyncio.run(checker.structured_output(body)) == structured_output(body)
    # The first error, in the order of the fields, as the synchronous check gives it.
    body = chat(tools=[tool("a", {"type": "string"}), tool("b", {"type": 5})])
    with pytest.raises(StructuredError) as sync:
        tool_mode(body)
    with pytest.raises(StructuredError) as async_:
        asyncio.run(checker.tool_mode(body))
    assert (str(sync.value), sync.value.param) == (str(async_.value), async_.value.param)
    assert sync.value.param == "tools.0.function.parameters"


async def _ticks_during(checker: SchemaChecker, body: ChatCompletionRequest) -> int:
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    before = ticks
    await checker.structured_output(body)
    during = ticks - before
    stop = True
    await task
    return during


def test_a_large_schema_is_checked_off_the_loop_while_other_tasks_run() -> None:
    # Near the limits, of draft-04: the walk, then jsonschema (the slowest check there is).
    field = {"type": "string", "maxLength": 64, "description": "a field of the record"}
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#"} | props(126, field)
    checker = SchemaChecker(SchemaLimits(cache_entries=0))
    assert asyncio.run(_ticks_during(checker, chat(guided_json=draft4))) > 0
    assert checker.offloaded == 1 and checker.pending == 0
    checker.close()
    # A check on the loop (inline_bytes above the schema's size) lets nothing else run: the
    # count tells the two apart.
    inline = SchemaChecker(SchemaLimits(cache_entries=0, inline_bytes=1 << 20))
    assert asyncio.run(_ticks_during(inline, chat(guided_json=props(126, field)))) == 0
    assert inline.offloaded == 0


def _slow(monkeypatch: pytest.MonkeyPatch, gate: threading.Event,
          calls: list[str] | None = None) -> None:
    """Every check off the loop waits for ``gate``."""
    real = st._validate_all

    def slow(todo: Any, limits: SchemaLimits, pause_every: int = 0) -> list[str | None]:
        if threading.current_thread() is not threading.main_thread():  # not on the loop
            if calls is not None:
                calls.append(threading.current_thread().name)
            gate.wait(10)
        return real(todo, limits, pause_every)

    monkeypatch.setattr(st, "_validate_all", slow)


def big_body(i: int = 0) -> CompletionRequest:
    return completion(guided_json=props(400 + i))  # above inline_bytes: checked off the loop


def test_beyond_max_checks_a_request_is_refused_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    _slow(monkeypatch, gate)
    checker = SchemaChecker(SchemaLimits(max_checks=2, check_workers=1))

    async def go() -> None:
        first = asyncio.create_task(checker.structured_output(big_body(0)))
        second = asyncio.create_task(checker.structured_output(big_body(1)))
        await asyncio.sleep(0.05)
        assert checker.pending == 2
        with pytest.raises(SchemaCheckBusy, match=r"structured_limits\.max_checks") as e:
            await checker.structured_output(big_body(2))
        assert e.value.retry_after > 0
        # A small schema is checked on the loop: never refused for the queue.
        assert await checker.structured_output(completion(guided_json=OBJ)) is not None
        gate.set()
        assert (await first) is not None and (await second) is not None

    asyncio.run(go())
    assert checker.pending == 0
    checker.close()


def test_a_check_past_its_deadline_is_too_complex_and_keeps_its_slot_until_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    _slow(monkeypatch, gate)
    checker = SchemaChecker(SchemaLimits(check_timeout_s=0.05, check_workers=1, max_checks=4))

    async def go() -> None:
        with pytest.raises(StructuredError, match="too complex to check") as e:
            await checker.structured_output(big_body(0))
        assert e.value.param == "guided_json"
        assert checker.pending == 1  # the thread still runs it
        # Queued behind it, the next one never starts: busy, not too complex.
        with pytest.raises(SchemaCheckBusy, match="did not start"):
            await checker.structured_output(big_body(1))
        gate.set()
        for _ in range(200):
            if checker.pending == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert checker.pending == 0
    checker.close()


def test_a_schema_seen_lately_is_not_checked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    walks: list[int] = []
    real = st._Inspector.run

    def counted(self: Any, pause_every: int = 0) -> None:
        walks.append(1)
        real(self, pause_every)

    monkeypatch.setattr(st._Inspector, "run", counted)
    checker = SchemaChecker(SchemaLimits(cache_entries=2))
    body = completion(guided_json=OBJ)
    for _ in range(3):
        asyncio.run(checker.structured_output(body))
    assert len(walks) == 1
    # A refused schema's verdict is kept too, and names the field it came in.
    bad = {"type": "string", "pattern": "^a$", "maxLength": 3}
    with pytest.raises(StructuredError) as first:
        asyncio.run(checker.structured_output(completion(guided_json=bad)))
    with pytest.raises(StructuredError) as again:
        asyncio.run(checker.structured_output(completion(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad}})))
    assert len(walks) == 2
    assert first.value.param == "guided_json"
    assert again.value.param == "response_format.json_schema.schema"
    assert str(again.value) == str(first.value).replace(
        "guided_json", "response_format.json_schema.schema", 1)
    # At most cache_entries verdicts: the oldest goes first.
    asyncio.run(checker.structured_output(completion(guided_json=props(2))))
    asyncio.run(checker.structured_output(body))
    assert len(walks) == 4


def test_the_off_loop_check_runs_on_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    gate.set()
    calls: list[str] = []
    _slow(monkeypatch, gate, calls)
    checker = SchemaChecker()
    assert asyncio.run(checker.structured_output(big_body())) is not None
    assert calls and calls[0].startswith("tierserve-schema")
    checker.close()
