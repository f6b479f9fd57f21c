"""Every tierserve metric, defined in one place (Prometheus conventions), and the replica's own.

The metrics go through Ray's metrics pipeline (``ray.serve.metrics``): every node's metrics agent
exports its own replicas' metrics, and Serve adds the ``deployment``, ``replica`` and
``application`` labels. Exported names get Ray's ``ray_`` prefix, and counters a ``_total`` suffix:
``tierserve_preemptions`` below is scraped as ``ray_tierserve_preemptions_total``.
``EXPORTED`` lists the scraped names (the dashboard test checks the Grafana JSON against them).

``ReplicaMetrics`` is the replica's (an ``EngineObserver``); the ingress's counter of what it
refuses is ``tierserve.cluster.metrics.IngressMetrics``, on the same definitions.

Gauges are refreshed every ``GAUGE_PERIOD_S`` by a thread in each replica, so they never expire
between scrapes (Ray drops a gauge that is not set for about 20 s).

``MEMORY_GAUGES`` are the replica's memory: its KV pool's bytes, and its GPU's memory in use and
in all (``gpu_memory``). A CPU replica exports the GPU gauges at 0, so that every replica has
every series and a query can sum them over a cluster of both kinds.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # importing the engine pulls in torch; the metrics module must stay light
    from tierserve.records import EngineStats
    from tierserve.replica.engine import RequestTimes

GAUGE_PERIOD_S = 1.0

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160]
# Six buckets per doubling, 1 ms to 2.5 s: a quantile read from the buckets (histogram_quantile
# interpolates within one) is within about 6% of the true one, close enough to compare the
# server's time per output token with a client's inter-token latency.
TPOT_BUCKETS = [float(f"{0.001 * 2 ** (i / 6):.4g}") for i in range(68)]
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
COMPILE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5]
TOKEN_BUCKETS: list[float] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]

GAUGES = {
    "tierserve_requests_running": "Requests running (decoding or prefilling) on the replica.",
    "tierserve_requests_waiting": "Requests in the replica's waiting queue (queue depth).",
    "tierserve_kv_blocks_free": "Free KV blocks of the replica's pool.",
    "tierserve_kv_blocks_total": "KV blocks of the replica's pool.",
    "tierserve_kv_blocks_cached": "Free KV blocks that keep a cached prefix (evictable).",
    "tierserve_replica_resident_memory_bytes": "Resident memory of the replica's process.",
    "tierserve_step_limit_seconds": (
        "The SLO-aware step's limit: the strictest TPOT target present times the headroom "
        "(0: no target present)."),
    "tierserve_requests_paused": "Running requests the last step left out to keep its limit.",
    "tierserve_lora_adapters_loaded": (
        "LoRA adapters the replica holds loaded in host memory (0 without enable_lora)."),
    "tierserve_lora_adapters_running": (
        "Distinct LoRA adapters of the replica's running requests: the device slots in use, at "
        "most max_loras."),
}
MEMORY_GAUGES = {
    "tierserve_kv_pool_bytes": "Bytes of the replica's KV pool.",
    "tierserve_gpu_memory_used_bytes": (
        "Memory in use on the replica's GPU, by every process on it (0 on a CPU replica)."),
    "tierserve_gpu_memory_total_bytes": "Memory of the replica's GPU (0 on a CPU replica).",
}
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tierserve_preemptions": ("Requests preempted (blocks freed, recomputed later).", ()),
    "tierserve_rejections": ("Requests refused at admission, by reason.", ("reason", "tier")),
    "tierserve_requests_finished": ("Requests finished, by reason and tier.", ("reason", "tier")),
    "tierserve_aborts": ("Requests aborted (client gone).", ("tier",)),
    "tierserve_prompt_tokens": ("Prompt tokens of finished requests.", ("tier",)),
    "tierserve_generation_tokens": ("Generated tokens of finished requests.", ("tier",)),
    "tierserve_prefix_cache_queries": (
        "Prompt tokens looked up in the prefix cache at admission.", ("tier",)),
    "tierserve_prefix_cache_hits": (
        "Prompt tokens found in the prefix cache at admission.", ("tier",)),
    "tierserve_grammar_cache": (
        "Structured-output grammar lookups, per request: hit (compiled before, or compiling "
        "for another request) or miss (compiled for this one).", ("result",)),
}
HISTOGRAMS: dict[str, tuple[str, list[float], tuple[str, ...]]] = {
    "tierserve_time_to_first_token_seconds": ("Time to first token.", LATENCY_BUCKETS, ("tier",)),
    "tierserve_time_per_output_token_seconds": ("Time per output token after the first.", TPOT_BUCKETS, ("tier",)),
    "tierserve_e2e_request_latency_seconds": ("End-to-end request latency in the replica.", LATENCY_BUCKETS, ("tier",)),
    "tierserve_queue_time_seconds": ("Time from arrival to admission.", LATENCY_BUCKETS, ("tier",)),
    "tierserve_step_duration_seconds": ("Duration of one engine step.", STEP_BUCKETS, ()),
    "tierserve_step_tokens": ("Tokens processed in one engine step.", TOKEN_BUCKETS, ()),
    "tierserve_grammar_compile_seconds": (
        "Time to compile a structured output's grammar (once per spec and replica).",
        COMPILE_BUCKETS, ("kind",)),
}

# The replica's grammar cache (replica/structured.py): apart from GAUGES and COUNTERS, which
# the dashboard shows every one of.
GRAMMAR_CACHE_GAUGES = {
    "tierserve_grammar_cache_entries": "Compiled structured-output grammars the replica caches.",
    "tierserve_grammar_cache_bytes": (
        "Bytes of the replica's grammar cache: each grammar's own size and its key's text "
        "(bounded by the engine's grammar_cache_bytes)."),
}
GRAMMAR_CACHE_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tierserve_grammar_cache_evictions": (
        "Compiled grammars dropped from the replica's cache for room (least recently used).",
        ()),
}
GRAMMAR_LOOKUPS = ("hit", "miss")
REJECTION_REASONS = ("queue_full", "empty", "too_long", "never_fits", "shed")
FINISH_REASONS = ("stop", "length", "abort", "error")
# What the ingress itself refuses: at its in-flight bound, past a tier's stream bytes, when its
# schema checks are all busy, and a prompt too long for the context (the rest is refused by the
# replicas).
INGRESS_REJECTIONS = ("shed", "queue_full", "stream_budget", "busy", "too_long")
# The ingress's own series (cluster/metrics.py): goodput per tier, flow control.
INGRESS_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tierserve_slo_requests": (
        "Requests that met or missed their tier's targets (target: ttft, tpot or both; a "
        "request shed or failed before its first token misses ttft and both).",
        ("tier", "target", "outcome")),
    "tierserve_flow_shed": (
        "Requests the ingress's flow control shed, by reason (late, max_hold, band_full, queue_full, "
        "evicted).", ("tier", "reason")),
    "tierserve_tenant_tokens": (
        "Tokens (prompt and output) served per tenant of a tier (fair share).",
        ("tier", "tenant")),
    "tierserve_structured_requests": (
        "Requests with a structured output, by tier and kind (json_schema, json_object, regex, "
        "choice, grammar, tool_call: tool_choice required or named).", ("tier", "kind")),
    "tierserve_model_requests": (
        "Requests the ingress admitted, per served model (a configured name) and tier.",
        ("model", "tier")),
}
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tool_call")
INGRESS_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "tierserve_flow_held": ("Requests held at the ingress, per tier and served model.",
                            ("tier", "model")),
    "tierserve_flow_starting": (
        "Requests dispatched to a replica that have not answered their first token, per served "
        "model.", ("model",)),
    "tierserve_flow_window": (
        "The dispatch window: requests that may be starting at once, per served model.",
        ("model",)),
}
# Serve's controller exports these (``tierserve.cluster.autoscaling``: only for a deployment
# autoscaled by its policy), per application and deployment.
AUTOSCALE_GAUGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "tierserve_autoscale_target_replicas": (
        "The replicas the autoscaling policy asks for (after the configured bounds).", ()),
    "tierserve_autoscale_running_replicas": ("The replicas running when it decided.", ()),
    "tierserve_autoscale_reason": (
        "1 for the reason of the policy's last decision (steady, changing, missed_targets, "
        "kv_pressure, waiting, preemptions, room_to_spare, bounds), 0 for the others.",
        ("reason",)),
    "tierserve_autoscale_signal": (
        "What the policy saw: miss_ratio (the watched tiers' requests past a target, of those "
        "finished in the report window), kv (mean share of the KV pool promised), busy (step "
        "loops' busy shares, summed), waiting (requests not yet answering), preemptions (per "
        "second).", ("signal",)),
}
SLO_TARGETS = ("ttft", "tpot", "both")
SLO_OUTCOMES = ("met", "missed")
SHED_REASONS = ("late", "max_hold", "band_full", "queue_full", "evicted")
NO_TIER = "none"  # the tier label of a request that came without one (direct handle calls)


def _zero(counter: Any, tags: dict[str, str]) -> None:
    """Export ``counter``'s series for ``tags`` at 0 before anything increments it: Prometheus
    then has a series to rate from the start (a dashboard shows 0, not "No data"), and the
    first increment is not lost to a missing baseline. Ray's ``Counter.inc`` refuses 0, so the
    point is recorded underneath it (its ``_record``, what ``inc`` calls)."""
    record = getattr(counter, "_record", None)
    if record is not None:
        record(0, tags=tags)


def zero_counters(counters: dict[str, Any], tiers: Sequence[str],
                  rejections: Sequence[str] = REJECTION_REASONS) -> None:
    """Every counter of ``counters`` at 0 for every known label set (``tiers`` x reasons)."""
    tiers = [*tiers, NO_TIER]
    for name, counter in counters.items():
        _, keys = COUNTERS[name]
        if not keys:
            _zero(counter, {})
        elif keys == ("result",):
            for result in GRAMMAR_LOOKUPS:
                _zero(counter, {"result": result})
        elif keys == ("tier",):
            for t in tiers:
                _zero(counter, {"tier": t})
        else:
            reasons = rejections if name == "tierserve_rejections" else FINISH_REASONS
            for t in tiers:
                for r in reasons:
                    _zero(counter, {"reason": r, "tier": t})


def resident_bytes() -> int:
    """This process's resident memory (``/proc/self/statm``; 0 where there is no ``/proc``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def gpu_memory(
    device: Any, mem_get_info: Callable[[Any], tuple[int, int]] | None = None
) -> tuple[int, int]:
    """``(used, total)`` bytes of the CUDA ``device`` (a ``torch.device``) as the driver counts
    them (every process's, the CUDA context included: what ``gpu_memory_utilization`` is a
    fraction of); ``(0, 0)`` for any other device or where the driver cannot be asked.
    ``mem_get_info``: ``(free, total)`` of a device (default ``torch.cuda.mem_get_info``)."""
    if getattr(device, "type", None) != "cuda":
        return 0, 0
    if mem_get_info is None:
        import torch

        mem_get_info = torch.cuda.mem_get_info
    try:
        free, total = mem_get_info(device)
    except (RuntimeError, AssertionError):  # no driver, or the device is gone
        return 0, 0
    return int(total - free), int(total)


