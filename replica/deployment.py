"""The Serve replica: one engine, its step loop in a background thread, a streaming ``generate``.

The ingress calls ``generate(request)`` with one ``tierserve.records.GenerateRequest`` through a
streaming handle (its router reads the same record). The stream yields either one
``ErrorRecord`` (the HTTP status the ingress should answer) or ``RequestOutput`` deltas, the last
of each sample ``finished``. An engine that fails before the request's first token is a refusal
(``tierserve.records.failed_before_first_token``, which the ingress applies too); after it, the failed delta ends
the stream. When the caller goes away, the stream is cancelled and the request aborted, so its
blocks return at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from ray import serve
from ray.serve import Deployment

from tierserve.records import (
    ADAPTER_UNAVAILABLE,
    AdapterUnavailable,
    EngineStats,
    ErrorRecord,
    GenerateRequest,
    LoRAError,
    LoRARequest,
    RoutingStats,
    ServingError,
    StreamItem,
    failed_before_first_token,
    share_of,
)
from tierserve.replica import spans, tracing
from tierserve.replica.config import EngineConfig
from tierserve.replica.load_report import LoadWindow, within_targets

log = logging.getLogger("tierserve.replica")


def _cpu_share() -> int | None:
    """Threads for torch: this replica's CPU share from Ray, so replicas don't oversubscribe."""
    try:
        import ray

        ids = ray.get_runtime_context().get_assigned_resources()
        cpus = ids.get("CPU")
        return max(1, int(cpus)) if cpus else None
    except Exception:  # outside Ray (tests) there is no share to honour
        return None


def _replica_id() -> str:
    """This replica's unique id within its deployment ("" outside a Serve replica)."""
    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # built directly (tests, tools): no Serve context
        return ""


