"""Router benchmark: one skewed, bursty workload against simulated engines, under three routers.

Run: ``python -m benchmarks.router`` (2, 4 and 8 replicas, 2 rounds, about 14 minutes on 2 cores);
``--quick`` (2 and 4 replicas, 1 round, a shorter workload, about 3 minutes); ``--replicas 2,4,8``;
``--rounds N``; ``--duration S`` (seconds of arrivals per round); ``--seed N``; ``--json PATH`` the
figures and every request's timings; ``--plot PATH.png`` CDFs and bars; ``--routers a,b`` a subset;
``--router NAME=JSON`` one more router (``RequestRouterConfig`` kwargs, e.g. another
``request_routing_stats_period_s`` or a class of your own); ``--offline`` the offline model below
instead of Serve. Nothing here asserts on time: the target (free-blocks p99 TTFT of the high tier
at most 0.7x the default router's, with fewer preemptions) is printed as met or not.

The cluster, per replica count N (one Serve app in a local Ray of this process's own):

- Three ``benchmarks.router_sim.SimEngine`` deployments of N replicas each, identical but
  for the router:
  ``free-blocks`` (``tierserve.router.free_blocks_router:FreeKVBlocksRouter``, stats every second),
  ``pow2`` (no router config: Serve's default ``PowerOfTwoChoicesRequestRouter``) and
  ``round-robin`` (``RoundRobinRouter`` below). Each replica is a ``SimCore``: the replicas' own
  scheduler (``tierserve.replica.scheduler.Scheduler`` over ``FreeListBlocks``: admission by free blocks,
  priority with aging, chunked prefill, preemption by recompute) with the ``EngineConfig`` of
  ``Engine`` below (the replica's defaults but for a smaller batch and queue), whose steps take ``base + per_token * tokens`` seconds of real time (``asyncio.sleep``)
  instead of a forward pass, so a replica saturates like an engine without using a CPU: a prompt
  is prefilled 256 tokens per step (a 3000-token one over 12 steps), and a step with 256 prompt
  tokens takes about twice as long as one of 16 decodes.
- One ``BenchDriver`` replica with a handle to each engine deployment. It replays the request list
  at its arrival times as ``GenerateRequest`` records, streaming every request, so the router
  runs where it runs in production: in the handle owner. TTFT is the time from the handle call to the first streamed item, e2e to
  the last; the engine streams only the first and last token (``stream_every``) to keep Ray's
  per-item cost out of the figures.
- Preemptions and rejections are the replicas' own counters (the scheduler's, through
  ``SimCore.preemptions`` and ``SimCore.rejections``), read from every replica actor before and
  after a run.

The workload, per replica count and round (a fixed seed; the same list for every router):

- Arrivals: on/off bursts, Poisson within a period: ``off_x`` times the mean rate during "off"
  periods, the rest of the mean during "on" periods (2.1x the mean by default); periods last
  0.5-1.5x ``on_s`` / ``off_s``, uniformly. The mean rate is ``rate_per_replica * N``.
- Tiers: ``interactive`` (30% of requests) and ``batch``, at the base priorities of the cluster's
  default tiers of those names (``tierserve.cluster.config.ClusterConfig``); a request is routed for its
  first token when its priority reaches the cluster's ``latency_floor``, as the ingress marks it
  (the interactive tier). Prompts are short (32-128 tokens) or long (1500-3000 tokens; 5% of
  interactive, 20% of batch requests); outputs 16-128 tokens.

Rounds alternate the order of the routers (ABC, CBA, ...) so that a drift of the machine's load
does not favour one of them; every figure pools the rounds. The machine may be shared: compare
the figures of one run, and read the paired-bootstrap interval of the ratio before the ratio.
Each run records the machine's CPU use and this benchmark's (``/proc``), and the driver's send lag:
a run whose p99 send lag exceeds 0.1 s is flagged STARVED (the machine, not the router, set the
pace; its route times, handle call to replica, show it too), and the ratio is also given over the
rounds where neither run was starved, and on the engine side only (replica arrival to first
token, which the driver's CPU does not delay).

The offline model (``--offline``): the same request lists and ``SimCore`` replicas in virtual
time, without Ray: free-blocks is ``tierserve.router.policy.rank_replicas`` with the router's own ledger
(``tierserve.router.ledger.InFlightLedger``: tentative charge, confirmation, completion) and reports every
second (+-10%) seen 0.1 s late; pow2 picks the less busy of two random replicas by this router's
count of ongoing requests (what Serve's queue-length cache holds with one router); round-robin
takes turns. Deterministic and noise-free, so 10 rounds take seconds: use it to tell a policy's
effect from the machine's noise, and the Serve run to check that the real router behaves as the
model says.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import logging
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from benchmarks.router_sim import (
    ROUTER_CLASS,
    TOKEN,
    SimCore,
    SimEngine,
    StepModel,
    sim_config,
)
from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.measure import load_avg_1m, machine, percentile, pyplot
from tierserve.records import ErrorRecord, GenerateRequest, RoutingStats, SamplingParams
from tierserve.replica.config import EngineConfig
from tierserve.replica.scheduler import AdmitError, EmptyPrompt, NeverFits, QueueFull, TooLong
from tierserve.router.policy import RequestShape
from tierserve.router.routing import RouterSettings, RouterState

# ----------------------------------------------------------------------------- the baseline router


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Baseline: the replicas in turn, whatever their load (a full replica is skipped by Serve).

    Serve pickles this module by value into the handle owner: no state outside the instance.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turn = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # else Serve retries at once
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        k = self._turn % len(ordered)
        self._turn += 1
        return [[r] for r in ordered[k:] + ordered[:k]]


def router_configs() -> dict[str, dict[str, Any]]:
    """Router name -> ``RequestRouterConfig`` kwargs (``--router`` adds more)."""
    return {
        "free-blocks": {"request_router_class": ROUTER_CLASS, "request_routing_stats_period_s": 1},
        "pow2": {},  # Serve's default: PowerOfTwoChoicesRequestRouter, default stats period
        "round-robin": {"request_router_class": "benchmarks.router:RoundRobinRouter"},
    }


OURS, DEFAULT = "free-blocks", "pow2"

# ----------------------------------------------------------------------------- the workload

# The cluster's default tiers: the workload's tiers take their base priorities by name, and a
# request is routed for its first token when its priority reaches the top tier's, as the ingress
# marks it.
_CLUSTER = ClusterConfig()
TIER_PRIORITY = {t.name: t.base_priority for t in _CLUSTER.tiers}
LATENCY_FLOOR = _CLUSTER.latency_floor


@dataclass(frozen=True, slots=True)
class Tier:
    name: str
    priority: int
    share: float  # of requests
    long_share: float  # of this tier's prompts that are long


@dataclass(frozen=True, slots=True)
class Workload:
    duration_s: float = 30.0  # seconds of arrivals per round
    rate_per_replica: float = 4.0  # mean requests per second per replica
    off_x: float = 0.25  # rate during an "off" period, times the mean
    on_s: float = 2.0  # mean length of an "on" period
    off_s: float = 3.0  # mean length of an "off" period
    tiers: tuple[Tier, ...] = (
        Tier("interactive", TIER_PRIORITY["interactive"], 0.3, 0.05),
        Tier("batch", TIER_PRIORITY["batch"], 0.7, 0.20),
    )
    short_prompt: tuple[int, int] = (32, 128)
    long_prompt: tuple[int, int] = (1500, 3000)
    output: tuple[int, int] = (16, 128)


# The replicas' EngineConfig fields this benchmark sets: a smaller batch, and a queue beyond
# which a replica rejects. The others are EngineConfig's defaults (a prompt is prefilled
# ``prefill_chunk_tokens`` per step, priority scheduling with aging); the prefix cache is off
# (``sim_config``: the default workload's prompts are lengths, all alike).
BENCH_ENGINE: dict[str, Any] = {"max_num_seqs": 16, "max_waiting": 64}


@dataclass(frozen=True, slots=True)
class Engine:
    """``SimEngine`` arguments (the same for every router): the pool, the step model, and the
    replicas' ``EngineConfig`` fields that differ from its defaults (``options``)."""

    pool_blocks: int = 256  # 4096 tokens: one long prompt takes 40-75% of it
    options: dict[str, Any] = field(default_factory=lambda: dict(BENCH_ENGINE))
    step_base_s: float = 0.010
    step_per_token_s: float = 0.00005
    stream_every: int = 1_000_000  # first and last token only

    @property
    def config(self) -> EngineConfig:
        """One replica's engine config (validated as a real replica's)."""
        return sim_config(self.pool_blocks, **self.options)

    def _step_model(self) -> dict[str, Any]:
        return {
            "pool_blocks": self.pool_blocks,
            "step_base_s": self.step_base_s,
            "step_per_token_s": self.step_per_token_s,
            "stream_every": self.stream_every,
        }

    def deployment_args(self) -> dict[str, Any]:
        """``SimEngine``'s keyword arguments."""
        return {**self._step_model(), **self.options}

    def record(self) -> dict[str, Any]:
        """What a run records: the step model and the replicas' whole engine config."""
        return {**self._step_model(), "config": self.config.model_dump(mode="json")}

    def core(self) -> SimCore:
        """One replica's engine, as ``SimEngine`` builds it, for the offline model."""
        return SimCore(self.config, StepModel(self.step_base_s, self.step_per_token_s))


