"""The tiers' promise in a deterministic simulation: ``python -m benchmarks.tiers_sim``.

What it is for: weighing a change to the SLO-aware step (docs/scheduler.md §8) or to the top
tier's routing before a run of ``benchmarks.tiers`` on the real cluster, which takes about
17 minutes a run here and moves with the shared machine (the same code gave 90% to 98% of the
interactive tier within its targets at 4x on one day). Here the same seed gives the same
figures, a run takes seconds, and the step's cost can be scaled to see how much margin a
setting leaves.

The simulated cluster (no Ray cluster: one process, simulated time):

- ``--replicas`` replicas, each the replica's own ``tierserve.replica.scheduler.Scheduler``
  configured by the engine section of ``--config`` (default ``configs/cluster.yaml``) over a
  pool of ``--kv-blocks`` blocks (728: what 512 MiB hold for the default model). A step takes
  ``StepTruth.seconds(plan)`` times a log-normal noise (``--noise``); the scheduler's cost model
  learns it from ``observe_step`` as in a replica, and its clock is the simulation's.
- The router's own ranking (``tierserve.router.policy.rank_replicas``) over reports taken
  every ``--report-s`` seconds (the config's ``request_routing_stats_period_s``), as old as they
  are by then, plus the requests sent since the report (``Charge``), as ``FreeKVBlocksRouter``
  does.
- A gate like the ingress's (``tierserve.cluster.gate``): a request is dispatched at once while
  nothing of its tier or above is held and the dispatch window has room for its tier
  (``flow.starting_per_replica`` times the replicas, times the tier's ``queue_share``, at least
  one; a request counts until its first token, under priority scheduling only against its own
  tier's window and the lower tiers'); otherwise it is held per tier, strict priority
  between tiers, first come first served inside one, on-time requests before late ones
  (held past the tier's ``late_after_s``), and shed (a 429) when its tier already holds
  ``max_held``, or while late if an on-time request of its tier or above, held, arrived after it
  became late. A request reaches its
  replica with its tier's ``ttft_target_s`` less what it waited at the gate (``ttft_left_s``).
- Not modelled: tenants (one per tier), the gate's aging (``flow.aging_s``) and its capacity
  over all tiers (``flow.max_held``), the HTTP path and streaming, the prefix cache (random
  prompts share nothing), the client.

Traffic: ``benchmarks.tiers``'s four classes (interactive 1, standard tenant A 5, tenant B
1, batch 3), open-loop Poisson at each of ``--levels`` times ``--capacity`` requests/s for
``--duration`` s, prompts uniform 64-256 tokens and outputs 16-64, the same for the same
``--seed``, level and traffic seed. A request is within its tier's targets when its first token
came within ``ttft_target_s`` of its arrival and its mean gap after it within
``tpot_target_s``; a shed one is a miss.

Variants: each ``--prefill-headroom`` value (``none``: off) with each ``--late-headroom`` value
(``slo_prefill_headroom_late``; ``none``: off) runs every level at every ``--scale`` (a factor on every coefficient of the step's cost) and every noise seed
(``--seeds``). The table prints, per variant and scale, the interactive tier's share within both
targets at each load (the lowest over the seeds, then the mean), its TTFT and TPOT (p50: the
mean over levels and seeds; p99: the highest), the share of the standard tier within its
targets (the mean), and the prompt and output tokens of the lower tiers' requests that were
not shed, a second of arrivals (every admitted request runs to its end: this counts what the
gate let through, not a rate the replicas sustained). Percentiles are
``tierserve.cluster.measure.percentile``'s, as every benchmark's (linear between the closest
ranks). The figures docs/tiers.md quotes were taken with this module's own earlier definition,
the order statistic at ``int(q n)`` (the upper median; the maximum for a p99 of fewer than 100
requests): on 42 to 80 requests a level the shared one gives p50s within 0.6% of it and p99s
up to 10% lower; the shares within the targets do not depend on it.

The step's cost (``StepTruth``'s defaults) was measured with ``engine.step`` on one core of the
2-core Xeon of docs/tiers.md (SmolLM2-135M, fp32, one torch thread, nothing else running): about
27 ms a step, 1.6 ms a prompt position, 2.5 ms a decode. Under ``benchmarks.tiers`` the same steps
take about 1.4 times that (two replicas, the ingress, Ray and the client share the two cores):
at scale 1.4 the interactive TTFT p50 and the lower tiers' tokens come out about where the real
cluster's were at the same levels with the budget off.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.router_sim import sampled
from benchmarks.tiers import CLASSES, app_args
from tierserve.cluster.measure import machine, percentile
from tierserve.records import RoutingStats
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.scheduler import FinishedEvent, Request, Scheduler, StepPlan, TokenEvent
from tierserve.router.policy import Charge, ReplicaLoad, RequestShape, blocks_for, rank_replicas

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cluster.yaml"
PROMPT_LEN = (64, 256)
OUTPUT_LEN = (16, 64)


@dataclass(frozen=True, slots=True)
class StepTruth:
    """Seconds a step of a plan takes: a fixed cost, per prompt position, per decode and per
    query-key pair of the chunks' attention, all times ``scale``."""

    base_s: float = 0.027
    per_position_s: float = 0.0016
    per_decode_s: float = 0.0025
    per_pair_s: float = 5e-7
    scale: float = 1.0

    def seconds(self, plan: StepPlan) -> float:
        positions = sum(c.len for c in plan.prefill)
        pairs = sum(c.len * (c.start + (c.len + 1) / 2) for c in plan.prefill)
        return self.scale * (self.base_s + self.per_position_s * positions
                             + self.per_decode_s * len(plan.decodes) + self.per_pair_s * pairs)


