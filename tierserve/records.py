"""The records every process of the cluster shares, at the bottom of the package: this module
imports nothing of tierserve's (the layer test, tests/test_imports.py, holds it to that), and
every layer above imports it (docs/architecture.md, "The layers").

The ingress sends a replica one ``GenerateRequest`` (its router reads the same record to size the
request); the replica streams back ``RequestOutput`` deltas, or a single ``ErrorRecord`` when it
refuses the request (an HTTP status for the ingress to answer: ``ServingError.record``, the
one type every refusal subclasses, makes it); ``EngineStats`` is what an engine reports about itself, from which the gauges
(``tierserve.replica.metrics``) and ``RoutingStats`` are derived.

``RoutingStats`` is the ``record_routing_stats`` contract: the replica's deployment returns
``RoutingStats(...).to_dict()`` from ``record_routing_stats``; Serve's controller calls it about
once per ``request_routing_stats_period_s`` and hands the dict to every router as
``RunningReplica.routing_stats`` (an empty dict until the first report).

Torch-free and Ray-free: the ingress and the router import it without the model code.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Final

RequestId = int

# Positions per KV block when nothing says otherwise: the engine's default ``block_size``, and
# what a router assumes of a replica that has not reported yet.
DEFAULT_BLOCK_SIZE: Final = 16
GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0

# Caps on a request's sampling inputs: ``SamplingParams`` refuses more, and the API's request
# models (``tierserve.cluster.protocol``) take their ``max_length`` from them, so that a request
# is refused (400) before anything else reads it. Whatever their lengths, a step applies a
# request's token-id inputs at a constant cost (built once, on the device); the caps bound what
# a request costs to check, build and ship, and what the stop strings cost each step on the host.
MAX_STOP_TOKEN_IDS: Final = 128
MAX_LOGIT_BIAS_ENTRIES: Final = 1024
MAX_STOP_STRINGS: Final = 64  # the ingress's ``max_stop_strings`` may allow fewer
MAX_STOP_STRING_CHARS: Final = 256
MAX_ALLOWED_TOKEN_IDS: Final = 4096
MAX_BAD_WORDS: Final = 64  # strings, at the API (``bad_words``)
MAX_BAD_WORD_CHARS: Final = 256
# The engine's bad words are token-id sequences (``SamplingParams.bad_words_ids``): the ingress
# tokenizes each word twice (as it starts the text and after a space), hence twice as many.
MAX_BAD_WORDS_IDS: Final = 2 * MAX_BAD_WORDS
MAX_BAD_WORD_TOKENS: Final = 16

# ``RequestOutput.error_code`` of an output that left its structured output's grammar.
GRAMMAR_REJECTED_TOKEN: Final = "grammar_rejected_token"
# ``RequestOutput.error_code`` (and the 503's code) of a request whose LoRA adapter this replica
# could not load: the server's fault, not the request's, so the ingress may try another replica.
ADAPTER_UNAVAILABLE: Final = "adapter_unavailable"


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class ServingError(Exception):
    """Every refusal of a request, wherever it is made: the HTTP ``status`` it is answered
    with, a stable ``code`` (the error body's ``code``, a metric's label), the request's field at
    fault (``param``, where one is), for a refusal under load the seconds after which to retry
    (``retry_after``; None: the config's ``retry_after_s`` for a 429), and for a replica's own
    failure the replica (``replica``). Subclasses set ``status`` and ``code`` for their kind;
    an instance may name its own. The replica's deployment turns one into an ``ErrorRecord``
    (``record``) and the ingress answers one as the API's error JSON or a stream's last event,
    each in one place. It crosses processes whole (``__reduce__``)."""

    status: int = 400
    code: str = "invalid_request"
    param: str | None = None

    def __init__(self, message: str, code: str | None = None, param: str | None = None, *,
                 status: int | None = None, retry_after: int | None = None,
                 replica: str = "") -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param
        if status is not None:
            self.status = status
        self.retry_after = retry_after
        self.replica = replica

    @property
    def message(self) -> str:
        """What went wrong, for the client (the exception's text, a caller's prefix
        included)."""
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_error, (type(self), self.message, dict(self.__dict__))

    def record(self) -> ErrorRecord:
        """What a replica streams back for this refusal."""
        return ErrorRecord(self.status, self.code, self.message, self.param, self.replica)

    @classmethod
    def of(cls, record: ErrorRecord) -> ServingError:
        """A replica's ``ErrorRecord`` as the error the ingress answers."""
        return ServingError(record.message, record.code, record.param, status=record.status,
                            replica=record.replica)


def _rebuild_error(kind: type[ServingError], message: str, state: dict[str, Any]) -> ServingError:
    """``ServingError.__reduce__``'s other half: the same class and fields, whatever the
    subclass's own ``__init__`` takes."""
    error = kind.__new__(kind)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class BadRequest(ServingError):
    """400: the request can never be served as sent."""


class Unauthorized(ServingError):
    """401: no key, or one the server does not know, where a key is required."""

    status = 401
    code = "invalid_api_key"


class NotFound(ServingError):
    """404: the thing the request names does not exist (a model id)."""

    status = 404
    code = "not_found"


class RequestTimeout(ServingError):
    """408: the request's body did not arrive in time."""

    status = 408
    code = "body_timeout"


class TooLarge(ServingError):
    """413: the request's body is larger than the server takes."""

    status = 413
    code = "too_large"


class TooManyRequests(ServingError):
    """429: not now; the same request may be served later (``retry_after``)."""

    status = 429
    code = "busy"


class ServerFault(ServingError):
    """500: a fault of the server's, never the client's."""

    status = 500
    code = "internal_error"


class Unavailable(ServingError):
    """503: no replica could serve the request now."""

    status = 503
    code = "replica_unavailable"


class InvalidSamplingParam(BadRequest, ValueError):
    """A sampling parameter out of its range; ``param`` names the field (``logit_bias.7``,
    ``stop_token_ids.0``: the entry at fault), as an HTTP error's ``param`` does."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param=param)


class LoRAError(BadRequest, ValueError):
    """A LoRA adapter that cannot be loaded or used, and why: a bad or missing adapter folder,
    a rank above ``max_lora_rank``, what the server does not apply (DoRA, embeddings,
    ``modules_to_save``), shapes of another base model, or adapters off (``enable_lora``)."""

    code = "invalid_lora_adapter"


class LoRANotFound(LoRAError):
    """404: the adapter named is not loaded (and the request gives no path to load it)."""

    status = 404
    code = "lora_not_found"


class LoRAInUse(LoRAError):
    """409: the adapter to unload has requests running or waiting on it: unload it once they
    finish (refused, not deferred, so that the caller knows when it is gone)."""

    status = 409
    code = "lora_in_use"


class AdapterUnavailable(ServingError):
    """503: this replica could not load the request's LoRA adapter (its folder missing or
    unreadable here, another replica may have it). The message names the adapter only, never
    its path (the detail goes to the replica's log); ``replica`` makes the ingress try another
    replica, as for ``replica_unavailable``."""

    status = 503
    code = ADAPTER_UNAVAILABLE


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must match (docs/structured.md): the replica compiles it into a
    grammar and masks every sampled token to it.

    ``kind``: ``json`` (``spec`` a JSON schema as JSON text), ``json_object`` (any JSON object;
    ``spec`` empty), ``regex``, ``choice`` (``spec`` a JSON list of the allowed strings) or
    ``grammar`` (EBNF). ``prefix`` and ``suffix``: literal text around a ``json`` output (a tool
    call's tags). ``any_whitespace``: JSON may put whitespace between its tokens (else none).
    ``param``: the request field it came from, named by a compile error.
    """

    kind: str
    spec: str = ""
    param: str = "structured_outputs"
    any_whitespace: bool = True
    prefix: str = ""
    suffix: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidSamplingParam(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}", self.param)
        if not isinstance(self.spec, str) or (not self.spec and self.kind != "json_object"):
            raise InvalidSamplingParam(f"a {self.kind} structured output needs its spec",
                                       self.param)
        if (self.prefix or self.suffix) and self.kind != "json":
            raise InvalidSamplingParam("prefix and suffix go with a json structured output",
                                       self.param)

    @property
    def key(self) -> tuple[str, str, bool, str, str]:
        """What names its compiled grammar in a replica's cache."""
        return (self.kind, self.spec, self.any_whitespace, self.prefix, self.suffix)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop (close to vLLM's ``SamplingParams``).

    temperature 0 is greedy. top_k 0 (or -1), top_p 1.0 and min_p 0 disable those filters.
    ``stop`` strings are matched on the detokenized text and not returned; ``stop_token_ids`` end
    the request like EOS; ``ignore_eos`` keeps generating past EOS. ``min_tokens``: EOS and the
    stop token ids cannot be drawn before that many tokens. Penalties and ``logit_bias`` (token
    id -> bias in [-100, 100]) as in the module docstring. ``allowed_token_ids``: only these ids
    may be drawn. ``bad_words_ids``: token-id sequences the output may not contain (vLLM's bad
    words: a one-token word is never drawn; a longer one's last token is not drawn after the
    output's last tokens match the rest of it; the ingress tokenizes the API's ``bad_words``).
    The counts and lengths of ``stop``, ``stop_token_ids``, ``logit_bias``,
    ``allowed_token_ids`` and ``bad_words_ids`` are capped (``MAX_STOP_TOKEN_IDS`` and the
    others). ``logprobs``: with every generated token, its log-probability and the ``logprobs``
    most likely alternatives (0: the token's alone); ``prompt_logprobs``: the same for every prompt token after the first. ``max_tokens``
    0 generates nothing (with ``prompt_logprobs``: scoring a prompt). ``structured``: the
    output is constrained to it (a ``StructuredOutput``; the grammar decides where it ends, so
    it takes neither ``min_tokens`` nor ``max_tokens`` 0).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_ids: list[list[int]] | None = None
    # The text: special tokens left out of it (as the tokenizer's decode skips them); a matched
    # stop string kept at its end.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Samples per prompt in the offline ``LLM.generate`` (vLLM's ``n``; a served request's
    # count is its ``GenerateRequest.n``, which ``GenerateRequest.of`` takes from here).
    n: int = 1
    # vLLM's ``bad_words`` as words: the offline ``LLM`` tokenizes them into ``bad_words_ids``
    # (``tierserve.replica.detokenizer.bad_words_ids``, as the ingress does the API's); the
    # engine takes token ids only and refuses a record that still has words.
    bad_words: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidSamplingParam`` (a ``ValueError``) naming the first field out of range.

        These are the parameters' ranges, checked once, when the record is made (``__post_init__``;
        ``dataclasses.replace`` makes a new one): the offline ``LLM``, the engine and the ingress
        all take their parameters as this record and do not check them again. The model's
        vocabulary is the engine's to check (``stop_token_ids``, ``logit_bias`` keys)."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidSamplingParam(
                f"max_tokens must be an integer, got {self.max_tokens!r}", "max_tokens")
        if self.max_tokens < 0:
            raise InvalidSamplingParam(
                f"max_tokens must be at least 0, got {self.max_tokens}", "max_tokens")
        if not _number(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            raise InvalidSamplingParam(
                f"temperature must be in [0, 100], got {self.temperature!r}", "temperature")
        if not _number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParam(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidSamplingParam(
                f"top_k must be an integer >= 0 (0 or -1: off), got {self.top_k!r}", "top_k")
        if not _number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParam(f"min_p must be in [0, 1], got {self.min_p!r}", "min_p")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise InvalidSamplingParam(f"seed must be an integer, got {self.seed!r}", "seed")
        if self.stop is not None:
            if isinstance(self.stop, str):
                self.stop = [self.stop]
            _at_most(self.stop, MAX_STOP_STRINGS, "stop", "strings")
            if any(not isinstance(s, str) or not s for s in self.stop):
                raise InvalidSamplingParam("stop must be a list of non-empty strings", "stop")
            for i, text in enumerate(self.stop):
                if len(text) > MAX_STOP_STRING_CHARS:
                    raise InvalidSamplingParam(
                        f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                        f"stop {i} has {len(text)}", f"stop.{i}")
        if self.stop_token_ids is not None:
            _token_ids(self.stop_token_ids, MAX_STOP_TOKEN_IDS, "stop_token_ids")
        if self.allowed_token_ids is not None:
            _token_ids(self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids")
            if not self.allowed_token_ids:
                raise InvalidSamplingParam(
                    "allowed_token_ids must name at least one token id (omit it to allow all)",
                    "allowed_token_ids")
        if self.bad_words_ids is not None:
            _at_most(self.bad_words_ids, MAX_BAD_WORDS_IDS, "bad_words_ids", "token sequences")
            for i, word in enumerate(self.bad_words_ids):
                if not isinstance(word, (list, tuple)) or not word:
                    raise InvalidSamplingParam(
                        "bad_words_ids must be a list of non-empty lists of token ids",
                        f"bad_words_ids.{i}")
                if len(word) > MAX_BAD_WORD_TOKENS:
                    raise InvalidSamplingParam(
                        f"a bad word may have at most {MAX_BAD_WORD_TOKENS} tokens, "
                        f"bad_words_ids {i} has {len(word)}", f"bad_words_ids.{i}")
                _token_ids(word, MAX_BAD_WORD_TOKENS, f"bad_words_ids.{i}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int):
            raise InvalidSamplingParam(
                f"min_tokens must be an integer, got {self.min_tokens!r}", "min_tokens")
        if not 0 <= self.min_tokens <= max(self.max_tokens, 0):
            raise InvalidSamplingParam(
                f"min_tokens must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}",
                "min_tokens",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -2.0 <= value <= 2.0:
                raise InvalidSamplingParam(f"{name} must be in [-2, 2], got {value!r}", name)
        if not _number(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= 10.0:
            raise InvalidSamplingParam(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty!r}",
                "repetition_penalty",
            )
        if self.logit_bias is not None:
            _at_most(self.logit_bias, MAX_LOGIT_BIAS_ENTRIES, "logit_bias", "entries")
            for tok, bias in self.logit_bias.items():
                if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                    raise InvalidSamplingParam(
                        f"logit_bias keys must be token ids >= 0, got {tok!r}", "logit_bias")
                if not _number(bias) or abs(bias) > MAX_LOGIT_BIAS:
                    raise InvalidSamplingParam(
                        f"logit_bias values must be in [-100, 100], got {bias!r}",
                        f"logit_bias.{tok}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int)
                or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InvalidSamplingParam(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", name)
        if self.bad_words is not None:
            _at_most(self.bad_words, MAX_BAD_WORDS, "bad_words", "words")
            for i, text in enumerate(self.bad_words):
                if not isinstance(text, str) or not text or len(text) > MAX_BAD_WORD_CHARS:
                    raise InvalidSamplingParam(
                        f"bad_words must be strings of 1 to {MAX_BAD_WORD_CHARS} characters, "
                        f"bad_words {i} is {text!r:.40}", f"bad_words.{i}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise InvalidSamplingParam(f"n must be an integer of at least 1, got {self.n!r}", "n")
        s = self.structured
        if s is not None:
            if not isinstance(s, StructuredOutput):
                raise InvalidSamplingParam(
                    f"structured must be a StructuredOutput, got {type(s).__name__}", "structured")
            if self.max_tokens == 0:
                raise InvalidSamplingParam(
                    "a structured output needs max_tokens of at least 1 (0 generates nothing "
                    "to constrain)", s.param)
            if self.min_tokens:
                raise InvalidSamplingParam(
                    "min_tokens cannot go with a structured output: its grammar decides where "
                    "the output ends", "min_tokens")

    @property
    def greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` are greedy (dividing by them would overflow)."""
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Whether any penalty applies (they need the request's token counts)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _at_most(items: Any, cap: int, name: str, what: str) -> None:
    try:
        n = len(items)
    except TypeError:
        raise InvalidSamplingParam(f"{name} must be a list, got {type(items).__name__}",
                                   name) from None
    if n > cap:
        raise InvalidSamplingParam(f"{name} may have at most {cap} {what}, got {n}", name)


def _token_ids(ids: Any, cap: int, name: str) -> None:
    """Refuse more than ``cap`` entries, or an entry that is not a token id (naming it)."""
    _at_most(ids, cap, name, "token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidSamplingParam(f"{name} must be a list of non-negative integers",
                                       f"{name}.{i}")


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and the ``top`` most likely tokens at its position (ids and
    log-probabilities, most likely first). ``rank``: the token's place in the model's
    distribution at its position (1: the most likely; None where not computed)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None



@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter a request runs under, in vLLM's fields: ``lora_name`` (what it is called,
    the key of a replica's loaded adapters and of its prefix-cache blocks), ``lora_int_id`` (a
    positive id, vLLM's) and ``lora_path`` (the PEFT adapter folder, read on first use where
    the adapter is not loaded yet). An adapter's identity is its name *and* id (``key``): a
    replica keys its loaded adapters, their slots and their prefix-cache blocks by it, so a name
    loaded again from other weights (a new id) never meets the old copy's blocks."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if (isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string, got {self.lora_path!r}")

    @property
    def key(self) -> str:
        """The adapter's identity, ``name#id``: what replicas, their routing stats and the
        router key an adapter by."""
        return f"{self.lora_name}#{self.lora_int_id}"


def static_lora_id(name: str, path: str) -> int:
    """The ``lora_int_id`` of a static adapter (``lora_modules``) of ``name`` at ``path`` (as the
    config writes it): a positive 63-bit number from their SHA-256, so the ingress's registry and
    every replica give it the same id without passing it."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1) or 1


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """One request from the ingress to a replica: ``n`` samples of ``prompt_ids``.

    ``queue_share``: the caller's tier may fill this fraction of the replica's waiting queue
    (lower tiers are refused first under load); ``tier``: its name, for the metrics.
    ``latency``: route it for its first token (the top tier's requests) rather than for room.
    ``prefix_hashes``: the names of the prompt's full blocks in the replicas' prefix caches
    (``tierserve.replica.prefix_cache.block_hashes``), for the router's prefix affinity; empty when the
    cache is off. The replica does not read them (it names its blocks itself).
    ``avoid_replicas``: unique ids of replicas that failed this request before it produced
    anything (``ErrorRecord.replica``): the router sends a retry elsewhere while it can.
    ``ttft_target_s``, ``tpot_target_s``: the latency its tier promises (None: no target); the
    replica's SLO-aware steps keep the TPOT target, the router prefers a replica with a seat
    for it. ``waited_s``: seconds since the request reached the ingress (held there, or sent to
    a replica that failed it): its time to first token counts from then (the replica's
    autoscaling report, ``tierserve.replica.load_report``). ``tenant``: who asked, inside the
    tier (grammar compiles are capped per tenant). ``cache_partition``: the prefix-cache
    partition of the prompt's blocks (None: the shared one; see ``docs/security.md``).
    ``request_id``: the HTTP request's id at the ingress (its ``X-Request-Id``, sent or made;
    empty from an in-process caller): the replica's log lines about this request carry it.
    ``traceparent``: the W3C trace context of the ingress's span that sent it ("" when tracing
    is off or from an in-process caller): the replica's spans join that trace
    (``tierserve.cluster.tracing``). ``lora``: the adapter it runs under (None: the base model);
    a replica without ``enable_lora`` refuses it.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    tier: str = ""
    queue_share: float = 1.0
    n: int = 1
    latency: bool = False
    prefix_hashes: tuple[int, ...] = ()
    avoid_replicas: tuple[str, ...] = ()
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None
    waited_s: float = 0.0
    tenant: str = ""
    cache_partition: str | None = None
    request_id: str = ""
    traceparent: str = ""
    lora: LoRARequest | None = None

    @classmethod
    def of(cls, prompt_ids: Sequence[int], sampling: SamplingParams | None = None,
           **kw: Any) -> GenerateRequest:
        """A request of ``prompt_ids`` (any sequence) and ``sampling`` (the defaults when
        None), the other fields by name (``n``: the sampling's own unless given): how an
        in-process caller makes one."""
        sampling = sampling if sampling is not None else SamplingParams()
        kw.setdefault("n", sampling.n)
        return cls(tuple(prompt_ids), sampling, **kw)

    @property
    def ttft_left_s(self) -> float | None:
        """Seconds left until its tier's first-token target when it reaches the replica (the
        target less what it waited before); None without a target."""
        return None if self.ttft_target_s is None else self.ttft_target_s - self.waited_s

    @property
    def prompt_tokens(self) -> int:
        """Prompt positions the replica holds for the request (each sample its own)."""
        return len(self.prompt_ids) * self.n

    @property
    def max_new_tokens(self) -> int:
        """Tokens it may generate in all (each sample its ``max_tokens``)."""
        return self.sampling.max_tokens * self.n


@dataclass(slots=True)
class RequestOutput:
    """One delta of a request: the text and token ids made since the last delta.

    ``finished`` marks the last delta; then ``finish_reason`` is ``"stop"``, ``"length"``,
    ``"abort"`` or ``"error"`` (with ``failure`` saying what went wrong, and ``error_code`` what
    kind of error: None for the replica's engine failing, which the ingress may send elsewhere;
    ``GRAMMAR_REJECTED_TOKEN`` for an output its structured output's grammar refused a token
    of, the request's own error, never sent again). ``index``: which of the
    ``n`` samples of one prompt this is. ``logprobs``: one per token of ``token_ids`` when the
    request asked for them; ``prompt_logprobs``: with the request's first delta, one per prompt
    token (None for the first, which has no context). ``cached_tokens``: with the first token's
    delta and the last delta, the prompt positions found in the prefix cache at admission.
    ``stop_reason``: with a last delta that ends in ``"stop"``, the stop string that matched or
    the ``stop_token_ids`` entry drawn (None for EOS or a grammar's end).
    ``ttft_s``, ``tpot_s``: with the last delta, the engine's one clock for the sample: its
    time to first token from its arrival at the engine (a grammar's compile included; None
    without a token) and its mean time per output token after the first (None below two).
    With the last delta too, on the same clock: ``queue_s`` from arrival to admission (None if
    never admitted), ``e2e_s`` from arrival to the end, and ``preemptions``, how many times the
    sample was preempted (the replica's trace spans are drawn from them).
    """

    request_id: RequestId
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    failure: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int | None = None
    error_code: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    queue_s: float | None = None
    e2e_s: float | None = None
    preemptions: int = 0
    stop_reason: str | int | None = None


def replica_failed(out: RequestOutput) -> bool:
    """Whether ``out`` ends its request in a failure of the replica (its engine), which another
    replica may not repeat: ``finish_reason`` "error" without an ``error_code`` (an error of
    the request's own, such as ``GRAMMAR_REJECTED_TOKEN``, is not the replica's)."""
    return out.finish_reason == "error" and out.error_code is None


def failed_before_first_token(first: RequestOutput) -> bool:
    """Whether a request failed before its first token: the first delta of its stream ends it
    in an engine failure (``replica_failed``) with no token made.

    Then nothing of the answer exists, so the failure is a refusal, not an answer: the replica
    yields ``ErrorRecord`` 503 ``replica_unavailable`` (naming itself) instead of the delta, and
    the ingress sends the request to another replica, or answers an HTTP error when it may send
    no more. A failure after the first token is the delta that ends the stream: an error event
    inside the client's stream (or an HTTP 503 for a request that is not streamed).
    """
    return replica_failed(first) and not first.completion_tokens


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """A replica's refusal of a request, before any delta: the HTTP answer for the ingress."""

    status: int  # 400 bad input, 429 queue full or shed, 503 unavailable
    code: str  # machine-readable reason (``queue_full``, ``never_fits``, ...)
    message: str
    param: str | None = None
    replica: str = ""  # the refusing replica's unique id, where Serve runs it


StreamItem = RequestOutput | ErrorRecord


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One snapshot of an engine. Blocks are KV blocks of its pool.

    ``waiting_blocks``: what the waiting queue needs to be admitted; ``committed_blocks``: what
    every unfinished request holds once it has generated all its ``max_tokens``; ``overhead``:
    the share of the step loop's time outside the model forward; ``rss_bytes``: the process's
    resident memory (0 where the engine runs without a server around it); ``cached_blocks``:
    unreferenced blocks the prefix cache keeps for their content (counted in ``free_blocks``).
    ``kv_pool_bytes``: the KV pool's memory; ``gpu_memory_used_bytes`` and
    ``gpu_memory_total_bytes``: the replica's GPU's memory in use (by every process on it) and in
    all; 0 on a CPU replica, and, like ``rss_bytes``, filled in by the server around the engine.
    """

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    block_size: int
    waiting_blocks: int = 0
    committed_blocks: int = 0
    preemptions: int = 0
    steps: int = 0
    overhead: float = 0.0
    rss_bytes: int = 0
    cached_blocks: int = 0
    # SLO-aware steps (docs/scheduler.md §8): the last step's limit (0: none), the running
    # requests it left out, and how many more decoding requests the step could carry (any, then
    # of the strictest target, for which the lower tiers' decodes give way).
    step_limit_s: float = 0.0
    paused: int = 0
    seats: int = 0
    target_seats: int = 0
    tpot_target_s: float = 0.0  # the strictest TPOT target of its unfinished requests (0: none)
    target_requests: int = 0  # unfinished requests holding that target
    target_prefill: int = 0  # their prompt positions not yet computed
    target_prefill_per_s: float = 0.0  # prompt positions a second they get within the limit
    slo_steps: bool = False  # SLO-aware steps are on
    kv_pool_bytes: int = 0
    gpu_memory_used_bytes: int = 0
    gpu_memory_total_bytes: int = 0
    # LoRA (0 without enable_lora): the adapters held loaded in host memory, and the distinct
    # adapters of the running requests (at most max_loras: the slots in use).
    lora_adapters_loaded: int = 0
    lora_adapters_running: int = 0


class EngineDead(Unavailable, RuntimeError):
    """The step loop stopped on an error; the engine takes no new requests."""


class InvalidToken(BadRequest, ValueError):
    """A token id the model does not have (in the prompt, ``stop_token_ids`` or ``logit_bias``);
    ``param`` names the field."""

    code = "invalid_token"

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param=param)


def targets_kept(ttft_s: float | None, tpot_s: float | None, ttft_target_s: float | None,
                 tpot_target_s: float | None) -> tuple[bool | None, bool | None]:
    """Whether a request kept each of its tier's targets: (TTFT, TPOT), None where the tier sets
    no such target. ``ttft_s`` None: no first token (misses a TTFT target); ``tpot_s`` None:
    at most one token, nothing to judge (no verdict on TPOT). The ingress counts goodput with
    it, a replica its autoscaling report."""
    ttft = None if ttft_target_s is None else ttft_s is not None and ttft_s <= ttft_target_s
    tpot = (None if tpot_target_s is None or tpot_s is None else tpot_s <= tpot_target_s)
    return ttft, tpot


def share_of(capacity: int, share: float) -> int:
    """A tier's part of a bound: ``share`` of ``capacity``, at least one. The ingress bounds each
    tier's requests in flight with it, a replica each tier's part of its waiting queue."""
    return max(1, int(share * capacity))


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """One snapshot of a replica's scheduler, taken at ``report_time``."""

    free_blocks: int  # KV blocks not held by any running request
    total_blocks: int  # KV blocks in the pool
    block_size: int  # positions per block
    waiting: int = 0  # requests in the waiting queue (including preempted ones)
    running: int = 0  # requests holding blocks
    preemptions: int = 0  # total since the replica started
    report_time: float = 0.0  # time.time() on the replica when the snapshot was taken
    # Blocks the waiting queue needs to be admitted: for each waiting request,
    # ceil((its tokens + 1) / block_size). 0 when the replica does not compute it.
    waiting_blocks: int = 0
    # Blocks every unfinished request (running or waiting) holds once it has generated all its
    # max_tokens: what the pool is promised. 0 when the replica does not compute it.
    committed_blocks: int = 0
    # 0 once the replica's engine has failed (Serve replaces it after its next health check;
    # until then the router sends it nothing it can avoid).
    alive: int = 1
    # For operators and tests (the router ignores them): engine steps run since the replica
    # started, and the replica process's resident memory.
    steps: int = 0
    rss_bytes: int = 0
    # Free blocks that hold a cached prefix (evictable; counted in free_blocks).
    cached_blocks: int = 0
    # SLO-aware steps: the last step's limit in ms (0: no target present) and how many more
    # decoding requests the step could carry within it (by max_num_seqs without a limit); then
    # how many more of its strictest target, for which the lower tiers' decodes give way (-1:
    # not reported, ``seats`` stands for it).
    step_limit_ms: int = 0
    seats: int = 0
    target_seats: int = -1
    # The strictest TPOT target of its unfinished requests, in ms (0: none), and how many hold it.
    tpot_target_ms: int = 0
    target_requests: int = 0
    # Their prompt positions not yet computed (running and waiting), and 1 where SLO-aware steps
    # are on (then a request of the strictest target passes the lower tiers' queue: only that
    # prefill is ahead of it).
    target_prefill: int = 0
    slo_steps: int = 0
    # Prompt positions a second that target's prompts get within the step limit (0: no limit).
    target_prefill_per_s: int = 0
    # The LoRA adapters the replica holds loaded (their keys, ``LoRARequest.key``: name#id;
    # empty without enable_lora): the router may prefer a replica that holds a request's adapter.
    lora_adapters: tuple[str, ...] = ()
    # The adapters one step may hold (the engine's max_loras); 0: the replica serves no LoRA
    # adapters (enable_lora off), and the router ranks it last for an adapter's request.
    max_loras: int = 0

    @classmethod
    def from_engine(cls, stats: EngineStats, report_time: float, alive: bool) -> RoutingStats:
        """The routing view of an engine's own stats."""
        return cls(
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            block_size=stats.block_size,
            waiting=stats.waiting,
            running=stats.running,
            preemptions=stats.preemptions,
            report_time=report_time,
            waiting_blocks=stats.waiting_blocks,
            committed_blocks=stats.committed_blocks,
            alive=int(alive),
            steps=stats.steps,
            rss_bytes=stats.rss_bytes,
            cached_blocks=stats.cached_blocks,
            step_limit_ms=round(stats.step_limit_s * 1000),
            seats=stats.seats,
            target_seats=stats.target_seats,
            tpot_target_ms=round(stats.tpot_target_s * 1000),
            target_requests=stats.target_requests,
            target_prefill=stats.target_prefill,
            slo_steps=int(stats.slo_steps),
            target_prefill_per_s=round(stats.target_prefill_per_s),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (ints, one float, and the adapters' names as a list)."""
        out = asdict(self)
        out["lora_adapters"] = list(self.lora_adapters)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RoutingStats | None:
        """Parse a report; ``None`` for an empty dict (no report yet).

        Unknown keys are ignored (a newer replica may report more). Raises ``ValueError`` when a
        non-empty dict lacks a required key or holds a value of the wrong kind.
        """
        if not data:
            return None
        required = ("free_blocks", "total_blocks", "block_size", "report_time")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"routing stats lack {', '.join(missing)}: got keys {sorted(data)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            raw = data[f.name]
            if f.name == "lora_adapters":
                if not isinstance(raw, (list, tuple)) or not all(isinstance(n, str) for n in raw):
                    raise ValueError(f"routing stats field lora_adapters must be a list of "
                                     f"names, got {raw!r}")
                values[f.name] = tuple(raw)
                continue
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise ValueError(f"routing stats field {f.name} must be a number, got {raw!r}")
            if f.name == "report_time":
                values[f.name] = float(raw)
            else:
                if not math.isfinite(raw) or raw != int(raw):
                    raise ValueError(
                        f"routing stats field {f.name} must be an integer, got {raw!r}"
                    )
                values[f.name] = int(raw)
        if values["block_size"] <= 0:
            raise ValueError(
                f"routing stats block_size must be positive, got {values['block_size']}"
            )
        return cls(**values)
