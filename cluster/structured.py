"""A request's structured output, as the ingress reads it from the body (docs/structured.md).

Four ways to ask, at most one per request: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), vLLM's older ``guided_json``/``guided_regex``/``guided_choice``/
``guided_grammar``, and a chat request's ``tool_choice`` ``required`` or naming a function
(the answer is then a call of the declared tools, ``tierserve.cluster.tool_calls``).

The ingress checks what it can without the grammar library (a JSON schema is valid JSON
Schema and uses only keywords, and combinations of keywords, the replica's grammar enforces);
the replica compiles the grammar and answers 400 for a regex or grammar that does not compile.

A schema is checked within ``SchemaLimits`` ("Limits on schemas" in docs/structured.md): its
size, nesting, properties, enums and bounds are counted by one iterative walk before anything
else reads it, and the same walk checks that it is well-formed JSON Schema (draft 2020-12, the
default, and the drafts typed alike, ``WALKED_DRAFTS``), so ``jsonschema`` runs only for a
schema whose ``$schema`` names another draft (draft-04, ...). ``SchemaChecker`` is the
ingress's entry point: it checks small schemas on the event loop, larger ones (and every
``jsonschema`` run) on a thread of its own, a bounded number at a time and each within a
deadline, and remembers the verdict on recent schemas.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeGuard
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field

from tierserve.cluster.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    StructuredOutputs,
)
from tierserve.cluster.tool_calls import (
    HERMES,
    ToolMessageError,
    call_output,
)
from tierserve.records import BadRequest, StructuredOutput, TooManyRequests
from tierserve.replica.structured import strip_annotations

# Keywords the grammar does not enforce (an output could break them): refused, not ignored.
UNSUPPORTED_KEYWORDS = frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "uniqueItems", "unevaluatedItems", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor", "contains", "minContains", "maxContains",
})

# Formats of the JSON Schema standard the grammar does not enforce (it lets any string through).
# A format the standard does not define (``binary``, ``password``, ...) is an annotation: no
# validator checks it, and it is taken.
UNENFORCED_FORMATS = frozenset({"idn-email", "idn-hostname", "iri", "iri-reference", "regex"})

# Drafts whose schemas the walk checks alone (a schema without ``$schema`` is of 2020-12): they
# type their keywords alike, but for the tuple form of ``items``, which the grammar does not
# compile. A schema of another draft (draft-04, ...) is checked by ``jsonschema`` too.
WALKED_DRAFTS = frozenset({
    f"{scheme}://json-schema.org/{draft}"
    for scheme in ("http", "https")
    for draft in ("draft/2020-12/schema", "draft/2019-09/schema", "draft-07/schema",
                  "draft-06/schema")
})


class StructuredError(BadRequest, ValueError):
    """A structured-output field the server cannot take; ``param`` names it (HTTP 400)."""

    code = "invalid_structured_output"

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message, param=param)


class SchemaCheckBusy(TooManyRequests):
    """Too many schema checks are running or waiting for a thread (HTTP 429 ``busy``): the
    request was not checked; ``retry_after`` is the whole seconds to wait before sending it
    again."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message, retry_after=retry_after)


class SchemaLimits(BaseModel):
    """What the ingress takes in a request's JSON schemas (``ClusterConfig.structured_limits``),
    and how it checks them. A schema beyond a limit is a 400 naming the limit's field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(
        default=64 * 1024, ge=64, le=16 << 20,
        description="Bytes of one schema's JSON text (UTF-8, as the server writes it back out): "
                    "the cost of every later step (the check, the grammar's compilation, the "
                    "replica's cache) grows with it.")
    max_total_bytes: int = Field(
        default=256 * 1024, ge=64, le=64 << 20,
        description="Bytes of all the schemas of one request together (its tools' parameters, or "
                    "its response format).")
    max_properties: int = Field(
        default=512, ge=1,
        description="Property names declared in one schema, counted over all its subschemas "
                    "(``properties`` and ``patternProperties``).")
    max_subschemas: int = Field(
        default=2048, ge=1,
        description="Subschemas in one schema, all of them (properties, items, branches, "
                    "definitions, ...): the walk takes about 6 us a subschema.")
    max_legacy_subschemas: int = Field(
        default=128, ge=1,
        description="Subschemas in a schema whose ``$schema`` names a draft the walk does not "
                    "check alone (draft-04, ...): ``jsonschema`` checks it against its "
                    "meta-schema, about 0.3 ms a subschema.")
    max_depth: int = Field(
        default=16, ge=1, le=32,
        description="How deep subschemas nest (the root is 0, a property of it 1, ...); a value in "
                    "a schema (``const``, ``enum``, ``default``, ``examples``, an unknown "
                    "keyword's) may nest twice as many levels. At most 32: the server and the "
                    "replica copy and rewrite schemas with recursive functions.")
    max_enum: int = Field(
        default=256, ge=1,
        description="Values of one ``enum``.")
    max_length_bound: int = Field(
        default=1024, ge=0,
        description="The largest ``minLength``/``maxLength``, and the largest count in a "
                    "``pattern``'s repetition (``{n}``, ``{n,m}``): the grammar unrolls a bounded "
                    "string, and its construction grows faster than the bound (about 0.5 s for "
                    "1,024 on a 2-core Xeon).")
    max_count_bound: int = Field(
        default=4096, ge=0,
        description="The largest ``minItems``/``maxItems``/``minProperties``/``maxProperties``.")
    max_tools: int = Field(
        default=128, ge=1, le=128,
        description="Tools one chat request declares (the request model takes at most 128).")
    inline_bytes: int = Field(
        default=8 * 1024, ge=0,
        description="A request whose schemas together are at most this many bytes is checked on "
                    "the event loop (about 1 ms); a larger one, or one that names an older draft, "
                    "on a checking thread.")
    check_workers: int = Field(
        default=1, ge=1, le=32,
        description="Threads that check schemas off the event loop. The checks are Python and hold "
                    "the GIL: a second thread adds no speed and takes a larger share of the loop's "
                    "time.")
    max_checks: int = Field(
        default=32, ge=1,
        description="Requests whose check runs or waits for a thread: one more is answered 429 at "
                    "once.")
    check_timeout_s: float = Field(
        default=5.0, gt=0.0, le=600.0,
        description="Seconds a request waits for its check: one still waiting for a thread then is "
                    "answered 429, one whose check was running 400 (the schema is too complex).")
    cache_entries: int = Field(
        default=256, ge=0,
        description="Verdicts kept, by the schema's JSON text (the same tools come with every turn "
                    "of an agent): a schema seen lately is not checked again. 0: none kept.")


@dataclass(frozen=True, slots=True)
class Structured:
    """What the ingress made of a request's structured-output fields: the replica's record and
    the metrics' kind (``tierserve.replica.metrics.STRUCTURED_KINDS``)."""

    output: StructuredOutput
    kind: str