@dataclass(frozen=True, slots=True)
class Tier:
    """What the simulation reads of a tier's config."""

    name: str
    priority: int
    share: float
    late_s: float
    ttft_s: float | None
    tpot_s: float | None
    max_held: int = 256


@dataclass(slots=True)
class SimRequest:
    """One request and what happened to it (times on the simulation's clock)."""

    arrival: float
    cls: str
    tier: str
    prompt: int
    output: int
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    shed: bool = False

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.last is None or self.tokens < 2:
            return None
        return (self.last - self.first) / (self.tokens - 1)

    def within(self, tier: Tier) -> bool:
        ttft, tpot = self.ttft, self.tpot
        if ttft is None:
            return False
        if tier.ttft_s is not None and ttft > tier.ttft_s:
            return False
        return not (tier.tpot_s is not None and tpot is not None and tpot > tier.tpot_s)


@dataclass(slots=True)
class _Replica:
    scheduler: Scheduler
    end: float | None = None  # when the step in flight ends (None: idle)
    plan: StepPlan | None = None
    took: float = 0.0
    requests: dict[int, SimRequest] = field(default_factory=dict)
    charges: dict[int, Charge] = field(default_factory=dict)
    stats: RoutingStats | None = None


@dataclass(frozen=True, slots=True)
class Setup:
    """Everything a run needs besides its traffic."""

    engine: EngineConfig
    tiers: dict[str, Tier]
    class_tier: dict[str, str]
    replicas: int = 2
    starting_per_replica: int = 8
    report_s: float = 1.0
    truth: StepTruth = StepTruth()
    noise: float = 0.1


def load_setup(config: Path, kv_blocks: int, prefill_headroom: float | None,
               late_headroom: float | None = None, **overrides: Any) -> Setup:
    """The engine, tiers and flow settings of ``config`` (a cluster config), with the pool set
    to ``kv_blocks`` blocks, ``slo_prefill_headroom`` to ``prefill_headroom`` and
    ``slo_prefill_headroom_late`` to ``late_headroom``."""
    raw = yaml.safe_load(config.read_text())
    args = app_args(raw)
    engine = {k: v for k, v in args.get("engine", {}).items()
              if k not in ("kv_cache_memory_bytes", "model", "gguf")}
    engine.update(num_kv_blocks=kv_blocks, slo_prefill_headroom=prefill_headroom,
                  slo_prefill_headroom_late=late_headroom)
    tiers: dict[str, Tier] = {}
    for t in args.get("tiers", []):
        tiers[t["name"]] = Tier(t["name"], int(t["base_priority"]),
                                float(t.get("queue_share", 1.0)),
                                float(t.get("late_after_s", 30.0)), t.get("ttft_target_s"),
                                t.get("tpot_target_s"), int(t.get("max_held", 256)))
    missing = {c.tier for c in CLASSES} - tiers.keys()
    if missing:
        raise ValueError(f"{config}: the traffic's tiers {sorted(missing)} are not configured")
    flow = args.get("flow", {})
    return Setup(engine=EngineConfig(**engine), tiers=tiers,
                 class_tier={c.name: c.tier for c in CLASSES},
                 starting_per_replica=int(flow.get("starting_per_replica", 8)), **overrides)