def gauge_values(s: EngineStats) -> dict[str, float]:
    """Every gauge's value for the stats ``s`` (the resident memory only where it is known)."""
    values: dict[str, float] = {
        "tierserve_requests_running": s.running,
        "tierserve_requests_waiting": s.waiting,
        "tierserve_kv_blocks_free": s.free_blocks,
        "tierserve_kv_blocks_total": s.total_blocks,
        "tierserve_kv_blocks_cached": s.cached_blocks,
        "tierserve_step_limit_seconds": s.step_limit_s,
        "tierserve_requests_paused": s.paused,
        "tierserve_lora_adapters_loaded": s.lora_adapters_loaded,
        "tierserve_lora_adapters_running": s.lora_adapters_running,
        "tierserve_kv_pool_bytes": s.kv_pool_bytes,
        "tierserve_gpu_memory_used_bytes": s.gpu_memory_used_bytes,
        "tierserve_gpu_memory_total_bytes": s.gpu_memory_total_bytes,
    }
    if s.rss_bytes:
        values["tierserve_replica_resident_memory_bytes"] = s.rss_bytes
    return values


def exported_names() -> set[str]:
    """The names a Prometheus scrape shows (``ray_`` prefix, ``_total``, histogram series)."""
    names = {f"ray_{g}" for g in GAUGES | MEMORY_GAUGES | GRAMMAR_CACHE_GAUGES}
    names |= {f"ray_{c}_total" for c in COUNTERS | GRAMMAR_CACHE_COUNTERS}
    names |= {f"ray_{g}" for g in INGRESS_GAUGES}
    names |= {f"ray_{c}_total" for c in INGRESS_COUNTERS}
    names |= {f"ray_{g}" for g in AUTOSCALE_GAUGES}
    for h in HISTOGRAMS:
        names |= {f"ray_{h}_bucket", f"ray_{h}_sum", f"ray_{h}_count"}
    return names


