"""Token log-probabilities in OpenAI's shapes, from the ids and numbers a replica streams.

A replica sends, per token, a ``tierserve.records.TokenLogprob`` (the id, its log-probability, the top
alternatives' ids and log-probabilities); this module turns ids into what clients expect:

- a token's exact bytes: for byte-level BPE vocabularies (GPT-2 style, SmolLM2, Llama 3, Qwen2)
  the token string mapped back through the byte-level alphabet; for SentencePiece ones ``▁``
  is a space and ``<0xNN>`` one byte; otherwise the token decoded alone;
- its text: those bytes as UTF-8, or OpenAI's ``bytes:\\xNN...`` form when they are only part of
  a character;
- the chat shape (``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``) and the
  completions one (parallel ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``
  lists; the first prompt token of an echo has no log-probability).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Protocol

from tierserve.cluster.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)
from tierserve.records import TokenLogprob
from tierserve.replica.models.byte_level import char_bytes

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


_BYTE_DECODER = char_bytes()


class TokenNames(Protocol):
    """How a log-probability entry names a token: its text and its bytes."""

    def text(self, token_id: int) -> str: ...

    def bytes(self, token_id: int) -> bytes: ...


class TokenIdNames:
    """vLLM's ``return_tokens_as_token_ids``: every token named ``token_id:<id>`` (its bytes
    those of that name), so a token that is no whole character is still told apart."""

    def text(self, token_id: int) -> str:
        return f"token_id:{int(token_id)}"

    def bytes(self, token_id: int) -> bytes:
        return self.text(token_id).encode()


class TokenText:
    """Bytes and text of a tokenizer's tokens (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        tok = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(tok, str):
            if self.byte_level and all(c in _BYTE_DECODER for c in tok):
                return bytes(_BYTE_DECODER[c] for c in tok)
            m = _BYTE_TOKEN.fullmatch(tok)
            if m:
                return bytes([int(m.group(1), 16)])
            if "▁" in tok:
                return tok.replace("▁", " ").encode()
        return str(self.tokenizer.decode([int(token_id)])).encode()

    def text(self, token_id: int) -> str:
        raw = self.bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenNames) -> ChatLogprobs:
    content = []
    for e in entries:
        tok, lp, top = e.token, e.logprob, e.top
        content.append(
            ChatTokenLogprob(
                token=text.text(tok),
                logprob=lp,
                bytes=list(text.bytes(tok)),
                top_logprobs=[
                    TopLogprob(token=text.text(i), logprob=x, bytes=list(text.bytes(i)))
                    for i, x in top
                ],
            )
        )
    return ChatLogprobs(content=content)


def completion_logprobs(
    entries: Sequence[TokenLogprob | None],
    text: TokenNames,
    offset: int = 0,
    prompt_ids: Sequence[int] = (),
) -> CompletionLogprobs:
    """``entries``: one per token (None for the echoed prompt's first token, whose id is
    ``prompt_ids[0]``); ``offset``: the text offset of the first token."""
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for i, e in enumerate(entries):
        if e is None:
            tok_text = text.text(prompt_ids[i]) if i < len(prompt_ids) else ""
            out.tokens.append(tok_text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            tok, lp, top = e.token, e.logprob, e.top
            tok_text = text.text(tok)
            out.tokens.append(tok_text)
            out.token_logprobs.append(lp)
            alts: dict[str, float] = {}
            for j, x in top:
                alts.setdefault(text.text(j), x)
            out.top_logprobs.append(alts)
        out.text_offset.append(offset)
        offset += len(tok_text)
    return out


def prompt_logprobs(entries: Sequence[TokenLogprob | None], text: TokenNames
                    ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` shape of a replica's prompt entries: per position, the
    prompt's token (its rank in the model's distribution, where the replica computed it) and
    the alternatives sent, by id (the first position has none: null)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranks = {tok: j + 1 for j, (tok, _) in enumerate(e.top)}
        rank = e.rank if e.rank is not None else ranks.get(e.token)
        entry = {str(e.token): PromptLogprob(logprob=e.logprob, rank=rank,
                                             decoded_token=text.text(e.token))}
        for tok, lp in e.top:
            entry.setdefault(str(tok), PromptLogprob(logprob=lp, rank=ranks[tok],
                                                     decoded_token=text.text(tok)))
        out.append(entry)
    return out
