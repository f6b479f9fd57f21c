"""The Serve replica: one engine, its step loop in a background thread, a streaming ``generate``.

The ingress calls ``generate(prompt_ids, sampling, priority=..., prompt_tokens=..., max_tokens=...,
queue_share=...)`` through a streaming handle; the router reads the keyword arguments. The first
item of the stream is either a token delta or one error record (``{"error": {...}}``) with the HTTP
status the ingress should answer; every later item is a delta dict, the last one ``finished``.
When the caller goes away, the stream is cancelled and the request is aborted, so its blocks
return at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from ray import serve
from ray.serve import Deployment

from replica.config import EngineConfig
from replica.engine import Engine, EngineDead
from replica.sampler import SamplingParams
from replica.scheduler import AdmitError, QueueFull

log = logging.getLogger("tierserve.replica")


def error_record(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"status": status, "code": code, "message": message, "param": param}}


def _cpu_share() -> int | None:
    """Threads for torch: this replica's CPU share from Ray, so replicas don't oversubscribe."""
    try:
        import ray

        ids = ray.get_runtime_context().get_assigned_resources()
        cpus = ids.get("CPU")
        return max(1, int(cpus)) if cpus else None
    except Exception:  # outside Ray (tests) there is no share to honour
        return None


class LLMServer:
    """One replica: scheduler, KV pool and runner of one model."""

    def __init__(
        self,
        engine: dict[str, Any] | None = None,
        fault_injection: bool = False,
        tiers: list[str] | None = None,
    ) -> None:
        self.fault_injection = fault_injection
        settings = dict(engine or {})
        if settings.get("num_threads") is None and "OMP_NUM_THREADS" not in os.environ:
            settings["num_threads"] = _cpu_share()
        self.config = EngineConfig(**settings)
        from replica.metrics import ReplicaMetrics

        self.metrics = ReplicaMetrics(tiers or [])
        self.engine = Engine(self.config, observer=self.metrics)
        self.engine.start()
        self.metrics.start(self.stats)
        self.started = time.time()
        log.info("replica ready: %s", self.engine.stats())

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: dict[str, Any],
        *,
        priority: int = 0,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
        queue_share: float = 1.0,
        tier: str = "",
        n: int = 1,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's deltas, of its ``n`` samples (see the module docstring for the
        record shapes)."""
        try:
            params = SamplingParams(**sampling)
        except (TypeError, ValueError) as e:
            yield error_record(400, "invalid_sampling", str(e))
            return
        shed_at = max(1, int(queue_share * self.config.max_waiting))
        if queue_share < 1.0 and self.engine.num_waiting() >= shed_at:
            self.engine.count_rejection("shed", tier)
            yield error_record(
                429,
                "shed",
                f"the server is busy: this tier's share of the queue ({shed_at}) is full",
            )
            return
        stream = self.engine.generate(prompt_ids, params, priority, tier, n=n)
        try:
            async for out in stream:
                yield asdict(out)
        except QueueFull as e:
            yield error_record(429, e.reason, str(e))
        except AdmitError as e:
            yield error_record(400, e.reason, str(e))
        except EngineDead as e:
            yield error_record(503, "replica_unavailable", str(e))
        except ValueError as e:
            yield error_record(400, "invalid_request", str(e))
        finally:
            await stream.aclose()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router ranks replicas by (``router.stats.RoutingStats``)."""
        from router.stats import RoutingStats

        s = self.stats()
        return RoutingStats(
            free_blocks=int(s["free_blocks"]),
            total_blocks=int(s["total_blocks"]),
            block_tokens=self.config.block_size,
            waiting=int(s["waiting"]),
            running=int(s["running"]),
            preemptions=int(s["num_preemptions"]),
            waiting_blocks=int(s["waiting_blocks"]),
            committed_blocks=int(s["committed_blocks"]),
            report_time=time.time(),
            alive=int(self.engine.alive),
            steps=int(s["steps"]),
            rss_bytes=int(s["rss_bytes"]),
        ).to_dict()

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy (it is replaced)."""
        if not self.engine.alive:
            raise RuntimeError(f"the engine's step loop is not running: {self.engine.error!r}")

    def stats(self) -> dict[str, int | float]:
        """The engine's stats and this process's resident memory (``rss_bytes``)."""
        from replica.metrics import resident_bytes

        return self.engine.stats() | {"rss_bytes": resident_bytes()}

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

            return str(ray.get_runtime_context().get_actor_name())
        except Exception:
            return ""

    def info(self) -> dict[str, Any]:
        """What the ingress needs about the model (served limits)."""
        return {
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "block_size": self.config.block_size,
            "total_blocks": int(self.engine.stats()["total_blocks"]),
        }

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
