"""The OpenAPI document the ingress serves at ``/openapi.json``: every field and every answer.

The two generation routes read their bodies themselves (a size limit before parsing, strict
validation, OpenAI-shaped errors), so FastAPI cannot see their request models. This module
builds the document from the same pydantic models: the request bodies, the JSON and the
event-stream answers, and every error status a route can return, with the ``Retry-After`` header
of 429. Limits that depend on the config (the served model's name, ``max_tokens_limit``, the
vocabulary, ``max_stop_strings``, the body size) are written into the schema, so a client (or a
fuzzer) generating from it knows what the server accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tierserve.cluster.protocol import (
    REQUEST_ID_PATTERN,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    LoRAAdapterAnswer,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from tierserve.cluster.responses import ResponseObject, ResponsesRequest
from tierserve.cluster.tiers import PRIORITY_PATTERN
from tierserve.records import MAX_STOP_STRING_CHARS

REF = "#/components/schemas/{model}"

# status -> when a route answers it
_ERRORS: dict[int, str] = {
    400: "Bad input: not JSON, unknown field, wrong type, out-of-range value, "
    "empty or too long prompt, a request that can never fit a replica's KV pool, a bad "
    "X-TL-Priority or X-Request-Id header.",
    401: "A missing (when keys are configured and no anonymous tier) or unknown API key.",
    404: "The model is not served, or not to this key (code model_not_found: the same answer "
    "either way).",
    408: "The body did not all arrive within body_timeout_s of the headers.",
    413: "The body is larger than max_request_bytes.",
    429: "The waiting queue is full for this tier, or lower tiers are shed under load. Retry "
    "after the Retry-After header's seconds.",
    500: "A fault of the server's own (never the client's input): the body names only the "
    "exception's type; inside a stream, its last event before [DONE].",
    503: "No replica could serve the request (replica failure or none running; "
    "adapter_unavailable: no replica tried could load the LoRA adapter its model names).",
}


def priority_header() -> dict[str, Any]:
    """The ``X-TL-Priority`` header parameter every generation route takes."""
    return {
        "name": "X-TL-Priority", "in": "header", "required": False,
        "description": "a priority within the caller's tier (an integer between the tier's "
                       "base_priority and max_priority)",
        "schema": {"type": "string", "pattern": PRIORITY_PATTERN},
    }

def _error(status: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": _ERRORS[status],
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}},
    }
    if status == 429:
        out["headers"] = {
            "Retry-After": {
                "description": "seconds to wait before retrying",
                "schema": {"type": "string", "pattern": "^[0-9]+$"},
            }
        }
    return out


def _components() -> dict[str, Any]:
    models: list[tuple[type[BaseModel], Any]] = [
        (CompletionRequest, "validation"),
        (ChatCompletionRequest, "validation"),
        (CompletionResponse, "serialization"),
        (ChatCompletionResponse, "serialization"),
        (ChatCompletionChunk, "serialization"),
        (ModelList, "serialization"),
        (ErrorResponse, "serialization"),
        (TokenizeCompletionRequest, "validation"),
        (TokenizeChatRequest, "validation"),
        (TokenizeResponse, "serialization"),
        (DetokenizeRequest, "validation"),
        (DetokenizeResponse, "serialization"),
        (ModelCard, "serialization"),
        (VersionResponse, "serialization"),
        (ResponsesRequest, "validation"),
        (ResponseObject, "serialization"),
        (LoadLoRAAdapterRequest, "validation"),
        (UnloadLoRAAdapterRequest, "validation"),
        (LoRAAdapterAnswer, "serialization"),
    ]
    _, schema = models_json_schema(models, ref_template=REF)
    defs: dict[str, Any] = _json_schema_keywords(schema.get("$defs", {}))
    # The server refuses an empty prompt (400 "empty").
    _set_in_any_of(defs["CompletionRequest"]["properties"]["prompt"], "string", {"minLength": 1})
    _set_in_any_of(defs["CompletionRequest"]["properties"]["prompt"], "array", {"minItems": 1})
    return defs


def _limit(schemas: dict[str, Any], limits: dict[str, Any]) -> None:
    """Write the config's limits into the request schemas."""
    model = limits.get("model")
    max_tokens = limits.get("max_tokens")
    vocab = limits.get("vocab_size")
    stops = limits.get("max_stop_strings")
    max_n = limits.get("max_n")
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        if max_n is not None:
            _set_in_any_of(props["n"], "integer", {"maximum": max_n})

        if model is not None:
            props["model"] = {"type": "string", "enum": _names(model), "title": "Model"}
        if max_tokens is not None:
            for key in ("max_tokens", "max_completion_tokens"):
                if key in props:
                    _set_in_any_of(props[key], "integer", {"maximum": max_tokens})
        if "stop" in props:  # the server refuses empty stop strings
            _set_in_any_of(props["stop"], "string", {"minLength": 1})
            _set_in_any_of(props["stop"], "array", {"items": {
                "type": "string", "minLength": 1, "maxLength": MAX_STOP_STRING_CHARS}})
            if stops is not None:
                _set_in_any_of(props["stop"], "array", {"maxItems": stops})
        for ids in ("stop_token_ids", "allowed_token_ids"):
            if vocab is not None and ids in props:
                _set_in_any_of(props[ids], "array", {"items": {
                    "type": "integer", "minimum": 0, "maximum": vocab - 1}})
    if vocab is not None:  # token ids, of one prompt or of each of a list of prompts
        token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
        for option in schemas["CompletionRequest"]["properties"]["prompt"].get("anyOf", []):
            items = option.get("items") or {}
            if items.get("type") == "integer":
                option["items"] = dict(token)
            elif items.get("type") == "array":
                items.update({"items": dict(token), "minItems": 1})
            elif items.get("type") == "string":
                items["minLength"] = 1


