"""The engine: one replica's loop of schedule, forward, sample, on_step.

``Engine.step()`` runs one iteration and returns every request's new output; the offline ``LLM``
calls it directly. ``Engine.start()`` runs the same loop in a background thread for a server:
requests come in through ``generate`` (an async iterator of deltas) or ``add_request`` from any
thread or asyncio task. A lock guards the scheduler; the forward pass runs outside it, so an abort
during a forward frees the request's blocks at once (nothing can reuse them before the next
``schedule``), and its sampled row is dropped by ``on_step``.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from tierserve.records import (
    ADAPTER_UNAVAILABLE,
    GRAMMAR_REJECTED_TOKEN,
    EngineDead,
    EngineStats,
    GenerateRequest,
    InvalidSamplingParam,
    InvalidToken,
    LoRARequest,
    RequestId,
    RequestOutput,
)
from tierserve.replica.config import EngineConfig
from tierserve.replica.detokenizer import IncrementalDetokenizer
from tierserve.replica.engine_config import build_engine_parts
from tierserve.replica.lora import LoRAAdapter, LoRAError, LoRAManager
from tierserve.replica.runner import ForwardBatch, PromptRows, StepLogits
from tierserve.replica.sampler import (
    SamplerState,
    SamplingParams,
    TokenLogprob,
    sample,
    token_logprobs,
)
from tierserve.replica.scheduler import (
    AdmitError,
    FinishedEvent,
    FinishReason,
    QueueFull,
    Request,
    SampledToken,
    StepPlan,
)
from tierserve.replica.structured import Grammars

log = logging.getLogger(__name__)


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """The parameters of sample ``index`` of a request's ``n``: its own; with a seed, sample
    ``i`` draws from ``seed + i``, so that seeded samples differ from each other and each is
    reproducible (the served ``generate`` and the offline ``LLM`` both make them here)."""
    if index == 0 or params.seed is None:
        return params
    return replace(params, seed=params.seed + index)


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One finished (or aborted) request, for metrics. Times in seconds; None when not reached."""

    tier: str
    reason: str
    prompt_tokens: int
    generated_tokens: int
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    # Prompt positions found in the prefix cache at admission (None: never admitted).
    cached_tokens: int | None = None


class EngineObserver(Protocol):
    """Receives what metrics need; called from the engine's loop thread (keep it cheap)."""

    def request_done(self, times: RequestTimes) -> None: ...
    def step_done(self, duration_s: float, tokens: int, preempted: int) -> None: ...
    def rejected(self, reason: str, tier: str) -> None: ...
    def grammar_compiled(self, kind: str, seconds: float) -> None: ...
    def grammar_lookup(self, hit: bool) -> None: ...


@dataclass(slots=True)
class _Live:
    """Engine-side state of one request."""

    id: RequestId
    prompt: Sequence[int]
    params: SamplingParams
    sampler: SamplerState
    detok: IncrementalDetokenizer
    stop_ids: frozenset[int]
    sink: Callable[[RequestOutput], None] | None
    tier: str = ""
    index: int = 0
    # max_tokens 0: the one token the scheduler makes the request sample is dropped (the prompt
    # alone was wanted, e.g. its log-probabilities).
    discard: bool = False
    # Prompt log-probabilities by position (of the token they score), until the first delta.
    prompt_lp: dict[int, TokenLogprob] | None = None
    # Generated tokens not yet detokenized: text is wanted only at the end (no streaming, no
    # stop strings), so it is decoded once at the finish instead of twice per token.
    held: list[int] | None = None
    arrival: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    cached_tokens: int | None = None
    first_token: float | None = None
    generated: int = 0
    preemptions: int = 0  # times the scheduler preempted it (its trace's decode span)
    lora: str | None = None  # its LoRA adapter's key (pinned in the adapter cache while it runs)
    lora_request: LoRARequest | None = None  # the adapter's name, id and path (to load it)

    def times(self, reason: str, now: float) -> RequestTimes:
        tpot = None
        if self.first_token is not None and self.generated > 1:
            tpot = (now - self.first_token) / (self.generated - 1)
        return RequestTimes(
            tier=self.tier,
            reason=reason,
            prompt_tokens=len(self.prompt),
            generated_tokens=self.generated,
            queue_s=None if self.admitted is None else self.admitted - self.arrival,
            ttft_s=None if self.first_token is None else self.first_token - self.arrival,
            tpot_s=tpot,
            e2e_s=now - self.arrival,
            cached_tokens=self.cached_tokens,
        )