def traffic(rate: float, duration_s: float, seed: int | str, setup: Setup) -> list[SimRequest]:
    """Poisson arrivals of ``benchmarks.tiers``'s classes at ``rate`` requests/s."""
    rng = random.Random(seed)
    weights = [c.weight for c in CLASSES]
    out: list[SimRequest] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        cls = rng.choices(CLASSES, weights=weights)[0]
        out.append(SimRequest(t, cls.name, cls.tier, rng.randint(*PROMPT_LEN),
                              rng.randint(*OUTPUT_LEN)))
        t += rng.expovariate(rate)
    return out


def _report(rep: _Replica, now: float) -> RoutingStats:
    """The report a replica would make now (``Engine.stats`` through ``RoutingStats``)."""
    return RoutingStats.from_engine(rep.scheduler.engine_stats(), now, True)


def simulate(requests: Sequence[SimRequest], setup: Setup, seed: int = 0) -> list[SimRequest]:
    """Run ``requests`` (sorted by arrival; updated in place) through the simulated cluster
    until every one is answered or shed; returns them."""
    now = 0.0
    cfg = setup.engine
    assert cfg.num_kv_blocks is not None
    reps = [_Replica(Scheduler(cfg, FreeListBlocks(cfg.block_size, range(cfg.num_kv_blocks)),
                               clock=lambda: now)) for _ in range(setup.replicas)]
    rng = random.Random(seed)
    order = sorted(setup.tiers.values(), key=lambda t: -t.priority)
    held: dict[str, list[SimRequest]] = {t.name: [] for t in order}
    window = setup.starting_per_replica * setup.replicas
    starting = {t.name: 0 for t in order}  # dispatched, no first token yet, by tier
    top = order[0].name
    passes_lower = cfg.scheduling_policy == "priority"

    def room(tier: str) -> bool:
        # As the gate: a tier counts its own and the tiers above it under priority scheduling.
        counted = order[:[t.name for t in order].index(tier) + 1] if passes_lower else order
        return (sum(starting[t.name] for t in counted)
                < max(1, int(setup.tiers[tier].share * window)))

    def start(rep: _Replica) -> None:
        if not rep.scheduler.has_unfinished():
            rep.end = None
            return
        plan = rep.scheduler.schedule()
        took = (setup.truth.seconds(plan) * math.exp(rng.gauss(0.0, setup.noise))
                if not plan.is_empty else 0.01)
        rep.plan, rep.took, rep.end = plan, took, now + took

    def dispatch(req: SimRequest) -> None:
        tier = setup.tiers[req.tier]
        shape = RequestShape(req.prompt, req.output, latency=req.tier == top,
                             tpot_target_s=tier.tpot_s)
        loads = [ReplicaLoad(k, r.stats, list(r.charges.values())) for k, r in enumerate(reps)]
        rep = reps[rank_replicas(loads, shape, rng)[0].key]
        # As the ingress: its first-token target less what it waited at the gate.
        left = None if tier.ttft_s is None else tier.ttft_s - (now - req.arrival)
        rid = rep.scheduler.add(Request([1] * req.prompt, req.output, tier.priority,
                                        tpot_target_s=tier.tpot_s, ttft_left_s=left))
        rep.requests[rid] = req
        rep.charges[rid] = Charge(blocks_for(req.prompt + 1, cfg.block_size), now,
                                  blocks_for(req.prompt + req.output, cfg.block_size),
                                  req.prompt if req.tier == top else 0)
        starting[req.tier] += 1
        if rep.end is None:
            start(rep)

    def pump() -> None:
        newest_on_time = -math.inf  # as the gate: late ones yield, and go while newer wait
        for t in order:
            queue = held[t.name]
            on_time = [r for r in queue if now - r.arrival <= t.late_s]
            newest_on_time = max([newest_on_time, *(r.arrival for r in on_time)])
            late = [r for r in queue if now - r.arrival > t.late_s]
            for r in late:
                r.shed = newest_on_time > r.arrival + t.late_s
            queue[:] = on_time + [r for r in late if not r.shed]
            while queue and room(t.name):
                dispatch(queue.pop(0))

    pending = list(requests)
    pending.reverse()
    next_report = 0.0
    while True:
        busy = [r for r in reps if r.end is not None]
        rep = min(busy, key=lambda r: r.end or 0.0) if busy else None
        arrival = pending[-1].arrival if pending else math.inf
        if rep is None and not pending and not any(held.values()):
            break
        if next_report <= min(arrival, rep.end if rep is not None and rep.end is not None
                              else math.inf):
            now = next_report  # every replica reports; the router ranks by these until the next
            for r in reps:
                r.stats = _report(r, now)
            next_report += setup.report_s
            continue
        if rep is None and not pending:
            now += 0.05  # only held requests are left: the pump's period
            pump()
            continue
        if rep is not None and rep.end is not None and rep.end <= arrival:
            now = rep.end
            plan = rep.plan
            assert plan is not None
            if not plan.is_empty:
                rep.scheduler.observe_step(plan.shape, rep.took)
            for e in rep.scheduler.on_step(sampled(plan)):
                req = rep.requests[e.id]
                if isinstance(e, TokenEvent):
                    if req.first is None:
                        req.first = now
                        starting[req.tier] -= 1
                    req.last = now
                    req.tokens += 1
                elif isinstance(e, FinishedEvent):
                    del rep.requests[e.id]
                    rep.charges.pop(e.id, None)
            pump()
            start(rep)
        else:
            now = arrival
            req = pending.pop()
            above = order[:[t.name for t in order].index(req.tier) + 1]
            if not any(held[t.name] for t in above) and room(req.tier):
                dispatch(req)
            elif len(held[req.tier]) >= setup.tiers[req.tier].max_held:
                req.shed = True  # its tier's queue is full: refused at once
            else:
                held[req.tier].append(req)
    for rep in reps:
        free = rep.scheduler.stats().free_blocks
        if rep.scheduler.has_unfinished() or free != cfg.num_kv_blocks:
            raise AssertionError("a simulated replica ended with work or blocks held")
    return list(requests)


