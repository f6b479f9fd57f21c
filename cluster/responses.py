"""OpenAI's Responses API (``POST /v1/responses``) as a translation onto the chat completion path.

A Responses request is validated here (strictly, as every body: unknown fields are a 400 naming
them), then turned into the chat completion request it means (``ResponsesCall.chat``): the
``instructions`` as a first system message, each ``input`` item as a chat message (``function_call``
items as the assistant's ``tool_calls``, ``function_call_output`` items as ``tool`` messages), the
flat function ``tools`` in the chat shape, ``text.format`` as ``response_format``,
``max_output_tokens`` as ``max_tokens``. The ingress runs that request through the chat route
unchanged (key, tier, flow control, admission, limits, tool-call parsing, structured outputs,
usage, request id), and this module shapes its answer as a ``Response`` object
(``ResponsesCall.response``) or, streamed, turns the chat chunks into the Responses events
(``ResponseEvents``): ``response.created``, ``response.in_progress``, per output item
``response.output_item.added`` ... ``response.output_item.done`` with the text or the call's
arguments in between, and ``response.completed`` (``response.incomplete`` on a length stop; an
error mid-stream an ``error`` event and ``response.failed``), each with its ``sequence_number``.
A refusal the chat path makes names the Responses field (``ResponsesCall.error``:
``max_tokens`` is ``max_output_tokens``, ``messages.3`` the input item it came from).

Nothing is stored: ``store`` is accepted and the answer says ``store: false``;
``previous_response_id`` and ``conversation`` (which need stored responses) are a 400.
Built-in tools (web search, file search, ...) are a 400; only function tools are served.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictStr,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from tierserve.cluster.protocol import (
    DefaultTrue,
    FunctionName,
    Int,
    Metadata,
    Number,
    RequestIdText,
    Schema,
    Stop,
    TopLogprobs,
)
from tierserve.records import BadRequest, ServingError

# The most items one ``input`` may hold (the body's byte limit bounds it too).
MAX_INPUT_ITEMS = 2048


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _str_or_list(list_type: Any) -> Any:
    """A string or a list of ``list_type``: only the member the value's JSON type picks is
    validated, so an error names what is wrong in it (not "should be a valid string" too);
    the tags are the names ``error_param`` leaves out of a field's path."""
    return Annotated[
        Annotated[StrictStr, Tag("str")] | Annotated[list[list_type], Tag("list")],
        Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
    ]


_TEXT_PARTS = ("input_text", "output_text", "text")


class InputPart(_Body):
    """A text part of an input message: ``input_text`` (what the user or system says) or
    ``output_text`` (an earlier answer's, sent back; its ``annotations`` and ``logprobs``
    are accepted and not shown to the model). Other parts (images, files, audio) are a 400."""

    type: Literal["input_text", "output_text", "text"]
    text: StrictStr
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None
    parsed: Any = None  # what the openai SDK's parse() adds: sent back as it is, ignored

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and "type" in value and value["type"] not in _TEXT_PARTS:
            raise ValueError(f"content parts of type {str(value.get('type'))[:64]!r} are not "
                             "supported: only text (type 'input_text')")
        return value


_ROLES = ("user", "system", "developer", "assistant")
_ITEM_TYPES = ("message", "function_call", "function_call_output")


