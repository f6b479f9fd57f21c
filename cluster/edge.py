"""What the ingress does with a request before any model work: read its body within a time and
size bound, parse it without letting its nesting exhaust the stack, and turn its prompt into
token ids off the event loop once a cheap bound says it can fit the model's context
(``docs/security.md``).

The order is the point: the caller is resolved from the headers first (``Ingress._caller``),
then the body is read (``read_json``: ``max_request_bytes``, ``body_timeout_s``), then the
prompt's length is bounded from its bytes (``PromptBound``) before the tokenizer sees it, and a
large prompt is tokenized on a small pool of its own (``Tokenizing``), so one client's megabyte
never pauses the streams the event loop is writing for everyone else.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from tierserve.records import BadRequest, RequestTimeout, TooLarge

T = TypeVar("T")

# Tokenizer normalizations may fold several bytes into one (fullwidth forms: 3 bytes to 1); the
# byte bound divides by this as well, so it never refuses a prompt that would have fitted.
_NORMALIZER_FOLD = 3
# Prompts (in characters) from which tokenizing goes to the pool instead of the event loop.
OFF_LOOP_CHARS = 2048


async def read_json(chunks: AsyncIterator[bytes], declared: str | None, limit: int,
                    timeout_s: float) -> dict[str, Any]:
    """The request body as a JSON object: 413 past ``limit`` bytes (declared or read), 408 when
    it has not all arrived within ``timeout_s``, 400 for bytes that are not a JSON object (JSON
    nested deeper than the parser's stack is one) or a string no tokenizer can encode."""
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"the request body is larger than {limit} bytes", "too_large")
    raw = bytearray()

    async def read() -> None:
        async for chunk in chunks:
            raw.extend(chunk)
            if len(raw) > limit:
                raise TooLarge(f"the request body is larger than {limit} bytes",
                               "too_large")

    try:
        await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s (read "
                             f"{len(raw)} bytes)", "body_timeout") from None
    try:
        data = json.loads(bytes(raw))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}", "invalid_json") from None
    except RecursionError:
        raise BadRequest("the request body's JSON is nested too deeply", "invalid_json"
                       ) from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", "invalid_json")
    try:  # JSON may escape a lone surrogate (\ud800): no tokenizer can encode that string
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise BadRequest("the request body has a string that is not valid Unicode "
                         "(an unpaired surrogate escape)", "invalid_json") from None
    except RecursionError:
        raise BadRequest("the request body's JSON is nested too deeply", "invalid_json"
                       ) from None
    return data


def longest_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes any token of ``tokenizer``'s vocabulary is written with: no token
    covers more bytes of text (a byte-level token writes each byte as one character of at least
    one byte; a byte-fallback token as ``<0x..>``)."""
    vocab = tokenizer.get_vocab()
    return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1


@dataclass(frozen=True, slots=True)
class PromptBound:
    """The context a prompt must fit (``context``: prompt plus one generated token) and the
    most bytes of text one token covers: a prompt of more than ``max_bytes`` UTF-8 bytes
    cannot fit, whatever the tokenizer makes of it."""

    context: int
    token_bytes: int

    @property
    def max_bytes(self) -> int:
        return (self.context - 1) * self.token_bytes * _NORMALIZER_FOLD

    def check_text(self, nbytes: int, param: str) -> None:
        """400 ``too_long`` for text of ``nbytes`` that no tokenization fits in the context."""
        if nbytes > self.max_bytes:
            least = math.ceil(nbytes / (self.token_bytes * _NORMALIZER_FOLD))
            raise BadRequest(f"the prompt is {nbytes} bytes, at least {least} tokens; this "
                             f"model's context is {self.context}, so a prompt may have at most "
                             f"{self.context - 1} tokens", "too_long", param)

    def check_ids(self, n: int, param: str) -> None:
        """400 ``too_long`` for a prompt of ``n`` token ids (the replica says the same)."""
        if n >= self.context:
            raise BadRequest(f"prompt has {n} tokens; this model's context is {self.context}, "
                             f"so a prompt may have at most {self.context - 1} tokens to "
                             "leave room for one generated token", "too_long", param)


def message_texts(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """The texts of rendered chat messages (a string content, or the ``text`` of each part of
    a list): what the prompt's length is bounded by before the template renders it."""
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out.extend(p["text"] for p in content
                       if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return out


class Tokenizing:
    """Runs tokenizer work for the ingress: small inputs inline, large ones on a pool of
    ``workers`` threads (the fast tokenizers release the GIL while they encode)."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="tierserve-tokenize")

    async def run(self, size: int, fn: Callable[[], T]) -> T:
        """``fn()``: on the pool when ``size`` (characters of input) reaches
        ``OFF_LOOP_CHARS``, else here."""
        if size < OFF_LOOP_CHARS:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