class LLMServer:
    """One replica: scheduler, KV pool and runner of one model."""

    def __init__(
        self,
        engine: dict[str, Any] | None = None,
        fault_injection: bool = False,
        tiers: list[str] | None = None,
    ) -> None:
        self.fault_injection = fault_injection
        tracing.setup()  # a bad OTEL_* value fails the replica's start, saying which
        settings = dict(engine or {})
        if settings.get("num_threads") is None and "OMP_NUM_THREADS" not in os.environ:
            settings["num_threads"] = _cpu_share()
        self.config = EngineConfig(**settings)
        # Imported here, not at the top: building the Serve app imports this module, and the
        # engine brings torch (about 1.5 s of start-up) where only the replica needs it.
        from tierserve.replica.engine import Engine
        from tierserve.replica.metrics import ReplicaMetrics

        self.metrics = ReplicaMetrics(tiers or [])
        self.engine = Engine(self.config, observer=self.metrics)
        # Serve counts the replica as running (and the ingress's /ready as able to take work)
        # once this returns: what a first step builds is built here, not under a first burst.
        warm_s = self.engine.warm_up()
        log.info("replica warmed up in %.1f s", warm_s)
        self.engine.start()
        self.metrics.start(self.stats)
        self.started = time.time()
        self.load = LoadWindow(self.config.block_size)
        self.replica_id = _replica_id()
        log.info("replica ready: %s", self.engine.stats())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        """Stream one request's deltas, of its ``n`` samples (see the module docstring),
        under its trace span (``tierserve.replica.spans``: the engine's phases of each sample
        are recorded when it ends; a refusal is the span's error)."""
        if not isinstance(request, GenerateRequest):
            yield ErrorRecord(
                400, "invalid_request", f"expected a GenerateRequest, got {type(request).__name__}"
            )
            return
        span = spans.request_span(request, self.replica_id)
        try:
            async for item in self._generate(request):
                if isinstance(item, ErrorRecord):
                    spans.refused(span, item)
                elif item.finished:
                    spans.sample_ended(span, item)
                yield item
        finally:
            span.end()

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[StreamItem]:
        rid = request.request_id or "-"
        log.debug("request %s: %d prompt tokens, n %d, tier %r", rid, len(request.prompt_ids),
                  request.n, request.tier)
        tier_queue_limit = share_of(self.config.max_waiting, request.queue_share)
        if request.queue_share < 1.0 and self.engine.num_waiting() >= tier_queue_limit:
            self.engine.count_rejection("shed", request.tier)
            log.info("request %s: shed (tier %r's share of the queue, %d, is full)", rid,
                     request.tier, tier_queue_limit)
            yield ErrorRecord(
                429,
                "shed",
                f"the server is busy: this tier's share of the queue ({tier_queue_limit}) is full",
            )
            return
        stream = self.engine.generate(request)
        ticket = self.load.arrived(request.tier, len(request.prompt_ids) * request.n)
        produced = False
        try:
            async for out in stream:
                if not produced and out.finished and out.error_code == ADAPTER_UNAVAILABLE:
                    # Its adapter could not be loaded here (the detail is in this replica's
                    # log; the message names the adapter only): the ingress tries another.
                    log.warning("request %s: refused, %s", rid, out.failure)
                    yield AdapterUnavailable(out.failure or "the LoRA adapter is not available",
                                             replica=self.replica_id).record()
                    return
                if not produced and failed_before_first_token(out):
                    # Refused, so the ingress sends it to another replica (the rest of its samples
                    # are aborted).
                    log.warning("request %s: refused, the engine failed: %s", rid, out.failure)
                    yield ErrorRecord(503, "replica_unavailable",
                                      out.failure or "the replica's engine failed",
                                      replica=self.replica_id)
                    return
                if not produced:
                    produced = True
                    self.load.answering(ticket)
                if out.finished and out.index == 0 and out.ttft_s is not None and (
                        request.ttft_target_s is not None or request.tpot_target_s is not None):
                    # The engine's clock, from the request's arrival at the ingress.
                    self.load.finished(request.tier, within_targets(
                        request.waited_s + out.ttft_s, out.tpot_s, request.ttft_target_s,
                        request.tpot_target_s))
                if out.finished:
                    log.debug("request %s: sample %d finished (%s), %d tokens", rid, out.index,
                              out.finish_reason, out.completion_tokens)
                yield out
        except ServingError as e:  # every refusal, its status and code its own
            if e.status == 503:  # this replica cannot serve it: the ingress tries another
                e.replica = self.replica_id
            # The message as repr: it may quote the client's text (a grammar compiler's complaint
            # about its regex), newlines included, and must not start a line of its own.
            log.info("request %s: refused, %d %s: %r", rid, e.status, e.code, e.message)
            yield e.record()
        except ValueError as e:  # a last guard: a check that raised the plain kind
            log.info("request %s: refused, 400 invalid_request: %r", rid, str(e))
            yield ErrorRecord(400, "invalid_request", str(e))
        finally:
            self.load.answering(ticket)
            await stream.aclose()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router ranks replicas by (``tierserve.records.RoutingStats``, as Serve wants it:
        a dict), with the keys (``LoRARequest.key``) of the LoRA adapters this replica holds
        loaded."""
        stats = RoutingStats.from_engine(self.stats(), time.time(), self.engine.alive)
        if self.engine.lora is not None:
            stats = replace(stats, lora_adapters=tuple(self.engine.lora.names()),
                            max_loras=self.engine.config.max_loras)
        return stats.to_dict()

    # ------------------------------------------------------------------ LoRA adapters

    async def load_lora_adapter(self, lora_name: str, lora_path: str,
                                lora_int_id: int = 1) -> ErrorRecord | None:
        """Load the PEFT adapter at ``lora_path`` as ``lora_name`` of id ``lora_int_id`` in this
        replica (a no-op when that key is loaded already), the disk read in a worker thread
        (never on this replica's event loop). None when done (kept in the cache, or, where
        every entry is in use by running requests, checked and loaded by its first request),
        else the refusal as an ``ErrorRecord`` (400 a bad adapter, another base model or
        adapters off, with the detail: an admin's answer), for the ingress to answer."""
        try:
            kept = await asyncio.to_thread(
                self.engine.load_lora, LoRARequest(lora_name, lora_int_id, lora_path))
        except LoRAError as e:
            return e.record()
        except ValueError as e:
            return ErrorRecord(400, "invalid_lora_adapter", str(e))
        log.info("LoRA adapter %r (id %d) %s from %s", lora_name, lora_int_id,
                 "loaded" if kept else "checked (the cache is in use)", lora_path)
        return None

    async def unload_lora_adapter(self, lora_name: str,
                                  lora_int_id: int | None = None) -> ErrorRecord | None:
        """Forget adapter ``lora_name`` here (every id of it; ``lora_int_id``: that one): None
        when done, else the refusal (404 not loaded, 409 running requests use it: see
        ``Engine.unload_lora``). Off the event loop: it waits for the engine's lock."""
        try:
            dropped = await asyncio.to_thread(self.engine.unload_lora, lora_name, lora_int_id)
        except LoRAError as e:
            return e.record()
        log.info("LoRA adapter %r unloaded (%s)", lora_name, ", ".join(dropped))
        return None

    def list_lora_adapters(self) -> list[LoRARequest]:
        """The adapters this replica holds loaded, least recently used first (empty without
        ``enable_lora``)."""
        return self.engine.loras()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What Serve's autoscaler hands the policy for this replica
        (``tierserve.replica.load_report``; docs/autoscaling.md)."""
        stats = self.engine.stats()
        kv = stats.committed_blocks / stats.total_blocks if stats.total_blocks else 0.0
        return self.load.report(kv, self.engine.times.total_s, stats.preemptions).to_dict()

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if not self.engine.alive:
            raise RuntimeError(f"the engine's step loop is not running: {self.engine.error!r}")

    def stats(self) -> EngineStats:
        """The engine's stats with this process's memory: resident (``rss_bytes``), the KV
        pool's, and the GPU's in use and in all (0 and 0 on a CPU replica)."""
        from tierserve.replica.metrics import gpu_memory, resident_bytes

        runner = self.engine.runner
        used, total = gpu_memory(runner.device)
        return replace(
            self.engine.stats(),
            rss_bytes=resident_bytes(),
            kv_pool_bytes=runner.pool.nbytes,
            gpu_memory_used_bytes=used,
            gpu_memory_total_bytes=total,
        )

    def inject_fault(self, message: str = "injected fault") -> str:
        """Make the next forward pass raise, as a broken GPU or kernel would (for fault tests).

        Refused unless the app was deployed with ``fault_injection: true`` (never in a real
        config). Returns this replica's actor name.
        """
        if not self.fault_injection:
            raise PermissionError("fault injection is off (the app's fault_injection setting)")
        self.engine.inject_fault(message)
        return self.replica_name()

    def replica_name(self) -> str:
        """This replica's Serve actor name (``SERVE_REPLICA::app#deployment#id``)."""
        try:
            import ray

            if not ray.is_initialized():  # (asking would start a Ray instance)
                return ""
            return str(ray.get_runtime_context().get_actor_name())
        except Exception:
            return ""

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.stop()


LLMDeployment: Deployment = serve.deployment(
    name="LLMServer",
    max_ongoing_requests=512,
    health_check_period_s=2,
    health_check_timeout_s=30,
)(LLMServer)
