"""The OpenAI-compatible subset: request bodies (validated strictly) and response bodies."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)

from tierserve.records import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

Number = StrictFloat | StrictInt


def _integral(value: Any) -> Any:
    """JSON Schema's ``integer`` includes numbers like ``4.0``: take them as ints (not bools,
    strings or fractions, which the strict int check then refuses)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    return value


# An integer as JSON Schema means it: 4 and 4.0, never "4", true or 4.5.
Int = Annotated[StrictInt, BeforeValidator(_integral)]


def _refuse(value: Any) -> Any:
    if value is not None:
        raise ValueError("is not supported by this server (it serves text generation only)")
    return value


def _null_is_true(value: Any) -> Any:
    return True if value is None else value


# A flag that defaults to true, where OpenAI's SDK types it optional: null is the default.
DefaultTrue = Annotated[
    StrictBool, BeforeValidator(_null_is_true),
    WithJsonSchema({"type": ["boolean", "null"], "default": True,
                    "description": "null is the default, true"}),
]


# An OpenAI field this server does not implement (tools, response formats, audio, ...): any value
# but null is a clear 400 that names the field.
Unsupported = Annotated[
    Any,
    AfterValidator(_refuse),
    WithJsonSchema({"description": "not supported: omit it (or send null)"}),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # vLLM's extension (guidellm sends it): usage in every chunk, not only the last one.
    continuous_usage_stats: StrictBool = False


Bias = Annotated[Number, Field(ge=-100.0, le=100.0)]
TokenId = Annotated[Int, Field(ge=0)]


def _stop_caps(value: str | list[str] | None) -> str | list[str] | None:
    """``stop``'s caps, checked on the whole field: a constrained member type would put its
    name ("constrained-str") in the error's location, and the client's ``param`` must be the
    field's path."""
    stops = [value] if isinstance(value, str) else value or []
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_STRING_CHARS} "
                             f"characters, stop {i} has {len(s)}")
    return value