@dataclass(frozen=True, slots=True)
class Request:
    at: float  # seconds after the start of the round
    prompt: int
    max_tokens: int
    priority: int
    tier: str
    # The prompt's token ids when they matter (a prefix cache tells prompts apart; None: every
    # position alike) and the names of its full blocks (``tierserve.replica.prefix_cache.block_hashes``).
    ids: tuple[int, ...] | None = None
    prefix: tuple[int, ...] = ()
    # Routed for its first token (GenerateRequest.latency: its priority reaches LATENCY_FLOOR).
    latency: bool = False


def make_requests(w: Workload, replicas: int, seed: int) -> list[Request]:
    """The arrivals of one round: on/off bursts, tiers and prompt lengths from ``seed``."""
    rng = random.Random(seed)
    mean = w.rate_per_replica * replicas
    frac_on = w.on_s / (w.on_s + w.off_s)
    rate_off = mean * w.off_x
    rate_on = (mean - (1 - frac_on) * rate_off) / frac_on
    shares = [t.share for t in w.tiers]
    out: list[Request] = []
    t, on = 0.0, True
    phase_end = w.on_s * rng.uniform(0.5, 1.5)
    while True:
        rate = rate_on if on else rate_off
        nxt = t + rng.expovariate(rate) if rate > 0 else math.inf
        if nxt > phase_end:
            t, on = phase_end, not on
            phase_end = t + (w.on_s if on else w.off_s) * rng.uniform(0.5, 1.5)
            if t >= w.duration_s:
                break
            continue
        t = nxt
        if t >= w.duration_s:
            break
        tier = rng.choices(w.tiers, weights=shares)[0]
        lo, hi = w.long_prompt if rng.random() < tier.long_share else w.short_prompt
        out.append(
            Request(
                round(t, 4), rng.randint(lo, hi), rng.randint(*w.output), tier.priority, tier.name,
                latency=tier.priority >= LATENCY_FLOOR,
            )
        )
    return out


# ----------------------------------------------------------------------------- the load driver


class Refused(Exception):
    """A replica's ``ErrorRecord``: its refusal of a request."""

    def __init__(self, record: ErrorRecord) -> None:
        super().__init__(f"{record.code}: {record.message}")
        self.record = record


class Rec(NamedTuple):
    """One request's timings (seconds; NaN when it failed), as the driver measured them."""

    ttft: float  # handle call -> first streamed item
    e2e: float  # handle call -> last streamed item
    lag: float  # how late the driver made the call against the request's arrival time
    replica: str
    tokens: int
    error: str  # empty when it was served
    route: float  # handle call -> the replica's generate() started (routing and transfer)
    engine_ttft: float  # generate() started -> first token handed to the stream (queueing)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=16)
