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
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    WithJsonSchema,
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


def _only_false(value: bool) -> bool:
    if value:
        raise ValueError("only false is supported")
    return value


# A flag this server accepts for compatibility but does not implement: true is a clear 400.
Unsupported = Annotated[
    StrictBool,
    AfterValidator(_only_false),
    WithJsonSchema({"type": "boolean", "enum": [False], "description": "only false is supported"}),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _SamplingFields(_Body):
    model: StrictStr
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] = 1.0
    # Bounded: the sampler builds an int64 tensor of the batch's k values.
    top_k: Annotated[Int, Field(ge=-1, le=2**31 - 1)] = 0
    seed: Annotated[Int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[Int, Field(ge=1, le=1, description="only 1 is supported")] = 1
    user: StrictStr | None = None
    presence_penalty: Annotated[Number, Field(ge=0.0, le=0.0)] = 0.0
    frequency_penalty: Annotated[Number, Field(ge=0.0, le=0.0)] = 0.0

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string or a list of token ids (one prompt)."""

    prompt: StrictStr | list[Annotated[Int, Field(ge=0)]]
    max_tokens: Annotated[Int, Field(ge=1)] | None = 16
    echo: Unsupported = False
    logprobs: None = Field(default=None, description="not supported")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant"]
    content: StrictStr
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: Unsupported = False


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tierserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int) -> Usage:
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json")
