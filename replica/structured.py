"""Structured outputs in the replica: grammars compiled once per replica, a matcher per sample,
and the token masks the sampler applies (docs/structured.md).

The grammar library is xgrammar (token bitmasks over the vocabulary, an Earley-style matcher
per sequence; ``bench/structured.py`` measured it against llguidance on this model's
tokenizer). ``Grammars`` compiles a request's ``StructuredOutput`` on a thread of its own, off
the step loop, and keeps every compiled grammar by its spec (``StructuredOutput.key``): the
same schema is compiled once per replica, and requests that ask for it while it compiles wait
for that one compilation. ``Constraint`` is one sample's matcher: the sampler asks it for the
mask of the next token (``apply_constraints``, one bitmask for the batch's constrained rows)
and tells it the token drawn. It lives with the request's sampler state, so it survives
preemption by recompute (the kept tokens were accepted already) and is never shared by two
samples.

xgrammar is imported on first use: a replica that never sees a structured request does not
load it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tierserve.records import StructuredOutput

if TYPE_CHECKING:
    import torch
    import xgrammar

    from tierserve.replica.sampler import TokenConstraint


class GrammarError(ValueError):
    """A structured output that does not compile (a schema, regex or grammar xgrammar refuses);
    ``param`` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[GrammarError], tuple[str, str]]:
        return type(self), (str(self), self.param)


# Whitespace characters JSON may put between two of its tokens: enough for any indentation a
# model writes, and a bound on a small model that would otherwise fill its answer with blanks.
MAX_WHITESPACE = 16

# Called after each compilation (its kind and seconds) and each lookup (hit or not).
CompileObserver = Callable[[str, float], None]
CacheObserver = Callable[[bool], None]


# Where a JSON schema holds subschemas: by name, in a list, or one (a list too: the old array
# form of ``items``).
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_ONE = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems",
            "unevaluatedProperties")
# A JSON string's characters without escapes, control characters or surrogates.
_PLAIN_CHARS = '[^"\\\\\\x00-\\x1f\\uD800-\\uDFFF]'


def subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each direct subschema of ``schema`` with its path from it (``properties/a``,
    ``anyOf/0``, ``items``)."""
    for key in _SUB_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield f"{key}/{name}", sub
    for key in _SUB_LISTS + _SUB_ONE:
        sub = schema.get(key)
        if isinstance(sub, list) and (key in _SUB_LISTS or key == "items"):
            for i, s in enumerate(sub):
                yield f"{key}/{i}", s
        elif key in _SUB_ONE and sub is not None:
            yield key, sub


def map_subschemas(schema: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A copy of ``schema`` with ``fn`` applied to each direct subschema (``subschemas``)."""
    out = dict(schema)
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    for key in _SUB_LISTS + _SUB_ONE:
        sub = out.get(key)
        if isinstance(sub, list) and (key in _SUB_LISTS or key == "items"):
            out[key] = [fn(v) for v in sub]
        elif key in _SUB_ONE and sub is not None:
            out[key] = fn(sub)
    return out


def enforceable(schema: Any) -> Any:
    """``schema`` as the grammar is compiled from it: every output still validates against the
    original.

    - An object schema that lists its ``properties`` and says nothing of others
      (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``) gets only
      those: a model given room for extra keys (a tool's arguments, a record) may fill its
      answer with them instead of ending it.
    - A string bounded by ``minLength``/``maxLength`` (and no ``pattern``, ``format``, ``enum``
      or ``const``) becomes that many plain characters: xgrammar's bounded string lets control
      characters through, which no JSON parser takes.
    """
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, enforceable)
    if ("properties" in out and not {"additionalProperties", "patternProperties",
                                     "unevaluatedProperties"} & out.keys()):
        out["additionalProperties"] = False
    bounded = {"minLength", "maxLength"} & out.keys()
    if (out.get("type") == "string" and bounded
            and not {"pattern", "format", "enum", "const"} & out.keys()):
        lo, hi = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^{_PLAIN_CHARS}{{{lo},{hi}}}$"
    return out