class BenchDriver:
    """Replays a request list through one engine deployment's handle (this process's router)."""

    def __init__(self, names: list[str], *engines: DeploymentHandle) -> None:
        self.engines = {n: e.options(stream=True) for n, e in zip(names, engines, strict=True)}

    async def _one(
        self, handle: DeploymentHandle, start: float, r: tuple[float, int, int, int, bool]
    ) -> tuple[float, float, float, str, int, str, float, float]:
        """A ``Rec`` as a plain tuple."""
        loop = asyncio.get_running_loop()
        at, prompt, max_tokens, priority, latency = r
        delay = start + at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        sent, sent_wall = loop.time(), time.time()
        first = route = engine_ttft = math.nan
        replica, tokens, error = "", 0, ""
        try:
            request = GenerateRequest(
                (TOKEN,) * prompt,
                SamplingParams(max_tokens=max_tokens),
                priority=priority,
                latency=latency,
            )
            stream = handle.generate.remote(request)
            assert isinstance(stream, DeploymentResponseGenerator)
            async for item in stream:
                if isinstance(item, ErrorRecord):
                    raise Refused(item)
                if math.isnan(first):
                    first = loop.time()
                    route = item.arrived - sent_wall
                    engine_ttft = item.at - item.arrived
                replica, tokens = item.replica, item.completion_tokens
            end = loop.time()
        except Refused as e:
            end, error = math.nan, str(e)[-400:]
        except Exception as e:
            end, error = math.nan, f"{type(e).__name__}: {e}"[-400:]
        lag = sent - (start + at)
        return (first - sent, end - sent, lag, replica, tokens, error, route, engine_ttft)

    async def replay(
        self, name: str, requests: list[tuple[float, int, int, int, bool]]
    ) -> list[tuple[float, float, float, str, int, str, float, float]]:
        """Send ``(at, prompt, max_tokens, priority, latency)`` at ``at`` seconds from now
        (+0.5 s)."""
        handle = self.engines[name]
        start = asyncio.get_running_loop().time() + 0.5
        return list(await asyncio.gather(*(self._one(handle, start, r) for r in requests)))

    async def warmup(self, name: str, n: int) -> list[str]:
        """``n`` short concurrent requests; the replicas that served them."""
        handle = self.engines[name]
        out = await asyncio.gather(*(self._one(handle, 0.0, (0.0, 32, 4, 0, False)) for _ in range(n)))
        return [o[3] for o in out]


# ----------------------------------------------------------------------------- measuring


def replica_counters(app: str, deployment: str) -> dict[str, dict[str, Any]]:
    """Every replica's ``record_routing_stats`` (preemptions, rejections, queues), by actor name.

    Called on the replica actors directly, as Serve's controller does.
    """
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and a["name"].startswith(prefix)
    ]
    if not names:
        raise RuntimeError(f"no replica actors named {prefix}*: Serve's naming changed?")
    refs: dict[str, Any] = {
        n: ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names
    }
    stats: dict[str, dict[str, Any]] = {}
    for n, ref in refs.items():
        stats[n.removeprefix(prefix)] = ray.get(ref, timeout=60)
    return stats


@dataclass(slots=True)
class RunResult:
    """One router, one round."""

    router: str
    round: int
    seconds: float
    load_avg_before: float
    load_avg_after: float
    preemptions: int
    rejections: int
    records: list[Rec] = field(default_factory=list)  # in request order
    # Prompt positions each request found cached at its replica (offline model; in request order).
    cached: list[int] = field(default_factory=list)
    machine_busy_cores: float = math.nan  # the whole machine's CPU use during the run
    bench_cores: float = math.nan  # this benchmark's processes (driver, Ray, replicas)

    @property
    def send_lag_p99(self) -> float:
        return percentile([r.lag for r in self.records], 99)

    @property
    def starved(self) -> bool:
        """The driver could not even send on time: the machine, not the router, set the pace."""
        return self.send_lag_p99 > STARVED_LAG_S


STARVED_LAG_S = 0.1  # driver send lag p99 above which a run is flagged as starved of CPU


