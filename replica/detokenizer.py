"""Incremental detokenization and stop strings.

Text is emitted only once it is whole: a token that ends inside a UTF-8 character (the decoder
shows U+FFFD) is held until the character completes, or until ``MAX_HOLD`` tokens show it never
will. Only a short window of tokens is decoded per step (the previous emission's tokens give the
context that word-piece and SentencePiece decoders need for leading spaces), so a step costs O(1)
in the length of the output. With stop strings, the last ``len(longest stop) - 1`` characters are
held back until they can no longer begin a stop string; a matched stop string is not returned
(unless ``include_stop``: then the text ends with it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tierserve.records import MAX_BAD_WORD_TOKENS, InvalidSamplingParam

MAX_HOLD = 6  # tokens; a UTF-8 character is at most 4 bytes
PROMPT_CONTEXT = 4  # prompt tokens decoded before the first generated one


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Per request: ``add(token)`` returns the text that became final; ``finish()`` the rest."""

    __slots__ = (
        "_hold",
        "_include_stop",
        "_max_stop",
        "_prefix",
        "_read",
        "_sent",
        "_skip",
        "_stops",
        "_text",
        "_tok",
        "_tokens",
        "stopped",
    )

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_ids: Sequence[int],
        stop: Sequence[str] | None = None,
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self._tok = tokenizer
        ctx = list(prompt_ids[-PROMPT_CONTEXT:])
        self._tokens: list[int] = ctx
        self._prefix = 0  # window start: tokens before it are fully emitted
        self._read = len(ctx)  # tokens before it have been turned into text
        self._skip = skip_special_tokens
        self._stops = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._include_stop = include_stop  # a matched stop string ends the text, not cut
        self._text = ""  # decoded text of the generated tokens, up to ``_read``
        self._sent = 0  # characters of ``_text`` already returned
        self._hold = 0
        self.stopped: str | None = None  # the stop string that matched, if any

    @property
    def text(self) -> str:
        """Everything decoded so far (without a matched stop string and what follows it)."""
        return self._text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token: int) -> str:
        """Feed one generated token; return the newly final text (may be empty)."""
        if self.stopped is not None:
            return ""
        self._tokens.append(token)
        before = self._decode(self._tokens[self._prefix : self._read])
        full = self._decode(self._tokens[self._prefix :])
        if full.endswith("\ufffd") and self._hold < MAX_HOLD:
            self._hold += 1
            return ""
        self._hold = 0
        new = full[len(before) :] if full.startswith(before) else full
        self._prefix, self._read = self._read, len(self._tokens)
        return self._append(new)

    def feed(self, tokens: Sequence[int]) -> None:
        """Take generated tokens without decoding them; ``finish()`` decodes them in one window.
        Only for a request without stop strings (they are matched as text arrives)."""
        if self._stops:
            raise ValueError("feed() skips stop-string matching; use add() with stop strings")
        self._tokens.extend(tokens)

    def _append(self, new: str, final: bool = False) -> str:
        start = len(self._text)
        self._text += new
        if self._stops:
            lo = max(0, start - self._max_stop + 1)
            hits = [(i, s) for s in self._stops if (i := self._text.find(s, lo)) >= 0]
            if hits:
                idx, s = min(hits)
                self.stopped = s
                end = idx + len(s) if self._include_stop else idx
                self._text = self._text[:end]
                return self._emit(end)
            if not final:
                return self._emit(len(self._text) - (self._max_stop - 1))
        return self._emit(len(self._text))

    def _emit(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        out = self._text[self._sent : upto]
        self._sent = upto
        return out

    def finish(self) -> str:
        """At the end of the request: everything still held back."""
        new = ""
        if self.stopped is None and self._read < len(self._tokens):
            before = self._decode(self._tokens[self._prefix : self._read])
            full = self._decode(self._tokens[self._prefix :])
            self._read = len(self._tokens)
            new = full[len(before) :] if full.startswith(before) else full
        if self.stopped is not None:
            return self._emit(len(self._text))
        return self._append(new, final=True)


def bad_words_ids(tokenizer: Any, words: Sequence[str]) -> list[list[int]]:
    """The token sequences of vLLM's ``bad_words`` (``SamplingParams.bad_words_ids``): each
    word as written and, where it tokenizes to as many tokens with a leading space, that way
    too (the word mid-sentence). The ingress and the offline ``LLM`` both tokenize them here.
    A word of no token or of more than ``MAX_BAD_WORD_TOKENS`` is an ``InvalidSamplingParam``
    naming it (``bad_words.<i>``)."""
    out: list[list[int]] = []
    for i, word in enumerate(words):
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain or max(len(plain), len(spaced)) > MAX_BAD_WORD_TOKENS:
            raise InvalidSamplingParam(f"bad_words.{i}: a bad word is 1 to {MAX_BAD_WORD_TOKENS} "
                                       f"tokens, {word[:32]!r} is {len(plain)}", f"bad_words.{i}")
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