class InputItem(_Body):
    """One item of ``input``: a ``message`` (``role`` user, system, developer or assistant;
    ``content`` a string or text parts; ``type`` may be left out), a ``function_call`` the
    model made earlier (``call_id``, ``name``, ``arguments``: sent back from an earlier
    answer's ``output``), or a ``function_call_output`` (the ``output`` of the call
    ``call_id`` names). Other item types (reasoning, built-in tool calls, item references)
    are a 400."""

    model_config = ConfigDict(extra="forbid", populate_by_name=False)

    type: StrictStr = "message"
    role: StrictStr | None = None
    content: _str_or_list(InputPart) | None = None  # type: ignore[valid-type]
    id: StrictStr | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    call_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    name: StrictStr | None = None
    arguments: StrictStr | None = None
    output: _str_or_list(InputPart) | None = None  # type: ignore[valid-type]
    phase: StrictStr | None = None  # an earlier answer's, sent back: accepted, not shown
    parsed_arguments: Any = None  # what the openai SDK's parse() adds: accepted, ignored
    # An earlier call's other fields in the SDK's types, sent back: accepted, ignored.
    namespace: StrictStr | None = None
    caller: dict[StrictStr, Any] | None = None
    async_: StrictBool | None = Field(default=None, alias="async")

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, value: Any) -> Any:
        if isinstance(value, dict):
            kind = value.get("type", "message")
            if kind not in _ITEM_TYPES:
                why = (" (items by reference need stored responses, which this server does "
                       "not keep)" if kind == "item_reference" else "")
                raise ValueError(f"input items of type {str(kind)[:64]!r} are not supported"
                                 f"{why}: only 'message', 'function_call' and "
                                 "'function_call_output'")
        return value

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> InputItem:
        given = {k for k in ("role", "content", "call_id", "name", "arguments", "output")
                 if getattr(self, k) is not None}
        if self.type == "message":
            if self.role not in _ROLES:
                raise ValueError(f"a message's role is one of {', '.join(_ROLES)} "
                                 f"(got {self.role!r})")
            if self.content is None:
                raise ValueError("a message needs its content")
            extra = given - {"role", "content"}
        elif self.type == "function_call":
            if self.call_id is None or self.name is None or self.arguments is None:
                raise ValueError("a function_call item needs its call_id, name and arguments")
            extra = given - {"call_id", "name", "arguments"}
        else:
            if self.call_id is None or self.output is None:
                raise ValueError("a function_call_output item needs its call_id and output")
            extra = given - {"call_id", "output", "name"}
        if extra:
            raise ValueError(f"a {self.type} item has no {', '.join(sorted(extra))}")
        return self

    def text(self) -> str:
        """The message's content (or the call's output) as one string: text parts joined by
        newlines, as a chat message's are."""
        value = self.content if self.type == "message" else self.output
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        return "\n".join(p.text for p in value)


class FunctionTool(_Body):
    """A function the model may call, in the Responses API's flat shape."""

    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


def _function_tools_only(value: Any) -> Any:
    if isinstance(value, list):
        for i, tool in enumerate(value):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise ValueError(f"tool {i} is of type {str(kind)[:64]!r}: built-in tools (web "
                                 "search, file search, computer use, code interpreter, ...) "
                                 "are not supported; only function tools (type 'function')")
    return value


class FunctionChoice(_Body):
    """``tool_choice`` naming one function: the answer is a call of it."""

    type: Literal["function"]
    name: StrictStr