def summarize(
    results: list[RunResult], rounds: list[list[Request]], replicas: int
) -> dict[str, Any]:
    """Pooled over rounds: per router and tier, TTFT / e2e percentiles; counters; balance."""
    out: dict[str, Any] = {}
    names = list(dict.fromkeys(r.router for r in results))
    for name in names:
        runs = [r for r in results if r.router == name]
        rows: dict[str, Any] = {}
        tiers = sorted({q.tier for reqs in rounds for q in reqs}, key=_tier_order)
        for tier in [*tiers, "all"]:
            ttft, e2e, route, engine, errors, rejected = [], [], [], [], 0, 0
            for run in runs:
                for q, rec in zip(rounds[run.round], run.records, strict=True):
                    if tier not in ("all", q.tier):
                        continue
                    if rec.error:
                        errors += 1
                        rejected += _is_rejection(rec.error)
                        continue
                    ttft.append(rec.ttft)
                    e2e.append(rec.e2e)
                    route.append(rec.route)
                    engine.append(rec.engine_ttft)
            rows[tier] = {
                "n": len(ttft),
                "ttft_p50": percentile(ttft, 50),
                "ttft_p90": percentile(ttft, 90),
                "ttft_p99": percentile(ttft, 99),
                "e2e_p50": percentile(e2e, 50),
                "e2e_p99": percentile(e2e, 99),
                # TTFT = route (to the replica) + engine (queue and prefill) + delivery
                "route_p50": percentile(route, 50),
                "route_p99": percentile(route, 99),
                "engine_ttft_p50": percentile(engine, 50),
                "engine_ttft_p99": percentile(engine, 99),
                "failed": errors,
                "rejected": rejected,
            }
        per_replica: Counter[str] = Counter()
        long_per_replica: Counter[str] = Counter()
        for run in runs:
            for q, rec in zip(rounds[run.round], run.records, strict=True):
                if rec.replica:
                    per_replica[rec.replica] += 1
                    long_per_replica[rec.replica] += q.prompt >= 1000
        lags = [rec.lag for run in runs for rec in run.records]
        top = _tier_order_list(rounds)[0]
        per_round = []
        for run in runs:
            served = [
                rec
                for q, rec in zip(rounds[run.round], run.records, strict=True)
                if q.tier == top and not rec.error
            ]
            per_round.append(
                {
                    "round": run.round,
                    "top_tier_ttft_p99": percentile([r.ttft for r in served], 99),
                    "top_tier_engine_ttft_p99": percentile([r.engine_ttft for r in served], 99),
                    "preemptions": run.preemptions,
                    "send_lag_p99_s": run.send_lag_p99,
                    "starved": run.starved,
                    "machine_busy_cores": run.machine_busy_cores,
                    "bench_cores": run.bench_cores,
                    "load_avg": [run.load_avg_before, run.load_avg_after],
                }
            )
        out[name] = {
            "rounds": per_round,
            "tiers": rows,
            "preemptions": sum(r.preemptions for r in runs),
            "rejections": sum(r.rejections for r in runs),
            "requests_per_replica": sorted(per_replica.values()),
            "long_prompts_per_replica": sorted(long_per_replica.values()),
            "send_lag_p99_s": percentile(lags, 99),
            "seconds": [round(r.seconds, 1) for r in runs],
            "errors": sorted({rec.error[-160:] for r in runs for rec in r.records if rec.error})[
                :5
            ],
        }
    top = _tier_order_list(rounds)[0]
    if DEFAULT in out:  # every router's high-tier p99 TTFT against the default router's
        theirs = out[DEFAULT]["tiers"][top]["ttft_p99"]
        out["vs_default"] = {
            name: {
                "ratio_p99_ttft": out[name]["tiers"][top]["ttft_p99"] / theirs
                if theirs
                else math.nan,
                "ratio_90ci": list(paired_bootstrap_ratio(results, rounds, top, name)),
            }
            for name in names
            if name != DEFAULT
        }
    if OURS in out and DEFAULT in out:
        ours = out[OURS]["tiers"][top]["ttft_p99"]
        theirs = out[DEFAULT]["tiers"][top]["ttft_p99"]
        lo, hi = out["vs_default"][OURS]["ratio_90ci"]
        out["target"] = {
            "tier": top,
            "ratio_p99_ttft": ours / theirs if theirs else math.nan,
            "ratio_90ci": [lo, hi],
            "fewer_preemptions": out[OURS]["preemptions"] < out[DEFAULT]["preemptions"],
        }
        out["target"]["met"] = bool(
            out["target"]["ratio_p99_ttft"] <= 0.7 and out["target"]["fewer_preemptions"]
        )
        # The same, over the rounds where neither run was starved of CPU, and engine-side only.
        by = {(r.router, r.round): r for r in results}
        clean = [
            k
            for k in range(len(rounds))
            if (OURS, k) in by
            and (DEFAULT, k) in by
            and not by[OURS, k].starved
            and not by[DEFAULT, k].starved
        ]
        out["target"]["clean_rounds"] = clean

        def top_p99(name: str, ks: list[int], attr: str) -> float:
            return percentile(
                [
                    getattr(rec, attr)
                    for k in ks
                    for q, rec in zip(rounds[k], by[name, k].records, strict=True)
                    if q.tier == top and not rec.error
                ],
                99,
            )

        if clean:
            a, b = top_p99(OURS, clean, "ttft"), top_p99(DEFAULT, clean, "ttft")
            out["target"]["ratio_p99_ttft_clean_rounds"] = a / b if b else math.nan
        all_k = [k for k in range(len(rounds)) if (OURS, k) in by and (DEFAULT, k) in by]
        a, b = top_p99(OURS, all_k, "engine_ttft"), top_p99(DEFAULT, all_k, "engine_ttft")
        out["target"]["ratio_p99_engine_ttft"] = a / b if b else math.nan
    out["replicas"] = replicas
    out["routers"] = names
    return out


# The replica scheduler's refusals (tierserve.replica.scheduler.AdmitError), by reason: a request's error
# starts with the reason (the code of the replica's ErrorRecord; the offline model writes the
# same).
REFUSALS = frozenset(c.reason for c in (QueueFull, NeverFits, TooLong, EmptyPrompt))


def _is_rejection(error: str) -> bool:
    return error.partition(":")[0] in REFUSALS


TIER_RANK = {"interactive": 0, "batch": 1}


def _tier_order(name: str) -> int:
    return TIER_RANK.get(name, 99)


def _tier_order_list(rounds: list[list[Request]]) -> list[str]:
    """Tiers by priority, highest first."""
    prio: dict[str, int] = {}
    for reqs in rounds:
        for q in reqs:
            prio[q.tier] = q.priority
    return sorted(prio, key=lambda t: -prio[t])


def paired_bootstrap_ratio(
    results: list[RunResult],
    rounds: list[list[Request]],
    tier: str,
    name: str = OURS,
    n: int = 2000,
) -> tuple[float, float]:
    """A 90% interval of p99(name) / p99(default) over the tier's requests, resampled in pairs.

    Each p99 and the interval's bounds are ``percentile``'s (linear between the closest ranks);
    until it was shared, each resample's p99 was numpy's next order statistic up (``higher``),
    which put the bounds a few percent apart from these, and the interval's upper bound came out
    NaN where both sides had rejections (now ``inf``)."""
    by = {(r.router, r.round): r for r in results}
    a, b = [], []
    for k, reqs in enumerate(rounds):
        ra, rb = by.get((name, k)), by.get((DEFAULT, k))
        if ra is None or rb is None:
            continue
        for q, x, y in zip(reqs, ra.records, rb.records, strict=True):
            if q.tier == tier:
                a.append(x.ttft if not x.error else math.inf)  # a rejection counts as never served
                b.append(y.ttft if not y.error else math.inf)
    if not a:
        return math.nan, math.nan
    rng = np.random.default_rng(0)
    ratios = []
    # Each resample's p99s by the one percentile of every figure (an inf, a rejection, stays an
    # inf: two of them do not make the p99 NaN); a ratio of two infs is NaN, left out below.
    for row in rng.integers(0, len(a), size=(n, len(a))).tolist():
        pa, pb = percentile([a[i] for i in row], 99), percentile([b[i] for i in row], 99)
        ratios.append(pa / pb if pb else (math.inf if pa else math.nan))
    return percentile(ratios, 5), percentile(ratios, 95)


# ----------------------------------------------------------------------------- offline model


class OfflinePolicy(Protocol):
    """A router in the offline model: told what a Serve router is told, in virtual time."""

    def choose(self, now: float, i: int, q: Request, ongoing: Sequence[int]) -> int: ...
    def on_routed(self, now: float, i: int, k: int) -> None: ...
    def on_completed(self, now: float, i: int, k: int) -> None: ...
    def on_report(self, now: float, k: int, stats: RoutingStats) -> None: ...


class _NoHooks:
    def on_routed(self, now: float, i: int, k: int) -> None:
        pass

    def on_completed(self, now: float, i: int, k: int) -> None:
        pass

    def on_report(self, now: float, k: int, stats: RoutingStats) -> None:
        pass


