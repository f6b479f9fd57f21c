"""The tiers' latency promise under load: ``python -m benchmarks.tiers``.

Does each tier keep its targets (``ttft_target_s``, ``tpot_target_s`` of its ``TierConfig``) as
the offered load grows past what the cluster can serve, with tierserve's SLO machinery on
(SLO-aware steps and the ingress's flow control) and without it? Three systems, each a cluster
config derived from ``--config`` (default ``configs/cluster.yaml``) and written to a temporary
directory, each started once (``python -m tierserve.cluster.launch CONFIG``, as ``make serve``) and
stopped after its levels:

- ``tiers``: the config as it is, with API keys added;
- ``off``: the same with ``engine.slo_scheduling: false`` and ``flow.enabled: false``;
- ``fcfs``: ``off`` with ``engine.scheduling_policy: fcfs`` (no priorities at all).

Keys: the tier ``interactive`` gets one key (a tenant of its own), ``standard`` two tenants,
``tenant-a`` and ``tenant-b`` (weight 1, one key each), ``batch`` one key. Each key is fresh and
random per run, written in the config as an ``env:VAR`` reference and put in the environment of
the cluster's process and of the load client only; neither the report nor the output shows one.

Traffic (``tierserve.cluster.load``'s workload and runner): four classes, ``interactive`` (weight 1, the
interactive key), ``std-a`` (5, tenant-a), ``std-b`` (1, tenant-b), ``batch`` (3). Prompts of
``--prompt-len`` tokens (``uniform:64:256``), outputs of ``--output-len`` (``uniform:16:64``,
``ignore_eos``), streamed. Arrivals are open-loop Poisson with no client-side cap on requests in
flight (``tierserve.cluster.load``'s ``max_inflight`` at 100000, which also sizes its httpx connection pool:
no client queue), so whatever queues, queues in the server.

Capacity: ``--capacity R`` (requests/s), or measured on the ``--capacity-on`` system (``off``;
the first system of ``--systems`` when that one is not run, which then runs first): a closed
loop of ``--capacity-concurrency`` clients (48) for ``--capacity-duration`` s (60), the
requests answered per second after the first tenth of it. Each system then runs the
``--levels`` (``0.5,1,1.5,2,4`` times capacity) in order, each for ``--duration`` s (120) of
arrivals and at most ``--drain-timeout`` s (60) more for the requests still running (then
cancelled: they count as misses); between levels, until the metrics show every replica idle and
nothing held at the ingress (at most ``--settle-timeout`` s), then ``--settle`` s more for Ray's
metrics export (about every 10 s) to catch up. Each system first gets ``--warmup`` s of light
closed-loop traffic (discarded). Every level of every system has the same requests at the same
arrival times (one seed per level).

Figures, per system x level x class (and per tier, and all together), client side as
``tierserve.cluster.load`` measures them: TTFT and TPOT p50/p99 of the answered requests; attainment, the
fraction of the class's requests that were answered AND met both of the tier's targets (a
refused, failed or cancelled request is a miss; a target the tier does not set is met by any
answer), and the TTFT-only and TPOT-only fractions; output tokens served, per second and as a
share of those offered; 429s and 503s. Per level: the server's preemptions, rejections and
aborts (``tierserve.cluster.load``'s before/after deltas), Jain's fairness index of tenant-a's and
tenant-b's output-token throughput (and of their served shares of what each offered), and the
ingress's own counters as deltas (``ray_tierserve_slo_requests_total``: goodput per tier and
target; ``ray_tierserve_flow_shed_total``; ``ray_tierserve_tenant_tokens_total``) where the
metrics endpoint has them.

Output (``--out-dir``, default ``benchmarks/out``; ``--name``, default ``tiers``): ``NAME.json`` (the
machine, each system's config, the capacity, every figure; rewritten after every level, so an
interrupted run keeps what it measured), ``NAME_attainment.png`` (attainment of both targets per
tier against the load multiple, one panel per system), ``NAME_tpot.png`` (the interactive
class's TPOT p99 against the load multiple, one line per system), ``NAME_<system>_cluster.log``
(each cluster's output), and a table per system on stdout. ``--dry-run`` writes the configs,
prints the plan and starts nothing.

Checked: the requests name the model the cluster lists at ``GET /v1/models``. The cluster is
ready when it answers a one-token completion of the interactive tier; one refused for a reason
that waiting cannot change (a 4xx other than 429: ``model_not_found``, ``invalid_api_key``)
stops the run at once. Every run of load (warm-up, capacity, each level) must have some request
answered and no clear error but a loaded server's refusals (``queue_full``, ``shed``:
``tierserve.cluster.load``'s verdict); else the run stops there, the report keeps what it measured
(the level with its ``verdict``), and the exit status is 1.

Bounded: start-up at most ``--start-timeout`` s per system; a level at most duration + drain +
settle-timeout + settle s. Loopback only (the cluster's HTTP options must name 127.0.0.1 or
localhost). The machine should be otherwise idle: the load client shares it with the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import os
import re
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml

from benchmarks.serving import answers, completion_ready, stop, wait_for
from benchmarks.tools import ROOT
from tierserve.cluster import load as loadgen
from tierserve.cluster.load import (
    LengthDist,
    LoadConfig,
    LoadRunner,
    Result,
    RunData,
    Scrape,
    TrafficClass,
    Workload,
)
from tierserve.cluster.measure import (
    NotServing,
    Verdict,
    load_avg_1m,
    machine,
    pyplot,
    rounded_percentile,
    served_model,
)
from tierserve.replica.metrics import INGRESS_COUNTERS, INGRESS_GAUGES

T = TypeVar("T")
DEFAULT_CONFIG = "configs/cluster.yaml"
SYSTEMS = ("tiers", "off", "fcfs")
TIERS = ("interactive", "standard", "batch")
# The environment variables that carry the keys (to the cluster and to the load client).
KEY_VARS: dict[str, str] = {
    "interactive": "TIERSERVE_BENCH_KEY_INTERACTIVE",
    "tenant-a": "TIERSERVE_BENCH_KEY_TENANT_A",
    "tenant-b": "TIERSERVE_BENCH_KEY_TENANT_B",
    "batch": "TIERSERVE_BENCH_KEY_BATCH",
}
TENANTS = ("tenant-a", "tenant-b")


@dataclass(frozen=True, slots=True)
class ClassDef:
    """One traffic class: its share of the requests, the key it sends (a ``KEY_VARS`` entry)
    and the tier (and tenant) that key belongs to."""

    name: str
    weight: float
    key: str
    tier: str
    tenant: str | None = None


CLASSES = (
    ClassDef("interactive", 1.0, "interactive", "interactive"),
    ClassDef("std-a", 5.0, "tenant-a", "standard", "tenant-a"),
    ClassDef("std-b", 1.0, "tenant-b", "standard", "tenant-b"),
    ClassDef("batch", 3.0, "batch", "batch"),
)
CLASS_TIER = {c.name: c.tier for c in CLASSES}

# The scraped names of the ingress's own series (replica/metrics.py; Ray's prefix and suffix).
SLO_REQUESTS = "ray_tierserve_slo_requests_total"
FLOW_SHED = "ray_tierserve_flow_shed_total"
TENANT_TOKENS = "ray_tierserve_tenant_tokens_total"
FLOW_HELD = "ray_tierserve_flow_held"
assert {n[4:-6] for n in (SLO_REQUESTS, FLOW_SHED, TENANT_TOKENS)} <= INGRESS_COUNTERS.keys()
assert FLOW_HELD[4:] in INGRESS_GAUGES

UNLIMITED_INFLIGHT = 100_000  # tierserve.cluster.load sizes its httpx pool from it: no client-side queue


# ---------------------------------------------------------------------------------- configs


def app_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``args`` of the config's tierserve application (``tierserve.cluster.app:...``, else the first):
    the dict itself, so a caller may change it."""
    apps = config.get("applications") or []
    if not apps:
        raise ValueError("the config has no applications")
    app = next((a for a in apps if str(a.get("import_path", "")).startswith("tierserve.cluster.app")),
               apps[0])
    args = app.get("args")
    if args is None:
        args = app["args"] = {}
    if not isinstance(args, dict):
        raise ValueError("the application's args are not a mapping")
    return args