_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _json_schema_keywords(node: Any) -> Any:
    """Pydantic writes a constraint it cannot place as its own name (``ge``) next to the schema
    it applies to (a union, an annotated int); JSON Schema calls it ``minimum``. Rewritten in
    place, recursively."""
    if isinstance(node, dict):
        for short, keyword in _KEYWORDS.items():
            if short in node and keyword not in node and not isinstance(node[short], dict):
                node[keyword] = node.pop(short)
        for value in node.values():
            _json_schema_keywords(value)
    elif isinstance(node, list):
        for value in node:
            _json_schema_keywords(value)
    return node


def _names(model: str | list[str]) -> list[str]:
    """The served model names a ``model`` limit stands for (one name, or a list of them)."""
    return [model] if isinstance(model, str) else list(model)


def _set_in_any_of(prop: dict[str, Any], type_: str, values: dict[str, Any]) -> None:
    options = prop.get("anyOf", [prop])
    for option in options:
        if option.get("type") == type_:
            option.update(values)


def openapi_schema(app: FastAPI, limits: dict[str, Any] | None = None) -> dict[str, Any]:
    """The complete document for ``app`` (the ingress's FastAPI app) under ``limits``.

    limits: ``model`` (the served name, or a list of them: every served model; None: no enum,
    where keys are limited to some models), ``max_tokens``, ``vocab_size``, ``max_stop_strings``,
    ``max_request_bytes``, ``max_n``, ``tokenizer_size`` (the ids ``/detokenize`` takes); any
    may be missing.
    """
    limits = limits or {}
    # get_openapi builds a fresh document on every call: editing it in place is safe.
    doc = get_openapi(title=app.title, version=app.version, description=app.description,
                      routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(_components())
    _limit(schemas, limits)
    size = limits.get("max_request_bytes")
    routes = {
        "/v1/completions": ("CompletionRequest", "CompletionResponse", "CompletionResponse"),
        "/v1/chat/completions": ("ChatCompletionRequest", "ChatCompletionResponse",
                                 "ChatCompletionChunk"),
    }
    security = {"bearer": {"type": "http", "scheme": "bearer",
                           "description": "an API key of a configured tier"}}
    doc["components"]["securitySchemes"] = security
    for path, (req, resp, chunk) in routes.items():
        op = doc["paths"][path]["post"]
        body_note = f" At most {size} bytes." if size else ""
        op["requestBody"] = {
            "required": True,
            "description": "An OpenAI-style request." + body_note,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=req)}}},
        }
        op["parameters"] = [priority_header()]
        op["security"] = [{"bearer": []}, {}]
        op["responses"] = {
            "200": {
                "description": "The completion; with stream=true, server-sent events of chunks "
                               f"({chunk}) ending with 'data: [DONE]'.",
                "content": {
                    "application/json": {"schema": {"$ref": REF.format(model=resp)}},
                    # One server-sent event: its data is a chunk's JSON, an error's JSON
                    # ({"error": ...}) or "[DONE]".
                    "text/event-stream": {"schema": {
                        "type": "object",
                        "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                                       "id": {"type": "string"}, "retry": {"type": "integer"}},
                        "required": ["data"],
                    }},
                },
            },
            **{str(status): _error(status) for status in _ERRORS},
        }
    models = doc["paths"]["/v1/models"]["get"]
    models["security"] = [{"bearer": []}, {}]
    models["responses"] = {"200": {
        "description": "The served models the caller may use.",
        "content": {"application/json": {"schema": {"$ref": REF.format(model="ModelList")}}},
    }, "401": _error(401)}
    _small_routes(doc, limits)
    _responses_route(doc, limits)
    _lora_routes(doc, limits)
    _request_ids(doc)
    health = doc["paths"]["/health"]["get"]
    health["responses"] = {"200": {
        "description": "The ingress is up.",
        "content": {"application/json": {"schema": {
            "type": "object", "properties": {"status": {"type": "string", "enum": ["ok"]}},
            "required": ["status"]}}},
    }}
    readiness = {"type": "object", "properties": {
        "status": {"type": "string", "enum": ["ready", "not_ready"]},
        "reason": {"type": "string"}, "replicas_ready": {"type": "integer", "minimum": 0}},
        "required": ["status", "reason", "replicas_ready"]}
    doc["paths"]["/ready"]["get"]["responses"] = {
        "200": {"description": "Every replica of the config could take work (and one still can).",
                "content": {"application/json": {"schema": readiness}}},
        "503": {"description": "Not ready yet: the reason says what is missing.",
                "content": {"application/json": {"schema": readiness}}},
    }
    for path in doc["paths"].values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    doc["components"]["schemas"].pop("HTTPValidationError", None)
    doc["components"]["schemas"].pop("ValidationError", None)
    return doc