class OfflineRoundRobin(_NoHooks):
    def __init__(self, n: int, rng: random.Random) -> None:
        self.n, self.turn = n, 0

    def choose(self, now: float, i: int, q: Request, ongoing: Sequence[int]) -> int:
        self.turn += 1
        return (self.turn - 1) % self.n


class OfflinePow2(_NoHooks):
    """Serve's default: two random replicas, the one with fewer ongoing requests.

    Serve probes the replicas' queue lengths and caches them, adding one on each send; with one
    router that is this router's own count of ongoing requests, used here exactly.
    """

    def __init__(self, n: int, rng: random.Random) -> None:
        self.n, self.rng = n, rng

    def choose(self, now: float, i: int, q: Request, ongoing: Sequence[int]) -> int:
        if self.n == 1:
            return 0
        a, b = self.rng.sample(range(self.n), 2)
        return a if ongoing[a] <= ongoing[b] else b


class OfflineFreeBlocks:
    """``FreeKVBlocksRouter``'s own state and steps (``tierserve.router.routing.RouterState``: the ledger,
    the prefix index, ``tierserve.router.policy.rank_replicas``) in virtual time.

    The router's sequence: tentative charges past the router's time to live expire, the request
    is ranked and charged tentatively at ``choose``, confirmed (dated then) when the replica took
    it, dropped on completion or rejection; reports arrive as the controller delivers them.
    """

    def __init__(self, n: int, rng: random.Random, settings: RouterSettings | None = None) -> None:
        self.state: RouterState[int] = RouterState(settings)
        self.state.rng = rng
        self.reports: list[RoutingStats | None] = [None] * n

    def shape(self, q: Request) -> RequestShape:
        """What the router reads from the request's ``GenerateRequest``."""
        return RequestShape(q.prompt, q.max_tokens, latency=q.latency, prefix=q.prefix)

    def choose(self, now: float, i: int, q: Request, ongoing: Sequence[int]) -> int:
        ranked = self.state.route(i, list(enumerate(self.reports)), self.shape(q), i, now)
        return ranked[0].key

    def on_routed(self, now: float, i: int, k: int) -> None:
        def unexpected() -> RequestShape:
            raise AssertionError(f"request {i} reached replica {k}, not the one it was charged to")

        self.state.routed(i, k, i, now, self.reports[k], unexpected)

    def on_completed(self, now: float, i: int, k: int) -> None:
        self.state.completed(k, i)

    def on_report(self, now: float, k: int, stats: RoutingStats) -> None:
        self.reports[k] = stats


class OfflineOracle(_NoHooks):
    """Not a router: the replica whose cache holds the most of the prompt right now (asked of
    the replicas themselves), the fewest ongoing requests among equals. The ceiling of any
    router's prefix hit rate (it ignores load, so its latencies are not a target)."""

    def __init__(self, n: int, rng: random.Random) -> None:
        self.rng = rng
        self.cores: Sequence[SimCore] = ()

    def bind(self, cores: Sequence[SimCore]) -> None:
        self.cores = cores

    def choose(self, now: float, i: int, q: Request, ongoing: Sequence[int]) -> int:
        ids = q.ids or ()
        return min(
            range(len(self.cores)),
            key=lambda k: (-self.cores[k].cached_prefix(ids), ongoing[k], self.rng.random()),
        )


OFFLINE_POLICIES: dict[str, Any] = {
    "free-blocks": OfflineFreeBlocks,
    "pow2": OfflinePow2,
    "round-robin": OfflineRoundRobin,
}


@dataclass(frozen=True, slots=True)
class OfflineTiming:
    """Serve's delays in the offline model (seconds)."""

    report_period_s: float = 1.0  # request_routing_stats_period_s (Serve jitters it +-10%)
    report_delay_s: float = 0.1  # snapshot -> the router sees it (controller poll, long poll)
    transit_s: float = 0.005  # routed -> the replica's generate() starts
    confirm_s: float = 0.005  # generate() started -> on_request_routed


def simulate(
    reqs: Sequence[Request],
    n: int,
    engine: Engine,
    policy: OfflinePolicy,
    name: str,
    k_round: int,
    timing: OfflineTiming = OfflineTiming(),
    seed: int = 0,
) -> RunResult:
    """Replay ``reqs`` through ``n`` ``SimCore`` replicas in virtual time, ``policy`` routing.

    The replica loop is ``SimEngine``'s: a step's tokens are delivered when it ends, and requests
    that arrive during a step are admitted at the next one. Deterministic for a seed.
    """
    rng = random.Random(seed)
    cores = [engine.core() for _ in range(n)]
    bind = getattr(policy, "bind", None)
    if bind is not None:  # a policy that asks the replicas (the oracle)
        bind(cores)
    ongoing = [0] * n  # routed and not finished (what Serve's queue-length cache counts)
    busy = [False] * n
    owner: list[dict[int, int]] = [{} for _ in range(n)]  # SimCore id -> request index
    first = [math.nan] * len(reqs)
    end = [math.nan] * len(reqs)
    reached = [math.nan] * len(reqs)
    where = [-1] * len(reqs)
    sids: dict[int, tuple[int, int]] = {}  # request index -> (replica, SimCore id)
    tokens = [0] * len(reqs)
    error = [""] * len(reqs)
    left = len(reqs)
    events: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, data: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    arrive, reach, step_end, report, report_seen = range(5)
    for i, q in enumerate(reqs):
        push(q.at, arrive, i)
    for k in range(n):
        policy.on_report(0.0, k, cores[k].stats(0.0))  # as after the warm-up
        push(rng.uniform(0, timing.report_period_s), report, k)

    def start(k: int, t: float) -> None:
        seconds, out = cores[k].step()
        busy[k] = True
        push(t + seconds, step_end, (k, out))

    while events and left:
        t, _, kind, data = heapq.heappop(events)
        if kind == arrive:
            i = data
            k = policy.choose(t, i, reqs[i], ongoing)
            where[i] = k
            ongoing[k] += 1
            push(t + timing.transit_s, reach, (i, k))
        elif kind == reach:
            i, k = data
            q = reqs[i]
            reached[i] = t
            try:
                sid = cores[k].add(q.ids or q.prompt, q.max_tokens, q.priority)
            except AdmitError as e:
                error[i] = f"{e.reason}: {e}"
                ongoing[k] -= 1
                left -= 1
                policy.on_completed(t, i, k)
                continue
            owner[k][sid] = i
            sids[i] = (k, sid)
            policy.on_routed(t + timing.confirm_s, i, k)
            if not busy[k]:
                start(k, t)
        elif kind == step_end:
            k, out = data
            for sid, _token, done in out:
                i = owner[k][sid]
                tokens[i] += 1
                if math.isnan(first[i]):
                    first[i] = t
                if done:
                    end[i] = t
                    del owner[k][sid]
                    ongoing[k] -= 1
                    left -= 1
                    policy.on_completed(t, i, k)
            busy[k] = False
            if cores[k].has_work:
                start(k, t)
        elif kind == report:
            push(t + timing.report_delay_s, report_seen, (data, cores[data].stats(t)))
            push(t + timing.report_period_s * rng.uniform(0.9, 1.1), report, data)
        else:
            k, stats = data
            policy.on_report(t, k, stats)
    records = [
        Rec(
            first[i] - q.at,
            end[i] - q.at,
            0.0,
            f"r{where[i]}",
            tokens[i],
            error[i],
            reached[i] - q.at,
            first[i] - reached[i],
        )
        for i, q in enumerate(reqs)
    ]
    return RunResult(
        name,
        k_round,
        max((x for x in end if not math.isnan(x)), default=0.0),
        math.nan,
        math.nan,
        sum(c.preemptions for c in cores),
        sum(c.rejections for c in cores),
        records,
        [cores[k].cached.get(sid, 0) for k, sid in (sids.get(i, (0, -1)) for i in range(len(reqs)))],
    )