def _refuse(param: str, text: str) -> StructuredError:
    return StructuredError(f"{param}: {text}", param)


# ---------------------------------------------------------------------- one schema, prepared


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A schema parsed and measured (the cheap part of its check)."""

    schema: dict[str, Any]
    text: str  # its JSON text for the replica, without annotations (``strip_annotations``)
    size: int  # bytes of ``text``
    param: str
    legacy: bool  # ``$schema`` names a draft not in WALKED_DRAFTS: ``jsonschema`` checks it


def _prepare(schema: Any, param: str, limits: SchemaLimits) -> _Prepared:
    """``schema`` (an object, a boolean, or either as JSON text) parsed, written back as JSON
    text without its annotations (``description``, ``title``, ``examples``, ...: they say
    nothing of which outputs are valid, so the replica never sees, compiles or caches them) and
    measured; ``StructuredError`` when it does not parse, is not a schema or is, without its
    annotations, larger than ``max_bytes`` (the annotations are bounded by the body's size,
    ``max_request_bytes``)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise _refuse(param, f"the schema is not valid JSON: {e}") from None
        except RecursionError:
            raise _refuse(param, _too_deep(limits, "")) from None
    if schema is True:
        schema = {}
    if schema is False:
        raise _refuse(param, "the schema is false: no output can match it")
    if not isinstance(schema, dict):
        raise _refuse(param, f"a JSON schema is an object (or a boolean), got "
                             f"{type(schema).__name__}")
    try:
        text = json.dumps(strip_annotations(schema), ensure_ascii=False)
    except RecursionError:
        raise _refuse(param, _too_deep(limits, "")) from None
    except (TypeError, ValueError) as e:  # a caller's object that is not JSON
        raise _refuse(param, f"the schema is not JSON: {e}") from None
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_bytes:
        raise _refuse(param, f"the schema is {size} bytes of JSON without its annotations, more "
                             f"than the server takes ({limits.max_bytes}, "
                             "structured_limits.max_bytes)")
    draft = schema.get("$schema")
    legacy = draft is not None and not (isinstance(draft, str)
                                        and draft.rstrip("#") in WALKED_DRAFTS)
    return _Prepared(schema, text, size, param, legacy)


def _too_deep(limits: SchemaLimits, where: str) -> str:
    if not where:  # found by the JSON parser or writer: hundreds of levels
        return (f"the schema nests far deeper than the server takes ({limits.max_depth} levels "
                "of subschemas, structured_limits.max_depth)")
    return (f"the schema nests subschemas more than {limits.max_depth} deep (at {where}) "
            "(structured_limits.max_depth)")


def _validate(p: _Prepared, limits: SchemaLimits, pause_every: int = 0) -> None:
    """The expensive part of a schema's check: the walk (``_Inspector``), then ``jsonschema``
    for a schema of an older draft. Raises ``StructuredError``."""
    inspector = _Inspector(p.schema, p.param, limits, strict=not p.legacy)
    inspector.run(pause_every)
    if p.legacy:
        if inspector.subschemas > limits.max_legacy_subschemas:
            raise _refuse(p.param, f"the schema names the draft {p.schema['$schema']!r} and has "
                                   f"more than {limits.max_legacy_subschemas} subschemas "
                                   "(structured_limits.max_legacy_subschemas): leave '$schema' "
                                   "out to have it read as draft 2020-12")
        _check_with_jsonschema(p.schema, p.param)