def _json(model: str, description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


def _small_routes(doc: dict[str, Any], limits: dict[str, Any]) -> None:
    """``/tokenize``, ``/detokenize`` (bodies read by the route itself, as the generation
    routes' are), ``/version`` and ``/v1/models/{model_id}``."""
    size = limits.get("max_request_bytes")
    body_note = f" At most {size} bytes." if size else ""
    errors = {str(status): _error(status) for status in (400, 401, 404, 408, 413, 500)}
    tokenize = doc["paths"]["/tokenize"]["post"]
    tokenize["requestBody"] = {
        "required": True,
        "description": "vLLM's shape: a prompt, or chat messages (rendered with the chat "
                       "template)." + body_note,
        "content": {"application/json": {"schema": {"anyOf": [
            {"$ref": REF.format(model="TokenizeCompletionRequest")},
            {"$ref": REF.format(model="TokenizeChatRequest")}]}}},
    }
    tokenize["security"] = [{"bearer": []}, {}]
    tokenize["responses"] = {"200": _json("TokenizeResponse", "The prompt's token ids."),
                             **errors}
    detokenize = doc["paths"]["/detokenize"]["post"]
    detokenize["requestBody"] = {
        "required": True, "description": "vLLM's shape: token ids." + body_note,
        "content": {"application/json": {"schema": {
            "$ref": REF.format(model="DetokenizeRequest")}}},
    }
    detokenize["security"] = [{"bearer": []}, {}]
    detokenize["responses"] = {"200": _json("DetokenizeResponse", "The ids' text."), **errors}
    vocab = limits.get("tokenizer_size")
    schemas = doc["components"]["schemas"]
    if vocab is not None:
        schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] = vocab - 1
    if limits.get("model") is not None:
        for name in ("TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"):
            # Optional (vLLM's): left out or null, it is the served model (the first one the
            # caller may use where there are several).
            schemas[name]["properties"]["model"] = {
                "anyOf": [{"type": "string", "enum": _names(limits["model"])}, {"type": "null"}],
                "default": None, "title": "Model"}
    doc["paths"]["/version"]["get"]["responses"] = {
        "200": _json("VersionResponse", "tierserve's version.")}
    one = doc["paths"]["/v1/models/{model_id}"]["get"]
    one["responses"] = {
        "200": _json("ModelCard", "The served model."),
        "404": {"description": "No model of that id is served, or not to this key (code "
                               "model_not_found).",
                "content": {"application/json": {"schema": {
                    "$ref": REF.format(model="ErrorResponse")}}}},
        "401": _error(401),
    }
    one["security"] = [{"bearer": []}, {}]


# The LoRA adapter routes' answers, by status (admin keys only).
_LORA_ERRORS: dict[int, str] = {
    400: "Bad input: not JSON, an unknown field; a lora_name that is a served model's or a static "
    "adapter's (lora_name_taken), a lora_path that is not absolute or outside lora_path_roots "
    "(lora_path_not_allowed), an adapter the replica refuses (invalid_lora_adapter: no such "
    "folder, not PEFT, rank above max_lora_rank, another base model's shapes), the name loaded "
    "from another path, for another model or other tenants (lora_adapter_exists), "
    "max_dynamic_loras reached (too_many_lora_adapters), a tenants entry that is not a tenant "
    "an API key identifies (invalid_request, param tenants), "
    "a model without enable_lora (lora_disabled); unload: a static adapter "
    "(static_lora_adapter).",
    401: _ERRORS[401],
    403: "The key is not one of admin_keys, or no key was sent (code permission_denied).",
    404: "Load: the model named is not served (model_not_found); unload: the adapter is not "
    "loaded (lora_not_found).",
    408: _ERRORS[408],
    413: _ERRORS[413],
    500: _ERRORS[500],
    503: "No replica of the model could be asked to load it (replica_unavailable), or the "
    "adapter registry could not be reached (adapter_registry_unavailable).",
}


