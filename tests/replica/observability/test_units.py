"""Fast checks (no Ray): the load generator's parts, the PromQL name extraction, the configs."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.replica.observability import promql
from tierserve.cluster import load as loadgen
from tierserve.cluster.load import LengthDist, Result, Scrape, TrafficClass, Workload
from tierserve.cluster.measure import percentile, rounded_percentile
from tierserve.replica.metrics import COUNTERS, EXPORTED, GAUGES, HISTOGRAMS, MEMORY_GAUGES

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "configs" / "grafana" / "tierserve.json"
PROMETHEUS = ROOT / "configs" / "prometheus.yml"


# ------------------------------------------------------------------ load generator


def test_the_names_the_load_generator_scrapes_are_exported() -> None:
    assert set(loadgen.SCRAPED) <= EXPORTED
    # ... taken from the definitions, not spelled out again
    assert loadgen.gauge("tierserve_requests_waiting") == "ray_tierserve_requests_waiting"
    assert loadgen.counter("tierserve_aborts") == "ray_tierserve_aborts_total"
    for name, make in (("tierserve_aborts", loadgen.gauge), ("tierserve_nope", loadgen.counter)):
        with pytest.raises(KeyError):
            make(name)


@pytest.mark.parametrize(("spec", "lo", "hi"), [
    ("7", 7, 7), ("uniform:3:9", 3, 9), ("normal:50:10", 1, 200), ("lognormal:64:0.5", 1, 2000),
])
def test_length_distributions(spec: str, lo: int, hi: int) -> None:
    d = LengthDist.parse(spec)
    rng = random.Random(0)
    xs = [d.sample(rng) for _ in range(500)]
    assert all(lo <= x <= hi for x in xs)
    assert str(LengthDist.parse(str(d))) == str(d)


@pytest.mark.parametrize("spec", ["0", "x", "uniform:5:2", "uniform:0:3", "normal:5", "zipf:1:2"])
def test_bad_length_distributions_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="bad length"):
        LengthDist.parse(spec)


def test_traffic_classes() -> None:
    c = TrafficClass.parse("interactive=2.5,key=env:K,priority=12", {"K": "sk-secret"})
    assert (c.name, c.weight, c.priority) == ("interactive", 2.5, 12)
    assert c.headers() == {"Authorization": "Bearer sk-secret", "X-TL-Priority": "12"}
    assert "sk-secret" not in repr(c) and c.describe()["api_key"] is True
    assert TrafficClass.parse("low").headers() == {}
    for bad in ("a=0", "a=-1", "a,prio=3", "a,priority=x", "a b", "a,key=env:MISSING"):
        with pytest.raises(ValueError):
            TrafficClass.parse(bad, {})


def test_the_workload_is_reproducible_and_follows_the_mix() -> None:
    classes = [TrafficClass("a", 3.0), TrafficClass("b", 1.0, priority=5)]
    w = Workload(classes, LengthDist.parse("uniform:4:8"), LengthDist.parse("16"), seed=3,
                 abort_fraction=0.25)
    specs = [w.spec(i) for i in range(400)]
    assert specs[17] == w.spec(17)
    assert all(4 <= len(s.prompt or []) <= 8 and s.max_tokens == 16 for s in specs)
    assert all(isinstance(t, int) and 33 <= t < 127 for s in specs for t in s.prompt or [])
    share_a = sum(s.cls.name == "a" for s in specs) / len(specs)
    assert 0.65 < share_a < 0.85
    assert 0.15 < sum(s.abort_early for s in specs) / len(specs) < 0.35
    text = Workload(classes, LengthDist.parse("40"), LengthDist.parse("4"), prompt_format="text")
    assert isinstance(text.spec(0).prompt, str) and len(text.spec(0).prompt or "") == 40


def test_a_dataset_file(tmp_path: Path) -> None:
    path = tmp_path / "reqs.jsonl"
    lines = [{"prompt": "hello", "max_tokens": 3, "class": "b"}, {"prompt": [1, 2, 3]},
             {"messages": [{"role": "user", "content": "hi"}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    data = loadgen.load_dataset(path, {"a", "b"})
    w = Workload([TrafficClass("a"), TrafficClass("b")], LengthDist.parse("9"),
                 LengthDist.parse("7"), dataset=data)
    s0, s1, s2, s3 = (w.spec(i) for i in range(4))
    assert (s0.prompt, s0.max_tokens, s0.cls.name, s0.path) == ("hello", 3, "b", "/v1/completions")
    assert (s1.prompt, s1.max_tokens) == ([1, 2, 3], 7)
    assert s2.messages and s2.path == "/v1/chat/completions"
    assert s3.prompt == "hello"  # cycles
    for bad in ('{"prompt": ""}', '{"prompt": "x", "messages": []}', '{"prompt": "x", "n": 2}',
                '{"prompt": "x", "class": "zz"}', '{"prompt": "x", "max_tokens": 0}', "[1]"):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=r"reqs\.jsonl:1"):
            loadgen.load_dataset(path, {"a", "b"})


def test_only_loopback_targets_unless_allowed() -> None:
    for url in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8080/metrics",
                "http://127.3.4.5"):
        assert loadgen.is_loopback(url), url
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000", "nonsense"):
        assert not loadgen.is_loopback(url), url
    args = loadgen.parse_args(["--rate", "1", "--url", "http://10.1.2.3:8000"])
    with pytest.raises(ValueError, match="allow-remote"):
        loadgen.build(args)
    assert loadgen.main(["--rate", "1", "--url", "http://10.1.2.3:8000"]) == 2
    args = loadgen.parse_args(["--rate", "1", "--url", "http://10.1.2.3:8000", "--allow-remote",
                               "--metrics-url", ""])
    cfg, _ = loadgen.build(args)
    assert cfg.metrics_url is None


def test_run_bounds_are_checked() -> None:
    for argv in (["--rate", "0"], ["--concurrency", "0"], ["--rate", "1", "-n", "0"],
                 ["--rate", "1", "-d", "0"], ["--rate", "1", "--name", "../x"]):
        with pytest.raises(ValueError):
            loadgen.build(loadgen.parse_args(argv))


SCRAPE = """\
# HELP ray_tierserve_requests_waiting Requests in the replica's waiting queue (queue depth).
# TYPE ray_tierserve_requests_waiting gauge
ray_tierserve_requests_waiting{application="app",replica="r1",WorkerId="w"} 3.0
ray_tierserve_requests_waiting{application="app",replica="r2"} 1.0
ray_tierserve_kv_blocks_free{application="app",replica="r1"} 10.0
ray_tierserve_kv_blocks_total{application="app",replica="r1"} 16.0
ray_tierserve_rejections_total{application="app",reason="shed",tier="batch"} 2.0
ray_tierserve_rejections_total{application="app",reason="queue_full",tier="interactive"} 1.0
ray_tierserve_rejections_total{application="other",reason="shed",tier="batch"} 5.0
ray_serve_num_http_requests_total{route="/a, \\"b\\""} 9.0
ray_tierserve_step_tokens_bucket{application="app",le="+Inf"} 4.0 1700000000000
"""


def test_scrape_parsing() -> None:
    s = Scrape(0.0, loadgen.parse_metrics(SCRAPE))
    assert {x.name for x in s.samples} == {
        "ray_tierserve_requests_waiting", "ray_tierserve_kv_blocks_free",
        "ray_tierserve_kv_blocks_total", "ray_tierserve_rejections_total",
        "ray_tierserve_step_tokens_bucket"}
    assert s.total("ray_tierserve_requests_waiting") == 4.0
    assert s.by("ray_tierserve_rejections_total", "reason", "app") == {"shed": 2.0, "queue_full": 1.0}
    assert s.total("ray_tierserve_rejections_total") == 8.0
    assert s.replicas("app") == {"r1": {"waiting": 3.0, "free_blocks": 10.0, "total_blocks": 16.0},
                                 "r2": {"waiting": 1.0}}
    quoted = loadgen.parse_metrics(SCRAPE, prefixes=("ray_serve_",))
    assert quoted[0].labels == {"route": '/a, "b"'}
    # A line it cannot parse, among its own: an error, not a silent gap.
    with pytest.raises(ValueError):
        loadgen.parse_metrics("ray_tierserve_requests_waiting{replica=r1} 3.0\n")
    # ... elsewhere on the endpoint: not its business.
    assert loadgen.parse_metrics("ray_other{x=oops} 1\n" + SCRAPE) == s.samples
    assert loadgen.delta({"a": 3.0, "b": 1.0, "c": 2.0}, {"a": 1.0, "c": 2.0}) == {"a": 2.0, "b": 1.0}


def test_percentiles_and_request_timings() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5  # any order
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50)) and percentile([math.nan, 1.0], 99) == 1.0
    assert percentile([1.0, math.inf], 0) == 1.0 and percentile([1.0, math.inf], 100) == math.inf
    assert percentile([1.0, 2.0, math.inf, math.inf], 99) == math.inf  # not NaN, as numpy's is
    xs = [random.Random(3).lognormvariate(0, 1) for _ in range(37)]
    assert [percentile(xs, q) for q in (1, 50, 90, 99)] == pytest.approx(
        [float(np.percentile(xs, q)) for q in (1, 50, 90, 99)], rel=1e-12)  # numpy's default
    assert rounded_percentile([None, 0.1234567, None, 0.3], 50) == 0.211728
    assert rounded_percentile([None], 99) is None and rounded_percentile([], 50) is None
    st = loadgen.stats([None, 1.0, 3.0, 2.0])
    assert (st["n"], st["p50"], st["max"], st["mean"]) == (3, 2.0, 3.0, 2.0)
    assert loadgen.stats([])["p99"] is None
    r = Result(0, "a", start=1.0, end=3.0, status=200, first_token=1.5, last_token=2.5,
               completion_tokens=11, finish_reason="length")
    assert r.outcome == "ok" and r.ttft == 0.5 and r.tpot == pytest.approx(0.1) and r.e2e == 2.0
    assert Result(1, "a", 0.0, status=429, code="shed").outcome == "rejected"
    assert Result(2, "a", 0.0, status=200, error="timeout").outcome == "error"
    assert Result(3, "a", 0.0, status=200, aborted=True).outcome == "aborted"
    ts, qs = loadgen.windowed([(0.5, 1.0), (0.7, 3.0), (2.5, 10.0)], 1.0)
    assert ts == [0.5, 2.5] and qs[50] == [2.0, 10.0]


# ------------------------------------------------------------------ dashboard and Prometheus


def balanced(expr: str) -> bool:
    """Brackets pair up outside strings (a cheap syntax check; no PromQL parser here)."""
    stack: list[str] = []
    pairs = {")": "(", "]": "[", "}": "{"}
    for ch in promql._STRING.sub('""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack and expr.count('"') % 2 == 0


def test_promql_metric_names() -> None:
    f = promql.metric_names
    assert f('histogram_quantile(0.99, sum by (tier, le) (rate(ray_x_bucket{job=~"$job", '
             'tier=~"$tier"}[$__rate_interval])))') == {"ray_x_bucket"}
    assert f("1 - sum by (replica) (a_free) / sum by (replica) (a_total)") == {"a_free", "a_total"}
    assert f('rate(a[5m] offset 1h) * on (x) group_left (y) b{c="d(e)"} > bool 1e3') == {"a", "b"}
    assert f("sum without (le) (rate(m:rule:sum[${__rate_interval}]))") == {"m:rule:sum"}


def test_the_dashboard_covers_every_metric_and_is_importable() -> None:
    dash = promql.load(DASHBOARD)
    queried = set().union(*(promql.metric_names(e) for _, e in promql.dashboard_queries(dash)))
    assert queried <= EXPORTED, sorted(queried - EXPORTED)
    assert promql.variable_metrics(dash) <= EXPORTED
    # every metric of replica/metrics.py is on some panel (histograms through their buckets)
    wanted = {f"ray_{g}" for g in GAUGES | MEMORY_GAUGES} | {f"ray_{c}_total" for c in COUNTERS}
    wanted |= {f"ray_{h}_bucket" for h in HISTOGRAMS}
    assert wanted <= queried, sorted(wanted - queried)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = set()
    for p in promql.panels(dash):
        assert p["id"] not in ids
        ids.add(p["id"])
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
            assert balanced(t["expr"]), t["expr"]
            # Legends name labels as Grafana writes them: {{label}}, nothing doubled.
            legend = t.get("legendFormat", "")
            assert all(re.fullmatch(r"[a-zA-Z_]\w*", x)
                       for x in re.findall(r"\{\{(.*?)\}\}", legend)), (p["title"], legend)
            assert "{{{" not in legend and "}}}" not in legend, (p["title"], legend)
            if "histogram_quantile" in t["expr"]:
                assert "_bucket" in t["expr"] and "le)" in t["expr"], t["expr"]
    titles = {p["title"] for p in promql.panels(dash)}
    for needed in ("Queue depth (waiting requests)", "Running requests", "KV cache use",
                   "Preemptions/s", "Time to first token", "Time per output token",
                   "Request rate per tier (finished)", "Rejections by reason", "Tokens/s"):
        assert needed in titles
    by_title = {p["title"]: p for p in promql.panels(dash)}
    for t in ("Queue depth (waiting requests)", "Running requests", "KV cache use", "Preemptions/s"):
        assert all("by (replica)" in x["expr"] for x in by_title[t]["targets"]), t
    for t in ("Time to first token", "Time per output token"):
        exprs = [x["expr"] for x in by_title[t]["targets"]]
        assert [e.split(",")[0] for e in exprs] == ["histogram_quantile(0.5", "histogram_quantile(0.9",
                                                     "histogram_quantile(0.99"]
        assert all("by (tier, le)" in e for e in exprs)


def test_the_prometheus_config() -> None:
    cfg = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["tierserve-local"]["static_configs"][0]["targets"] == ["127.0.0.1:8080"]
    files = jobs["ray"]["file_sd_configs"][0]["files"]
    assert [Path(f).name for f in files] == ["prom_metrics_service_discovery.json"]
    assert cfg["global"]["scrape_interval"] == "10s"