def _check_with_jsonschema(schema: dict[str, Any], param: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise _refuse(param, f"not a valid JSON schema{f' at /{where}' if where else ''}: "
                             f"{e.message}") from None
    except RecursionError:
        raise _refuse(param, "the schema nests too deeply to check") from None
    except Exception as e:  # an unknown $schema draft, ...
        raise _refuse(param, f"not a usable JSON schema: {e}") from None


def check_schema(schema: Any, param: str, limits: SchemaLimits | None = None) -> str:
    """``schema`` (an object, a boolean, or either as JSON text) as JSON text for the replica;
    ``StructuredError`` naming ``param`` when it is not valid JSON Schema, is ``false`` (nothing
    matches it), is beyond ``limits`` (the defaults when None) or uses a keyword, or keywords
    together, the grammar does not enforce. Runs on the caller's thread: the ingress calls
    ``SchemaChecker`` instead."""
    limits = limits or _DEFAULT_LIMITS
    p = _prepare(schema, param, limits)
    _validate(p, limits)
    return p.text


# ---------------------------------------------------------------------- the walk

_TYPES = frozenset({"array", "boolean", "integer", "null", "number", "object", "string"})
# Keywords that constrain an instance: beside ``$ref``, ``anyOf``/``oneOf``, ``allOf``, ``enum``
# or ``const`` the grammar ignores them (it follows that one keyword only).
_ASSERTIONS = frozenset({
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "contains", "items", "prefixItems",
    "maxProperties", "minProperties", "required", "properties", "patternProperties",
    "additionalProperties", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
    "dependentRequired", "dependentSchemas", "dependencies", "not", "if", "then", "else",
    "$ref", "anyOf", "oneOf", "allOf", "$dynamicRef", "$recursiveRef",
})
_SOLE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")
# Keywords of one type of instance; in a schema without ``type`` the grammar enforces them only
# where it infers the type (``properties``/``additionalProperties``: an object;
# ``items``/``prefixItems``: an array).
_BY_TYPE: dict[str, tuple[str, ...]] = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("properties", "additionalProperties", "patternProperties", "propertyNames",
               "required", "minProperties", "maxProperties", "unevaluatedProperties"),
}
_KEYWORD_TYPE = {k: t for t, keys in _BY_TYPE.items() for k in keys}
_LENGTHS = ("minLength", "maxLength")
_COUNTS = ("minItems", "maxItems", "minProperties", "maxProperties")
# A repetition count in a regex (not an escaped brace).
_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_ANCHOR = re.compile(r"^[A-Za-z_][-A-Za-z0-9._]*$")

# Where subschemas are: by name, in a list, or one (``items`` may be a list in older drafts).
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUB_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUB_ONE = ("items", "additionalProperties", "propertyNames", "unevaluatedProperties",
            "contains", "unevaluatedItems", "not", "if", "then", "else", "contentSchema")
# Not keywords of draft 2020-12: walked where they hold schemas, otherwise left alone.
_SUB_LOOSE = ("additionalItems",)
# Keywords whose values the walk goes through as subschemas; any other value is JSON data.
_SUB_KEYWORDS = frozenset(_SUB_MAPS + _SUB_LISTS + _SUB_ONE + _SUB_LOOSE + ("dependencies",))


def _is_count(v: Any) -> bool:
    """A non-negative integer as JSON Schema reads it (2.0 is one)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    return v >= 0 and (isinstance(v, int) or (math.isfinite(v) and v.is_integer()))


def _is_number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _is_whole(v: Any) -> bool:
    return _is_number(v) and (isinstance(v, int) or (math.isfinite(v) and v.is_integer()))


def _is_regex(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    try:
        re.compile(v)
    except (re.error, RecursionError, OverflowError):
        return False
    return True


def _unique_strings(v: Any) -> bool:
    return (isinstance(v, list) and all(isinstance(s, str) for s in v)
            and len(set(v)) == len(v))


def _is_type(v: Any) -> bool:
    if isinstance(v, str):
        return v in _TYPES
    return (isinstance(v, list) and bool(v) and all(isinstance(t, str) and t in _TYPES for t in v)
            and len(set(v)) == len(v))


def _is_schema(v: Any) -> bool:
    return isinstance(v, dict | bool)


def _schema_map(v: Any) -> bool:
    return isinstance(v, dict)


def _schema_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v)


# Draft 2020-12's meta-schema for the keywords it types: (test, what the value must be).
_SHAPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (_is_type, "one of the types or a non-empty list of distinct types"),
    "enum": (lambda v: isinstance(v, list), "an array"),
    "multipleOf": (lambda v: _is_number(v) and v > 0, "a number above 0"),
    "maximum": (_is_number, "a number"),
    "exclusiveMaximum": (_is_number, "a number"),
    "minimum": (_is_number, "a number"),
    "exclusiveMinimum": (_is_number, "a number"),
    "maxLength": (_is_count, "a non-negative integer"),
    "minLength": (_is_count, "a non-negative integer"),
    "pattern": (_is_regex, "a regular expression"),
    "maxItems": (_is_count, "a non-negative integer"),
    "minItems": (_is_count, "a non-negative integer"),
    "maxContains": (_is_count, "a non-negative integer"),
    "minContains": (_is_count, "a non-negative integer"),
    "maxProperties": (_is_count, "a non-negative integer"),
    "minProperties": (_is_count, "a non-negative integer"),
    "uniqueItems": (lambda v: isinstance(v, bool), "a boolean"),
    "required": (_unique_strings, "an array of distinct strings"),
    "dependentRequired": (lambda v: isinstance(v, dict) and all(
        _unique_strings(x) for x in v.values()), "an object of arrays of distinct strings"),
    "format": (lambda v: isinstance(v, str), "a string"),
    "$ref": (lambda v: isinstance(v, str), "a string"),
    "$schema": (lambda v: isinstance(v, str), "a string"),
    "$id": (lambda v: isinstance(v, str), "a string"),
    "$anchor": (lambda v: isinstance(v, str) and bool(_ANCHOR.match(v)), "a plain name"),
    "$dynamicAnchor": (lambda v: isinstance(v, str) and bool(_ANCHOR.match(v)), "a plain name"),
    "$comment": (lambda v: isinstance(v, str), "a string"),
    "$vocabulary": (lambda v: isinstance(v, dict), "an object"),
    "title": (lambda v: isinstance(v, str), "a string"),
    "description": (lambda v: isinstance(v, str), "a string"),
    "contentMediaType": (lambda v: isinstance(v, str), "a string"),
    "contentEncoding": (lambda v: isinstance(v, str), "a string"),
    "deprecated": (lambda v: isinstance(v, bool), "a boolean"),
    "readOnly": (lambda v: isinstance(v, bool), "a boolean"),
    "writeOnly": (lambda v: isinstance(v, bool), "a boolean"),
    "examples": (lambda v: isinstance(v, list), "an array"),
    **{k: (_schema_map, "an object of schemas") for k in _SUB_MAPS},
    **{k: (_schema_list, "a non-empty array of schemas") for k in _SUB_LISTS},
    **{k: (_is_schema, "a schema (an object or a boolean)") for k in _SUB_ONE},
}


def _pointer_depth(ref: str) -> int:
    """How many subschemas deep a ``#/...`` pointer goes (``#/$defs/a/items``: 2)."""
    parts = ref[2:].split("/") if ref != "#" else []
    depth, i = 0, 0
    while i < len(parts):
        depth += 1
        i += 2 if parts[i] in _SUB_MAPS or parts[i] in _SUB_LISTS or (
            parts[i] == "items" and i + 1 < len(parts) and parts[i + 1].isdigit()) else 1
    return depth