def _function_choice_only(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") != "function":
        raise ValueError(f"tool_choice of type {str(value.get('type'))[:64]!r} is not "
                         "supported: send 'none', 'auto', 'required' or "
                         "{'type': 'function', 'name': ...}")
    return value


class TextFormat(_Body):
    """``text.format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (a
    JSON object) or ``{"type": "json_schema", "name", "schema", "description", "strict"}``
    (JSON that validates against the schema): the chat route's ``response_format``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[StrictStr, Field(min_length=1, max_length=64,
                                     pattern=r"^[a-zA-Z0-9_-]+$")] | None = None
    schema_: Schema | None = Field(default=None, alias="schema")
    description: StrictStr | None = None
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type 'json_schema' needs its 'name' and 'schema'")
        if self.type != "json_schema" and (self.name is not None or self.schema_ is not None
                                           or self.strict is not None
                                           or self.description is not None):
            raise ValueError(f"'name', 'schema', 'description' and 'strict' go with type "
                             f"'json_schema', not {self.type!r}")
        return self


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class ReasoningConfig(_Body):
    """Accepted, no effect: the model does not reason apart from its answer."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Body):
    include_obfuscation: StrictBool = True  # accepted, no effect: no obfuscation is added


def _nothing_stored(name: str) -> Any:
    def refuse(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"stored responses are not supported (store is false here), so "
                             f"none can be named by {name}: send the whole conversation in "
                             "input")
        return value

    return AfterValidator(refuse)


def _no_background(value: bool | None) -> bool | None:
    if value:
        raise ValueError("background responses are not supported: leave background false")
    return value


def _no_prompt_template(value: Any) -> Any:
    if value is not None:
        raise ValueError("stored prompt templates are not supported: send the instructions "
                         "and input themselves")
    return value


def _not_offered(name: str, why: str) -> Any:
    def refuse(value: Any) -> Any:
        if value is not None:
            raise ValueError(f"{name} is not supported: {why}; omit it (or send null)")
        return value

    return AfterValidator(refuse)


# The schema of a field refused unless null.
_REFUSED = WithJsonSchema({"type": "null", "description": "not supported: omit it (or send null)"})

# What ``include`` may name. The logprobs are honoured; the others name the output of built-in
# tools, images or reasoning, which this server never produces: there is nothing to add.
INCLUDABLE = frozenset({
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs",
})
LOGPROBS = "message.output_text.logprobs"


def _known_includes(value: list[str] | None) -> list[str] | None:
    for i, name in enumerate(value or ()):
        if name not in INCLUDABLE:
            raise ValueError(f"include.{i}: {name[:64]!r} is not something a response can "
                             f"include (one of {', '.join(sorted(INCLUDABLE))})")
    return value


class ResponsesRequest(_Body):
    """``POST /v1/responses``: OpenAI's Responses API, served through the chat route
    (``ResponsesCall``). docs/api.md says what each field does here."""

    model: StrictStr
    input: _str_or_list(InputItem)  # type: ignore[valid-type]
    instructions: StrictStr | None = None
    max_output_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: TopLogprobs | None = None
    include: Annotated[list[StrictStr], AfterValidator(_known_includes)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: (Literal["none", "auto", "required"] | FunctionChoice | None) = None
    parallel_tool_calls: DefaultTrue = True
    max_tool_calls: Annotated[Int, Field(ge=1)] | None = None  # of built-in tools: none here
    text: TextConfig | None = None
    stream: StrictBool = False
    stream_options: ResponsesStreamOptions | None = None
    # Nothing is stored: ``store`` is accepted and the answer says false.
    store: StrictBool | None = None
    metadata: Metadata | None = None
    user: StrictStr | None = None
    # "fast" and "ultrafast" run as "priority" (``TierResolver.for_service_tier``).
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast",
                          "ultrafast"] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: Annotated[StrictStr, Field(max_length=256)] | None = None
    prompt_cache_key: Annotated[StrictStr, Field(max_length=256)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    background: Annotated[StrictBool, AfterValidator(_no_background)] | None = None
    previous_response_id: Annotated[Any, _nothing_stored("previous_response_id"),
                                    _REFUSED] = None
    conversation: Annotated[Any, _nothing_stored("conversation"), _REFUSED] = None
    prompt: Annotated[Any, AfterValidator(_no_prompt_template), _REFUSED] = None
    # Accepted, without effect: a cache hint (the prefix cache is automatic here), options for
    # image inputs (none are taken) and OpenAI's access programs (there are none here).
    prompt_cache_options: dict[StrictStr, Any] | None = None
    image: dict[StrictStr, Any] | None = None
    access_programs: dict[StrictStr, Any] | None = None
    # Refused unless null: no moderation, no context compaction, no background runs here.
    moderation: Annotated[Any, _not_offered("moderation", "no moderation model runs here"),
                          _REFUSED] = None
    context_management: Annotated[Any, _not_offered(
        "context_management", "the context is never compacted here: send what fits"),
        _REFUSED] = None
    background_options: Annotated[Any, _not_offered(
        "background_options", "background responses are not supported"), _REFUSED] = None
    # The chat route's sampling and vLLM's fields, as it takes them (docs/api.md).
    seed: Annotated[Int, Field(ge=0, le=2**63 - 1)] | None = None
    top_k: Annotated[Int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    stop: Stop = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=10.0)] | None = None
    request_id: RequestIdText | None = None
    priority: Annotated[Int, Field(ge=-(10**9) + 1, le=10**9 - 1)] | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        if not isinstance(value, str | list):
            raise ValueError("input is a string or a list of items")
        if isinstance(value, list) and not 1 <= len(value) <= MAX_INPUT_ITEMS:
            raise ValueError(f"input has {len(value)} items; it needs 1 to {MAX_INPUT_ITEMS}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _tools(cls, value: Any) -> Any:
        return _function_tools_only(value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        return _function_choice_only(value)


# ---------------------------------------------------------------------------- the answer


class OutputLogprobAlternative(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class OutputLogprob(OutputLogprobAlternative):
    top_logprobs: list[OutputLogprobAlternative]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[OutputLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int  # input positions the prefix cache held


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The ``Response`` object: the answer of ``POST /v1/responses``, and the ``response`` of
    the stream's lifecycle events (``output`` and ``usage`` filled in at its end)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputMessage | FunctionCallItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, as they ran.
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None
    temperature: float
    top_p: float
    top_logprobs: int | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    reasoning: dict[str, Any]
    truncation: str
    store: bool = False  # nothing is stored
    background: bool = False
    previous_response_id: None = None
    metadata: dict[str, str]
    service_tier: str
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _num(value: Any, default: float) -> float:
    return default if value is None else float(value)


def _logprobs(entries: Any) -> list[OutputLogprob]:
    """The chat answer's ``logprobs.content`` entries as an output text's ``logprobs``."""
    return [OutputLogprob.model_validate(e) for e in entries or ()]


def _usage(chat_usage: dict[str, Any] | None) -> ResponseUsage | None:
    if chat_usage is None:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return ResponseUsage(
        input_tokens=chat_usage["prompt_tokens"], output_tokens=chat_usage["completion_tokens"],
        total_tokens=chat_usage["total_tokens"],
        input_tokens_details=InputTokensDetails(cached_tokens=details.get("cached_tokens") or 0))


@dataclass(slots=True)
class ResponsesCall:
    """One Responses request: the chat request it is served as, where each of that request's
    fields came from (to name the Responses field in a refusal), and the settings its answer
    echoes."""

    body: ResponsesRequest
    chat: dict[str, Any]
    # A chat request's field path (prefix) -> the Responses field it came from.
    sources: dict[str, str]
    created_at: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def of(cls, body: ResponsesRequest) -> ResponsesCall:
        """The chat completion request ``body`` means (as a JSON body the chat route takes)."""
        messages: list[dict[str, Any]] = []
        sources: dict[str, str] = {"messages": "input", "max_tokens": "max_output_tokens",
                                   "max_completion_tokens": "max_output_tokens",
                                   "response_format.json_schema": "text.format",
                                   "response_format": "text.format",
                                   "tool_choice.function": "tool_choice"}
        if body.instructions is not None:
            sources[f"messages.{len(messages)}"] = "instructions"
            sources[f"messages.{len(messages)}.content"] = "instructions"
            messages.append({"role": "system", "content": body.instructions})
        items = ([InputItem(role="user", content=body.input)] if isinstance(body.input, str)
                 else list(body.input))
        for k, item in enumerate(items):
            where = "input" if isinstance(body.input, str) else f"input.{k}"
            if item.type == "function_call":
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    sources[f"messages.{len(messages)}"] = where
                    last = {"role": "assistant", "content": None, "tool_calls": []}
                    messages.append(last)
                j = len(last.setdefault("tool_calls", []))
                sources[f"messages.{len(messages) - 1}.tool_calls.{j}.function"] = where
                sources[f"messages.{len(messages) - 1}.tool_calls.{j}"] = where
                last["tool_calls"].append({"id": item.call_id, "type": "function", "function": {
                    "name": item.name, "arguments": item.arguments}})
                continue
            sources[f"messages.{len(messages)}"] = where
            if where == "input":  # a string: the message's content is the input itself
                sources[f"messages.{len(messages)}.content"] = where
            if item.type == "function_call_output":
                sources[f"messages.{len(messages)}.content"] = f"{where}.output"
                sources[f"messages.{len(messages)}.tool_call_id"] = f"{where}.call_id"
                messages.append({"role": "tool", "tool_call_id": item.call_id,
                                 "content": item.text()})
            else:
                messages.append({"role": item.role, "content": item.text()})
        chat: dict[str, Any] = {"model": body.model, "messages": messages,
                                "stream": body.stream}
        if body.stream:
            chat["stream_options"] = {"include_usage": True}
        if body.max_output_tokens is not None:
            chat["max_tokens"] = body.max_output_tokens
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "stop",
                     "presence_penalty", "frequency_penalty", "repetition_penalty", "user",
                     "service_tier", "safety_identifier", "prompt_cache_key", "request_id",
                     "priority", "cache_salt"):
            value = getattr(body, name)
            if value is not None:
                chat[name] = value
        if chat.get("service_tier") == "ultrafast":  # the chat route's alias of "priority"
            chat["service_tier"] = "fast"
        if LOGPROBS in (body.include or ()):
            chat["logprobs"] = True
            chat["top_logprobs"] = body.top_logprobs or 0
        if body.tools:
            chat["tools"] = []
            for i, tool in enumerate(body.tools):
                sources[f"tools.{i}.function"] = f"tools.{i}"
                chat["tools"].append({"type": "function", "function": tool.model_dump(
                    exclude={"type"}, exclude_none=True)})
            chat["parallel_tool_calls"] = body.parallel_tool_calls
        if isinstance(body.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function",
                                   "function": {"name": body.tool_choice.name}}
        elif body.tool_choice is not None:
            chat["tool_choice"] = body.tool_choice
        fmt = body.text.format if body.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
            if fmt.description is not None:
                spec["description"] = fmt.description
            if fmt.strict is not None:
                spec["strict"] = fmt.strict
            chat["response_format"] = {"type": "json_schema", "json_schema": spec}
        elif fmt is not None:
            chat["response_format"] = {"type": fmt.type}
        return cls(body, chat, sources)

    # ------------------------------------------------------------------ refusals

    def param(self, param: str | None) -> str | None:
        """The Responses field a chat field path came from (the longest known prefix, the
        rest of the path kept): ``max_tokens`` is ``max_output_tokens``, ``messages.2.content``
        the input item's ``content``, ``tools.0.function.parameters`` ``tools.0.parameters``."""
        if param is None:
            return None
        parts = param.split(".")
        for cut in range(len(parts), 0, -1):
            head = ".".join(parts[:cut])
            if head in self.sources:
                return ".".join([self.sources[head], *parts[cut:]])
        return param

    def error(self, e: ServingError) -> ServingError:
        """``e`` (a refusal the chat path made) naming the Responses field: its ``param`` and,
        where its message starts with the chat field's path, the message too (elsewhere in the
        message a word such as "messages" may be plain prose)."""
        param = self.param(e.param)
        if param is not None and e.param is not None and param != e.param:
            message = e.message
            for old in (e.param, e.param.split(".")[0]):
                if message.startswith(old):
                    message = param + message[len(old):]
                    break
            e.args = (message, *e.args[1:])
            e.param = param
        return e

    # ------------------------------------------------------------------ the answer

    def skeleton(self, rid: str, status: Literal["in_progress", "completed", "incomplete",
                                                 "failed"],
                 service_tier: str | None) -> ResponseObject:
        """The ``Response`` object with the request's settings, without output or usage."""
        b = self.body
        tools = [t.model_dump(exclude_none=True) for t in b.tools or ()]
        for t in tools:
            t.setdefault("strict", None)
        choice: Any = b.tool_choice if b.tool_choice is not None else "auto"
        if isinstance(choice, FunctionChoice):
            choice = choice.model_dump()
        text: dict[str, Any] = {"format": {"type": "text"}}
        if b.text is not None:
            text = b.text.model_dump(by_alias=True, exclude_none=True)
            text.setdefault("format", {"type": "text"})
        return ResponseObject(
            id=rid, created_at=self.created_at, status=status, model=b.model,
            instructions=b.instructions, max_output_tokens=b.max_output_tokens,
            max_tool_calls=b.max_tool_calls,
            temperature=_num(b.temperature, 1.0), top_p=_num(b.top_p, 1.0),
            top_logprobs=b.top_logprobs, tools=tools, tool_choice=choice,
            parallel_tool_calls=b.parallel_tool_calls, text=text,
            reasoning=(b.reasoning.model_dump() if b.reasoning is not None
                       else {"effort": None, "summary": None}),
            truncation=b.truncation or "disabled", metadata=dict(b.metadata or {}),
            service_tier=service_tier or "default", user=b.user,
            safety_identifier=b.safety_identifier, prompt_cache_key=b.prompt_cache_key)

    def response(self, chat: dict[str, Any]) -> ResponseObject:
        """The ``Response`` of a chat completion answer (one choice)."""
        choice = chat["choices"][0]
        message = choice["message"]
        incomplete = choice["finish_reason"] == "length"
        status: Literal["completed", "incomplete"] = "incomplete" if incomplete else "completed"
        out = self.skeleton(response_id(chat["id"]), status, chat.get("service_tier"))
        calls = message.get("tool_calls") or []
        content = message.get("content")
        if content or not calls:
            lps = (choice.get("logprobs") or {}).get("content")
            out.output.append(OutputMessage(id=_new_id("msg"), status=status, content=[
                OutputText(text=content or "", logprobs=_logprobs(lps))]))
        for c in calls:
            out.output.append(FunctionCallItem(
                id=_new_id("fc"), call_id=c["id"], name=c["function"]["name"],
                arguments=c["function"]["arguments"], status="completed"))
        out.usage = _usage(chat.get("usage"))
        out.completed_at = int(time.time())
        if incomplete:
            out.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return out

    def events(self, chunks: AsyncIterable[Any]) -> AsyncIterator[str]:
        """The Responses stream of the chat route's SSE stream ``chunks``."""
        return ResponseEvents(self).run(chunks)


def stored_responses_refused(response_id: str) -> BadRequest:
    """The answer to any use of a stored response (retrieve, cancel, delete, input items)."""
    rid = response_id.split("/")[0][:128]
    return BadRequest(f"stored responses are not supported: this server keeps no response "
                      f"(store is false here), so {rid!r} cannot be retrieved, cancelled or "
                      "deleted", "stored_responses_unsupported", "response_id")


def response_id(chat_id: str) -> str:
    """The response's id from its chat answer's: ``chatcmpl-X`` is ``resp_X`` (a client's
    ``request_id`` or ``X-Request-Id`` stays in it)."""
    return "resp_" + chat_id.removeprefix("chatcmpl-")


@dataclass(slots=True)
class _Open:
    """The output item being streamed: a message's text or a function call's arguments."""

    index: int
    item_id: str
    kind: Literal["message", "function_call"]
    text: str = ""
    logprobs: list[OutputLogprob] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class ResponseEvents:
    """The Responses events of one chat stream, numbered in order (``sequence_number``).

    A chat chunk's text opens a ``message`` item (``response.output_item.added``,
    ``response.content_part.added``) and goes out as ``response.output_text.delta``; logprobs
    that come without text (a tool call's tokens, held by its parser) open no item: they go
    with the next text, and an answer that ends with no item at all gets an empty message, as
    ``ResponsesCall.response`` gives it. A tool
    call's first piece closes the open item and opens a ``function_call`` item, its argument
    fragments go out as ``response.function_call_arguments.delta``. At the end every open item
    is closed (``...done`` events with the whole text or arguments) and the final
    ``Response`` goes out in ``response.completed`` (``response.incomplete`` on a length stop).
    The chat stream's error event becomes an ``error`` event and ``response.failed``."""

    def __init__(self, call: ResponsesCall) -> None:
        self.call = call
        self.seq = 0
        self.rid = ""
        self.service_tier: str | None = None
        self.output: list[OutputMessage | FunctionCallItem] = []
        self.open: _Open | None = None
        self.calls: dict[int, _Open] = {}  # the chat stream's tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        # Logprobs that came with no text and no message open: they go with the next text, or
        # with an empty message if the answer ends with no item (as ``response`` makes one).
        self.pending: list[OutputLogprob] = []

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        # ``event:`` names the type, as OpenAI's stream does; ``data:`` is one line (ASCII JSON:
        # no character a line splitter could take for a line end).
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def _response(self, status: Literal["in_progress", "completed", "incomplete", "failed"]
                  ) -> dict[str, Any]:
        out = self.call.skeleton(self.rid, status, self.service_tier)
        if status != "in_progress":
            out.output = list(self.output)
            out.usage = _usage(self.usage)
        if status in ("completed", "incomplete"):
            out.completed_at = int(time.time())
        if status == "incomplete":
            out.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        return out.model_dump(mode="json", by_alias=True)

    async def run(self, chunks: AsyncIterable[Any]) -> AsyncIterator[str]:
        started = False
        try:
            async for raw in chunks:
                text = raw if isinstance(raw, str) else bytes(raw).decode()
                for line in text.split("\n"):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    if not started:  # the first chunk names the answer
                        started = True
                        cid = chunk.get("id")
                        self.rid = response_id(cid) if isinstance(cid, str) else _new_id("resp")
                        self.service_tier = chunk.get("service_tier")
                        yield self._event("response.created",
                                          response=self._response("in_progress"))
                        yield self._event("response.in_progress",
                                          response=self._response("in_progress"))
                    if "error" in chunk:
                        for event in self._failed(chunk["error"]):
                            yield event
                        return
                    for event in self._feed(chunk):
                        yield event
            if not self.output:  # no text and no call: an empty message, as ``response``
                for event in self._text("", self.pending):
                    yield event
            for event in self._close():
                yield event
            status: Literal["completed", "incomplete"] = (
                "incomplete" if self.finish_reason == "length" else "completed")
            yield self._event(f"response.{status}", response=self._response(status))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def _feed(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        out: list[str] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            lps = _logprobs((choice.get("logprobs") or {}).get("content"))
            if text or (lps and self.open is not None and self.open.kind == "message"):
                out += self._text(text, self.pending + lps)
                self.pending = []
            elif lps:  # tokens with no text of their own (a tool call's, held by its parser)
                self.pending += lps
            for piece in delta.get("tool_calls") or ():
                out += self._call_piece(piece)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return out

    def _text(self, text: str, lps: list[OutputLogprob]) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open.kind != "message":
            out += self._close()
            self.open = _Open(len(self.output), _new_id("msg"), "message")
            self.output.append(OutputMessage(id=self.open.item_id, status="in_progress",
                                             content=[]))
            out.append(self._event("response.output_item.added", output_index=self.open.index,
                                   item=self.output[-1].model_dump(mode="json")))
            out.append(self._event("response.content_part.added", item_id=self.open.item_id,
                                   output_index=self.open.index, content_index=0,
                                   part=OutputText(text="").model_dump(mode="json")))
        o = self.open
        o.text += text
        o.logprobs += lps
        if text or lps:
            out.append(self._event("response.output_text.delta", item_id=o.item_id,
                                   output_index=o.index, content_index=0, delta=text,
                                   logprobs=[lp.model_dump(mode="json") for lp in lps]))
        return out

    def _call_piece(self, piece: dict[str, Any]) -> list[str]:
        out: list[str] = []
        fn = piece.get("function") or {}
        index = int(piece.get("index", 0))
        if piece.get("id") or index not in self.calls:
            out += self._close()
            self.open = _Open(len(self.output), _new_id("fc"), "function_call",
                              call_id=str(piece.get("id") or _new_id("call")),
                              name=str(fn.get("name") or ""))
            self.calls[index] = self.open
            self.output.append(self._call_item(self.open, "in_progress"))
            out.append(self._event("response.output_item.added", output_index=self.open.index,
                                   item=self.output[-1].model_dump(mode="json")))
        o = self.calls[index]
        args = fn.get("arguments") or ""
        if args:
            o.text += args
            out.append(self._event("response.function_call_arguments.delta", item_id=o.item_id,
                                   output_index=o.index, delta=args))
        return out

    @staticmethod
    def _call_item(o: _Open, status: Literal["in_progress", "completed"]) -> FunctionCallItem:
        return FunctionCallItem(id=o.item_id, call_id=o.call_id, name=o.name,
                                arguments=o.text if status == "completed" else "",
                                status=status)

    def _close(self) -> list[str]:
        """The ``...done`` events of the open item, if any."""
        o, self.open = self.open, None
        if o is None:
            return []
        if o.kind == "function_call":
            item: OutputMessage | FunctionCallItem = self._call_item(o, "completed")
            self.output[o.index] = item
            return [self._event("response.function_call_arguments.done", item_id=o.item_id,
                                output_index=o.index, arguments=o.text, name=o.name),
                    self._event("response.output_item.done", output_index=o.index,
                                item=item.model_dump(mode="json"))]
        status: Literal["completed", "incomplete"] = (
            "incomplete" if self.finish_reason == "length" else "completed")
        part = OutputText(text=o.text, logprobs=o.logprobs)
        item = OutputMessage(id=o.item_id, status=status, content=[part])
        self.output[o.index] = item
        lps = [lp.model_dump(mode="json") for lp in o.logprobs]
        return [self._event("response.output_text.done", item_id=o.item_id,
                            output_index=o.index, content_index=0, text=o.text, logprobs=lps),
                self._event("response.content_part.done", item_id=o.item_id,
                            output_index=o.index, content_index=0,
                            part=part.model_dump(mode="json")),
                self._event("response.output_item.done", output_index=o.index,
                            item=item.model_dump(mode="json"))]

    def _failed(self, error: dict[str, Any]) -> list[str]:
        """An error mid-stream: the ``error`` event (the chat stream's error, its field named
        as the Responses request names it), then ``response.failed``."""
        param = self.call.param(error.get("param"))
        code = str(error.get("code") or "server_error")
        message = str(error.get("message") or "the response failed")
        out = [self._event("error", code=code, message=message, param=param)]
        self.open = None
        failed = self._response("failed")
        failed["error"] = {"code": code, "message": message}
        out.append(self._event("response.failed", response=failed))
        return out