def _lora_routes(doc: dict[str, Any], limits: dict[str, Any]) -> None:
    """``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's bodies; admin keys)."""
    size = limits.get("max_request_bytes")
    body_note = f" At most {size} bytes." if size else ""
    for path, req, says, statuses in (
            ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest",
             "The adapter is loaded (status loaded), or was from that path already "
             "(already_loaded).", (400, 401, 403, 404, 408, 413, 500, 503)),
            ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest",
             "The adapter is out of the registry (status unloaded); replicas still running "
             "requests on it keep it until they end (the message says how many).",
             (400, 401, 403, 404, 408, 413, 500))):
        op = doc["paths"][path]["post"]
        op["requestBody"] = {
            "required": True, "description": "vLLM's body." + body_note,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=req)}}}}
        op["security"] = [{"bearer": []}]
        errors: dict[str, Any] = {}
        for status in statuses:
            errors[str(status)] = (_error(status) if status in _ERRORS else {
                "content": {"application/json": {"schema": {
                    "$ref": REF.format(model="ErrorResponse")}}}}) | {
                "description": _LORA_ERRORS[status]}
        op["responses"] = {"200": _json("LoRAAdapterAnswer", says), **errors}


def _responses_route(doc: dict[str, Any], limits: dict[str, Any]) -> None:
    """``/v1/responses`` (OpenAI's Responses API, served through the chat route): its body,
    the ``Response`` object or its events, and the chat route's error answers."""
    size = limits.get("max_request_bytes")
    body_note = f" At most {size} bytes." if size else ""
    op = doc["paths"]["/v1/responses"]["post"]
    op["requestBody"] = {
        "required": True,
        "description": "OpenAI's Responses request (served as a chat completion; nothing is "
                       "stored)." + body_note,
        "content": {"application/json": {"schema": {
            "$ref": REF.format(model="ResponsesRequest")}}},
    }
    op["parameters"] = [priority_header()]
    op["security"] = [{"bearer": []}, {}]
    op["responses"] = {
        "200": {
            "description": "The Response object; with stream=true, server-sent events (each "
                           "an 'event:' line naming its type and a 'data:' line of its JSON, "
                           "numbered by sequence_number): response.created, "
                           "response.in_progress, per output item response.output_item.added "
                           "... response.output_item.done (with response.output_text.delta or "
                           "response.function_call_arguments.delta between), then "
                           "response.completed or response.incomplete; an error mid-stream is "
                           "an 'error' event and response.failed. No [DONE].",
            "content": {
                "application/json": {"schema": {"$ref": REF.format(model="ResponseObject")}},
                "text/event-stream": {"schema": {
                    "type": "object",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                    "required": ["data", "event"],
                }},
            },
        },
        **{str(status): _error(status) for status in _ERRORS},
    }
    for stored in doc["paths"]["/v1/responses/{response_id}"].values():
        stored["security"] = [{"bearer": []}, {}]
        stored["responses"] = {
            "400": {"description": "Stored responses are not supported (code "
                                   "stored_responses_unsupported): nothing is stored.",
                    "content": {"application/json": {"schema": {
                        "$ref": REF.format(model="ErrorResponse")}}}},
            "401": _error(401)}
    props = doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    if limits.get("model") is not None:
        props["model"] = {"type": "string", "enum": _names(limits["model"]), "title": "Model"}
    if limits.get("max_tokens") is not None:
        _set_in_any_of(props["max_output_tokens"], "integer",
                       {"maximum": limits["max_tokens"]})


_REQUEST_ID_PARAM = {
    "name": "X-Request-Id", "in": "header", "required": False,
    "description": "the request's id (1 to 128 visible ASCII characters; one is made when "
                   "none is sent): sent back in this header on every response and in an "
                   "error's error.request_id",
    "schema": {"type": "string", "pattern": REQUEST_ID_PATTERN},
}


def _request_ids(doc: dict[str, Any]) -> None:
    """Every operation takes ``X-Request-Id`` and answers with it; an error body carries it."""
    header = {"description": "the request's id (the one sent, or one made)",
              "schema": {"type": "string"}}
    for path in doc["paths"].values():
        for op in path.values():
            op.setdefault("parameters", []).append(dict(_REQUEST_ID_PARAM))
            for response in op.get("responses", {}).values():
                response.setdefault("headers", {})["X-Request-Id"] = dict(header)
    detail = doc["components"]["schemas"].get("ErrorDetail")
    if detail is not None:
        detail["properties"]["request_id"] = {
            "type": "string", "title": "Request Id",
            "description": "the request's X-Request-Id (on HTTP errors and a stream's error "
                           "event)"}