def _nests_deeper(value: Any, limit: int) -> bool:
    """Whether the JSON ``value`` nests arrays and objects more than ``limit`` levels."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        items = v.values() if isinstance(v, dict) else v
        stack.extend((x, depth + 1) for x in items if isinstance(x, dict | list))
    return False


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _of_type(v: Any, t: str) -> bool:
    """``v`` is a JSON value of type ``t``."""
    if t == "string":
        return isinstance(v, str)
    if t == "integer":
        return _is_whole(v)
    if t == "number":
        return _is_number(v)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "null":
        return v is None
    if t == "array":
        return isinstance(v, list)
    return isinstance(v, dict)


class _Inspector:
    """One iterative walk over a schema and every subschema in it: the limits, the
    well-formedness of the keywords draft 2020-12 types (``strict``; a schema of another draft
    is left to ``jsonschema``), the keywords the grammar does not enforce and the ones it does
    not enforce together. Raises ``StructuredError`` at the first finding."""

    def __init__(self, root: dict[str, Any], param: str, limits: SchemaLimits,
                 strict: bool) -> None:
        self.root = root
        self.param = param
        self.limits = limits
        self.strict = strict
        self.subschemas = 1
        self.properties = 0
        # (schema, where, depth, checked: False under ``contentSchema``, an annotation)
        self.stack: list[tuple[Any, str, int, bool]] = [(root, "", 0, True)]
        self.seen: set[int] = set()
        self.names: set[int] = set()  # ``propertyNames`` schemas: of strings, type or not

    def run(self, pause_every: int = 0) -> None:
        """The walk; ``pause_every`` (off the event loop): let go of the GIL after that many
        subschemas, so that the loop's thread waits for it a short while only."""
        walked = 0
        while self.stack:
            if pause_every:
                walked += 1
                if walked % pause_every == 0:
                    time.sleep(0)
            node, where, depth, checked = self.stack.pop()
            if isinstance(node, bool):
                continue
            if not isinstance(node, dict):
                self._malformed(where, f"{_short(node)} is not of type 'object', 'boolean'")
                continue
            if id(node) in self.seen:
                continue
            self.seen.add(id(node))
            if depth > self.limits.max_depth:
                raise _refuse(self.param, _too_deep(self.limits, where or "/"))
            self._node(node, where, checked)
            children = list(self._children(node, where, checked))
            self.subschemas += len(children)
            if self.subschemas > self.limits.max_subschemas:
                raise _refuse(self.param, f"the schema has more than "
                                          f"{self.limits.max_subschemas} subschemas "
                                          "(structured_limits.max_subschemas)")
            self.stack.extend((c, w, depth + 1, ch) for c, w, ch in reversed(children))

    # ------------------------------------------------------------------ findings

    def _malformed(self, where: str, what: str) -> None:
        if self.strict:  # otherwise jsonschema judges the schema of its draft
            raise _refuse(self.param, f"not a valid JSON schema at {where or '/'}: {what}")

    def _unsupported(self, keyword: str, where: str) -> StructuredError:
        return _refuse(self.param, f"the keyword {keyword!r} (at {where or '/'}) is not "
                                   "supported: the output's grammar cannot enforce it")

    def _together(self, keyword: str, other: str, where: str, why: str = "") -> StructuredError:
        return _refuse(self.param, f"the keyword {keyword!r} together with {other} (at "
                                   f"{where or '/'}) is not supported: the output's grammar "
                                   f"cannot enforce both{f' ({why})' if why else ''}")

    # ------------------------------------------------------------------ one schema

    def _children(self, node: dict[str, Any], where: str,
                  checked: bool) -> Iterator[tuple[Any, str, bool]]:
        for key in _SUB_MAPS:
            subs = node.get(key)
            if isinstance(subs, dict):
                for name, sub in subs.items():
                    yield sub, f"{where}/{key}/{name}", checked
        for key in _SUB_LISTS:
            subs = node.get(key)
            if isinstance(subs, list):
                for i, sub in enumerate(subs):
                    yield sub, f"{where}/{key}/{i}", checked
        for key in _SUB_ONE:
            if key in node:
                sub = node[key]
                if key == "items" and isinstance(sub, list):
                    for i, s in enumerate(sub):  # an older draft's tuple form
                        yield s, f"{where}/items/{i}", checked
                else:
                    if key == "propertyNames" and isinstance(sub, dict):
                        self.names.add(id(sub))
                    yield sub, f"{where}/{key}", checked and key != "contentSchema"
        for key in _SUB_LOOSE:
            sub = node.get(key)
            if isinstance(sub, dict | bool):
                yield sub, f"{where}/{key}", checked
        if isinstance(node.get("dependencies"), dict):  # a property's schema, or names
            for name, sub in node["dependencies"].items():
                if isinstance(sub, dict | bool):
                    yield sub, f"{where}/dependencies/{name}", checked

    def _node(self, node: dict[str, Any], where: str, checked: bool) -> None:
        limits = self.limits
        for key, value in node.items():
            if checked and key in UNSUPPORTED_KEYWORDS:
                raise self._unsupported(key, where)
            if checked and key == "items" and isinstance(value, list):
                raise _refuse(self.param, f"the array form of 'items' (at {where or '/'}) is not "
                                          "supported: the output's grammar cannot compile it; "
                                          "write prefixItems (draft 2020-12)")
            shape = _SHAPES.get(key)
            if shape is not None and not shape[0](value):
                self._malformed(f"{where}/{key}", f"{_short(value)} is not {shape[1]}")
            if (isinstance(value, dict | list) and key not in _SUB_KEYWORDS
                    and _nests_deeper(value, 2 * limits.max_depth)):
                raise _refuse(self.param, f"the value of {key!r} (at {where or '/'}) nests more "
                                          f"than {2 * limits.max_depth} levels "
                                          "(structured_limits.max_depth)")
        if isinstance(node.get("patternProperties"), dict):
            for name in node["patternProperties"]:
                if not _is_regex(name):
                    self._malformed(f"{where}/patternProperties",
                                    f"{_short(name)} is not a regular expression")
        for key in ("properties", "patternProperties"):
            if isinstance(node.get(key), dict):
                self.properties += len(node[key])
                if self.properties > limits.max_properties:
                    raise _refuse(self.param, f"the schema declares more than "
                                              f"{limits.max_properties} properties "
                                              "(structured_limits.max_properties)")
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > limits.max_enum:
            raise _refuse(self.param, f"the enum at {where or '/'} has {len(enum)} values, more "
                                      f"than {limits.max_enum} (structured_limits.max_enum)")
        self._bounds(node, where)
        if checked and isinstance(node.get("$ref"), str):
            self._reference(node["$ref"], where)
        if checked:
            self._enforceable(node, where)

    def _bounds(self, node: dict[str, Any], where: str) -> None:
        limits = self.limits
        for keys, bound, field in ((_LENGTHS, limits.max_length_bound, "max_length_bound"),
                                   (_COUNTS, limits.max_count_bound, "max_count_bound")):
            for key in keys:
                v = node.get(key)
                if _is_number(v) and v > bound:
                    raise _refuse(self.param, f"{key} {v} (at {where or '/'}) is above the "
                                              f"server's limit {bound} "
                                              f"(structured_limits.{field})")
        patterns = [(node.get("pattern"), f"{where}/pattern")]
        if isinstance(node.get("patternProperties"), dict):
            patterns += [(k, f"{where}/patternProperties") for k in node["patternProperties"]]
        for pattern, at in patterns:
            if not isinstance(pattern, str) or "{" not in pattern:
                continue
            for m in _REPEAT.finditer(pattern):
                count = max(int(m[1]), int(m[2]) if m[2] else 0)
                if count > limits.max_length_bound:
                    raise _refuse(self.param, f"the pattern at {at} repeats {count} times "
                                              f"({m[0]}), more than the server's limit "
                                              f"{limits.max_length_bound} "
                                              "(structured_limits.max_length_bound)")

    def _reference(self, ref: str, where: str) -> None:
        """A ``$ref`` the grammar can follow: a JSON pointer into this schema (``#`` or
        ``#/...``) that resolves. Its target is walked too (it may be outside the places
        subschemas are)."""
        at = f"{where or '/'}"
        if ref != "#" and not ref.startswith("#/"):
            raise _refuse(self.param, f"the $ref {ref!r} (at {at}) is not supported: the "
                                      "output's grammar follows only references into the "
                                      "schema itself ('#/$defs/...')")
        target: Any = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            name = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and name in target:
                target = target[name]
            elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
                target = target[int(name)]
            else:
                raise _refuse(self.param, f"the $ref {ref!r} (at {at}) does not resolve: the "
                                          "schema has nothing there")
        if isinstance(target, dict) and id(target) not in self.seen:
            self.subschemas += 1
            self.stack.append((target, ref[1:], _pointer_depth(ref), True))

    def _enforceable(self, node: dict[str, Any], where: str) -> None:
        """The keywords, and keywords together, that the grammar library (xgrammar) would leave
        unenforced in ``node``: each was checked by compiling it and feeding the grammar an
        output that breaks it (tests/cluster/test_schema_limits.py)."""
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            raise self._unsupported("allOf (with more than one schema)", where)
        sole = next((k for k in _SOLE if k in node), None)
        if sole is not None:
            for key in node:
                if key == sole or key not in _ASSERTIONS:
                    continue
                if key == "type" and sole in ("enum", "const"):
                    self._values_of_type(node, sole, where)
                    continue
                raise self._together(key, repr(sole), where,
                                     f"it follows {sole!r} and leaves the rest out")
            if sole == "enum" and node["enum"] == []:
                raise _refuse(self.param, f"the enum at {where or '/'} is empty: no output can "
                                          "match it")
            return
        declared = node.get("type")
        types: set[str] = ({declared} if isinstance(declared, str) else
                           set(declared) if isinstance(declared, list) else set())
        if declared is None and id(node) in self.names:
            types.add("string")
        elif declared is None:
            if "properties" in node or "additionalProperties" in node:
                types.add("object")
            if "items" in node or "prefixItems" in node:
                types.add("array")
        if not types:
            for key in node:
                if key in _KEYWORD_TYPE:
                    raise _refuse(self.param, f"the keyword {key!r} (at {where or '/'}) needs a "
                                              f"'type' beside it: the output's grammar enforces "
                                              f"it only in a schema that says its type")
            return
        if "string" in types:
            self._string(node, where)
        if "number" in types or "integer" in types:
            self._number(node, where, types)
        if "object" in types:
            self._object(node, where)

    def _values_of_type(self, node: dict[str, Any], sole: str, where: str) -> None:
        declared = node["type"]
        types = [declared] if isinstance(declared, str) else declared
        if not isinstance(types, list):
            return
        values = node[sole] if sole == "enum" else [node[sole]]
        if not isinstance(values, list):
            return
        for v in values:
            if not any(_of_type(v, t) for t in types if isinstance(t, str)):
                raise self._together("type", repr(sole), where,
                                     f"the value {_short(v)} is not of type {declared!r}, and "
                                     f"the grammar follows {sole!r} alone")

    def _string(self, node: dict[str, Any], where: str) -> None:
        bounded = next((k for k in _LENGTHS if k in node), None)
        if bounded is not None:
            for other in ("pattern", "format"):
                if other in node:
                    raise self._together(bounded, repr(other), where)
            declared = node.get("type")
            typed = declared == "string" or (isinstance(declared, list) and "string" in declared)
            if not typed and not where.endswith("propertyNames"):  # names are strings
                raise _refuse(self.param, f"the keyword {bounded!r} (at {where or '/'}) is not "
                                          "supported outside a schema whose type is (or "
                                          "includes) 'string': without it the output's grammar "
                                          "does not bound the string; write {\"type\": "
                                          f"\"string\", {json.dumps(bounded)}: ...}}")
        if "pattern" in node and "format" in node:
            raise self._together("format", "'pattern'", where)
        fmt = node.get("format")
        if isinstance(fmt, str) and fmt in UNENFORCED_FORMATS:
            raise _refuse(self.param, f"the format {fmt!r} (at {where or '/'}) is not "
                                      "supported: the output's grammar cannot enforce it")

    def _number(self, node: dict[str, Any], where: str, types: set[str]) -> None:
        if "multipleOf" not in node:
            return
        bound = next((k for k in _BY_TYPE["number"] if k != "multipleOf" and k in node), None)
        if bound is not None:
            raise self._together("multipleOf", repr(bound), where)
        if "number" in types:
            raise _refuse(self.param, f"the keyword 'multipleOf' on a number (at "
                                      f"{where or '/'}) is not supported: the output's grammar "
                                      "enforces it on integers only (type 'integer')")
        if not _is_whole(node["multipleOf"]):
            raise _refuse(self.param, f"multipleOf {node['multipleOf']} (at {where or '/'}) is "
                                      "not supported: the output's grammar enforces a whole "
                                      "multipleOf only")

    def _object(self, node: dict[str, Any], where: str) -> None:
        props = node.get("properties")
        declared = props if isinstance(props, dict) else {}
        required = node.get("required")
        if isinstance(required, list):
            missing = [r for r in required if isinstance(r, str) and r not in declared]
            if missing:
                raise _refuse(self.param, f"the keyword 'required' (at {where or '/'}) naming "
                                          f"{missing[0]!r}, which 'properties' does not declare, "
                                          "is not supported: the output's grammar enforces only "
                                          "the required properties it declares")
        if "properties" in node and "patternProperties" in node:
            raise self._together("patternProperties", "'properties'", where)
        extra = node.get("additionalProperties", False) is not False
        if "properties" in node and "propertyNames" in node and extra:
            raise self._together("propertyNames", "'properties' and 'additionalProperties'",
                                 where)
        if node.get("unevaluatedProperties") is False and node.get(
                "additionalProperties") is not False:
            raise _refuse(self.param, f"unevaluatedProperties false (at {where or '/'}) is not "
                                      "supported: the output's grammar cannot enforce it; "
                                      "write additionalProperties: false")


