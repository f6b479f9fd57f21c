"""Observability against a real local cluster: Ray's metrics endpoint, the dashboard, the load generator.

One Ray instance for the module, started here with its metrics exported on a free port (as
``make serve`` does on 8080) and a 2 s metrics report interval instead of Ray's 10 s, so the
counters reach the endpoint sooner (gauges then expire after 4 s unless refreshed: a stricter
check of the replicas' gauge refresher than the default 20 s). The app is the YAML's
(``configs/cluster.yaml``, with the tiers' test API keys) with one small engine replica (on the
autoscaling policy, held at one replica, so that its gauges are exported too): 16 KV
blocks of 16 tokens, 4 running sequences, a queue of 4 (batch is shed from 2 waiting, standard
from 3, interactive refused at 4).

The load generator's smoke run (closed loop, every tier, some clients hanging up) provokes
preemptions and shedding. Then, so that every metric moves whatever the smoke run met: one short
request per tier, one client that hangs up mid-stream (an abort), a burst of interactive
requests that fills the queue (``queue_full``, and preemptions again) while two batch requests
are shed, and two requests that can never run (``never_fits``, ``too_long``). Ray exports a
counter only after its first increment, so the checks poll the endpoint for a bounded time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from tests.cluster.helpers import (
    KEYS,
    ServeApp,
    app_config,
    deploy,
    free_port,
    start_serve,
)
from tests.replica.observability import promql
from tests.tools import Prometheus
from tierserve.cluster import load as loadgen
from tierserve.cluster.app import POLICY
from tierserve.replica.metrics import EXPORTED, GAUGES

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "configs" / "grafana" / "tierserve.json"
APP = "tierserve"
MODEL = "tierserve-tiny"
BLOCKS, BLOCK_TOKENS, MAX_MODEL_LEN = 16, 16, 2048
ENGINE: dict[str, Any] = {"num_kv_blocks": BLOCKS, "kv_cache_memory_bytes": None, "max_num_seqs": 4,
                          "max_waiting": 4, "block_size": BLOCK_TOKENS,
                          "max_model_len": MAX_MODEL_LEN}
REPORT_INTERVAL_MS = 2000


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def scrape(url: str) -> list[Sample]:
    """Every sample of the endpoint, read with prometheus_client's own parser."""
    text = httpx.get(url, timeout=10).text
    return [Sample(s.name, dict(s.labels), float(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples]


def ours(samples: list[Sample], name: str) -> list[Sample]:
    return [s for s in samples if s.name == name and s.labels.get("application") == APP]


def by_label(samples: list[Sample], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in ours(samples, name):
        out[s.labels.get(label, "")] = out.get(s.labels.get(label, ""), 0.0) + s.value
    return out


@dataclass
class Cluster:
    app: ServeApp
    metrics_url: str

    def wait_scrape(self, what: str, ok: Callable[[list[Sample]], bool],
                    timeout_s: float = 60.0) -> list[Sample]:
        """Scrape until ``ok``; on a timeout, say which tierserve series the last scrape had."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = scrape(self.metrics_url)
            if ok(samples):
                return samples
            if time.monotonic() > deadline:
                seen = sorted({s.name for s in samples if s.labels.get("application") == APP})
                missing = sorted(EXPORTED - set(seen))
                raise AssertionError(f"gave up waiting for {what} after {timeout_s:g} s; "
                                     f"exported names missing from the last scrape: {missing}")
            time.sleep(0.5)


@dataclass
class Provoked:
    report: dict[str, Any]
    out_dir: Path
    statuses: dict[str, list[tuple[int, str | None]]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    if ray.is_initialized():  # an earlier module's instance: this one needs its own settings
        ray.shutdown()
    metrics_port, http_port = free_port(), free_port()
    # address="local": a new instance even where `ray start` left /tmp/ray/ray_current_cluster
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning",
             log_to_driver=False,
             _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": REPORT_INTERVAL_MS})
    try:
        client = start_serve(http_port)
        config = app_config(APP, "/", ENGINE, {})
        llm = next(d for d in config["deployments"] if d["name"] == "LLMServer")
        # One replica, on tierserve's autoscaling policy held at one (min = max): Serve's
        # controller then exports the policy's gauges too (the dashboard's autoscaling panels).
        llm.pop("num_replicas")
        llm["autoscaling_config"] = {
            "min_replicas": 1, "max_replicas": 1, "initial_replicas": 1,
            "metrics_interval_s": 1, "look_back_period_s": 2, "upscale_delay_s": 0,
            "downscale_delay_s": 0, "policy": {"policy_function": POLICY}}
        deploy(client, [config])
        app = ServeApp(APP, f"http://127.0.0.1:{http_port}", 1)
        app.wait_ready()
        yield Cluster(app, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _post(url: str, tier: str, prompt: list[int], max_tokens: int,
          **extra: Any) -> tuple[int, str | None]:
    r = httpx.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                              "ignore_eos": True, **extra},
                   headers={"Authorization": f"Bearer {KEYS[tier]}"}, timeout=120)
    code = r.json()["error"]["code"] if r.status_code != 200 else None
    return r.status_code, code


def _hang_up(url: str) -> bool:
    """Stream a long request and go away after its first chunk (the server aborts it)."""
    body = {"model": MODEL, "prompt": [66] * 16, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=120) as client, client.stream(
        "POST", url, json=body, headers={"Authorization": f"Bearer {KEYS['interactive']}"}
    ) as r:
        if r.status_code != 200:
            return False
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return True
    return False


async def _burst(url: str, n: int, max_tokens: int, waiting: Callable[[], int]
                 ) -> dict[str, list[tuple[int, str | None]]]:
    """``n`` interactive requests at once (4 run, 4 wait, the rest: queue_full), then, once the
    replica has 2 waiting, two batch requests (shed: batch may only fill half the queue)."""
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(tier: str, i: int) -> tuple[int, str | None]:
            r = await client.post(url, json={"model": MODEL, "prompt": [40 + i] * 16,
                                             "max_tokens": max_tokens, "ignore_eos": True},
                                  headers={"Authorization": f"Bearer {KEYS[tier]}"})
            return r.status_code, (r.json()["error"]["code"] if r.status_code != 200 else None)

        burst = [asyncio.create_task(one("interactive", i)) for i in range(n)]
        shed: list[tuple[int, str | None]] = []
        # The replica's stats lag its queue: by the time a pair of batch requests arrives, the
        # queue may have drained below half. Try again while the burst still runs.
        for _ in range(10):
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(waiting) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            shed += await asyncio.gather(*(one("batch", i) for i in range(2)))
            if (429, "shed") in shed or all(task.done() for task in burst):
                break
        return {"burst": list(await asyncio.gather(*burst)), "shed": shed}


@pytest.fixture(scope="module")
def prometheus(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus server (Debian's, installed when missing) scraping the cluster's
    metrics endpoint every second, from before the load starts."""
    target = cluster.metrics_url.removeprefix("http://").removesuffix("/metrics")
    server = Prometheus.start([target], tmp_path_factory.mktemp("prometheus"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def provoked(cluster: Cluster, prometheus: Prometheus,
             tmp_path_factory: pytest.TempPathFactory) -> Provoked:
    """The load generator's smoke run, then requests that provoke every metric for certain."""
    out = tmp_path_factory.mktemp("load")
    rc = loadgen.main([
        "--url", cluster.app.base_url, "--metrics-url", cluster.metrics_url, "--app", APP,
        "--concurrency", "10", "-n", "48", "-d", "30", "--drain-timeout", "60",
        "--prompt-len", "24", "--output-len", "uniform:48:96", "--abort-fraction", "0.15",
        "--class", f"interactive=1,key={KEYS['interactive']}",
        "--class", f"standard=1,key={KEYS['standard']}",
        "--class", f"batch=1,key={KEYS['batch']}",
        "--sample-interval", "1", "--settle-timeout", "30", "--seed", "1",
        "--out-dir", str(out), "--name", "smoke", "--no-progress",
    ])
    assert rc == 0
    report = json.loads((out / "smoke.json").read_text())
    url = cluster.app.url("/v1/completions")
    statuses = {  # one short request per tier while idle: each tier's latencies are observed
        tier: [_post(url, tier, [70] * 8, 4)] for tier in ("interactive", "standard", "batch")}
    assert all(v == [(200, None)] for v in statuses.values()), statuses
    # The same structured output twice: a compilation (a miss), then a hit on the same replica
    # or a second miss on the other. Once the compile-time histogram is in the scrape, a new
    # spec compiles again, so that its rate (the dashboard's quantiles) has an increase to show.
    statuses["structured"] = [_post(url, "interactive", [70] * 8, 8, guided_choice=["ab", "cd"])
                              for _ in range(2)]
    cluster.wait_scrape("the grammar compile histogram", lambda ss: bool(
        ours(ss, "ray_tierserve_grammar_compile_seconds_count")))
    time.sleep(3)  # a scrape or two of it before the next compilation
    statuses["structured"].append(
        _post(url, "interactive", [70] * 8, 8, guided_choice=["ef", "gh"]))
    assert statuses["structured"] == [(200, None)] * 3, statuses
    assert _hang_up(url), "the stream to hang up on did not start"
    waiting = lambda: sum(int(x["waiting"]) for x in cluster.app.replica_stats().values())  # noqa: E731
    statuses |= asyncio.run(_burst(url, 12, 64, waiting))
    statuses |= {
        # 24 + 400 tokens need 27 blocks of 16: more than the pool's 16, ever.
        "never_fits": [_post(url, "standard", [65] * 24, 400)],
        "too_long": [_post(url, "batch", [65] * MAX_MODEL_LEN, 1)],
    }
    return Provoked(report, out, statuses)


# ------------------------------------------------------------------ (a) the scrape


def test_counters_are_exported_at_zero_before_anything_happens(cluster: Cluster,
                                                               prometheus: Prometheus) -> None:
    """Before any request (this test runs before the load): every counter, for every tier and
    reason it can count, is in the scrape at 0, so a dashboard shows 0 rather than "No data"."""
    from tierserve.replica.metrics import FINISH_REASONS, INGRESS_REJECTIONS, REJECTION_REASONS

    tiers = {"interactive", "standard", "batch", "none"}

    def complete(ss: list[Sample]) -> bool:
        rej = {(x.labels.get("deployment"), x.labels["reason"], x.labels["tier"])
               for x in ours(ss, "ray_tierserve_rejections_total")}
        fin = {(x.labels["reason"], x.labels["tier"])
               for x in ours(ss, "ray_tierserve_requests_finished_total")}
        return (
            {("LLMServer", r, t) for r in REJECTION_REASONS for t in tiers} <= rej
            and {("Ingress", r, t) for r in INGRESS_REJECTIONS for t in tiers} <= rej
            and {(r, t) for r in FINISH_REASONS for t in tiers} <= fin
            and {x.labels["tier"] for x in ours(ss, "ray_tierserve_aborts_total")} >= tiers
            and bool(ours(ss, "ray_tierserve_preemptions_total"))
        )

    samples = cluster.wait_scrape("every counter's label sets at 0", complete)
    for name in ("rejections", "requests_finished", "aborts", "preemptions", "prompt_tokens",
                 "generation_tokens"):
        series = ours(samples, f"ray_tierserve_{name}_total")
        assert series and all(x.value == 0 for x in series), name
    # ... and the real Prometheus reads them: a rate of 0, not an empty answer.
    rate = "sum(rate(ray_tierserve_aborts_total[1m]))"  # needs two scrapes
    deadline = time.monotonic() + 30
    while not prometheus.query(rate) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [float(r["value"][1]) for r in prometheus.query(rate)] == [0.0]  # type: ignore[index]


def test_a_scrape_holds_every_exported_metric(cluster: Cluster, provoked: Provoked) -> None:
    samples = cluster.wait_scrape(
        "every name of tierserve.replica.metrics.EXPORTED in the scrape",
        lambda ss: EXPORTED.issubset(s.name for s in ss if s.labels.get("application") == APP))
    replicas = {s.labels.get("replica") for s in ours(samples, "ray_tierserve_kv_blocks_total")}
    assert replicas == {name.rsplit("#", 1)[1] for name in cluster.app.replicas()}
    tiers = set(by_label(samples, "ray_tierserve_time_to_first_token_seconds_count", "tier"))
    assert {"interactive", "standard", "batch"} <= tiers


def test_the_autoscaling_policy_exports_its_decision(cluster: Cluster) -> None:
    """Serve's controller runs tierserve's policy for the replica and exports what it decided:
    one replica asked for and running, exactly one reason current, every signal."""
    samples = cluster.wait_scrape(
        "the autoscaling policy's gauges",
        lambda ss: bool(ours(ss, "ray_tierserve_autoscale_target_replicas"))
        and bool(ours(ss, "ray_tierserve_autoscale_signal")))
    assert [s.value for s in ours(samples, "ray_tierserve_autoscale_target_replicas")] == [1.0]
    assert [s.value for s in ours(samples, "ray_tierserve_autoscale_running_replicas")] == [1.0]
    reasons = by_label(samples, "ray_tierserve_autoscale_reason", "reason")
    assert sum(reasons.values()) == 1.0 and set(reasons) >= {"steady", "room_to_spare"}, reasons
    assert set(by_label(samples, "ray_tierserve_autoscale_signal", "signal")) == {
        "miss_ratio", "kv", "busy", "waiting", "preemptions"}


def total(samples: list[Sample], name: str) -> float:
    return sum(s.value for s in ours(samples, name))


def test_structured_outputs_are_counted(cluster: Cluster, provoked: Provoked) -> None:
    """The three structured requests of the provoked load (two specs, one of them twice):
    counted per tier and kind at the ingress; in the replicas, a compilation (timed) per miss,
    and each request looked up once."""
    def misses(ss: list[Sample]) -> float:
        return total([x for x in ss if x.labels.get("result") == "miss"],
                     "ray_tierserve_grammar_cache_total")

    # A lookup is counted when the request asks, its compilation timed when it is done, and
    # the ingress's and the replicas' series reach the scrape each on its own schedule.
    samples = cluster.wait_scrape(
        "the structured requests' counts",
        lambda ss: total(ss, "ray_tierserve_grammar_cache_total") >= 3
        and total(ss, "ray_tierserve_structured_requests_total") >= 3
        and misses(ss) == total(ss, "ray_tierserve_grammar_compile_seconds_count"))
    kinds = {(x.labels["tier"], x.labels["kind"]): x.value
             for x in ours(samples, "ray_tierserve_structured_requests_total")}
    assert kinds[("interactive", "choice")] == 3
    assert sum(v for (t, k), v in kinds.items() if (t, k) != ("interactive", "choice")) == 0
    cache = {x.labels["result"]: x.value for x in ours(samples, "ray_tierserve_grammar_cache_total")}
    assert cache.get("miss", 0) + cache.get("hit", 0) == 3 and cache.get("miss", 0) >= 2
    compiled = total([x for x in samples if x.labels.get("kind") == "choice"],
                     "ray_tierserve_grammar_compile_seconds_count")
    assert compiled == cache["miss"]


def test_preemptions_aborts_and_finishes_are_counted(cluster: Cluster, provoked: Provoked) -> None:
    # the smoke run's clients that hung up (if any got a token before a 429), and one more
    aborted = provoked.report["requests"]["aborted_by_client"] + 1
    samples = cluster.wait_scrape(
        f"preemptions > 0 and at least {aborted} aborts",
        lambda ss: total(ss, "ray_tierserve_preemptions_total") > 0
        and total(ss, "ray_tierserve_aborts_total") >= aborted)
    finished = by_label(samples, "ray_tierserve_requests_finished_total", "reason")
    assert finished.get("length", 0) > 0 and finished.get("abort", 0) > 0
    assert total(samples, "ray_tierserve_generation_tokens_total") > 0
    assert total(samples, "ray_tierserve_prompt_tokens_total") > 0
    for h in ("step_duration_seconds", "step_tokens", "queue_time_seconds",
              "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert total(samples, f"ray_tierserve_{h}_count") > 0, h


def counted_reasons(samples: list[Sample]) -> set[str]:
    """Rejection reasons counted at least once (every reason's series exists from the start)."""
    return {r for r, v in by_label(samples, "ray_tierserve_rejections_total", "reason").items()
            if v > 0}


def test_rejections_by_reason(cluster: Cluster, provoked: Provoked) -> None:
    assert (429, "queue_full") in provoked.statuses["burst"], provoked.statuses["burst"]
    assert (429, "shed") in provoked.statuses["shed"], provoked.statuses["shed"]
    samples = cluster.wait_scrape(
        "rejections for queue_full and shed",
        lambda ss: {"queue_full", "shed"} <= counted_reasons(ss))
    by_tier = by_label(samples, "ray_tierserve_rejections_total", "tier")
    assert by_tier.get("batch", 0) > 0
    assert provoked.report["rejections"]["total"] > 0


def test_requests_that_can_never_run_are_counted_by_reason(cluster: Cluster,
                                                           provoked: Provoked) -> None:
    assert provoked.statuses["never_fits"] == [(400, "never_fits")]
    assert provoked.statuses["too_long"] == [(400, "too_long")]
    cluster.wait_scrape(
        "rejections for never_fits and too_long",
        lambda ss: {"never_fits", "too_long"} <= counted_reasons(ss),
        timeout_s=4 * REPORT_INTERVAL_MS / 1000)


def test_the_gauges_return_to_idle_and_stay(cluster: Cluster, provoked: Provoked) -> None:
    def idle(ss: list[Sample]) -> bool:
        reps: dict[str, dict[str, float]] = {}
        for name in GAUGES:
            for s in ours(ss, f"ray_{name}"):
                reps.setdefault(s.labels["replica"], {})[name] = s.value
        return len(reps) == 1 and all(
            r.get("tierserve_requests_waiting") == 0 and r.get("tierserve_requests_running") == 0
            and r.get("tierserve_kv_blocks_free") == r.get("tierserve_kv_blocks_total") == BLOCKS
            for r in reps.values())

    cluster.wait_scrape("waiting 0, running 0 and all blocks free in the scrape", idle)
    time.sleep(2.5 * REPORT_INTERVAL_MS / 1000)  # past Ray's gauge expiry (2 report intervals)
    assert idle(scrape(cluster.metrics_url)), "the idle replica's gauges expired"


# ------------------------------------------------------------------ (b) the dashboard


def test_every_metric_the_dashboard_queries_is_scraped(cluster: Cluster, provoked: Provoked) -> None:
    dash = promql.load(DASHBOARD)
    queries = promql.dashboard_queries(dash)
    assert len(queries) >= 20
    names = set().union(*(promql.metric_names(e) for _, e in queries)) | promql.variable_metrics(dash)
    assert names and names <= EXPORTED, sorted(names - EXPORTED)
    samples = cluster.wait_scrape(
        "every metric the dashboard queries in the scrape",
        lambda ss: names.issubset(s.name for s in ss if s.labels.get("application") == APP))
    # the label the per-replica and per-tier panels group by is on the series they read
    for title, expr in queries:
        for label in ("replica", "tier", "reason"):
            if f"by ({label}" in expr:
                for name in promql.metric_names(expr):
                    assert all(label in s.labels for s in ours(samples, name)), (title, name, label)


def test_a_real_prometheus_answers_every_panel_query(prometheus: Prometheus,
                                                    provoked: Provoked) -> None:
    """Every query of every panel, with Grafana's variables as the dashboard's "All" sets them,
    evaluated by Prometheus over the scrapes it took during the load: each returns data, at least
    one series with a number (a panel whose every series is NaN, e.g. a quantile of empty
    histograms or a ratio of zeros, draws nothing)."""
    dash = promql.load(DASHBOARD)
    queries = promql.dashboard_queries(dash)
    subst = {"$__rate_interval": "5m", "$job": ".*", "$application": ".*", "$tier": ".*"}

    def numbers(result: list[dict[str, Any]]) -> list[float]:
        values = [float(r["value"][1]) for r in result]
        return [v for v in values if math.isfinite(v)]

    empty: list[str] = []
    for title, expr in queries:
        q = expr
        for var, value in subst.items():
            q = q.replace(var, value)
        assert "$" not in q, (title, q)
        deadline = time.monotonic() + 30
        result = prometheus.query(q)
        while not numbers(result) and time.monotonic() < deadline:
            time.sleep(1)
            result = prometheus.query(q)
        if not numbers(result):
            empty.append(f"{title}: {q} -> {result}")
    assert empty == [], "queries that returned no number:\n" + "\n".join(empty)


# ------------------------------------------------------------------ (c) the load generator


def test_the_load_generator_report(provoked: Provoked) -> None:
    rep = provoked.report
    req = rep["requests"]
    assert req["sent"] == 48 or rep["wall_s"] >= 30
    assert req["ok"] > 0 and req["errors"] == 0, rep["errors"]
    assert req["sent"] == req["ok"] + req["rejected"] + req["aborted_by_client"] + req["errors"]
    assert rep["throughput"]["requests_per_s"] > 0 and rep["throughput"]["output_tokens_per_s"] > 0
    for group in [rep["latency_s"]["all"], *rep["latency_s"]["per_class"].values()]:
        for metric in ("ttft", "tpot", "e2e"):
            s = group[metric]
            if s["n"]:
                assert 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"], (metric, s)
    assert rep["latency_s"]["all"]["ttft"]["n"] == req["ok"]
    assert set(rep["latency_s"]["per_class"]) == {"interactive", "standard", "batch"}
    assert all(k.startswith(("429 ", "400 ")) for k in rep["rejections"]["by_status_code"])
    srv = rep["server"]
    assert srv is not None and srv["settled"] and srv["idle_after"], (srv, rep["metrics_error"])
    assert [(g["free_blocks"], g["total_blocks"]) for g in srv["replicas_after"].values()] == [
        (BLOCKS, BLOCKS)]
    assert srv["preemptions"] > 0
    assert srv["finished_by_reason"].get("length", 0) >= req["ok"]
    assert srv["aborts"] >= req["aborted_by_client"]
    assert sum(srv["rejections_by_reason"].values()) >= sum(
        n for k, n in rep["rejections"]["by_status_code"].items() if k.startswith("429"))
    assert len(rep["samples"]) >= 5
    assert any(r["waiting"] > 0 for s in rep["samples"] for r in s["replicas"].values())
    assert "sk-" not in json.dumps(rep) and KEYS["batch"] not in json.dumps(rep)
    for kind in ("latency", "server"):
        png = Path(rep["plots"][kind])
        assert png.parent == provoked.out_dir
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


# ------------------------------------------------------------------ (d) disconnects under load


async def _disconnects(url: str, waiting: Callable[[], int]) -> dict[str, list[str]]:
    """Under a load of two long streams: two clients hang up mid-stream, two during their
    (long) prompt, two while queued. Returns what each client saw, by kind."""
    hdrs = {"Authorization": f"Bearer {KEYS['interactive']}"}
    async with httpx.AsyncClient(timeout=120) as client:
        async def stream(prompt: list[int], max_tokens: int, leave_after_first: bool) -> str:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": True, "stream": True}
            async with client.stream("POST", url, json=body, headers=hdrs) as r:
                if r.status_code != 200:
                    return f"status {r.status_code}"
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and leave_after_first:
                        return "hung up mid-stream"
                    if line == "data: [DONE]":
                        return "done"
            return "ended without [DONE]"

        async def hang_up(task: asyncio.Task[str], after_s: float) -> str:
            await asyncio.sleep(after_s)
            if task.done():
                return f"finished before the hang-up: {task.result()}"
            task.cancel()  # closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return "hung up"

        load = [asyncio.create_task(stream([50 + i] * 16, 96, False)) for i in range(2)]
        mid_stream = [asyncio.create_task(stream([60 + i] * 16, 200, True)) for i in range(2)]
        long_prompts = [asyncio.create_task(stream([80 + i] * 180, 60, False)) for i in range(2)]
        mid_prompt = await asyncio.gather(*(hang_up(t, 0.02 + 0.03 * i)
                                            for i, t in enumerate(long_prompts)))
        holders = [asyncio.create_task(stream([90 + i] * 16, 200, False)) for i in range(2)]
        queued_tasks = [asyncio.create_task(stream([100 + i] * 16, 200, False)) for i in range(2)]
        deadline = time.monotonic() + 60
        while await asyncio.to_thread(waiting) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        queued = await asyncio.gather(*(hang_up(t, 0.0) for t in queued_tasks + holders))
        return {"load": list(await asyncio.gather(*load)),
                "mid_stream": list(await asyncio.gather(*mid_stream)),
                "mid_prompt": list(mid_prompt), "queued": queued}


def test_disconnects_under_load_are_aborted_and_return_every_block(cluster: Cluster,
                                                                   provoked: Provoked) -> None:
    before = total(scrape(cluster.metrics_url), "ray_tierserve_aborts_total")
    waiting = lambda: sum(int(x["waiting"]) for x in cluster.app.replica_stats().values())  # noqa: E731
    seen = asyncio.run(_disconnects(cluster.app.url("/v1/completions"), waiting))
    assert seen["load"] == ["done", "done"], seen
    assert seen["mid_stream"] == ["hung up mid-stream"] * 2, seen
    assert all(s.startswith(("hung up", "finished before")) for s in seen["mid_prompt"]), seen
    hung_up = seen["mid_stream"] + [s for s in seen["mid_prompt"] + seen["queued"]
                                    if s == "hung up"]
    # Every client that went away while its request was on the replica (at least the two that
    # hung up mid-stream and those that were queued there) is counted as an abort, and every
    # block is back once the load is over.
    samples = cluster.wait_scrape(
        "the aborts counted and the replica idle with every block free",
        lambda ss: total(ss, "ray_tierserve_aborts_total") - before >= 2
        and total(ss, "ray_tierserve_requests_waiting") == 0
        and total(ss, "ray_tierserve_requests_running") == 0
        and total(ss, "ray_tierserve_kv_blocks_free") == BLOCKS)
    aborts = total(samples, "ray_tierserve_aborts_total") - before
    assert 2 <= aborts <= len(hung_up), (aborts, seen)
    stats = cluster.app.wait_idle()
    assert [s["free_blocks"] for s in stats.values()] == [BLOCKS]


def test_an_empty_prompt_is_counted_once_by_the_replica_that_refused_it(
        cluster: Cluster, provoked: Provoked) -> None:
    """The scheduler owns the empty-prompt limit: the replica refuses and counts it; the
    ingress counts only what it refuses itself (its in-flight bound)."""
    r = httpx.post(cluster.app.url("/v1/completions"), timeout=60,
                   headers={"Authorization": f"Bearer {KEYS['batch']}"},
                   json={"model": MODEL, "prompt": "", "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty", r.text
    def counted(ss: list[Sample]) -> list[Sample]:  # every series is exported, most at 0
        return [s for s in ours(ss, "ray_tierserve_rejections_total")
                if s.labels.get("reason") == "empty" and s.value > 0]

    empty = counted(cluster.wait_scrape("a rejection for reason empty, counted by the replica",
                                        lambda ss: bool(counted(ss))))
    assert {s.labels.get("deployment") for s in empty} == {"LLMServer"}
    assert sum(s.value for s in empty) == 1
    assert {s.labels.get("tier") for s in empty} == {"batch"}