def _default_tiers() -> list[dict[str, Any]]:
    from tierserve.cluster.config import ClusterConfig

    return [t.model_dump(exclude={"api_keys", "tenants"}) for t in ClusterConfig().tiers]


def derive_config(base: Mapping[str, Any], system: str,
                  key_vars: Mapping[str, str] = KEY_VARS) -> dict[str, Any]:
    """``system``'s config (a Serve deploy config) made from ``base``, with the bench's keys as
    ``env:VAR`` references: ``tiers`` (``base`` with keys), ``off`` (no SLO-aware steps, no
    flow control), ``fcfs`` (``off`` with FCFS scheduling). Validated by ``ClusterConfig``:
    ``ValueError`` when it refuses it or the tiers lack one of interactive, standard, batch."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}: one of {', '.join(SYSTEMS)}")
    config = copy.deepcopy(dict(base))
    args = app_args(config)
    if "tiers" not in args:  # the ClusterConfig defaults, written out so keys can be added
        args["tiers"] = _default_tiers()
    tiers = {t.get("name"): t for t in args["tiers"]}
    missing = [t for t in TIERS if t not in tiers]
    if missing:
        raise ValueError(f"the config has no tier {missing[0]!r} (the bench needs "
                         f"{', '.join(TIERS)})")
    ref = {role: f"env:{var}" for role, var in key_vars.items()}
    for tier in ("interactive", "batch"):
        tiers[tier]["api_keys"] = [*(tiers[tier].get("api_keys") or []), ref[tier]]
    std = tiers["standard"]
    taken = {t.get("name") for t in std.get("tenants") or []}
    if taken & set(TENANTS):
        raise ValueError(f"the standard tier already has a tenant named "
                         f"{sorted(taken & set(TENANTS))[0]!r}")
    std["tenants"] = [*(std.get("tenants") or []),
                      *({"name": t, "weight": 1.0, "api_keys": [ref[t]]} for t in TENANTS)]
    # Every caller of the bench has a key: a request without one is refused.
    args["anonymous_tier"] = None
    if system in ("off", "fcfs"):
        args.setdefault("engine", {})["slo_scheduling"] = False
        args["flow"] = {**(args.get("flow") or {}), "enabled": False}
    if system == "fcfs":
        args["engine"]["scheduling_policy"] = "fcfs"
    validate(args)
    return config


def validate(args: Mapping[str, Any]) -> Any:
    """The ``ClusterConfig`` of an application's args; ``ValueError`` with pydantic's lines."""
    from pydantic import ValidationError

    from tierserve.cluster.config import ClusterConfig
    from tierserve.replica.config import describe

    try:
        return ClusterConfig(**args)
    except ValidationError as e:
        raise ValueError(f"the derived config is not valid: {describe(e)}") from None


def new_keys(key_vars: Mapping[str, str] = KEY_VARS) -> dict[str, str]:
    """Fresh random keys: ``{VAR: key}``, for the cluster's and the client's environment."""
    return {var: "tsb-" + secrets.token_urlsafe(24) for var in key_vars.values()}


def redact(config: Any) -> Any:
    """``config`` with every API key that is not an ``env:``/``file:`` reference replaced (what
    the report records: a base config may hold literal keys)."""
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for k, v in config.items():
            if k == "api_keys" and isinstance(v, list):
                out[k] = [x if isinstance(x, str) and x.startswith(("env:", "file:"))
                          else "<literal key>" for x in v]
            else:
                out[k] = redact(v)
        return out
    if isinstance(config, list):
        return [redact(x) for x in config]
    return config


@dataclass(frozen=True, slots=True)
class Targets:
    """A tier's promise (None: no such target)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: Result) -> tuple[bool, bool]:
        """(TTFT met, TPOT met) for one request: an unanswered request meets neither; a target
        the tier does not set is met by any answer, and so is TPOT by an answer of one token."""
        if r.outcome != "ok":
            return False, False
        ttft_ok = self.ttft_s is None or (r.ttft is not None and r.ttft <= self.ttft_s)
        tpot_ok = self.tpot_s is None or r.tpot is None or r.tpot <= self.tpot_s
        return ttft_ok, tpot_ok