# ---------------------------------------------------------------------- a request's fields


@dataclass(frozen=True, slots=True)
class _Job:
    """One schema of a request to check; ``tool``: a function's parameters (an object)."""

    schema: Any
    param: str
    tool: bool = False


Checked = dict[str, str]  # a request's schemas by param: their JSON text for the replica


def _object_parameters(job: _Job, schema: Any) -> None:
    if job.tool and isinstance(schema, dict) and schema.get("type", "object") != "object":
        raise _refuse(job.param, f"a function's parameters are an object schema (type "
                                 f"'object'), got type {schema.get('type')!r}")


def _output_jobs(body: CompletionRequest | ChatCompletionRequest) -> list[_Job]:
    """The JSON schemas in a request's structured-output fields, in the order they are read."""
    jobs = []
    rf = body.response_format
    if rf is not None and rf.type == "json_schema":
        assert rf.json_schema is not None  # ResponseFormat checks it
        jobs.append(_Job(rf.json_schema.schema_, "response_format.json_schema.schema"))
    so = body.structured_outputs
    if so is not None and so.json_ is not None:
        jobs.append(_Job(so.json_, "structured_outputs.json"))
    if body.guided_json is not None:
        jobs.append(_Job(body.guided_json, "guided_json"))
    return jobs


def _tool_jobs(body: ChatCompletionRequest, limits: SchemaLimits) -> list[_Job] | None:
    """The tools' parameter schemas to check (None: no tools, the mode is ``none``);
    ``StructuredError`` for what is wrong before them."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise StructuredError("tool_choice needs tools: declare the functions it may call",
                                  "tool_choice")
        return None
    if len(body.tools) > limits.max_tools:
        raise StructuredError(f"tools declares {len(body.tools)} functions, more than "
                              f"{limits.max_tools} (structured_limits.max_tools)", "tools")
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise StructuredError(f"tools declares the function {dup!r} twice", "tools")
    return [_Job(t.function.parameters, f"tools.{i}.function.parameters", tool=True)
            for i, t in enumerate(body.tools) if t.function.parameters is not None]


def _tool_mode_of(body: ChatCompletionRequest) -> str:
    """The mode once the tools are checked."""
    assert body.tools
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in body.tools]
        if choice.function.name not in names:
            raise StructuredError(
                f"tool_choice names the function {choice.function.name!r}, which tools does not "
                f"declare (declared: {', '.join(names)})", "tool_choice")
        return "named"
    return choice or "auto"


def _total(prepared: Sequence[_Prepared], limits: SchemaLimits) -> None:
    total = 0
    for p in prepared:
        total += p.size
        if total > limits.max_total_bytes:
            raise _refuse(p.param, f"the request's schemas are more than "
                                   f"{limits.max_total_bytes} bytes of JSON together "
                                   "(structured_limits.max_total_bytes)")


def _check_jobs(jobs: Sequence[_Job], limits: SchemaLimits) -> Checked:
    """Every job checked here, in order; ``StructuredError`` at the first that fails."""
    prepared = []
    for job in jobs:
        prepared.append(_prepare(job.schema, job.param, limits))
    _total(prepared, limits)
    for job, p in zip(jobs, prepared, strict=True):
        _validate(p, limits)
        _object_parameters(job, p.schema)
    return {p.param: p.text for p in prepared}


def _from_vllm(so: StructuredOutputs, checked: Checked) -> Structured:
    ws = not so.disable_any_whitespace
    if so.json_ is not None:
        spec = checked["structured_outputs.json"]
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


def _build(body: CompletionRequest | ChatCompletionRequest, checked: Checked,
           tools: str | None, tool_format: str = HERMES) -> Structured | None:
    """The request's structured output, its schemas checked (``checked``) and, for a chat
    request, its ``tool_mode`` known (calls in ``tool_format``)."""
    given: list[tuple[str, Structured | None]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", Structured(
                StructuredOutput("json_object", "", "response_format"), "json_object")))
        else:
            param = "response_format.json_schema.schema"
            given.append(("response_format", Structured(
                StructuredOutput("json", checked[param], param), "json_schema")))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _from_vllm(body.structured_outputs, checked)))
    if body.guided_json is not None:
        given.append(("guided_json", Structured(
            StructuredOutput("json", checked["guided_json"], "guided_json"), "json_schema")))
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
        assert tools is not None
        call = tool_output(body, tools, tool_format)
        if call is not None:
            given.append(("tool_choice", call))
    if len(given) > 1:
        names = [name for name, _ in given]
        raise StructuredError(
            f"{' and '.join(names)} both constrain the output: send one of them", names[1])
    return given[0][1] if given else None


def structured_output(body: CompletionRequest | ChatCompletionRequest,
                      tools: str | None = None,
                      limits: SchemaLimits | None = None,
                      tool_format: str = HERMES) -> Structured | None:
    """The request's structured output (None: its output is free text); ``StructuredError``
    for a field the server cannot take or two fields that both constrain the output.
    ``tools``: a chat request's ``tool_mode``, when the caller has it already; ``tool_format``:
    the call format a constrained call is written in (``tool_calls.call_output``). Checks on the
    caller's thread: the ingress uses ``SchemaChecker.structured_output``."""
    limits = limits or _DEFAULT_LIMITS
    if isinstance(body, ChatCompletionRequest) and tools is None:
        tools = tool_mode(body, limits)
    return _build(body, _check_jobs(_output_jobs(body), limits), tools, tool_format)