def bench_offline(
    replicas: int,
    rounds: int,
    w: Workload,
    engine: Engine,
    seed: int,
    policies: dict[str, Any],
) -> tuple[dict[str, Any], list[RunResult], list[list[Request]]]:
    """The offline model: every router on every round's list, in virtual time."""
    lists = [make_requests(w, replicas, seed + 1000 * replicas + k) for k in range(rounds)]
    results = [
        simulate(reqs, replicas, engine, make(replicas, random.Random(k)), name, k, seed=k)
        for k, reqs in enumerate(lists)
        for name, make in policies.items()
    ]
    return summarize(results, lists, replicas), results, lists


# ----------------------------------------------------------------------------- running


def deploy(
    app: str, replicas: int, engine: Engine, configs: dict[str, dict[str, Any]]
) -> DeploymentHandle:
    """One engine deployment per router and the driver, as one app."""
    engine_deployment: Any = SimEngine  # a serve.Deployment (mypy sees the class)
    driver_deployment: Any = BenchDriver
    bound = [
        engine_deployment.options(
            name=f"engine-{name}",
            num_replicas=replicas,
            ray_actor_options={"num_cpus": 0.1},
            request_router_config=RequestRouterConfig(**configs[name]),
        ).bind(**engine.deployment_args())
        for name in configs
    ]
    return serve.run(driver_deployment.bind(list(configs), *bound), name=app, route_prefix=None)