def level_figures(reqs: Sequence[SimRequest], setup: Setup, duration_s: float) -> dict[str, Any]:
    """The top tier's share within both targets, its TTFT and TPOT p50/p99, each tier's share
    within its targets, the tokens of the lower tiers' requests not shed a second of arrivals,
    and the requests shed per tier."""
    top = max(setup.tiers.values(), key=lambda t: t.priority)
    mine = [r for r in reqs if r.tier == top.name]
    ttfts = [r.ttft for r in mine if r.ttft is not None]
    tpots = [r.tpot for r in mine if r.tpot is not None]
    lower = sum(r.prompt + r.tokens for r in reqs if r.tier != top.name and r.first is not None)
    return {
        "within": sum(r.within(top) for r in mine) / len(mine) if mine else math.nan,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "tpot_p50_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
        "lower_tokens_per_s": lower / duration_s,
        "within_by_tier": {t.name: (sum(r.within(t) for r in reqs if r.tier == t.name)
                                    / max(sum(r.tier == t.name for r in reqs), 1))
                           for t in setup.tiers.values()},
        "shed": {t: sum(r.shed for r in reqs if r.tier == t) for t in setup.tiers},
        "requests": len(reqs),
    }


def parse_headroom(text: str) -> float | None:
    return None if text.strip().lower() in ("none", "null", "off") else float(text)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tiers_sim",
                                 description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--prefill-headroom", default="none,0.85",
                    help="slo_prefill_headroom values to compare, comma-separated (none: off)")
    ap.add_argument("--late-headroom", default="none",
                    help="slo_prefill_headroom_late values to compare with each prefill headroom, "
                         "comma-separated (none: off)")
    ap.add_argument("--levels", default="2,4", help="load levels, times --capacity")
    ap.add_argument("--capacity", type=float, default=2.963, help="requests/s at 1x")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals a level")
    ap.add_argument("--scale", default="1.4,1.6,1.8", help="factors on the step's cost")
    ap.add_argument("--seeds", type=int, default=3, help="noise seeds per level")
    ap.add_argument("--traffic-seeds", type=int, default=2, help="traffic seeds per level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.1, help="sigma of a step's log-normal noise")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--kv-blocks", type=int, default=728)
    ap.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = ap.parse_args(argv)
    try:
        variants = [(parse_headroom(v), parse_headroom(w))
                    for v in args.prefill_headroom.split(",")
                    for w in args.late_headroom.split(",")]
        # Without the budget the late share has nothing to raise: one row for it.
        variants = [(v, w) for v, w in variants if v is not None or w is None] or [(None, None)]
        levels = [float(x) for x in args.levels.split(",")]
        scales = [float(x) for x in args.scale.split(",")]
    except ValueError as e:
        ap.error(f"a list holds something that is not a number: {e}")
    if args.seeds < 1 or args.traffic_seeds < 1 or args.duration <= 0 or args.capacity <= 0:
        ap.error("--seeds, --traffic-seeds, --duration and --capacity must be positive")
    rows: list[dict[str, Any]] = []
    print(f"tiers_sim: {args.replicas} replicas, {args.capacity:g} requests/s at 1x, "
          f"{args.duration:g} s a level, {args.traffic_seeds} traffic x {args.seeds} noise "
          f"seeds; step {StepTruth()} times the scale")
    header = " | ".join(f"{m:g}x within min/mean" for m in levels)
    print(f"{'prefill_headroom':>16} {'late':>4} {'scale':>5} | {header} | TTFT p50 mean | TTFT p99 max "
          f"| TPOT p50 mean | TPOT p99 max | standard within | lower tok/s")
    for scale in scales:
        for variant, late in variants:
            try:
                setup = load_setup(args.config, args.kv_blocks, variant, late,
                                   replicas=args.replicas, truth=StepTruth(scale=scale),
                                   noise=args.noise)
            except (OSError, ValueError) as e:
                ap.error(f"cannot run {args.config} with prefill headroom {variant} "
                         f"(late: {late}): {e}")
            figs: dict[float, list[dict[str, Any]]] = {m: [] for m in levels}
            for k, mult in enumerate(levels):
                for ts in range(args.traffic_seeds):
                    reqs = traffic(mult * args.capacity, args.duration,
                                   f"{args.seed}:{k}:{ts}", setup)
                    for ns in range(args.seeds):
                        done = simulate([SimRequest(r.arrival, r.cls, r.tier, r.prompt,
                                                    r.output) for r in reqs], setup, ns)
                        f = level_figures(done, setup, args.duration)
                        figs[mult].append(f)
                        rows.append({"prefill_headroom": variant, "late_headroom": late,
                                     "scale": scale,
                                     "multiple": mult, "traffic_seed": ts, "noise_seed": ns,
                                     **f})
            cells = " | ".join(
                f"{100 * min(f['within'] for f in figs[m]):5.1f}% / "
                f"{100 * statistics.mean(f['within'] for f in figs[m]):5.1f}%"
                for m in levels)
            every = [f for m in levels for f in figs[m]]
            standard = [f["within_by_tier"].get("standard", math.nan) for f in every]
            print(f"{variant if variant is not None else 'none':>16} "
                  f"{late if late is not None else 'none':>4} {scale:5.2f} | {cells} | "
                  f"{statistics.mean(f['ttft_p50_s'] for f in every):10.2f} s | "
                  f"{max(f['ttft_p99_s'] for f in every):9.2f} s | "
                  f"{1000 * statistics.mean(f['tpot_p50_s'] for f in every):10.0f} ms | "
                  f"{1000 * max(f['tpot_p99_s'] for f in every):9.0f} ms | "
                  f"{100 * statistics.mean(standard):14.1f}% | "
                  f"{statistics.mean(f['lower_tokens_per_s'] for f in every):9.0f}", flush=True)
    if args.json is not None:
        # The figures are the simulation's, the same on any machine; the machine is recorded
        # as for every benchmark (and the step's cost was measured on docs/tiers.md's).
        args.json.write_text(json.dumps({"machine": machine(torch_info=False),
                                         "args": {k: str(v) for k, v in vars(args).items()},
                                         "truth": str(StepTruth()), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