def tool_mode(body: ChatCompletionRequest, limits: SchemaLimits | None = None) -> str:
    """``none`` (tools left out of the prompt, or none declared), ``auto`` (the model may call
    one), ``required`` or ``named``; ``StructuredError`` for a ``tool_choice`` without tools or
    naming a function that was not declared, and for a tool whose parameters are not a JSON
    schema the server can take. Checks on the caller's thread: the ingress uses
    ``SchemaChecker.tool_mode``."""
    limits = limits or _DEFAULT_LIMITS
    jobs = _tool_jobs(body, limits)
    if jobs is None:
        return "none"
    _check_jobs(jobs, limits)
    return _tool_mode_of(body)


def tool_output(body: ChatCompletionRequest, mode: str,
                tool_format: str = HERMES) -> Structured | None:
    """The constraint of ``tool_choice`` ``required`` or named (``mode``, ``tool_mode``'s): a
    call of the declared tools in ``tool_format``'s surface form (``tool_calls.call_output``:
    between the tool-call tags for ``hermes``) (None for ``auto`` and ``none``)."""
    if mode not in ("required", "named"):
        return None
    assert body.tools is not None
    try:
        out = call_output(body.tools, body.tool_choice, body.parallel_tool_calls, tool_format)
    except ToolMessageError as e:
        raise StructuredError(str(e), e.param) from None
    spec = json.dumps(out.schema, ensure_ascii=False)
    return Structured(StructuredOutput("json", spec, "tool_choice", prefix=out.prefix,
                                       suffix=out.suffix), "tool_call")