def _literal(text: str) -> str:
    """An EBNF string literal matching ``text`` exactly (JSON's escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF of one of ``choices``, verbatim."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


class Grammars:
    """One replica's compiled grammars, by spec, and the thread that compiles them."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Sequence[int],
        on_compile: CompileObserver | None = None,
        on_lookup: CacheObserver | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.on_compile = on_compile
        self.on_lookup = on_lookup
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._futures: dict[tuple[str, str, bool, str, str], Future[Any]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierserve-grammar")
        self.compiled = 0  # compilations run (not lookups)

    # ------------------------------------------------------------------ compiling

    def _compiler_of(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
            # One thread: it runs beside the step loop, which owns the replica's cores.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _build(self, spec: StructuredOutput) -> Any:
        import xgrammar as xgr

        t0 = time.perf_counter()
        compiler = self._compiler_of()
        try:
            if spec.kind == "json":
                schema = xgr.Grammar.from_json_schema(
                    json.dumps(enforceable(json.loads(spec.spec))),
                    any_whitespace=spec.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=MAX_WHITESPACE if spec.any_whitespace else None)
                if spec.prefix or spec.suffix:
                    parts = [xgr.Grammar.from_ebnf(f"root ::= {_literal(spec.prefix)}"), schema,
                             xgr.Grammar.from_ebnf(f"root ::= {_literal(spec.suffix)}")]
                    schema = xgr.Grammar.concat(*parts)
                compiled = compiler.compile_grammar(schema)
            elif spec.kind == "json_object":
                compiled = compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=spec.any_whitespace, strict_mode=False,
                    max_whitespace_cnt=MAX_WHITESPACE if spec.any_whitespace else None)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.spec)
            elif spec.kind == "choice":
                choices = json.loads(spec.spec)
                if not isinstance(choices, list) or not choices or not all(
                        isinstance(c, str) for c in choices):
                    raise ValueError("choice must be a non-empty list of strings")
                compiled = compiler.compile_grammar(choice_grammar(choices))
            else:  # grammar (StructuredOutput checked the kind)
                compiled = compiler.compile_grammar(spec.spec)
        except Exception as e:  # xgrammar raises RuntimeError with the parser's message
            raise GrammarError(f"{spec.param}: the {spec.kind} does not compile: "
                               f"{_reason(e)}", spec.param) from None
        seconds = time.perf_counter() - t0
        self.compiled += 1
        if self.on_compile is not None:
            self.on_compile(spec.kind, seconds)
        return compiled

    def _future(self, spec: StructuredOutput, count: bool = True) -> Future[Any]:
        """The compilation of ``spec``: done, under way, or started now. A failed one is not
        kept (the next request with that spec gets the same error, compiled again). ``count``:
        report the lookup (once per request)."""
        with self._lock:
            future = self._futures.get(spec.key)
            hit = future is not None
            if future is None:
                future = self._pool.submit(self._build, spec)
                self._futures[spec.key] = future
        if count and self.on_lookup is not None:
            self.on_lookup(hit)
        if not hit:
            future.add_done_callback(lambda f: self._forget_failed(spec, f))
        return future

    def _forget_failed(self, spec: StructuredOutput, future: Future[Any]) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._futures.get(spec.key) is future:
                    del self._futures[spec.key]

    async def prepare(self, spec: StructuredOutput) -> None:
        """Wait, without blocking the event loop or the step loop, until ``spec`` is compiled;
        raises ``GrammarError`` when it does not compile."""
        await asyncio.wrap_future(self._future(spec))

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``, compiling it on the grammar thread when it is new
        (the caller waits: the offline path, or a request whose compilation ``prepare`` already
        awaited)."""
        return self._future(spec).result()

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher for one sample (compiling ``spec`` first if no one has: the lookup
        is not counted, ``prepare`` or ``compile`` counts it once per request)."""
        import xgrammar as xgr

        compiled = self._future(spec, count=False).result()
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids)
        return Constraint(matcher)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(e: BaseException) -> str:
    """xgrammar's message without its source location (``[time] path.cc:123: reason``)."""
    text = str(e).strip()
    head, sep, tail = text.partition(": ")
    if sep and head.startswith("[") and ".cc:" in head:
        text = tail
    return text.splitlines()[0] if text else type(e).__name__


class Constraint:
    """One sample's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (nothing changes)."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output ends here."""
        return bool(self.matcher.is_terminated())


def apply_constraints(logits: torch.Tensor, rows: Sequence[int],
                      constraints: Sequence[TokenConstraint]) -> None:
    """Set to -inf, in ``logits`` ``[R, V]``, every token the grammar of row ``rows[i]`` does
    not allow next. One bitmask for the step, filled row by row on the host, applied in one
    call on the logits' device (each row's mask is its own: the rows do not affect each other)."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], vocab)
    for r, c in zip(rows, constraints, strict=True):
        c.fill(bitmask, r)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=list(rows))