@dataclass(slots=True)
class StepTimes:
    """Where the loop's wall time went, cumulative."""

    steps: int = 0
    total_s: float = 0.0
    forward_s: float = 0.0

    @property
    def overhead(self) -> float:
        """Share of the loop's time not spent in the model forward."""
        return 1.0 - self.forward_s / self.total_s if self.total_s else 0.0


class Engine:
    """Scheduler, KV pool, runner, sampler and detokenizer of one replica."""

    def __init__(
        self, config: EngineConfig | None = None, observer: EngineObserver | None = None
    ) -> None:
        self.config = config or EngineConfig()
        self.observer = observer
        parts = build_engine_parts(self.config)
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.lora = parts.runner.lora  # the adapters (None without enable_lora)
        self.max_model_len = parts.max_model_len
        self.vocab_size = parts.model_config.vocab_size
        self.eos_ids = frozenset(parts.model_config.eos_token_ids)
        self.grammars = Grammars(
            self.tokenizer, self.vocab_size, sorted(self.eos_ids),
            on_compile=observer.grammar_compiled if observer is not None else None,
            on_lookup=observer.grammar_lookup if observer is not None else None,
            on_cache=getattr(observer, "grammar_cache", None),
            cache_bytes=self.config.grammar_cache_bytes,
            compile_timeout_s=self.config.grammar_compile_timeout_s,
            compiles_per_tenant=self.config.grammar_compiles_per_tenant)
        self.times = StepTimes()
        self._live: dict[RequestId, _Live] = {}
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        # LoRA loads, off the step loop and the callers' event loops: keys being read by the
        # loader thread or read and waiting for an unpinned entry (``_pending``); keys whose
        # load failed, with the detail, until the next step ends their requests.
        self._loading: set[str] = set()
        self._pending: dict[str, LoRAAdapter] = {}
        self._load_failed: dict[str, str] = {}
        self._loader: ThreadPoolExecutor | None = None
        if self.lora is not None:
            self.scheduler.lora_ready = self._lora_ready

    # ------------------------------------------------------------------ requests

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=True))

    def validate(self, request: GenerateRequest) -> None:
        """Raise what ``add_request`` would raise for ``request``, a full queue aside, without
        queueing it (``LLM.generate`` checks every prompt before any work): ``InvalidToken``
        (``_check_tokens``), ``ValueError`` for a bad priority, the scheduler's ``AdmitError``
        for what it can never run and ``GrammarError`` for a structured output that does not
        compile (compiled here, once, after every other check). Its sampling parameters were
        checked when they were made. A LoRA adapter is read here, on the caller's thread (the
        offline ``LLM``'s: there is no event loop to keep free), and ``LoRAError`` raised, the
        path in it, when it cannot be loaded; a server's requests load theirs at admission."""
        params = request.sampling
        self._check_tokens(request.prompt_ids, params)
        self._lora_of(request, load=True)
        with self._lock:
            self.scheduler.check(self._request(request, params))
        if params.structured is not None:
            self.grammars.compile(params.structured)

    def _check_tokens(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ``InvalidToken`` for an id outside the vocabulary, in the prompt,
        ``stop_token_ids``, ``logit_bias``, ``allowed_token_ids`` or ``bad_words_ids``: the engine
        owns this check, it knows its model (the parameters' ranges are ``SamplingParams``';
        admission is the scheduler's)."""
        if params.bad_words:
            raise InvalidSamplingParam(
                "bad_words reach the engine as token ids: tokenize them into bad_words_ids "
                "first (tierserve.replica.detokenizer.bad_words_ids; the offline LLM does)",
                "bad_words")
        self._check_ids("prompt", prompt_ids)
        self._check_ids("stop_token_ids", params.stop_token_ids or ())
        self._check_ids("logit_bias", params.logit_bias or ())
        self._check_ids("allowed_token_ids", params.allowed_token_ids or ())
        for i, word in enumerate(params.bad_words_ids or ()):
            self._check_ids(f"bad_words_ids.{i}", word)

    @staticmethod
    def _request(request: GenerateRequest, params: SamplingParams) -> Request:
        """The scheduler's record of one sample of ``request`` (its sampling ``params``), made
        once. ``max_tokens`` 0 runs the prompt and one sampled position (see
        ``_Live.discard``); scoring a prompt needs every position's logits, so such a request
        takes no cached prefix."""
        return Request(request.prompt_ids, max(params.max_tokens, 1), request.priority,
                       reuse_cache=params.prompt_logprobs is None,
                       tpot_target_s=request.tpot_target_s, ttft_left_s=request.ttft_left_s,
                       cache_partition=request.cache_partition,
                       lora=None if request.lora is None else request.lora.key)

    def _lora_of(self, request: GenerateRequest, load: bool = False) -> str | None:
        """The key of ``request``'s adapter (None for the base model); ``LoRAError``
        ``lora_disabled`` where the engine serves no adapters (``enable_lora`` off). ``load``:
        read it now where it is not loaded (``validate``), raising ``LoRAError`` when it cannot
        be; kept in the cache if an unpinned entry can make room."""
        lora = request.lora
        if lora is None:
            return None
        if self.lora is None:
            raise LoRAError(f"this engine serves no LoRA adapters (enable_lora is off): the "
                            f"request names adapter {lora.lora_name!r}", "lora_disabled")
        if load and not self.lora.has(lora.key):
            adapter = self.lora.read(lora.lora_name, lora.lora_path, lora.lora_int_id)
            with self._lock:
                self.lora.install(adapter, self.scheduler.running_adapters())
        return lora.key

    def _check_ids(self, field: str, ids: Iterable[int]) -> None:
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidToken(
                f"{field}: token id {bad!r} is out of range for this model's vocab "
                f"({self.vocab_size})",
                field,
            )

    def add_request(
        self,
        request: GenerateRequest,
        sink: Callable[[RequestOutput], None] | None = None,
        *,
        stream_text: bool = True,
        index: int = 0,
        validated: bool = False,
    ) -> RequestId:
        """Queue one sample of ``request`` (its ``n`` is ``generate``'s to honour); raises
        ``ValueError``/``AdmitError`` for bad input or a full queue. Each check runs once:
        token ids here (``_check_tokens``), the admission rules in ``Scheduler.add``, the
        parameters' ranges when they were made. The request's fields reach the scheduler as
        they are: its priority, its tier's TPOT target (with SLO-aware steps it bounds every
        step while the request is unfinished) and what is left of its first-token target.

        ``stream_text=False``: the caller wants the text only with the final output (each delta
        still carries its token ids); without stop strings the text is then decoded once, at
        the finish, instead of incrementally. ``index``: which sample this is.

        ``validated``: the caller checked these token ids already (``generate`` once for its
        ``n`` samples); they are not scanned again, and a structured output's grammar was
        compiled (``generate`` awaits it off the step loop); else it is compiled here, by the
        grammar worker while this caller waits (``GrammarError`` if it does not), once the
        scheduler's admission rules let the request in.
        """
        return self._admit(request, request.sampling, sink, stream_text=stream_text,
                           index=index, validated=validated, arrival=time.monotonic())

    def _admit(self, request: GenerateRequest, params: SamplingParams,
               sink: Callable[[RequestOutput], None] | None, *, stream_text: bool, index: int,
               validated: bool, arrival: float, scheduled: Request | None = None
               ) -> RequestId:
        """``add_request`` for sample ``index`` with ``params``; ``scheduled``: its
        scheduler record when the caller made it already (to check it)."""
        if not validated:
            self._check_tokens(list(request.prompt_ids), params)
            self._lora_of(request)  # adapters off: refused before anything else
        try:
            grammar = None
            sched = scheduled or self._request(request, params)
            if not validated and params.structured is not None:
                with self._lock:  # what refuses the request refuses it before its compile
                    self.scheduler.check(sched)
                # Held until its matchers are made (the grammar cache may drop it meanwhile).
                grammar = self.grammars.compile(params.structured)
            rid = self._add(request, params, sched, sink, stream_text, index, arrival)
            del grammar
            return rid
        except AdmitError as e:  # empty, too_long, never_fits, queue_full
            if self.observer is not None:
                self.observer.rejected(e.reason, request.tier)
            raise

    def _add(
        self,
        request: GenerateRequest,
        params: SamplingParams,
        sched: Request,
        sink: Callable[[RequestOutput], None] | None,
        stream_text: bool,
        index: int,
        arrival: float,
    ) -> RequestId:
        ids = list(request.prompt_ids)
        stop_ids = frozenset(params.stop_token_ids or ())
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        # Each sample its own matcher (max_tokens 0 samples nothing to constrain).
        constraint = (self.grammars.constraint(params.structured)
                      if params.structured is not None and params.max_tokens else None)
        lora = sched.lora
        if lora is not None and (self.lora is None or request.lora is None):
            raise LoRAError(f"this engine serves no LoRA adapters (enable_lora is off): "
                            f"the request names adapter {lora!r}", "lora_disabled")
        with self._lock:
            if self.error is not None:
                raise EngineDead(f"the engine's step loop died: {self.error!r}")
            # Queued first (a full queue refuses it before anything about its adapter); its
            # adapter is then loaded off this thread where it is not (``_lora_ready``), and
            # the scheduler admits it once it is.
            rid = self.scheduler.add(sched)
            self._live[rid] = _Live(
                id=rid,
                prompt=ids,
                params=params,
                sampler=SamplerState(params, prompt=ids, stop_ids=stop_ids,
                                     constraint=constraint),
                detok=IncrementalDetokenizer(
                    self.tokenizer, ids, params.stop, params.skip_special_tokens,
                    params.include_stop_str_in_output),
                stop_ids=stop_ids,
                sink=sink,
                tier=request.tier,
                index=index,
                discard=params.max_tokens == 0,
                prompt_lp={} if params.prompt_logprobs is not None else None,
                held=None if stream_text or params.stop else [],
                arrival=arrival,
                lora=lora,
                lora_request=request.lora,
            )
            if (lora is not None and request.lora is not None and self.lora is not None
                    and len(self.lora.names()) < self.lora.max_cpu_loras):
                # Where the cache has room its load starts now; else when admission reaches
                # it (in rank order), so a request far back evicts no one's adapter early.
                self._want_lora(request.lora)
            self._wake.notify()
        return rid

    def abort(self, rid: RequestId) -> bool:
        """Drop a request (waiting or running); its blocks are free when this returns."""
        with self._lock:
            live = self._live.pop(rid, None)
            found = self.scheduler.abort(rid)
        if live is not None:
            if self.observer is not None:
                self.observer.request_done(live.times("abort", time.monotonic()))
            if live.sink is not None:
                live.sink(self._final(live, "abort"))
        return found

    # ------------------------------------------------------------------ adapters

    def _adapters(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAError("this engine serves no LoRA adapters (enable_lora is off)",
                            "lora_disabled")
        return self.lora

    def load_lora(self, lora: LoRARequest) -> bool:
        """Load adapter ``lora`` (from its ``lora_path``) so that requests may name it; a
        no-op when that key is loaded already. Reads the disk on the caller's thread (the
        deployment calls it in a worker thread). Returns whether it is kept in the cache
        (False: valid, but every entry it could replace is in use by running requests; a
        request of it loads it again). ``LoRAError`` (a ``ValueError``): no adapters here, or a
        bad adapter (the detail, its path included: an admin's answer)."""
        if not lora.lora_path:
            raise LoRAError(f"load_lora needs the adapter's path (lora {lora.lora_name!r})")
        manager = self._adapters()
        have = manager.get(lora.key)
        if have is not None and have.path == lora.lora_path:
            return True
        adapter = manager.read(lora.lora_name, lora.lora_path, lora.lora_int_id)
        with self._lock:
            kept = manager.install(adapter, self.scheduler.running_adapters())
            self._wake.notify_all()
        return kept

    def unload_lora(self, name: str, int_id: int | None = None) -> list[str]:
        """Forget adapter ``name`` (every id of it; ``int_id``: that one only). Returns the keys
        dropped. Refused while running requests use it (``LoRAInUse``, 409: the caller
        retries once they finish; not deferred, so that it knows when the adapter is gone), or
        when it is not loaded (``LoRANotFound``, 404). Waiting requests of it hold nothing: one
        admitted later loads it again from its path."""
        manager = self._adapters()
        target = name if int_id is None else f"{name}#{int_id}"
        with self._lock:
            dropped = manager.unload(target, self.scheduler.running_adapters())
            for key in dropped:
                if self._pending.pop(key, None) is not None:
                    self._loading.discard(key)
        return dropped

    # A load: ``_want_lora`` (under the lock) hands the read to the loader thread (one per key
    # in flight); ``_read_lora`` reads and installs it, or leaves it in ``_pending`` while every
    # entry it could replace is pinned (retried at each step, ``_settle_loras``); a failure is
    # recorded and ends that key's requests at the next step.

    def _lora_ready(self, key: str) -> bool:
        """The scheduler's ``lora_ready`` (under the lock): whether ``key`` is loaded; where it
        is not, its load is started (once)."""
        assert self.lora is not None
        if self.lora.has(key):
            return True
        if key not in self._loading:
            lora = next((live.lora_request for live in self._live.values()
                         if live.lora == key and live.lora_request is not None), None)
            if lora is not None:
                self._want_lora(lora)
        return False

    def _want_lora(self, lora: LoRARequest) -> None:
        """Start loading ``lora`` unless it is loaded or being loaded (under the lock)."""
        key = lora.key
        if self.lora is None or key in self._loading or self.lora.has(key):
            return
        self._loading.add(key)
        if self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierserve-lora")
        self._loader.submit(self._read_lora, lora)

    def _read_lora(self, lora: LoRARequest) -> None:
        """The loader thread: read ``lora`` from disk (no lock held), then install it."""
        assert self.lora is not None
        key = lora.key
        try:
            adapter = self.lora.read(lora.lora_name, lora.lora_path, lora.lora_int_id)
        except Exception as e:  # every failure ends the key's requests, the detail logged
            log.warning("LoRA adapter %r (id %d) could not be loaded: %s", lora.lora_name,
                        lora.lora_int_id, e)
            with self._lock:
                self._loading.discard(key)
                self._load_failed[key] = lora.lora_name
                self._wake.notify_all()
            return
        with self._lock:
            self._pending[key] = adapter
            self._settle_loras()
            self._wake.notify_all()

    def _settle_loras(self) -> None:
        """Install the adapters read and waiting for room, where an unpinned entry makes it now
        (under the lock)."""
        if not self._pending or self.lora is None:
            return
        pinned = self.scheduler.running_adapters()
        for key, adapter in list(self._pending.items()):
            if self.lora.install(adapter, pinned):
                del self._pending[key]
                self._loading.discard(key)

    def _fail_loads(self) -> list[tuple[_Live, RequestOutput]]:
        """End the requests whose adapter failed to load (under the lock): 503-class errors
        naming the adapter only (``ADAPTER_UNAVAILABLE``; the detail is in the log), which the
        deployment answers so that the ingress may try another replica."""
        failed, self._load_failed = self._load_failed, {}
        ended: list[tuple[_Live, RequestOutput]] = []
        for rid, live in list(self._live.items()):
            if live.lora is None or live.lora not in failed:
                continue
            del self._live[rid]
            self.scheduler.abort(rid)
            out = self._final(live, "error", f"LoRA adapter {failed[live.lora]!r} is not "
                                             "available on this replica")
            out.error_code = ADAPTER_UNAVAILABLE
            ended.append((live, out))
        return ended

    def loras(self) -> list[LoRARequest]:
        """The loaded adapters, least recently used first (empty without ``enable_lora``)."""
        if self.lora is None:
            return []
        return [LoRARequest(a.name, max(a.int_id, 1), a.path) for a in self.lora.adapters()]

    def count_rejection(self, reason: str, tier: str = "") -> None:
        """Report a request refused before it reached the scheduler (e.g. ``shed``)."""
        if self.observer is not None:
            self.observer.rejected(reason, tier)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    def num_waiting(self) -> int:
        """Requests in the waiting queue and waiting for their grammar's compile (cheap: no
        per-request sums, unlike ``stats``)."""
        with self._lock:
            return self.scheduler.num_waiting + self.grammars.waiting

    def stats(self) -> EngineStats:
        """The scheduler's stats; ``waiting`` counts the requests waiting for a compile too."""
        with self._lock:
            stats = self.scheduler.engine_stats(self.times.overhead)
            compiling = self.grammars.waiting
            if self.lora is not None:
                stats = replace(stats, lora_adapters_loaded=len(self.lora.names()))
        return replace(stats, waiting=stats.waiting + compiling) if compiling else stats

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, forward, sample, on_step. Returns this step's deltas."""
        t0 = time.perf_counter()
        with self._lock:
            failed = self._fail_loads() if self._load_failed else []
            self._settle_loras()
            plan = self.scheduler.schedule()
            if plan.is_empty and not failed and self._loading:
                # Only loads are awaited: sleep until one ends (its thread wakes us).
                self._wake.wait(timeout=0.05)
            if not plan.is_empty:
                scoring = [
                    c.id
                    for c in plan.prefill
                    if (live := self._live.get(c.id)) is not None and live.prompt_lp is not None
                ]
                adapters = None
                if self.lora is not None:
                    ids = [d.id for d in plan.decodes] + [c.id for c in plan.prefill]
                    adapters = {rid: name for rid in ids
                                if (name := self._live[rid].lora) is not None}
                if adapters:
                    batch = self.runner.build_batch(plan, scoring, adapters)
                else:  # the base model's step, as without adapters
                    batch = self.runner.build_batch(plan, scoring)
                prompt_targets = [(rows, self._live[rows.id].prompt) for rows in batch.prompt_rows]
                states = [self._live[rid] for rid in batch.sampled]
                now = time.monotonic()
                for c in plan.prefill:
                    live = self._live.get(c.id)
                    if live is not None and live.admitted is None:  # its admitting chunk
                        live.admitted = now
                        live.cached_tokens = c.cached_tokens
                for rid in plan.preempted:
                    live = self._live.get(rid)
                    if live is not None:
                        live.preemptions += 1
        if plan.is_empty:
            return self._deliver_failed(failed)
        t1 = time.perf_counter()
        result = self.runner.forward(batch)
        t2 = time.perf_counter()
        tokens = sample(result.logits, [s.sampler for s in states])
        logprobs = self._logprobs(result.logits, states, tokens)
        if result.prompt_logits is not None:
            self._score_prompts(result.prompt_logits, prompt_targets)
        outputs = self._deliver_failed(failed) + self._finish_step(plan, states, tokens, logprobs)
        t3 = time.perf_counter()
        with self._lock:
            self.scheduler.observe_step(plan.shape, t3 - t0)
        self.times.steps += 1
        self.times.forward_s += t2 - t1
        self.times.total_s += t3 - t0
        if self.observer is not None:
            self.observer.step_done(t3 - t0, plan.num_tokens, len(plan.preempted))
        return outputs

    def _deliver_failed(self, failed: list[tuple[_Live, RequestOutput]]) -> list[RequestOutput]:
        """Send the requests ``_fail_loads`` ended to their sinks (outside the lock)."""
        now = time.monotonic()
        for live, out in failed:
            if self.observer is not None:
                self.observer.request_done(live.times("error", now))
            if live.sink is not None:
                live.sink(out)
        return [out for _, out in failed]

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, states: list[_Live], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        """The sampled tokens' log-probabilities, for the requests that asked for them."""
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None and not s.discard]
        out: list[TokenLogprob | None] = [None] * len(states)
        if rows:
            ks = [states[i].params.logprobs or 0 for i in rows]
            lps = token_logprobs(logits[rows], [tokens[i] for i in rows], ks)
            for i, lp in zip(rows, lps, strict=True):
                out[i] = lp
        return out

    def _score_prompts(
        self, logits: torch.Tensor, targets: list[tuple[PromptRows, Sequence[int]]]
    ) -> None:
        """Record the prompt tokens' log-probabilities that this step's chunks computed."""
        tokens: list[int] = []
        ks: list[int] = []
        for rows, seq in targets:
            live = self._live.get(rows.id)
            k = (live.params.prompt_logprobs or 0) if live is not None else 0
            tokens.extend(seq[rows.first + 1 : rows.first + 1 + rows.count])
            ks.extend([k] * rows.count)
        lps = token_logprobs(logits, tokens, ks)
        at = 0
        for rows, _ in targets:
            live = self._live.get(rows.id)
            if live is not None and live.prompt_lp is not None:
                for j in range(rows.count):
                    live.prompt_lp[rows.first + 1 + j] = lps[at + j]
            at += rows.count

    def _finish_step(
        self,
        plan: StepPlan,
        states: list[_Live],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> list[RequestOutput]:
        now = time.monotonic()
        step_outputs: list[SampledToken] = []
        deltas: dict[RequestId, RequestOutput] = {}
        for live, tok, lp in zip(states, tokens, logprobs, strict=True):
            delta = RequestOutput(live.id, "", [], prompt_tokens=len(live.prompt), index=live.index)
            if live.first_token is None:
                live.first_token = now
                delta.cached_tokens = live.cached_tokens
            if live.prompt_lp is not None:
                delta.prompt_logprobs = [
                    None, *(live.prompt_lp.get(p) for p in range(1, len(live.prompt)))
                ]
                live.prompt_lp = None
            if live.discard:  # max_tokens 0: the scheduler ends it now, at its one-token limit
                step_outputs.append(SampledToken(live.id, tok, False))
                deltas[live.id] = delta
                continue
            if live.sampler.rejected:
                # Its grammar refused the drawn token (never, while its mask applies): the
                # token is not part of the output, which ends in an error (below), not a "stop".
                step_outputs.append(SampledToken(live.id, tok, True))
                delta.completion_tokens = live.generated
                deltas[live.id] = delta
                continue
            live.generated += 1
            if tok in live.stop_ids and not live.params.include_stop_str_in_output:
                pass  # a stop token's own text is not output (its id is), as vLLM has it
            elif live.held is None:
                delta.text = live.detok.add(tok)
            else:
                live.held.append(tok)
            # A grammar ends its output once complete (its stop token accepted), even with
            # ignore_eos.
            grammar = live.sampler.constraint
            stop = (tok in live.stop_ids or live.detok.stopped is not None
                    or (grammar is not None and grammar.terminated))
            step_outputs.append(SampledToken(live.id, tok, stop))
            delta.token_ids = [tok]
            delta.completion_tokens = live.generated
            if lp is not None:
                delta.logprobs = [lp]
            deltas[live.id] = delta
        with self._lock:
            events = self.scheduler.on_step(step_outputs)
            for e in events:
                if isinstance(e, FinishedEvent):
                    live_done = self._live.pop(e.id, None)
                    out = deltas.get(e.id)
                    if live_done is None or out is None:
                        continue
                    if live_done.held:
                        live_done.detok.feed(live_done.held)
                        live_done.held = []
                    out.text += live_done.detok.finish()
                    out.finished = True
                    reason = e.reason.value
                    if live_done.sampler.rejected:  # an error of the request, not the replica's
                        reason = "error"
                        out.error_code = GRAMMAR_REJECTED_TOKEN
                        out.failure = (
                            f"the structured output's grammar rejected token "
                            f"{live_done.sampler.rejected_token} that its mask allowed: the "
                            "output ends before it")
                    out.finish_reason = reason
                    if reason == "stop":
                        out.stop_reason = self._stop_reason(live_done, out)
                    times = live_done.times(reason, now)
                    out.ttft_s, out.tpot_s = times.ttft_s, times.tpot_s
                    out.queue_s, out.e2e_s = times.queue_s, times.e2e_s
                    out.preemptions = live_done.preemptions
                    if self.observer is not None:
                        self.observer.request_done(times)
            # Requests aborted during the forward are gone from _live: drop their deltas.
            result = [d for rid, d in deltas.items() if rid in self._live or d.finished]
        sinks = {live.id: live.sink for live in states}
        for d in result:
            sink = sinks[d.request_id]
            if sink is not None:
                sink(d)
        return result

    def _stop_reason(self, live: _Live, out: RequestOutput) -> str | int | None:
        """What stopped ``live``: the stop string that matched, else the ``stop_token_ids``
        entry drawn last (None for EOS, which the tokenizer owns, or a grammar's end)."""
        if live.detok.stopped is not None:
            return live.detok.stopped
        last = out.token_ids[-1] if out.token_ids else None
        if (last is not None and last in (live.params.stop_token_ids or ())
                and (live.params.ignore_eos or last not in self.eos_ids)):
            return last
        return None

    def _final(self, live: _Live, reason: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            live.id,
            "",
            [],
            finished=True,
            finish_reason=reason,
            prompt_tokens=len(live.prompt),
            completion_tokens=live.generated,
            failure=error,
            index=live.index,
            cached_tokens=live.cached_tokens,
        )

    # ------------------------------------------------------------------ background loop

    def warm_up(self, prompt_tokens: int = 4, max_tokens: int = 2) -> float:
        """Run one small request through the whole step path before serving, so that what a
        first step builds or loads (the native CPU kernels on a new cache, first-call costs) is
        paid here and not by the first request; the step cost model, step times and observer
        do not see it. Only before ``start``. Returns the seconds it took."""
        if self._thread is not None:
            raise RuntimeError("warm_up runs before start(), not beside the step loop")
        t0 = time.perf_counter()
        cost = copy.deepcopy(self.scheduler.cost)
        observer, self.observer = self.observer, None
        token = next(t for t in range(self.vocab_size) if t not in self.eos_ids)
        rid: RequestId | None = None
        try:
            rid = self.add_request(
                GenerateRequest.of([token] * prompt_tokens,
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                stream_text=False)
            while self.has_unfinished():
                self.step()
        finally:
            self.observer = observer
            with self._lock:
                if rid is not None and rid in self._live:
                    self.abort(rid)
                self.scheduler.cost = cost
                self.times = StepTimes()
        return time.perf_counter() - t0

    def start(self) -> None:
        """Run the step loop in a daemon thread until ``shutdown``."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="tierserve-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            # Triton launches on the thread's current device: make it the runner's (cuda:N).
            device = getattr(self.runner, "device", None)
            if isinstance(device, torch.device) and device.type == "cuda" and device.index is not None:
                torch.cuda.set_device(device)
            while True:
                with self._lock:
                    while not self._stopping and not self.scheduler.has_unfinished():
                        self._wake.wait(timeout=1.0)
                    if self._stopping:
                        return
                self.step()
        except BaseException as e:  # the loop must never die silently
            log.exception("engine step loop died")
            self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        with self._lock:
            self.error = e
            lives = list(self._live.values())
            self._live.clear()
            for live in lives:
                self.scheduler.abort(live.id)
        for live in lives:
            if live.sink is not None:
                live.sink(self._final(live, "error", f"the replica's engine failed: {e!r}"))

    def inject_fault(self, message: str = "injected fault") -> None:
        """Make every later forward pass raise ``RuntimeError(message)`` (for fault tests): the
        next step then fails, every live request ends with ``"error"`` and ``alive`` turns False."""

        def broken(batch: ForwardBatch) -> StepLogits:
            raise RuntimeError(message)

        self.runner.forward = broken  # type: ignore[method-assign]

    @property
    def alive(self) -> bool:
        """False once the background loop has died (or was never started)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def shutdown(self) -> None:
        self.grammars.shutdown()
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[RequestOutput, None]:
        """Stream the deltas of ``request``'s ``n`` samples (``RequestOutput.index`` tells them
        apart; with a seed, sample ``i`` draws from ``seed + i``); leaving the iterator early
        aborts every unfinished one. Admission is all or nothing: if sample ``i`` is refused,
        the ones before it are aborted and the error raised. The samples' clock starts here
        (``RequestOutput.ttft_s`` counts a grammar's compile too)."""
        arrival = time.monotonic()
        n = request.n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        params = request.sampling
        self._check_tokens(list(request.prompt_ids), params)  # once for the n samples
        self._lora_of(request)  # adapters off; the adapter is loaded at admission, off this loop
        first = self._request(request, params)
        grammar = None
        if params.structured is not None:
            # Whatever can refuse the request refuses it before its compile: the admission
            # rules, and a full queue (counting the requests waiting for a compile).
            try:
                with self._lock:
                    self.scheduler.check(first)
                    if (self.scheduler.num_waiting + self.grammars.waiting
                            >= self.config.max_waiting):
                        raise QueueFull(self.config.max_waiting)
            except AdmitError as e:
                if self.observer is not None:
                    self.observer.rejected(e.reason, request.tier)
                raise
            # Compiled off the step loop (in the grammar worker, queued by priority) while this
            # one waits; held until the samples' matchers are made.
            grammar = await self.grammars.prepare(params.structured, priority=request.priority,
                                                  tenant=request.tenant)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        rids: list[RequestId] = []
        try:
            for i in range(n):
                child = sample_params(params, i)
                rids.append(self._admit(request, child, sink, stream_text=True, index=i,
                                        validated=True, arrival=arrival,
                                        scheduled=first if i == 0 else None))
        except BaseException:
            for rid in rids:
                self.abort(rid)
            raise
        del grammar
        unfinished = set(rids)
        try:
            while unfinished:
                out = await queue.get()
                if out.finished:
                    unfinished.discard(out.request_id)
                yield out
        finally:
            for rid in unfinished:
                self.abort(rid)


__all__ = ["Engine", "EngineDead", "EngineStats", "FinishReason", "RequestOutput", "StepTimes"]