def _machine_cpu() -> tuple[float, float]:
    """``(busy, total)`` CPU seconds of the whole machine since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) / ticks, sum(v) / ticks


def _tree_cpu(root: int) -> float:
    """CPU seconds of ``root`` and its live descendants (the local Ray and its workers)."""
    ticks = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields_ = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry)] = int(fields_[1])
        cpu[int(entry)] = (int(fields_[11]) + int(fields_[12])) / ticks
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


def run_one(
    driver: DeploymentHandle, app: str, name: str, k: int, reqs: list[Request]
) -> RunResult:
    dep = f"engine-{name}"
    before = replica_counters(app, dep)
    load0 = os.getloadavg()[0]
    busy0, own0 = _machine_cpu()[0], _tree_cpu(os.getpid())
    t0 = time.perf_counter()
    payload = [(q.at, q.prompt, q.max_tokens, q.priority, q.latency) for q in reqs]
    timeout = 4 * (payload[-1][0] if payload else 0) + 300
    records = driver.replay.remote(name, payload).result(timeout_s=timeout)
    seconds = time.perf_counter() - t0
    busy1, own1 = _machine_cpu()[0], _tree_cpu(os.getpid())
    after = replica_counters(app, dep)
    delta = {
        key: sum(after[n].get(key, 0) - before.get(n, {}).get(key, 0) for n in after)
        for key in ("preemptions", "rejections")
    }
    return RunResult(
        name,
        k,
        seconds,
        load0,
        os.getloadavg()[0],
        delta["preemptions"],
        delta["rejections"],
        [Rec(*r) for r in records],
        machine_busy_cores=(busy1 - busy0) / seconds,
        bench_cores=(own1 - own0) / seconds,
    )


def bench_replicas(
    replicas: int,
    rounds: int,
    w: Workload,
    engine: Engine,
    seed: int,
    configs: dict[str, dict[str, Any]],
) -> tuple[dict[str, Any], list[RunResult], list[list[Request]]]:
    app = f"router-bench-{replicas}"
    t0 = time.perf_counter()
    driver = deploy(app, replicas, engine, configs)
    for name in configs:  # every replica has served and reported before the first round
        driver.warmup.remote(name, 4 * replicas).result(timeout_s=120)
    time.sleep(2.5)
    print(f"  [{replicas} replicas] deployed and warmed up in {time.perf_counter() - t0:.0f} s")
    lists = [make_requests(w, replicas, seed + 1000 * replicas + k) for k in range(rounds)]
    results: list[RunResult] = []
    for k, reqs in enumerate(lists):
        order = list(configs) if k % 2 == 0 else list(reversed(configs))
        for name in order:
            res = run_one(driver, app, name, k, reqs)
            results.append(res)
            hi = [rec.ttft for q, rec in zip(reqs, res.records, strict=True) if q.priority > 0]
            print(
                f"  [{replicas} replicas] round {k} {name:>11}: {len(reqs)} requests in "
                f"{res.seconds:.0f} s, interactive p99 TTFT {percentile(hi, 99):.3f} s, "
                f"preemptions {res.preemptions}, rejections {res.rejections}, "
                f"load {res.load_avg_before:.1f}->{res.load_avg_after:.1f}, CPU busy "
                f"{res.machine_busy_cores:.1f} cores (this benchmark {res.bench_cores:.1f}), "
                f"send lag p99 {res.send_lag_p99 * 1000:.0f} ms"
                + (" STARVED" if res.starved else "")
            )
            time.sleep(2.0)  # the next router's replicas report their idle state
    serve.delete(app)
    return summarize(results, lists, replicas), results, lists


def print_table(summary: dict[str, Any]) -> None:
    n = summary["replicas"]
    print(
        f"\n{n} replicas  (seconds, pooled over rounds; route: handle call -> replica, "
        "engine: replica -> first token)"
    )
    head = (
        f"{'router':<12} {'tier':<12} {'n':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'e2e p50':>8} {'e2e p99':>8} {'route p99':>9} {'engine p99':>10} "
        f"{'preempt':>8} {'reject':>7}"
    )
    print(head)
    print("-" * len(head))
    for name in summary["routers"]:
        s = summary[name]
        for i, (tier, row) in enumerate(s["tiers"].items()):
            counters = (
                f"{s['preemptions']:>8} {s['rejections']:>7}" if i == 0 else f"{'':>8} {'':>7}"
            )
            print(
                f"{name if i == 0 else '':<12} {tier:<12} {row['n']:>5} {row['ttft_p50']:>9.3f} "
                f"{row['ttft_p99']:>9.3f} {row['e2e_p50']:>8.2f} {row['e2e_p99']:>8.2f} "
                f"{row['route_p99']:>9.3f} {row['engine_ttft_p99']:>10.3f} {counters}"
            )
    for name in summary["routers"]:
        if name in summary:
            s = summary[name]
            print(
                f"  {name}: requests per replica {s['requests_per_replica']}, long prompts per "
                f"replica {s['long_prompts_per_replica']}, driver send lag p99 "
                f"{s['send_lag_p99_s'] * 1000:.0f} ms"
            )
            for e in s["errors"]:
                print(f"    error: {e}")
    for name, v in summary.get("vs_default", {}).items():
        if name != OURS:
            lo, hi = v["ratio_90ci"]
            print(
                f"  {name} / {DEFAULT} p99 TTFT of the top tier = {v['ratio_p99_ttft']:.2f} "
                f"(90% interval {lo:.2f}-{hi:.2f})"
            )
    t = summary.get("target")
    if t:
        lo, hi = t["ratio_90ci"]
        print(
            f"  {t['tier']} p99 TTFT, free-blocks / pow2 = {t['ratio_p99_ttft']:.2f} "
            f"(paired bootstrap 90% interval {lo:.2f}-{hi:.2f}); fewer preemptions: "
            f"{t['fewer_preemptions']}; target (<= 0.70 and fewer preemptions) "
            f"{'MET' if t['met'] else 'NOT met'}"
        )
        clean = t["clean_rounds"]
        print(
            f"  same ratio over rounds where neither run was starved ({clean or 'none'}): "
            + (f"{t['ratio_p99_ttft_clean_rounds']:.2f}" if clean else "n/a")
            + f"; engine side only (replica arrival -> first token): "
            f"{t['ratio_p99_engine_ttft']:.2f}"
        )
        for name in summary["routers"]:
            rows = ", ".join(
                f"r{r['round']} {r['top_tier_ttft_p99']:.2f}s"
                + (" (starved)" if r["starved"] else "")
                for r in summary[name]["rounds"]
            )
            print(f"    {name} {t['tier']} p99 TTFT per round: {rows}")


COLORS = {"free-blocks": "#2a7ab9", "pow2": "#e08a2c", "round-robin": "#7a9a3a"}
EXTRA_COLORS = ["#9b59b6", "#c0392b", "#16a085", "#7f8c8d", "#d4ac0d"]


def color(name: str) -> str:
    if name in COLORS:
        return COLORS[name]
    return EXTRA_COLORS[sum(map(ord, name)) % len(EXTRA_COLORS)]


def plot(
    summaries: list[dict[str, Any]],
    results: dict[int, list[RunResult]],
    lists: dict[int, list[list[Request]]],
    path: str,
    info: dict[str, Any],
) -> None:
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    cols = len(summaries)
    fig, axes = plt.subplots(3, cols, figsize=(5.2 * cols, 11), squeeze=False)
    for c, s in enumerate(summaries):
        n = s["replicas"]
        tiers = [t for t in s[s["routers"][0]]["tiers"] if t != "all"]
        for row, tier in enumerate(tiers[:2]):
            ax = axes[row][c]
            for name in s["routers"]:
                xs = sorted(
                    rec.ttft
                    for run in results[n]
                    if run.router == name
                    for q, rec in zip(lists[n][run.round], run.records, strict=True)
                    if q.tier == tier and not rec.error
                )
                if xs:
                    ys = np.arange(1, len(xs) + 1) / len(xs)
                    p99 = s[name]["tiers"][tier]["ttft_p99"]
                    ax.step(
                        xs, ys, where="post", color=color(name), label=f"{name} (p99 {p99:.2f}s)"
                    )
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0.5, 1.0)
            ax.axhline(0.99, color="grey", lw=0.6, ls=":")
            ax.set_title(f"{n} replicas: TTFT CDF, {tier} tier (upper half)", fontsize=10)
            ax.set_xlabel("TTFT (s, log)")
            ax.legend(fontsize=8, loc="lower right")
        ax = axes[2][c]
        names = s["routers"]
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            vals = [s[name]["tiers"][t]["ttft_p99"] for t in tiers]
            pos = np.arange(len(tiers)) + (i - (len(names) - 1) / 2) * width
            bars = ax.bar(
                pos,
                vals,
                width,
                color=color(name),
                label=f"{name}: {s[name]['preemptions']} preempt., {s[name]['rejections']} rej.",
            )
            for bar, v in zip(bars, vals, strict=True):
                ax.annotate(
                    f"{v:.2f}",
                    (bar.get_x() + bar.get_width() / 2, v),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        ax.set_xticks(np.arange(len(tiers)), tiers)
        ax.set_ylabel("p99 TTFT (s)")
        t = s.get("target")
        title = f"{n} replicas: p99 TTFT per tier"
        if t:
            title += f"\nfree-blocks / pow2 ({t['tier']}) = {t['ratio_p99_ttft']:.2f}"
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
        ax.margins(y=0.25)
    fig.suptitle(
        f"router benchmark ({info.get('mode', 'serve')}): SimEngine replicas, {info['cpu']} "
        f"x{info['cores']}, Ray {info['ray']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 and 4 replicas, 1 round of 12 s")
    ap.add_argument("--replicas", default=None, help="comma list, default 2,4,8 (--quick 2,4)")
    ap.add_argument("--rounds", type=int, default=None, help="default 2 (--quick 1, --offline 10)")
    ap.add_argument("--duration", type=float, default=None, help="arrival seconds per round, 30")
    ap.add_argument(
        "--routers",
        default=None,
        help="comma list of the routers to run, default free-blocks,pow2,round-robin",
    )
    ap.add_argument(
        "--router",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="one more router: a name and RequestRouterConfig kwargs as JSON, e.g. "
        'fb-nosat=\'{"request_router_class": "tierserve.router.free_blocks_router:FreeKVBlocksRouter", '
        '"request_router_kwargs": {"saturation_waiting": 1000000}}\'',
    )
    ap.add_argument(
        "--offline",
        action="store_true",
        help="no Ray: the offline model (virtual time, the same workload and SimCore, the real "
        "ranking), 10 rounds by default; a few seconds per replica count",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures to this path")
    ap.add_argument("--plot", default=None, help="write a PNG plot to this path")
    args = ap.parse_args(argv)

    replicas = [int(x) for x in (args.replicas or ("2,4" if args.quick else "2,4,8")).split(",")]
    rounds = args.rounds or (1 if args.quick else 10 if args.offline else 2)
    w = Workload(duration_s=args.duration or (12.0 if args.quick else 30.0))
    engine = Engine()
    configs = router_configs()
    if args.routers:
        wanted = args.routers.split(",")
        unknown = [r for r in wanted if r not in configs]
        if unknown:
            ap.error(f"unknown routers {unknown}; known: {sorted(configs)}")
        configs = {r: configs[r] for r in wanted}
    for spec in args.router:
        name, _, raw = spec.partition("=")
        configs[name] = json.loads(raw)
    if args.offline and args.router:
        ap.error("--router needs Serve: the offline model runs only " + ", ".join(OFFLINE_POLICIES))
    info = machine(ray=ray.__version__)
    print(f"machine: {json.dumps(info)}")
    print(f"workload: {json.dumps(asdict(w))}")
    print(f"engine: {json.dumps(engine.record())}")
    print(f"replicas {replicas}, {rounds} round(s), routers {json.dumps(configs)}")

    t_start = time.perf_counter()
    summaries: list[dict[str, Any]] = []
    all_results: dict[int, list[RunResult]] = {}
    all_lists: dict[int, list[list[Request]]] = {}
    if args.offline:
        print("OFFLINE MODEL: virtual time, no Serve; not a measurement of the Serve cluster")
        policies = {name: OFFLINE_POLICIES[name] for name in configs}
        for n in replicas:
            s, res, lists = bench_offline(n, rounds, w, engine, args.seed, policies)
            summaries.append(s)
            all_results[n], all_lists[n] = res, lists
            print_table(s)
    else:
        run_serve(
            replicas, rounds, w, engine, args.seed, configs, summaries, all_results, all_lists
        )
    info["mode"] = "offline model" if args.offline else "serve"
    _finish(args, info, t_start, w, engine, rounds, configs, summaries, all_results, all_lists)
    return 0


def run_serve(
    replicas: list[int],
    rounds: int,
    w: Workload,
    engine: Engine,
    seed: int,
    configs: dict[str, dict[str, Any]],
    summaries: list[dict[str, Any]],
    all_results: dict[int, list[RunResult]],
    all_lists: dict[int, list[list[Request]]],
) -> None:
    """Every replica count against the Serve cluster, in a local Ray of this process's own."""
    ray.init(
        address="local",  # a Ray of its own, never someone else's cluster
        num_cpus=max(4, max(replicas)),
        include_dashboard=False,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    try:
        serve.start(http_options={"location": "NoServer"})
        for n in replicas:
            s, res, lists = bench_replicas(n, rounds, w, engine, seed, configs)
            summaries.append(s)
            all_results[n], all_lists[n] = res, lists
            print_table(s)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def _finish(
    args: argparse.Namespace,
    info: dict[str, Any],
    t_start: float,
    w: Workload,
    engine: Engine,
    rounds: int,
    configs: dict[str, dict[str, Any]],
    summaries: list[dict[str, Any]],
    all_results: dict[int, list[RunResult]],
    all_lists: dict[int, list[list[Request]]],
) -> None:
    """The summary lines, the JSON and the plot."""
    info["load_avg_1m_after"] = load_avg_1m()
    info["run_seconds"] = round(time.perf_counter() - t_start, 1)
    print(
        f"\nrun took {info['run_seconds']:.0f} s; load average {info['load_avg_1m_before']:.2f} "
        f"before, {info['load_avg_1m_after']:.2f} after"
    )
    print("\nsummary: interactive p99 TTFT free-blocks / pow2 (target <= 0.70, fewer preemptions)")
    for s in summaries:
        t = s.get("target")
        if t:
            print(
                f"  {s['replicas']} replicas: {t['ratio_p99_ttft']:.2f} "
                f"[{t['ratio_90ci'][0]:.2f}-{t['ratio_90ci'][1]:.2f}], preemptions "
                f"{s[OURS]['preemptions']} vs {s[DEFAULT]['preemptions']}: "
                f"{'MET' if t['met'] else 'NOT met'}; unstarved rounds "
                + (f"{t['ratio_p99_ttft_clean_rounds']:.2f}" if t["clean_rounds"] else "none")
                + f", engine side {t['ratio_p99_engine_ttft']:.2f}"
            )
    if args.json:
        doc = {
            "machine": info,
            "workload": asdict(w),
            "engine": engine.record(),
            "rounds": rounds,
            "routers": configs,
            "summaries": summaries,
            "requests": {
                str(n): [[asdict(q) for q in reqs] for reqs in all_lists[n]] for n in all_lists
            },
            "runs": {
                str(n): [
                    {
                        "router": r.router,
                        "round": r.round,
                        "seconds": r.seconds,
                        "preemptions": r.preemptions,
                        "rejections": r.rejections,
                        "records": [list(rec) for rec in r.records],
                        "machine_busy_cores": r.machine_busy_cores,
                        "bench_cores": r.bench_cores,
                    }
                    for r in all_results[n]
                ]
                for n in all_results
            },
        }
        with open(args.json, "w") as f:
            json.dump(_jsonable(doc), f)
        print(f"wrote {args.json}")
    if args.plot:
        plot(summaries, all_results, all_lists, args.plot, info)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