_STOP_STRING_SCHEMA = {"type": "string", "maxLength": MAX_STOP_STRING_CHARS}
# ``stop``: one string or a list of them, within the caps (``_stop_caps``), as the schema says.
Stop = Annotated[
    StrictStr | list[StrictStr] | None,
    AfterValidator(_stop_caps),
    WithJsonSchema({"anyOf": [
        _STOP_STRING_SCHEMA,
        {"type": "array", "items": _STOP_STRING_SCHEMA, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"},
    ]}),
]

# A JSON schema as a request carries it: an object (or a boolean schema), or that object as a
# JSON string (vLLM's ``guided_json`` takes both).
Schema = dict[str, Any] | StrictBool | StrictStr


class JsonSchemaFormat(_Body):
    """``response_format.json_schema``: OpenAI's structured output (``name`` as OpenAI limits it)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: StrictStr | None = None
    schema_: Schema = Field(default_factory=dict, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    """``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON object) or
    ``{"type": "json_schema", "json_schema": {...}}`` (JSON that validates against the schema)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs its 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' goes with type 'json_schema', not {self.type!r}")
        return self


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` request extra: exactly one of ``json`` (a JSON schema),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF, as xgrammar reads it) or
    ``json_object`` (any JSON object). ``disable_any_whitespace``: JSON without free whitespace
    between its tokens."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: Schema | None = Field(default=None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1, max_length=1024)] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k, v in (("json", self.json_), ("regex", self.regex),
                                ("choice", self.choice), ("grammar", self.grammar))
                 if v is not None]
        if self.json_object:  # false asks for nothing
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


def _no_beam_search(value: bool) -> bool:
    if value:
        raise ValueError("beam search is not supported yet: leave use_beam_search false")
    return value


def _no_store(value: bool | None) -> bool | None:
    if value:
        raise ValueError("stored completions are not supported yet: this server keeps nothing "
                         "it answers (send store false, or leave it out)")
    return value


def _metadata_caps(value: dict[str, str]) -> dict[str, str]:
    """OpenAI's bounds on ``metadata``: 16 pairs, keys of 64 characters, values of 512."""
    if len(value) > 16:
        raise ValueError(f"metadata has {len(value)} pairs; at most 16 are allowed")
    for k, v in value.items():
        if len(k) > 64 or len(v) > 512:
            raise ValueError(f"metadata key {k[:64]!r}: keys have at most 64 characters, "
                             "values at most 512")
    return value


Metadata = Annotated[dict[StrictStr, StrictStr], AfterValidator(_metadata_caps)]
# A client's request id: 1 to 128 visible ASCII characters (it goes into headers and logs).
REQUEST_ID_PATTERN = r"^[!-~]{1,128}$"
RequestIdText = Annotated[StrictStr, Field(pattern=REQUEST_ID_PATTERN)]
TopLogprobs = Annotated[Int, Field(ge=0, le=20)]


class _SamplingFields(_Body):
    model: StrictStr
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    # Bounded: the sampler builds an int64 tensor of the batch's k values.
    top_k: Annotated[Int, Field(ge=-1, le=2**31 - 1)] = 0
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[Int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: Stop = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[Int, Field(ge=1)] = 1
    user: StrictStr | None = None
    # vLLM's: the prompt's blocks are shared in the prefix cache only with requests of the
    # same caller and salt (docs/security.md).
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[Number, Field(gt=0.0, le=10.0)] = 1.0
    # Token id (as a JSON object key) -> bias added to its logit.
    logit_bias: dict[StrictStr, Bias] | None = Field(default=None,
                                                      max_length=MAX_LOGIT_BIAS_ENTRIES)
    # vLLM's extras: only these token ids may be drawn; these words may not be generated (the
    # ingress tokenizes each into the engine's ``bad_words_ids``).
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1,
                                                      max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[Annotated[StrictStr, Field(min_length=1,
                                                         max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    # Structured outputs (docs/structured.md): at most one of these constrains the output.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: StrictStr | None = None
    # vLLM's server's fields (docs/api.md says what each does here). Honoured:
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    truncate_prompt_tokens: Annotated[Int, Field(ge=1)] | None = None
    prompt_logprobs: TopLogprobs | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    # The request's id: in the answer's ``id`` (it wins over an ``X-Request-Id`` header sent
    # besides, which then names only the request's logs and error bodies).
    request_id: RequestIdText | None = None
    # vLLM's scale (lower first, 0 the default): moves the request's priority within the caller's
    # tier (TierResolver.shifted).
    priority: Annotated[Int, Field(ge=-(10**9) + 1, le=10**9 - 1)] | None = None
    # Accepted, with no effect here: fast tokenizers put no spaces between special tokens;
    # without beam search there is no length penalty; the server picks its grammar backend.
    spaces_between_special_tokens: StrictBool = True
    use_beam_search: Annotated[StrictBool, AfterValidator(_no_beam_search)] = False
    length_penalty: Number = 1.0
    guided_decoding_backend: StrictStr | None = None
    # Refused unless null: what cannot be honoured yet and would be wrong to ignore.
    guided_whitespace_pattern: Unsupported = None
    structural_tag: Unsupported = None
    logits_processors: Unsupported = None
    kv_transfer_params: Unsupported = None
    vllm_xargs: Unsupported = None
    # OpenAI's fields. ``metadata`` is checked as OpenAI bounds it and kept nowhere (nothing
    # is stored); ``store: true`` is refused (no stored completions yet); ``user``,
    # ``safety_identifier`` and ``prompt_cache_key`` are accepted and not used.
    metadata: Metadata | None = None
    # Which tier runs it (docs/api.md): "flex" the lowest, "priority" (and "fast", its alias)
    # the caller's own at its highest priority, the others the caller's own.
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    store: Annotated[StrictBool, AfterValidator(_no_store)] | None = None
    safety_identifier: Annotated[StrictStr, Field(max_length=256)] | None = None
    prompt_cache_key: Annotated[StrictStr, Field(max_length=256)] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


# The prompts one completions request may carry (each is a request of its own at the ingress).
MAX_PROMPTS = 64


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt), or
    a list of strings or of token-id lists (up to ``MAX_PROMPTS`` prompts).

    ``echo``: the prompt's text is returned before the completion (with ``logprobs``, its
    tokens' log-probabilities too: with ``max_tokens`` 0, that is how a prompt is scored).
    ``logprobs``: per token, its log-probability and the ``logprobs`` most likely alternatives.
    """

    prompt: (StrictStr | list[Annotated[Int, Field(ge=0)]]
             | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS)]
             | Annotated[list[list[Annotated[Int, Field(ge=0)]]],
                         Field(min_length=1, max_length=MAX_PROMPTS)])
    max_tokens: Annotated[Int, Field(ge=0)] | None = 16
    echo: StrictBool = False
    logprobs: TopLogprobs | None = None
    best_of: Annotated[Int, Field(ge=1, le=1, description="only 1 is supported")] | None = None
    suffix: Unsupported = None
    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_list(cls, value: Any) -> Any:
        """A list of prompts, said plainly where its union's members would each complain."""
        if isinstance(value, list) and value and not isinstance(value[0], int | float):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"a request has at most {MAX_PROMPTS} prompts, got "
                                 f"{len(value)}")
            kinds = {type(p) for p in value}
            if kinds not in ({str}, {list}):
                raise ValueError("a list of prompts is all strings or all lists of token ids")
        return value

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list of strings or of token-id lists."""
        p: Any = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]
        return list(p)

    # vLLM's: the tokenizer's special tokens (BOS) around a text prompt.
    add_special_tokens: StrictBool = True
    prompt_embeds: Unsupported = None


class TextPart(BaseModel):
    """A chat content part. Only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="allow")

    type: StrictStr
    text: StrictStr | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(
                f"content parts of type {self.type!r} are not supported: only text is "
                "(type 'text')"
            )
        if self.text is None:
            raise ValueError("a text content part needs its 'text'")
        return self


FunctionName = Annotated[StrictStr, Field(min_length=1, max_length=64,
                                           pattern=r"^[a-zA-Z0-9_.-]+$")]


class FunctionDef(_Body):
    """A tool's function: its name, what it does, and its arguments as a JSON schema (an
    object schema; absent: no arguments)."""

    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: StrictStr


class NamedToolChoice(_Body):
    """``tool_choice`` naming one function: the answer is a call of it."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr  # a JSON object, as text
    # What the openai SDK's parse() adds to the message it returns: sent back as it is, ignored.
    parsed_arguments: Any = None


class ToolCall(_Body):
    """A call an assistant message made (sent back in the next turn's history)."""

    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    """A chat message, whatever its role (the fields every role's model has); a request's
    messages are validated by role (``Message``: ``SystemMessage``, ``UserMessage``,
    ``AssistantMessage``, ``ToolMessage``), each saying what its role carries."""

    # "developer" is what OpenAI's newer models call the system message; "tool" answers a call.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: StrictStr | None = None
    content: StrictStr | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    # An earlier answer's fields, sent back with it (OpenAI's assistant message; the openai
    # SDK's parse() adds ``parsed``): accepted and not shown to the model.
    refusal: StrictStr | None = None
    annotations: list[Any] | None = None
    parsed: Any = None
    function_call: Unsupported = None
    audio: Unsupported = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)

    def template_role(self) -> str:
        return "system" if self.role == "developer" else self.role



Content = StrictStr | list[TextPart]


class SystemMessage(ChatMessage):
    role: Literal["system", "developer"]
    content: Content
    tool_calls: None = None
    tool_call_id: None = None


class UserMessage(ChatMessage):
    role: Literal["user"]
    content: Content
    tool_calls: None = None
    tool_call_id: None = None


class AssistantMessage(ChatMessage):
    """An earlier answer: its text, its tool calls, or both (content null with calls)."""

    role: Literal["assistant"]
    tool_call_id: None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs its content or its tool_calls")
        return self


class ToolMessage(ChatMessage):
    """A tool's answer to the call ``tool_call_id`` names."""

    role: Literal["tool"]
    content: Content
    tool_call_id: StrictStr
    tool_calls: None = None


def _no_chat_echo(value: bool) -> bool:
    if value:
        raise ValueError("echo in a chat request is not supported yet: leave it false")
    return value


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                    Field(discriminator="role")]

class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``logprobs``: the log-probability of every generated
    token, with the ``top_logprobs`` most likely alternatives."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: DefaultTrue = True
    functions: Unsupported = None
    function_call: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    reasoning_effort: Unsupported = None
    web_search_options: Unsupported = None
    # OpenAI's, for reasoning models: accepted, no effect here.
    verbosity: Literal["low", "medium", "high"] | None = None
    # vLLM's chat rendering: the template's generation prompt (or, instead, the last message
    # left open for the model to continue), the tokenizer's special tokens on top of what the
    # template adds, extra variables and documents for the template.
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    documents: list[dict[StrictStr, StrictStr]] | None = None
    # Accepted, no effect: this server parses no reasoning out of an answer.
    include_reasoning: StrictBool = True
    # Refused unless null (or false): not supported yet.
    chat_template: Unsupported = None
    mm_processor_kwargs: Unsupported = None
    echo: Annotated[StrictBool, AfterValidator(_no_chat_echo)] = False

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true: send add_generation_prompt false to continue the last "
                             "message")
        return self


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt positions the replica's prefix cache held (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token of ``text``."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _unasked() -> Any:
    """A field of an answer written only where the request asked for it (vLLM's
    ``prompt_logprobs``, OpenAI's ``service_tier``): absent, not null, when it is None."""
    return Field(default=None, exclude_if=lambda v: v is None)


class PromptLogprob(BaseModel):
    """vLLM's log-probability of one prompt position's token or alternative: ``rank`` is its
    place among the alternatives sent (1: the likeliest), null when it is not among them;
    ``decoded_token`` its text."""

    logprob: float
    rank: int | None
    decoded_token: str


# vLLM's ``prompt_logprobs``: per prompt token (null for the first), token id -> its entry.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = _unasked()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    service_tier: str | None = _unasked()  # where the request asked for one: where it ran


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class _SetFieldsOnly(BaseModel):
    """Written without its unset (None) fields, as OpenAI streams a tool call's pieces: a client
    that copies every key of a piece would take a null ``type`` or ``id`` for a value."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionDelta(_SetFieldsOnly):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_SetFieldsOnly):
    """A streamed tool call's piece: its first carries ``id``, ``type`` and the function's
    ``name``; the next ones fragments of its ``arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = _unasked()
    service_tier: str | None = _unasked()


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = _unasked()


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierserve"
    # vLLM's: ``root`` the model's id (a base model's own; an adapter's name, never its
    # folder), ``parent`` the base model an adapter runs on (None for a base model).
    root: str | None = None
    parent: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Body):
    """``POST /tokenize`` of a prompt (vLLM's shape): its ids, with the tokenizer's special
    tokens unless ``add_special_tokens`` is false; ``return_token_strs``: each id's token too."""

    model: StrictStr | None = None  # None: the served model (vLLM's)
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(_Body):
    """``POST /tokenize`` of chat messages (vLLM's shape): the ids the chat template renders
    them to, as ``/v1/chat/completions`` would send them (no tools)."""

    model: StrictStr | None = None  # None: the served model (vLLM's)
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    return_token_strs: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    documents: list[dict[StrictStr, StrictStr]] | None = None
    # Refused unless null: not supported yet.
    tools: Unsupported = None
    chat_template: Unsupported = None
    mm_processor_kwargs: Unsupported = None

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true: send add_generation_prompt false to continue the last "
                             "message")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int  # the context: a prompt may have at most this many tokens less one
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize`` (vLLM's shape): the text of ``tokens``."""

    model: StrictStr | None = None  # None: the served model (vLLM's)
    tokens: list[Annotated[Int, Field(ge=0)]]


class LoadLoRAAdapterRequest(_Body):
    """``POST /v1/load_lora_adapter`` (vLLM's body): load the PEFT folder ``lora_path`` as
    adapter ``lora_name`` of ``model`` (None: the only model with ``enable_lora``)."""

    lora_name: StrictStr
    lora_path: StrictStr
    model: StrictStr | None = None
    # vLLM's: new weights in place under a loaded name. Refused here when true: an unload and
    # a load do it (the name comes back as a new registration, with a new id).
    load_inplace: StrictBool = False
    # Tierserve's: the tenants that own it (names an API key of the config identifies); only
    # their keys may use or see it. None: whoever the allowlists let name it.
    tenants: list[StrictStr] | None = Field(default=None, max_length=256)


class UnloadLoRAAdapterRequest(_Body):
    """``POST /v1/unload_lora_adapter`` (vLLM's body): forget adapter ``lora_name``
    (``lora_int_id``, vLLM's, is taken and not needed: the name says which)."""

    lora_name: StrictStr
    lora_int_id: Int | None = None


class LoRAAdapterAnswer(BaseModel):
    """What the adapter routes answer (JSON, where vLLM answers a line of text): the adapter,
    its parent model and what was done (``loaded``, ``already_loaded``, ``unloaded``)."""

    object: Literal["lora_adapter"] = "lora_adapter"
    id: str
    parent: str
    status: Literal["loaded", "already_loaded", "unloaded"]
    message: str


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# OpenAI's error ``type`` for each HTTP status the API answers; any other is a "server_error".
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """Every error the API returns: ``{"error": {"message", "type", "code", "param"}}``, its
    ``type`` named by ``status`` (``ERROR_TYPES``). The body of an HTTP error, and the event that
    ends a stream in an error."""
    detail = ErrorDetail(message=message, type=ERROR_TYPES.get(status, "server_error"),
                         code=code, param=param)
    return dump(ErrorResponse(error=detail))


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int | None = None) -> Usage:
    """OpenAI's usage; ``cached``: the prompt positions found in the prefix cache (None: not
    known yet, as in a stream's chunks before the replica admitted the request)."""
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=None if cached is None else PromptTokensDetails(
                     cached_tokens=cached))


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