def tier_targets(config: Mapping[str, Any]) -> dict[str, Targets]:
    """Each tier's targets, as the cluster reads them (the validated config)."""
    cfg = validate(app_args(config))
    return {t.name: Targets(t.ttft_target_s, t.tpot_target_s) for t in cfg.tiers}


def class_specs(classes: Sequence[ClassDef] = CLASSES,
                key_vars: Mapping[str, str] = KEY_VARS) -> list[str]:
    """The classes in ``tierserve.cluster.load``'s ``--class`` syntax (keys by ``env:VAR``)."""
    return [f"{c.name}={c.weight:g},key=env:{key_vars[c.key]}" for c in classes]


def traffic(keys: Mapping[str, str], classes: Sequence[ClassDef] = CLASSES,
            key_vars: Mapping[str, str] = KEY_VARS) -> list[TrafficClass]:
    """The traffic classes, their keys read from ``keys`` (never from this process's env)."""
    return [TrafficClass.parse(s, keys) for s in class_specs(classes, key_vars)]


# ---------------------------------------------------------------------------------- figures


def served_rate(results: Iterable[Result], t0: float, t1: float) -> float:
    """Requests answered per second among those that ended in ``[t0, t1]`` (a closed loop's
    throughput, its ramp-up and drain left out)."""
    if not t1 > t0:
        raise ValueError("the window must have t1 > t0")
    n = sum(1 for r in results if r.outcome == "ok" and t0 <= r.end <= t1)
    return n / (t1 - t0)


def attainment(results: Sequence[Result], targets: Mapping[str, Targets]) -> dict[str, Any]:
    """The fractions of ``results`` that met both targets of their class's tier (``targets``
    by class name), the TTFT one and the TPOT one; a request not answered misses all three.
    None for an empty selection."""
    met = Counter[str]()
    for r in results:
        ttft_ok, tpot_ok = targets[r.cls].met(r)
        met["ttft"] += ttft_ok
        met["tpot"] += tpot_ok
        met["both"] += ttft_ok and tpot_ok
    n = len(results)
    return {"n": n, **{k: (round(met[k] / n, 4) if n else None) for k in ("both", "ttft", "tpot")}}


def jain(xs: Sequence[float]) -> float | None:
    """Jain's fairness index, ``(sum x)^2 / (n * sum x^2)``: 1 when all are equal, 1/n when one
    takes everything; None for no values or all zero."""
    sq = sum(x * x for x in xs)
    if not xs or sq == 0:
        return None
    return round(sum(xs) ** 2 / (len(xs) * sq), 4)


def group_figures(results: Sequence[Result], targets: Mapping[str, Targets], span_s: float,
                  offered_tokens: int) -> dict[str, Any]:
    """One row of the table: a class's (or tier's) requests of one level. ``span_s``: the
    level's span (tokens/s over it); ``offered_tokens``: the output tokens they asked for."""
    ok = [r for r in results if r.outcome == "ok"]
    status = Counter(r.status for r in results if r.outcome == "rejected")
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "sent": len(results),
        "ok": len(ok),
        "status_429": status[429],
        "status_503": status[503],
        "rejected_other": sum(v for k, v in status.items() if k not in (429, 503)),
        "errors": sum(1 for r in results if r.outcome == "error"),
        "ttft_p50_s": rounded_percentile([r.ttft for r in ok], 50),
        "ttft_p99_s": rounded_percentile([r.ttft for r in ok], 99),
        "tpot_p50_s": rounded_percentile([r.tpot for r in ok], 50),
        "tpot_p99_s": rounded_percentile([r.tpot for r in ok], 99),
        "attainment": attainment(results, targets),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / span_s, 3) if span_s > 0 else None,
        "offered_output_tokens": offered_tokens,
        "served_share": round(tokens / offered_tokens, 4) if offered_tokens else None,
    }


def groups(classes: Sequence[ClassDef] = CLASSES) -> dict[str, list[str]]:
    """The table's rows: each class, each tier of more than one class, then ``all``."""
    out = {c.name: [c.name] for c in classes}
    for tier in dict.fromkeys(c.tier for c in classes):
        members = [c.name for c in classes if c.tier == tier]
        if members != [tier]:
            out[f"tier:{tier}"] = members
    out["all"] = [c.name for c in classes]
    return out


def window_tokens(results: Sequence[Result], start: float, end: float,
                  prompt: bool = False) -> float:
    """The output tokens ``results`` delivered between ``start`` and ``end`` (run seconds): each
    answer's first token at its first-token time, the rest spread evenly up to its last token
    (an answer cut short counts what it delivered). With ``prompt``, each answer's prompt tokens
    too, at its first-token time (when its prefill had been done): the service the fair share
    counts."""
    total = 0.0
    for r in results:
        n, first = r.completion_tokens or 0, r.first_token
        if n <= 0 or first is None:
            continue
        if start <= first <= end:
            total += 1.0 + (r.prompt_tokens or 0 if prompt else 0)
        last = r.last_token if r.last_token is not None else first
        if n > 1 and last > first:
            overlap = min(last, end) - max(first, start)
            total += (n - 1) * max(overlap, 0.0) / (last - first)
        elif n > 1 and start <= first <= end:
            total += n - 1
    return total


def max_min_level(demands: Sequence[float], weights: Sequence[float],
                  service: float) -> float:
    """The water level of a weighted max-min share of ``service`` among demands: each gets
    ``min(demand, level * weight)``, and they sum to ``service`` (``inf`` when everything
    asked for fits). Weights must be positive."""
    if any(w <= 0 for w in weights):
        raise ValueError("weights must be positive")
    if sum(demands) <= service:
        return math.inf
    left, rest = service, sorted(zip(demands, weights, strict=True), key=lambda p: p[0] / p[1])
    while rest:
        wsum = sum(w for _, w in rest)
        d, w = rest[0]
        if d / w * wsum > left:
            return left / wsum
        left -= d
        rest.pop(0)
    return math.inf  # not reached: the demands sum above the service