_DEFAULT_LIMITS = SchemaLimits()


# ---------------------------------------------------------------------- off the event loop


class SchemaChecker:
    """The ingress's schema checks, off its event loop.

    A request's schemas are parsed and measured on the loop (``max_bytes``,
    ``max_total_bytes``: C-speed, before any walk). Schemas seen lately take their remembered
    verdict (``cache_entries``). The rest are walked on the loop when they are small
    (``inline_bytes`` together, draft 2020-12) and otherwise on one of ``check_workers``
    threads: at most ``max_checks`` requests run or wait there (one more raises
    ``SchemaCheckBusy``), and a request waits at most ``check_timeout_s`` for its verdict (then
    ``SchemaCheckBusy`` if its check had not started, ``StructuredError`` if it had: the
    schema is too complex). A check that outlives its request keeps its thread until it ends:
    the walk is bounded by the limits, so it ends soon.

    Only the event loop's thread calls the ``async`` methods."""

    def __init__(self, limits: SchemaLimits | None = None) -> None:
        self.limits = limits or _DEFAULT_LIMITS
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._pending = 0  # requests whose check runs or waits on the pool
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()  # text -> error or None
        self.offloaded = 0  # requests checked on the pool (for tests and metrics)

    @property
    def pending(self) -> int:
        """Requests whose check runs or waits on the checking threads."""
        return self._pending

    async def tool_mode(self, body: ChatCompletionRequest) -> str:
        """``tool_mode``, its schemas checked off the loop when they are large."""
        jobs = _tool_jobs(body, self.limits)
        if jobs is None:
            return "none"
        await self._check(jobs)
        return _tool_mode_of(body)

    async def structured_output(self, body: CompletionRequest | ChatCompletionRequest,
                                tools: str | None = None,
                                tool_format: str = HERMES) -> Structured | None:
        """``structured_output``, its schemas checked off the loop when they are large."""
        if isinstance(body, ChatCompletionRequest) and tools is None:
            tools = await self.tool_mode(body)
        return _build(body, await self._check(_output_jobs(body)), tools, tool_format)

    def close(self) -> None:
        """Stop the checking threads (a check under way finishes)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ------------------------------------------------------------------ internals

    async def _check(self, jobs: Sequence[_Job]) -> Checked:
        if not jobs:
            return {}
        limits = self.limits
        prepared = [_prepare(job.schema, job.param, limits) for job in jobs]
        _total(prepared, limits)
        verdicts: dict[int, str | None] = {}  # by index: an error (without the param) or None
        todo: list[tuple[int, _Prepared]] = []
        for i, p in enumerate(prepared):
            verdict = self._recall(p.text)
            if verdict is _UNKNOWN:
                todo.append((i, p))
                continue
            verdicts[i] = verdict
            if verdict is not None:
                break  # the schemas after it are not needed: its error is the answer
        if todo:
            schemas = [p for _, p in todo]
            if (sum(p.size for p in schemas) <= limits.inline_bytes
                    and not any(p.legacy for p in schemas)):
                errors = _validate_all(schemas, limits)
            else:
                errors = await self._offload(schemas)
            for (i, p), error in zip(todo, errors, strict=False):
                verdicts[i] = error
                self._remember(p.text, error)
        # In the order of the fields, as ``_check_jobs``: the first error is the answer.
        for i, (job, p) in enumerate(zip(jobs, prepared, strict=True)):
            error = verdicts[i]
            if error is not None:
                raise _refuse(p.param, error)
            _object_parameters(job, p.schema)
        return {p.param: p.text for p in prepared}

    async def _offload(self, todo: list[_Prepared]) -> list[str | None]:
        limits = self.limits
        with self._lock:
            if self._pending >= limits.max_checks:
                raise SchemaCheckBusy(f"the server is checking {self._pending} requests' "
                                      "schemas: try again shortly "
                                      "(structured_limits.max_checks)")
            self._pending += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(limits.check_workers,
                                            thread_name_prefix="tierserve-schema")
        self.offloaded += 1
        started = threading.Event()

        def work() -> list[str | None]:
            started.set()
            return _validate_all(todo, limits, _PAUSE_EVERY)

        try:
            future = self._pool.submit(work)
        except BaseException:
            self._release()
            raise
        future.add_done_callback(lambda _: self._release())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limits.check_timeout_s)
        except asyncio.TimeoutError:
            if not started.is_set():
                raise SchemaCheckBusy(f"the server's schema checks are behind: this request's "
                                      f"did not start within {limits.check_timeout_s:g} s "
                                      "(structured_limits.check_timeout_s)") from None
            raise _refuse(todo[0].param, f"the schema is too complex to check within "
                                         f"{limits.check_timeout_s:g} s "
                                         "(structured_limits.check_timeout_s)") from None

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1

    def _recall(self, text: str) -> Any:
        if self.limits.cache_entries == 0:
            return _UNKNOWN
        with self._lock:
            verdict = self._verdicts.get(text, _UNKNOWN)
            if verdict is not _UNKNOWN:
                self._verdicts.move_to_end(text)
        return verdict

    def _remember(self, text: str, error: str | None) -> None:
        if self.limits.cache_entries == 0:
            return
        with self._lock:
            self._verdicts[text] = error
            self._verdicts.move_to_end(text)
            while len(self._verdicts) > self.limits.cache_entries:
                self._verdicts.popitem(last=False)


_UNKNOWN = object()
# Subschemas a checking thread walks between two pauses (about 1 ms of walking).
_PAUSE_EVERY = 128


def _validate_all(todo: Sequence[_Prepared], limits: SchemaLimits,
                  pause_every: int = 0) -> list[str | None]:
    """Each schema's verdict in order (None, or its error without the param), up to the first
    that fails."""
    errors: list[str | None] = []
    for p in todo:
        try:
            _validate(p, limits, pause_every)
        except StructuredError as e:
            errors.append(str(e).removeprefix(f"{p.param}: "))
            break
        errors.append(None)
    return errors