EXPORTED = exported_names()


class ReplicaMetrics:
    """The metrics of one replica; an ``EngineObserver`` plus a gauge refresher."""

    # The grammar cache's entries and bytes, as last reported (the refresher sets them again).
    _grammar_cache: tuple[int, int] = (0, 0)
    _grammar_evictions = 0

    def __init__(self, tiers: Sequence[str] = ()) -> None:
        from ray.serve.metrics import Counter, Gauge, Histogram

        self.gauges = {
            name: Gauge(name, description=doc)
            for name, doc in (GAUGES | MEMORY_GAUGES | GRAMMAR_CACHE_GAUGES).items()
        }
        self.counters = {
            name: Counter(name, description=doc, tag_keys=tags)  # type: ignore[arg-type]
            for name, (doc, tags) in COUNTERS.items()
        }
        self.grammar_counters = {
            name: Counter(name, description=doc, tag_keys=tags)  # type: ignore[arg-type]
            for name, (doc, tags) in GRAMMAR_CACHE_COUNTERS.items()
        }
        for counter in self.grammar_counters.values():
            _zero(counter, {})
        self._grammar_lock = threading.Lock()
        self.histograms = {
            name: Histogram(name, description=doc, boundaries=b, tag_keys=tags)  # type: ignore[arg-type]
            for name, (doc, b, tags) in HISTOGRAMS.items()
        }
        zero_counters(self.counters, tiers)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # EngineObserver
    def request_done(self, t: RequestTimes) -> None:
        tier = {"tier": t.tier or NO_TIER}
        c, h = self.counters, self.histograms
        if t.reason == "abort":
            c["tierserve_aborts"].inc(1, tags=tier)
        c["tierserve_requests_finished"].inc(1, tags={"reason": t.reason, **tier})
        c["tierserve_prompt_tokens"].inc(t.prompt_tokens, tags=tier)
        if t.generated_tokens:
            c["tierserve_generation_tokens"].inc(t.generated_tokens, tags=tier)
        if t.cached_tokens is not None:
            c["tierserve_prefix_cache_queries"].inc(t.prompt_tokens, tags=tier)
            if t.cached_tokens:
                c["tierserve_prefix_cache_hits"].inc(t.cached_tokens, tags=tier)
        h["tierserve_e2e_request_latency_seconds"].observe(t.e2e_s, tags=tier)
        if t.queue_s is not None:
            h["tierserve_queue_time_seconds"].observe(t.queue_s, tags=tier)
        if t.ttft_s is not None:
            h["tierserve_time_to_first_token_seconds"].observe(t.ttft_s, tags=tier)
        if t.tpot_s is not None:
            h["tierserve_time_per_output_token_seconds"].observe(t.tpot_s, tags=tier)

    def step_done(self, duration_s: float, tokens: int, preempted: int) -> None:
        self.histograms["tierserve_step_duration_seconds"].observe(duration_s)
        self.histograms["tierserve_step_tokens"].observe(tokens)
        if preempted:
            self.counters["tierserve_preemptions"].inc(preempted)

    def rejected(self, reason: str, tier: str) -> None:
        self.counters["tierserve_rejections"].inc(1, tags={"reason": reason, "tier": tier or NO_TIER})

    def grammar_compiled(self, kind: str, seconds: float) -> None:
        self.histograms["tierserve_grammar_compile_seconds"].observe(seconds, tags={"kind": kind})

    def grammar_lookup(self, hit: bool) -> None:
        self.counters["tierserve_grammar_cache"].inc(1, tags={"result": "hit" if hit else "miss"})

    def grammar_cache(self, entries: int, nbytes: int, evictions: int) -> None:
        """The grammar cache changed: its entries and bytes now, its evictions so far."""
        with self._grammar_lock:
            self._grammar_cache = (entries, nbytes)
            evicted = evictions - self._grammar_evictions
            if evicted > 0:
                self._grammar_evictions = evictions
                self.grammar_counters["tierserve_grammar_cache_evictions"].inc(evicted)
        self._set_grammar_gauges()

    def _set_grammar_gauges(self) -> None:
        entries, nbytes = self._grammar_cache
        for name, value in (("tierserve_grammar_cache_entries", entries),
                            ("tierserve_grammar_cache_bytes", nbytes)):
            gauge = self.gauges.get(name)
            if gauge is not None:
                gauge.set(value)

    # gauges
    def start(self, read: Callable[[], EngineStats]) -> None:
        """Refresh the gauges from ``read()`` (the engine's stats) every ``GAUGE_PERIOD_S``."""

        def loop() -> None:
            while not self._stop.is_set():
                self.refresh(read())
                self._stop.wait(GAUGE_PERIOD_S)

        self._thread = threading.Thread(target=loop, name="tierserve-metrics", daemon=True)
        self._thread.start()

    def refresh(self, s: EngineStats) -> None:
        for name, value in gauge_values(s).items():
            self.gauges[name].set(value)
        self._set_grammar_gauges()

    def stop(self) -> None:
        self._stop.set()
