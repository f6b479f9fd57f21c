"""A request's structured output, as the ingress reads it from the body (docs/structured.md).

Four ways to ask, at most one per request: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), vLLM's older ``guided_json``/``guided_regex``/``guided_choice``/
``guided_grammar``, and a chat request's ``tool_choice`` ``required`` or naming a function
(the answer is then a call of the declared tools, ``tierserve.cluster.tool_calls``).

The ingress checks what it can without the grammar library (a JSON schema is valid JSON
Schema and uses only keywords the replica's grammar enforces); the replica compiles the
grammar and answers 400 for a regex or grammar that does not compile.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tierserve.cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    StructuredOutputs,
)
from tierserve.cluster.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ToolMessageError,
    call_schema,
)
from tierserve.records import StructuredOutput
from tierserve.replica.structured import subschemas

# Keywords the grammar does not enforce (an output could break them): refused, not ignored.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "uniqueItems", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor",
})


class StructuredError(ValueError):
    """A structured-output field the server cannot take; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Structured:
    """What the ingress made of a request's structured-output fields: the replica's record and
    the metrics' kind (``tierserve.replica.metrics.STRUCTURED_KINDS``)."""

    output: StructuredOutput
    kind: str


def _walk(schema: Any, path: str) -> Iterator[tuple[str, str]]:
    """Every (keyword, where) of ``schema`` and its subschemas."""
    if not isinstance(schema, dict):
        return
    for key in schema:
        yield key, path
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        yield "allOf (with more than one schema)", path
    for where, sub in subschemas(schema):
        yield from _walk(sub, f"{path}/{where}")


def check_schema(schema: Any, param: str) -> str:
    """``schema`` (an object, a boolean, or either as JSON text) as JSON text for the replica;
    ``StructuredError`` naming ``param`` when it is not valid JSON Schema, is ``false`` (nothing
    matches it) or uses a keyword the grammar does not enforce."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise StructuredError(f"{param}: the schema is not valid JSON: {e}", param) from None
    if schema is True:
        schema = {}
    if schema is False:
        raise StructuredError(f"{param}: the schema is false: no output can match it", param)
    if not isinstance(schema, dict):
        raise StructuredError(f"{param}: a JSON schema is an object (or a boolean), got "
                              f"{type(schema).__name__}", param)
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise StructuredError(f"{param}: not a valid JSON schema"
                              f"{f' at /{where}' if where else ''}: {e.message}", param) from None
    except Exception as e:  # an unknown $schema draft, a reference that does not resolve, ...
        raise StructuredError(f"{param}: not a usable JSON schema: {e}", param) from None
    for keyword, where in _walk(schema, ""):
        name = keyword.split(" ")[0]
        if name in UNSUPPORTED_KEYWORDS or name != keyword:
            raise StructuredError(
                f"{param}: the keyword {keyword!r} (at {where or '/'}) is not supported: the "
                "output's grammar cannot enforce it", param)
    return json.dumps(schema, ensure_ascii=False)


def _from_vllm(so: StructuredOutputs) -> Structured:
    ws = not so.disable_any_whitespace
    if so.json_ is not None:
        spec = check_schema(so.json_, "structured_outputs.json")
        return Structured(StructuredOutput("json", spec, "structured_outputs.json", ws),
                          "json_schema")
    if so.regex is not None:
        return Structured(StructuredOutput("regex", so.regex, "structured_outputs.regex"), "regex")
    if so.choice is not None:
        return Structured(StructuredOutput("choice", json.dumps(so.choice, ensure_ascii=False),
                                           "structured_outputs.choice"), "choice")
    if so.grammar is not None:
        return Structured(StructuredOutput("grammar", so.grammar, "structured_outputs.grammar"),
                          "grammar")
    return Structured(StructuredOutput("json_object", "", "structured_outputs.json_object", ws),
                      "json_object")


def structured_output(body: CompletionRequest | ChatCompletionRequest,
                      tools: str | None = None) -> Structured | None:
    """The request's structured output (None: its output is free text); ``StructuredError``
    for a field the server cannot take or two fields that both constrain the output.
    ``tools``: a chat request's ``tool_mode``, when the caller has it already."""
    given: list[tuple[str, Structured | None]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", Structured(
                StructuredOutput("json_object", "", "response_format"), "json_object")))
        else:
            assert rf.json_schema is not None  # ResponseFormat checks it
            param = "response_format.json_schema.schema"
            spec = check_schema(rf.json_schema.schema_, param)
            given.append(("response_format", Structured(StructuredOutput("json", spec, param),
                                                        "json_schema")))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _from_vllm(body.structured_outputs)))
    if body.guided_json is not None:
        spec = check_schema(body.guided_json, "guided_json")
        given.append(("guided_json", Structured(StructuredOutput("json", spec, "guided_json"),
                                                "json_schema")))
    if body.guided_regex is not None:
        given.append(("guided_regex", Structured(
            StructuredOutput("regex", body.guided_regex, "guided_regex"), "regex")))
    if body.guided_choice is not None:
        given.append(("guided_choice", Structured(StructuredOutput(
            "choice", json.dumps(body.guided_choice, ensure_ascii=False), "guided_choice"),
            "choice")))
    if body.guided_grammar is not None:
        given.append(("guided_grammar", Structured(
            StructuredOutput("grammar", body.guided_grammar, "guided_grammar"), "grammar")))
    if isinstance(body, ChatCompletionRequest):
        call = tool_output(body, tool_mode(body) if tools is None else tools)
        if call is not None:
            given.append(("tool_choice", call))
    if len(given) > 1:
        names = [name for name, _ in given]
        raise StructuredError(
            f"{' and '.join(names)} both constrain the output: send one of them", names[1])
    return given[0][1] if given else None


def tool_mode(body: ChatCompletionRequest) -> str:
    """``none`` (tools left out of the prompt, or none declared), ``auto`` (the model may call
    one), ``required`` or ``named``; ``StructuredError`` for a ``tool_choice`` without tools or
    naming a function that was not declared, and for a tool whose parameters are not a JSON
    schema the server can take."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise StructuredError("tool_choice needs tools: declare the functions it may call",
                                  "tool_choice")
        return "none"
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise StructuredError(f"tools declares the function {dup!r} twice", "tools")
    for i, tool in enumerate(body.tools):
        params = tool.function.parameters
        if params is not None:
            param = f"tools.{i}.function.parameters"
            check_schema(params, param)
            if params.get("type", "object") != "object":
                raise StructuredError(f"{param}: a function's parameters are an object schema "
                                      f"(type 'object'), got type {params.get('type')!r}", param)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise StructuredError(
                f"tool_choice names the function {choice.function.name!r}, which tools does not "
                f"declare (declared: {', '.join(names)})", "tool_choice")
        return "named"
    return choice or "auto"


def tool_output(body: ChatCompletionRequest, mode: str) -> Structured | None:
    """The constraint of ``tool_choice`` ``required`` or named (``mode``, ``tool_mode``'s): a
    call of the declared tools, between the tool-call tags (None for ``auto`` and ``none``)."""
    if mode not in ("required", "named"):
        return None
    assert body.tools is not None
    try:
        schema = call_schema(body.tools, body.tool_choice, body.parallel_tool_calls)
    except ToolMessageError as e:
        raise StructuredError(str(e), e.param) from None
    spec = json.dumps(schema, ensure_ascii=False)
    return Structured(StructuredOutput("json", spec, "tool_choice", prefix=TOOL_CALL_OPEN,
                                       suffix=TOOL_CALL_CLOSE), "tool_call")