def below_share(results: Sequence[Result], window: tuple[float, float],
                classes: Sequence[ClassDef] = CLASSES,
                weights: Mapping[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Whether each tenant asked for less than its fair share of its tier in ``window`` (run
    seconds; the level's steady state), and what it got. The tier's service there is the number
    of its requests whose first token came inside it, shared max-min between its tenants
    (``weights`` by tenant, default equal, as the bench's tenants are) by the requests each sent
    inside it: ``below`` when a tenant sent some and they fit its share; ``sent`` and ``ok``,
    its requests inside the window and those answered (a tenant below its share should have
    them all). Counted in requests: the classes
    draw their lengths from the same distributions."""
    w0, w1 = window
    if not w1 > w0:
        raise ValueError("the window must have an end after its start")
    out: dict[str, dict[str, Any]] = {}
    inside = [r for r in results if w0 <= r.start < w1]
    for tier in dict.fromkeys(c.tier for c in classes):
        mine = [c for c in classes if c.tier == tier and c.tenant is not None]
        if len({c.tenant for c in mine}) < 2:
            continue
        names = {c.name for c in mine}
        service = sum(1 for r in results if r.cls in names and r.outcome == "ok"
                      and r.first_token is not None and w0 <= r.first_token < w1)
        sent = {c.name: [r for r in inside if r.cls == c.name] for c in mine}
        wts = [(weights or {}).get(c.tenant or "", 1.0) for c in mine]
        level = max_min_level([len(sent[c.name]) for c in mine], wts, service)
        for c, w in zip(mine, wts, strict=True):
            n = len(sent[c.name])
            ok = sum(1 for r in sent[c.name] if r.outcome == "ok")
            out[c.name] = {"tenant": c.tenant, "below": 0 < n <= level * w, "sent": n, "ok": ok,
                           "served": round(ok / n, 4) if n else None,
                           "share": None if math.isinf(level) else round(level * w, 1),
                           "tier_served": service}
    return out


def fairness(figs: Mapping[str, Mapping[str, Any]],
             classes: Sequence[ClassDef] = CLASSES,
             results: Sequence[Result] = (),
             steady: tuple[float, float] | None = None) -> dict[str, Any]:
    """Jain's index between the tenants' classes (by ``group_figures``' rows): of their output
    tokens per second over the level, and of their served shares of what each offered; with
    ``steady`` (a window of run seconds), also of the tokens each received inside it
    (``jain_steady``), and of the service the fair share counts, prompt and output tokens
    (``jain_steady_service``): the level's whole span counts the ramp before the queues fill
    and the drain after arrivals stop, when one tenant is served alone because the other has
    nothing left held, which is not a share between backlogged tenants; output tokens alone
    also vary with the lengths each tenant's prompts happened to draw. ``below_share``: inside
    the same window, which tenant asked for less than its fair share and what it got
    (``below_share``'s rows)."""
    mine = {c.tenant: figs[c.name] for c in classes if c.tenant is not None and c.name in figs}
    thr = [float(f["output_tokens_per_s"] or 0.0) for f in mine.values()]
    shares = [f["served_share"] for f in mine.values()]
    out: dict[str, Any] = {
        "jain_throughput": jain(thr),
        "jain_served_share": jain([float(s) for s in shares]) if None not in shares else None,
        "tenants": {t: {"output_tokens_per_s": f["output_tokens_per_s"],
                        "served_share": f["served_share"]} for t, f in mine.items()},
        "steady_window_s": None, "jain_steady": None, "jain_steady_service": None,
        "below_share": None,
    }
    if steady is not None and steady[1] > steady[0]:
        w0, w1 = steady
        names = {c.tenant: c.name for c in classes if c.tenant is not None and c.name in figs}
        mine_r = {t: [r for r in results if r.cls == cls] for t, cls in names.items()}
        rates = {t: window_tokens(rs, w0, w1) / (w1 - w0) for t, rs in mine_r.items()}
        service = {t: window_tokens(rs, w0, w1, prompt=True) / (w1 - w0)
                   for t, rs in mine_r.items()}
        for t in rates:
            out["tenants"][t]["steady_output_tokens_per_s"] = round(rates[t], 3)
            out["tenants"][t]["steady_service_tokens_per_s"] = round(service[t], 3)
        out["steady_window_s"] = [round(w0, 3), round(w1, 3)]
        out["jain_steady"] = jain(list(rates.values()))
        out["jain_steady_service"] = jain(list(service.values()))
        out["below_share"] = below_share(results, (w0, w1), classes)
    return out


def labelled_delta(before: Scrape | None, after: Scrape | None, name: str,
                   labels: Sequence[str]) -> dict[str, Any] | None:
    """The increase of counter ``name`` between two scrapes, nested by ``labels`` (``{tier:
    {target: {outcome: n}}}``); zero increases left out; None without both scrapes."""
    if before is None or after is None:
        return None

    def key(s: loadgen.Sample) -> tuple[str, ...]:
        return tuple(s.labels.get(label, "") for label in labels)

    base: dict[tuple[str, ...], float] = {}
    for s in before.select(name):
        base[key(s)] = base.get(key(s), 0.0) + s.value
    now: dict[tuple[str, ...], float] = {}
    for s in after.select(name):
        now[key(s)] = now.get(key(s), 0.0) + s.value
    out: dict[str, Any] = {}
    for k in sorted(now):
        d = now[k] - base.get(k, 0.0)
        if not d:
            continue
        node = out
        for part in k[:-1]:
            node = node.setdefault(part, {})
        node[k[-1]] = d
    return out


def goodput(slo: Mapping[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """The fraction met per tier and target from ``labelled_delta`` of the SLO counter."""
    out: dict[str, dict[str, float | None]] = {}
    for tier, targets in (slo or {}).items():
        for target, outcomes in targets.items():
            met, missed = outcomes.get("met", 0.0), outcomes.get("missed", 0.0)
            out.setdefault(tier, {})[target] = (round(met / (met + missed), 4)
                                                if met + missed else None)
    return out


def level_figures(results: Sequence[Result], targets: Mapping[str, Targets],
                  offered: Mapping[int, int], span_s: float,
                  classes: Sequence[ClassDef] = CLASSES,
                  steady: tuple[float, float] | None = None) -> dict[str, Any]:
    """Every row of one level (``groups``: per class, per tier of several classes, all), the
    same per tier (``tiers``) and the tenants' fairness. ``targets`` by tier; ``offered``: each
    request's ``max_tokens`` by index; ``steady``: the window of run seconds where the tenants'
    shares are judged (``fairness``)."""
    by_class = {c.name: targets[c.tier] for c in classes}
    rows: dict[str, Any] = {}
    for row, members in groups(classes).items():
        sel = [r for r in results if r.cls in members]
        rows[row] = group_figures(sel, by_class, span_s, sum(offered.get(r.index, 0) for r in sel))
    tiers = {tier: rows[tier if tier in rows else f"tier:{tier}"]
             for tier in dict.fromkeys(c.tier for c in classes)}
    return {"groups": rows, "tiers": tiers,
            "fairness": fairness(rows, classes, results, steady)}


def _fmt(x: float | None, scale: float = 1.0, digits: int = 3) -> str:
    if x is None:
        return "-"
    v = x * scale
    return f"{v:.0f}" if abs(v) >= 10 ** digits else f"{v:.{digits}g}"


def steady_text(f: Mapping[str, Any], key: str = "steady_output_tokens_per_s") -> str:
    """The tenants' steady-state token rates, ``a / b``, for the table's notes."""
    rates = [t.get(key) for t in f["tenants"].values()]
    return " / ".join(_fmt(r, digits=4) for r in rates) if None not in rates else "-"


def below_text(rows: Mapping[str, Mapping[str, Any]] | None) -> str:
    """The tenants below their fair share in the steady state and what they got, for the
    table's notes."""
    if not rows:
        return "below fair share: -"
    below = [f"{name} {r['ok']}/{r['sent']}" for name, r in rows.items() if r["below"]]
    return "below fair share (answered/sent): " + (", ".join(below) or "none")


def table_text(system: dict[str, Any]) -> str:
    """The printed table of one system: one row per level x group, a summary line per level."""
    head = ["load", "req/s", "class", "sent", "ok", "429", "503", "err", "TTFT p50/p99 s",
            "TPOT p50/p99 ms", "both", "ttft", "tpot", "out tok/s", "served"]
    rows: list[list[str]] = [head]
    notes: list[str] = []
    for lv in system["levels"]:
        for name, g in lv["groups"].items():
            a = g["attainment"]
            rows.append([
                f"{lv['multiple']:g}x", f"{lv['rate']:.3g}", name, str(g["sent"]), str(g["ok"]),
                str(g["status_429"]), str(g["status_503"]), str(g["errors"]),
                f"{_fmt(g['ttft_p50_s'])} / {_fmt(g['ttft_p99_s'])}",
                f"{_fmt(g['tpot_p50_s'], 1e3)} / {_fmt(g['tpot_p99_s'], 1e3)}",
                _fmt(a["both"]), _fmt(a["ttft"]), _fmt(a["tpot"]),
                _fmt(g["output_tokens_per_s"], digits=4), _fmt(g["served_share"])])
        f, srv = lv["fairness"], lv.get("server") or {}
        gp = goodput(srv.get("slo_requests"))
        gp_text = ", ".join(f"{t} {_fmt(v.get('both'))}" for t, v in gp.items()) or "n/a"
        notes.append(
            f"  {lv['multiple']:g}x: Jain(tenant-a, tenant-b) tokens/s {_fmt(f['jain_throughput'])}, "
            f"served shares {_fmt(f['jain_served_share'])}, in steady state (tokens/s "
            f"{steady_text(f)}) {_fmt(f.get('jain_steady'))}, of prompt and output tokens "
            f"({steady_text(f, 'steady_service_tokens_per_s')}) "
            f"{_fmt(f.get('jain_steady_service'))}; {below_text(f.get('below_share'))}; "
            "preemptions "
            f"{_fmt(srv.get('preemptions'), digits=6)}; server goodput (both) {gp_text}")
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"system {system['name']}: {system['description']}; both, ttft, tpot: the fraction "
             "of requests answered within the tier's targets; served: of the output offered"]
    lines += ["  " + "  ".join(c.rjust(w) if i not in (2,) else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
              for r in rows]
    return "\n".join(lines + notes)


# ---------------------------------------------------------------------------------- plots


def plot_attainment(report: Mapping[str, Any], path: Path) -> None:
    """Attainment of both targets per tier against the load multiple, one panel per system."""
    plt = pyplot()
    systems = [s for s in report["systems"].values() if s["levels"]]
    fig, axes = plt.subplots(1, max(1, len(systems)), figsize=(4.6 * max(1, len(systems)), 3.8),
                             sharey=True, squeeze=False)
    for ax, s in zip(axes[0], systems, strict=False):
        xs = [lv["multiple"] for lv in s["levels"]]
        for tier in TIERS:
            ys = [lv["tiers"].get(tier, {}).get("attainment", {}).get("both") for lv in s["levels"]]
            ax.plot(xs, [math.nan if y is None else y for y in ys], "-o", markersize=4, label=tier)
        ax.set_title(f"{s['name']}: {s['description']}", fontsize=8)
        ax.set_xlabel("offered load (x capacity)")
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction meeting both targets")
    axes[0][0].legend(fontsize=8)
    cap = report.get("capacity", {}).get("requests_per_s")
    fig.suptitle(f"benchmarks.tiers: target attainment per tier (capacity {_fmt(cap)} req/s)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tpot(report: Mapping[str, Any], path: Path, cls: str = "interactive") -> None:
    """``cls``'s TPOT p99 against the load multiple, one line per system, and its target."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    target = None
    for s in report["systems"].values():
        if not s["levels"]:
            continue
        xs = [lv["multiple"] for lv in s["levels"]]
        ys = [lv["groups"].get(cls, {}).get("tpot_p99_s") for lv in s["levels"]]
        ax.plot(xs, [math.nan if y is None else y * 1e3 for y in ys], "-o", markersize=4,
                label=s["name"])
        target = target or s.get("targets", {}).get(CLASS_TIER.get(cls, cls), {}).get("tpot_s")
    if target:
        ax.axhline(target * 1e3, color="k", linestyle="--", linewidth=1, label="target")
    ax.set_xlabel("offered load (x capacity)")
    ax.set_ylabel(f"{cls} TPOT p99 (ms)")
    ax.set_title(f"benchmarks.tiers: {cls} TPOT p99 against load", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- the run


DESCRIPTIONS = {
    "tiers": "SLO-aware steps and flow control on (the config as is)",
    "off": "SLO-aware steps and flow control off",
    "fcfs": "off, and FCFS scheduling",
}


def parse_levels(text: str) -> list[float]:
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--levels {text!r}: want numbers, e.g. 0.5,1,2") from None
    if not levels or not all(0 < x <= 1000 and math.isfinite(x) for x in levels):
        raise ValueError(f"--levels {text!r}: want positive multiples of capacity")
    return levels


def parse_systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS) or len(set(systems)) != len(systems):
        raise ValueError(f"--systems takes distinct names of {', '.join(SYSTEMS)}; got {text!r}")
    return systems


def http_target(config: Mapping[str, Any]) -> str:
    """The cluster's HTTP API from the config's ``http_options`` (loopback only)."""
    opts = config.get("http_options") or {}
    host, port = str(opts.get("host", "127.0.0.1")), int(opts.get("port", 8000))
    url = f"http://{host}:{port}"
    if not loadgen.is_loopback(url):
        raise ValueError(f"the config serves on {host}: the bench runs on loopback only")
    return url


def raise_fd_limit() -> None:
    """As many open files as allowed: with no cap on requests in flight, every one is a socket."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


def scrape_now(metrics_url: str) -> Scrape | None:
    """One scrape of the metrics endpoint (tierserve's samples); None when it fails."""
    try:
        resp = httpx.get(metrics_url, timeout=10.0)
        resp.raise_for_status()
        return Scrape(0.0, loadgen.parse_metrics(resp.text))
    except (httpx.HTTPError, ValueError):
        return None


def is_idle(s: Scrape) -> bool:
    """Every replica idle (nothing waiting or running) and nothing held at the ingress."""
    reps = s.replicas().values()
    return (bool(reps) and all(r.get("waiting") == 0 and r.get("running") == 0 for r in reps)
            and s.total(FLOW_HELD) == 0)


def settle(metrics_url: str, timeout_s: float, extra_s: float) -> tuple[Scrape | None, bool]:
    """Until the server is idle (at most ``timeout_s``), then ``extra_s`` more (the metrics
    export's lag); the last scrape, and whether it was idle."""
    deadline = time.monotonic() + timeout_s
    idle = False
    while time.monotonic() < deadline:
        s = scrape_now(metrics_url)
        if s is not None and is_idle(s):
            idle = True
            break
        time.sleep(1.0)
    time.sleep(extra_s)
    return scrape_now(metrics_url), idle


@dataclass(slots=True)
class Plan:
    url: str
    metrics_url: str
    prompt_len: LengthDist
    output_len: LengthDist
    duration_s: float
    drain_s: float
    seed: int
    progress: bool
    # The load client's threads run at this niceness (Linux: per thread, so the clusters this
    # process starts keep theirs; Ray runs its workers, the replicas, the ingress and the proxy,
    # at RAY_WORKER_NICENESS): a client on the server's own cores stands in for users on other
    # machines, and at 19 it takes the CPU only when they leave it.
    client_nice: int = 0


# Ray's default niceness of its worker processes (its ``worker_niceness`` setting, which this
# benchmark leaves as it is: the clusters it starts get no RAY_ variables).
RAY_WORKER_NICENESS = 15


def run_niced(make: Callable[[], Coroutine[Any, Any, T]], nice: int) -> T:
    """Run the coroutine ``make()`` returns on an event loop in a thread of its own at
    niceness ``nice`` (threads it starts inherit it); in this thread when ``nice`` is not above
    this thread's own. Ctrl-C here cancels it there, and is raised once it has stopped."""
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if nice <= mine:
        return asyncio.run(make())
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, asyncio.Task[T]] = {}

    def body() -> T:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        asyncio.set_event_loop(loop)
        try:
            box["task"] = loop.create_task(make())
            started.set()
            return loop.run_until_complete(box["task"])
        finally:
            started.set()
            loop.close()

    with ThreadPoolExecutor(1, thread_name_prefix="load-client") as pool:
        future = pool.submit(body)
        try:
            return future.result()
        except KeyboardInterrupt:
            started.wait()
            task = box.get("task")
            if task is not None and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # it ended meanwhile
                    loop.call_soon_threadsafe(task.cancel)
            with contextlib.suppress(BaseException):
                future.result()
            raise


def run_load(plan: Plan, classes: list[TrafficClass], seed: int, *, rate: float | None = None,
             concurrency: int | None = None, duration_s: float | None = None,
             model: str | None = None) -> tuple[RunData, LoadConfig, Workload]:
    """One ``tierserve.cluster.load`` run: open loop at ``rate`` (no client cap on requests in flight) or a
    closed loop of ``concurrency`` clients."""
    duration = duration_s or plan.duration_s
    n = 10_000_000 if rate is None else min(10_000_000, int(rate * duration * 3) + 1000)
    cfg = LoadConfig(url=plan.url, metrics_url=plan.metrics_url, model=model, rate=rate,
                     concurrency=concurrency, num_requests=n, duration_s=duration,
                     max_inflight=UNLIMITED_INFLIGHT if rate is not None else 256,
                     drain_timeout_s=plan.drain_s, request_timeout_s=duration + plan.drain_s + 60,
                     progress=plan.progress)
    workload = Workload(classes, plan.prompt_len, plan.output_len, seed=seed)
    run = run_niced(LoadRunner(cfg, workload).run, plan.client_nice)
    return run, cfg, workload


def ready(url: str, key: str) -> bool:
    """The cluster answers a one-token completion of the interactive tier, of the model it
    names at ``GET /v1/models``. ``RequestsFailed`` when it names none, or refuses the
    completion for a reason that waiting cannot change."""
    try:
        model = served_model(url)
    except NotServing:
        return False
    return completion_ready(url, model, {"Authorization": f"Bearer {key}"})


def check_run(run: RunData, what: str) -> Verdict:
    """``tierserve.cluster.load``'s verdict on one run's requests; ``RuntimeError`` naming
    ``what`` and why when it failed."""
    judged = loadgen.run_verdict(run.results)
    if not judged.passed:
        raise RuntimeError(f"{what}: " + "; ".join(judged.reasons))
    return judged


def start_cluster(config_path: Path, env: Mapping[str, str], log: Path, url: str,
                  metrics_port: int, key: str, timeout_s: float) -> tuple[subprocess.Popen[bytes], float]:
    """``python -m tierserve.cluster.launch CONFIG``, in its own process group; its start-up time."""
    with open(log, "wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cluster.launch", str(config_path),
             "--metrics-port", str(metrics_port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    try:
        wait_for(proc, lambda: ready(url, key), log, t0, timeout_s, "the cluster", poll_s=1.0)
    except BaseException:
        stop(proc)
        raise
    return proc, time.perf_counter() - t0


STEADY_SKIP = 0.25  # the first quarter of a level's arrivals: its queues still filling


def steady_window(results: Sequence[Result], duration_s: float | None) -> tuple[float, float] | None:
    """The window where a level is in steady state: from a quarter into its arrivals (its
    queues filled) to the end of its arrivals (before the drain); None without arrivals."""
    if not results or not duration_s:
        return None
    t0 = min(r.start for r in results)
    return t0 + STEADY_SKIP * duration_s, t0 + duration_s


def summarize_level(run: RunData, cfg: LoadConfig, workload: Workload, multiple: float,
                    targets: Mapping[str, Targets], after: Scrape | None,
                    idle: bool) -> dict[str, Any]:
    """One level's entry of the report."""
    rep = loadgen.build_report(run, cfg, workload)
    span = rep["throughput"]["span_s"] or cfg.duration_s
    offered = {r.index: workload.spec(r.index).max_tokens for r in run.results}
    figs = level_figures(run.results, targets, offered, span, steady=steady_window(run.results, cfg.duration_s))
    later = after or run.after
    server: dict[str, Any] = {
        "preemptions": None, "idle_before_next": idle,
        "slo_requests": labelled_delta(run.before, later, SLO_REQUESTS, ("tier", "target", "outcome")),
        "flow_shed": labelled_delta(run.before, later, FLOW_SHED, ("tier", "reason")),
        "tenant_tokens": labelled_delta(run.before, later, TENANT_TOKENS, ("tier", "tenant")),
    }
    if rep["server"] is not None:
        server.update({k: rep["server"][k] for k in (
            "preemptions", "rejections_by_reason", "rejections_by_tier", "aborts",
            "finished_by_tier", "generation_tokens", "settled")})
    server["goodput"] = goodput(server["slo_requests"])
    return {
        "multiple": multiple, "rate": cfg.rate, "seed": workload.seed,
        "wall_s": round(run.wall_s, 3), "span_s": span,
        "requests": rep["requests"], "throughput": rep["throughput"],
        "rejections": rep["rejections"], "errors": rep["errors"],
        "metrics_error": rep["metrics_error"], **figs, "server": server,
    }


def append_results(path: Path, system: str, multiple: float, results: Iterable[Result]) -> None:
    """Every request of one level as a JSON line (the client's view: start, first and last
    token, status, tokens; times in seconds since the level started), for looking at misses
    one by one."""
    with open(path, "a") as f:
        for r in results:
            f.write(json.dumps({"system": system, "multiple": multiple, **asdict(r)}) + "\n")


def write_report(report: Mapping[str, Any], out_dir: Path, name: str) -> Path:
    path = out_dir / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(path)
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tiers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the base cluster config")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="of tiers, off, fcfs")
    p.add_argument("--capacity", type=float, default=None, help="requests/s (else measured)")
    p.add_argument("--capacity-on", default="off", choices=SYSTEMS)
    p.add_argument("--capacity-duration", type=float, default=60.0)
    p.add_argument("--capacity-concurrency", type=int, default=48)
    p.add_argument("--levels", default="0.5,1,1.5,2,4", help="multiples of capacity")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per level")
    p.add_argument("--drain-timeout", type=float, default=60.0)
    p.add_argument("--settle", type=float, default=12.0,
                   help="seconds after the server is idle, between levels")
    p.add_argument("--settle-timeout", type=float, default=120.0)
    p.add_argument("--warmup", type=float, default=15.0, help="seconds of warm-up per system")
    p.add_argument("--prompt-len", default="uniform:64:256")
    p.add_argument("--output-len", default="uniform:16:64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=8080)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--out-dir", default="benchmarks/out")
    p.add_argument("--name", default="tiers")
    p.add_argument("--client-nice", type=int, default=0,
                   help="run the load client's threads at this niceness (0 to 19; Ray runs "
                   f"the cluster's workers at {RAY_WORKER_NICENESS}: 19 puts the client below "
                   "them, where it shares the server's cores)")
    p.add_argument("--results", action="store_true",
                   help="also write every request, a JSON line each, to OUT_DIR/NAME_requests.jsonl")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="write the configs, start nothing")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    systems, levels = parse_systems(args.systems), parse_levels(args.levels)
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        raise ValueError(f"--name {args.name!r}: letters, digits, _ . - only")
    if args.capacity is not None and not 0 < args.capacity <= 10_000:
        raise ValueError("--capacity must be in (0, 10000] requests/s")
    if max(levels) * (args.capacity or 1.0) > 10_000:
        raise ValueError("the highest level exceeds tierserve.cluster.load's 10000 requests/s")
    for name in ("capacity_duration", "duration", "drain_timeout", "settle_timeout",
                 "start_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if args.settle < 0 or args.warmup < 0:
        raise ValueError("--settle and --warmup must be 0 or more")
    if not 1 <= args.capacity_concurrency <= 4096:
        raise ValueError("--capacity-concurrency must be in [1, 4096]")
    if not 0 <= args.client_nice <= 19:
        raise ValueError("--client-nice must be in [0, 19]")
    LengthDist.parse(args.prompt_len)
    LengthDist.parse(args.output_len)
    if args.capacity is None:  # the capacity system runs first (measured there)
        first = args.capacity_on if args.capacity_on in systems else systems[0]
        systems = [first, *(s for s in systems if s != first)]
    return systems, levels


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        systems, levels = check_args(args)
        base_path = Path(args.config)
        base = yaml.safe_load(base_path.read_text())
        configs = {s: derive_config(base, s) for s in systems}
        url = http_target(configs[systems[0]])
        targets = {s: tier_targets(c) for s, c in configs.items()}
    except (ValueError, OSError, yaml.YAMLError, TypeError, AttributeError) as e:
        print(f"benchmarks.tiers: {e}", file=sys.stderr)
        return 2
    metrics_url = f"http://127.0.0.1:{args.metrics_port}/metrics"
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_level = args.duration + args.drain_timeout + args.settle_timeout + args.settle
    bound = len(systems) * (args.start_timeout + args.warmup + args.drain_timeout
                            + len(levels) * per_level)
    if args.capacity is None:
        bound += args.capacity_duration + args.drain_timeout
    typical = len(systems) * (60 + args.warmup + len(levels) * (
        args.duration + args.settle + 15)) + (args.capacity_duration if args.capacity is None else 0)
    notargets = [t for t, v in targets[systems[0]].items() if v == Targets()]
    print(f"benchmarks.tiers: systems {systems} (from {base_path}), levels {levels} x capacity, "
          f"{args.duration:g} s each; typically about {typical / 60:.0f} min, at most "
          f"{bound / 60:.0f} min", flush=True)
    if notargets:
        print(f"benchmarks.tiers: tiers without targets (any answer meets them): {notargets}")
    report: dict[str, Any] = {
        "tool": "benchmarks.tiers",
        "machine": machine(torch_info=False),
        "base_config": str(base_path),
        "settings": {k: v for k, v in vars(args).items()},
        "niceness": {"load_client": args.client_nice, "ray_workers": RAY_WORKER_NICENESS},
        "classes": [{"name": c.name, "weight": c.weight, "tier": c.tier, "tenant": c.tenant}
                    for c in CLASSES],
        "capacity": {"requests_per_s": args.capacity,
                     "measured": args.capacity is None},
        "systems": {s: {"name": s, "description": DESCRIPTIONS[s], "config": redact(configs[s]),
                        "targets": {t: {"ttft_s": v.ttft_s, "tpot_s": v.tpot_s}
                                    for t, v in targets[s].items()},
                        "levels": []} for s in systems},
    }
    if args.dry_run:
        for s in systems:
            path = out_dir / f"{args.name}_{s}.yaml"
            path.write_text(yaml.safe_dump(configs[s], sort_keys=False))
            print(f"  {s}: {DESCRIPTIONS[s]}; config {path}")
        print(f"  classes: {' '.join(class_specs())}")
        return 0
    if answers(lambda: httpx.get(f"{url}/v1/models", timeout=5)):
        print(f"benchmarks.tiers: something already serves on {url}; stop it first", file=sys.stderr)
        return 1
    if args.results:  # this run's requests only
        (out_dir / f"{args.name}_requests.jsonl").unlink(missing_ok=True)
    raise_fd_limit()
    keys = new_keys()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | keys
    classes = traffic(keys)
    plan = Plan(url, metrics_url, LengthDist.parse(args.prompt_len),
                LengthDist.parse(args.output_len), args.duration, args.drain_timeout,
                args.seed, not args.no_progress, args.client_nice)
    capacity = args.capacity
    try:
        with tempfile.TemporaryDirectory(prefix="bench-tiers-") as tmp:
            for s in systems:
                path = Path(tmp) / f"{s}.yaml"
                path.write_text(yaml.safe_dump(configs[s], sort_keys=False))
                log = out_dir / f"{args.name}_{s}_cluster.log"
                entry = report["systems"][s]
                print(f"{s}: starting the cluster ({DESCRIPTIONS[s]}), log {log}", flush=True)
                proc, startup = start_cluster(path, env, log, url, args.metrics_port,
                                              keys[KEY_VARS["interactive"]], args.start_timeout)
                entry["startup_s"] = round(startup, 2)
                try:
                    if args.warmup > 0:
                        run, _, _ = run_load(plan, classes, seed=10_000 + args.seed,
                                             concurrency=4, duration_s=args.warmup)
                        check_run(run, f"{s}: the warm-up")
                        settle(metrics_url, args.settle_timeout, 0.0)
                    if capacity is None:
                        run, _, _ = run_load(plan, classes, seed=20_000 + args.seed,
                                             concurrency=args.capacity_concurrency,
                                             duration_s=args.capacity_duration)
                        d = args.capacity_duration
                        capacity = served_rate(run.results, 0.1 * d, d)
                        report["capacity"].update(
                            requests_per_s=round(capacity, 4), system=s,
                            concurrency=args.capacity_concurrency, duration_s=d,
                            window_s=[0.1 * d, d],
                            ok=sum(r.outcome == "ok" for r in run.results),
                            sent=len(run.results))
                        check_run(run, f"{s}: the capacity run")
                        print(f"capacity: {capacity:.3f} requests/s (closed loop of "
                              f"{args.capacity_concurrency} on {s})", flush=True)
                        if capacity <= 0:
                            raise RuntimeError("no request was answered while measuring capacity")
                        settle(metrics_url, args.settle_timeout, args.settle)
                    for i, mult in enumerate(levels):
                        rate = round(min(10_000.0, mult * capacity), 4)
                        print(f"{s}: {mult:g}x = {rate:.3f} requests/s for {args.duration:g} s",
                              flush=True)
                        run, cfg, workload = run_load(plan, classes, seed=args.seed * 1000 + i,
                                                      rate=rate)
                        after, idle = settle(metrics_url, args.settle_timeout, args.settle)
                        level = summarize_level(run, cfg, workload, mult, targets[s], after, idle)
                        level["verdict"] = loadgen.run_verdict(run.results).record()
                        entry["levels"].append(level)
                        if args.results:
                            append_results(out_dir / f"{args.name}_requests.jsonl", s, mult,
                                           run.results)
                        write_report(report, out_dir, args.name)
                        check_run(run, f"{s}: level {mult:g}x")
                finally:
                    stop(proc)
                print(table_text(entry), flush=True)
    except RuntimeError as e:
        print(f"benchmarks.tiers: {e}", file=sys.stderr)
        write_report(report, out_dir, args.name)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.tiers: interrupted", file=sys.stderr)
        write_report(report, out_dir, args.name)
        return 130
    report["machine"]["load_avg_1m_after"] = load_avg_1m()
    if not args.no_plots:
        try:
            plots = {"attainment": out_dir / f"{args.name}_attainment.png",
                     "tpot": out_dir / f"{args.name}_tpot.png"}
            plot_attainment(report, plots["attainment"])
            plot_tpot(report, plots["tpot"])
            report["plots"] = {k: str(v) for k, v in plots.items()}
        except ImportError:
            print("benchmarks.tiers: matplotlib is not installed: no plots", file=sys.stderr)
    path = write_report(report, out_dir, args.name)
    print(f"report: {path}" + "".join(f"\nplot: {p}" for p in report.get("plots", {}).values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
