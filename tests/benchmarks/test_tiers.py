"""``benchmarks.tiers``'s own logic, without a cluster (the runs are by hand: ``python -m
benchmarks.tiers``): the derived configs validate and carry keys only as ``env:`` references, the
attainment, fairness and table figures from fake ``tierserve.cluster.load`` results, the counter deltas from
fake scrapes, the plots, and arguments refused before anything starts."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from benchmarks import tiers
from tierserve.cluster.config import ClusterConfig
from tierserve.cluster.load import Result, Sample, Scrape

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "cluster.yaml"


def base() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(DEFAULT.read_text())
    return config


def ok(i: int, cls: str, ttft: float, tpot: float, n: int = 20, start: float = 0.0) -> Result:
    first = start + ttft
    last = first + tpot * (n - 1)
    return Result(i, cls, start, end=last, status=200, first_token=first, last_token=last,
                  prompt_tokens=100, completion_tokens=n, finish_reason="length")


def refused(i: int, cls: str, status: int = 429) -> Result:
    return Result(i, cls, 0.0, end=0.01, status=status, code="shed")


def failed(i: int, cls: str) -> Result:
    return Result(i, cls, 0.0, end=60.0, error="cancelled")


TARGETS = {"interactive": tiers.Targets(3.0, 0.1), "standard": tiers.Targets(15.0, 0.5),
           "batch": tiers.Targets(60.0, None)}


# ---------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("system", tiers.SYSTEMS)
def test_derived_configs_validate_and_differ_as_described(system: str) -> None:
    b = base()
    before = copy.deepcopy(b)
    cfg = tiers.derive_config(b, system)
    assert b == before  # the base is not touched
    ServeDeploySchema.model_validate(cfg)  # a config `serve run` takes
    cc = ClusterConfig(**cfg["applications"][0]["args"])
    by_name = {t.name: t for t in cc.tiers}
    assert [n for n, _ in by_name["interactive"].all_keys()] == ["interactive-key0"]
    assert [k for _, k in by_name["interactive"].all_keys()] == [
        f"env:{tiers.KEY_VARS['interactive']}"]
    assert [(t.name, t.weight) for t in by_name["standard"].tenants] == [
        ("tenant-a", 1.0), ("tenant-b", 1.0)]
    assert [k for _, k in by_name["standard"].all_keys()] == [
        f"env:{tiers.KEY_VARS['tenant-a']}", f"env:{tiers.KEY_VARS['tenant-b']}"]
    assert [k for _, k in by_name["batch"].all_keys()] == [f"env:{tiers.KEY_VARS['batch']}"]
    base_cc = ClusterConfig(**b["applications"][0]["args"])
    if system == "tiers":
        assert cc.engine == base_cc.engine and cc.flow == base_cc.flow
    else:
        assert cc.engine.slo_scheduling is False and cc.flow.enabled is False
        assert cc.flow.starting_per_replica == base_cc.flow.starting_per_replica
        policy = "fcfs" if system == "fcfs" else base_cc.engine.scheduling_policy
        assert cc.engine.scheduling_policy == policy
    # the targets the bench counts against are the config's
    assert tiers.tier_targets(cfg) == {
        t.name: tiers.Targets(t.ttft_target_s, t.tpot_target_s) for t in base_cc.tiers}
    # everything else of the application is as it was
    assert cfg["applications"][0]["deployments"] == b["applications"][0]["deployments"]
    assert cfg["http_options"] == b["http_options"]


def test_keys_are_written_only_as_env_references() -> None:
    keys = tiers.new_keys()
    assert set(keys) == set(tiers.KEY_VARS.values()) and len(set(keys.values())) == len(keys)
    for system in tiers.SYSTEMS:
        text = yaml.safe_dump(tiers.derive_config(base(), system), sort_keys=False)
        for var, key in keys.items():
            assert key not in text
            assert f"env:{var}" in text
        written = yaml.safe_load(text)["applications"][0]["args"]["tiers"]
        refs = [k for t in written for k in [*t.get("api_keys", []),
                                             *(k for n in t.get("tenants", []) for k in n["api_keys"])]]
        assert sorted(refs) == sorted(f"env:{v}" for v in tiers.KEY_VARS.values())
    # the client's classes read them from the given mapping; neither repr nor the report's
    # description shows them
    classes = tiers.traffic(keys)
    assert [(c.name, c.weight) for c in classes] == [
        ("interactive", 1.0), ("std-a", 5.0), ("std-b", 1.0), ("batch", 3.0)]
    assert classes[1].api_key == keys[tiers.KEY_VARS["tenant-a"]]
    for c in classes:
        assert c.api_key is not None and c.api_key not in repr(c)
        assert c.api_key not in json.dumps(c.describe())
    assert all("key=env:" in s for s in tiers.class_specs())


def test_literal_keys_of_a_base_config_are_redacted_in_the_report() -> None:
    b = base()
    b["applications"][0]["args"]["tiers"][2]["api_keys"] = ["s3cret-literal", "file:/k"]
    cfg = tiers.derive_config(b, "tiers")
    text = json.dumps(tiers.redact(cfg))
    assert "s3cret-literal" not in text and "<literal key>" in text and "file:/k" in text
    assert f"env:{tiers.KEY_VARS['batch']}" in text


def test_a_config_without_tiers_gets_the_default_tiers_with_keys() -> None:
    b = base()
    del b["applications"][0]["args"]["tiers"]
    cfg = tiers.derive_config(b, "off")
    cc = ClusterConfig(**cfg["applications"][0]["args"])
    assert [t.name for t in cc.tiers] == ["interactive", "standard", "batch"]
    assert tiers.tier_targets(cfg)["interactive"] == tiers.Targets(
        ClusterConfig().tiers[0].ttft_target_s, ClusterConfig().tiers[0].tpot_target_s)


def test_bad_base_configs_are_refused() -> None:
    b = base()
    b["applications"][0]["args"]["tiers"] = b["applications"][0]["args"]["tiers"][:2]
    with pytest.raises(ValueError, match="no tier 'batch'"):
        tiers.derive_config(b, "tiers")
    b = base()
    b["applications"][0]["args"]["tiers"][1]["tenants"] = [{"name": "tenant-b"}]
    with pytest.raises(ValueError, match="already has a tenant named 'tenant-b'"):
        tiers.derive_config(b, "tiers")
    with pytest.raises(ValueError, match="unknown system"):
        tiers.derive_config(base(), "vllm")
    with pytest.raises(ValueError, match="no applications"):
        tiers.derive_config({"applications": []}, "tiers")
    b = base()
    b["applications"][0]["args"]["engine"]["slo_headroom"] = 2.0
    with pytest.raises(ValueError, match=r"engine\.slo_headroom"):
        tiers.derive_config(b, "tiers")
    remote = tiers.derive_config(base(), "tiers")
    remote["http_options"]["host"] = "0.0.0.0"
    with pytest.raises(ValueError, match="loopback only"):
        tiers.http_target(remote)
    assert tiers.http_target(base()) == "http://127.0.0.1:8000"


# ---------------------------------------------------------------------------------- figures


def test_attainment_counts_unanswered_requests_as_misses() -> None:
    t = tiers.Targets(3.0, 0.1)
    assert t.met(ok(0, "interactive", 1.0, 0.05)) == (True, True)
    assert t.met(ok(1, "interactive", 4.0, 0.05)) == (False, True)
    assert t.met(ok(2, "interactive", 1.0, 0.2)) == (True, False)
    assert t.met(refused(3, "interactive")) == (False, False)
    assert t.met(failed(4, "interactive")) == (False, False)
    # no TPOT target: any answer meets it; one token has no TPOT: met
    assert tiers.Targets(60.0, None).met(ok(5, "batch", 1.0, 9.0)) == (True, True)
    assert t.met(ok(6, "interactive", 1.0, 9.0, n=1)) == (True, True)
    assert tiers.Targets().met(refused(7, "batch")) == (False, False)

    rs = [ok(0, "a", 1.0, 0.05), ok(1, "a", 4.0, 0.05), ok(2, "a", 1.0, 0.2),
          refused(3, "a"), ok(4, "a", 4.0, 0.3)]
    a = tiers.attainment(rs, {"a": t})
    assert a == {"n": 5, "both": 0.2, "ttft": 0.4, "tpot": 0.4}
    assert tiers.attainment([], {"a": t}) == {"n": 0, "both": None, "ttft": None, "tpot": None}


def test_jain() -> None:
    assert tiers.jain([5.0, 5.0]) == 1.0
    assert tiers.jain([1.0, 0.0]) == 0.5
    assert tiers.jain([3.0, 1.0]) == pytest.approx(16 / 20)
    assert tiers.jain([]) is None and tiers.jain([0.0, 0.0]) is None


def test_served_rate_counts_answers_in_the_window() -> None:
    rs = [ok(i, "std-a", 0.1, 0.01, start=float(i)) for i in range(10)]  # ends at i + 0.29
    rs.append(refused(99, "std-a"))
    assert tiers.served_rate(rs, 2.0, 6.0) == pytest.approx(4 / 4.0)
    with pytest.raises(ValueError):
        tiers.served_rate(rs, 1.0, 1.0)


def test_window_tokens_spreads_each_answer_over_its_streaming_time() -> None:
    # 11 tokens: the first at 1.0, ten more evenly up to 2.0
    r = ok(0, "std-a", 1.0, 0.1, n=11)
    assert tiers.window_tokens([r], 0.0, 10.0) == pytest.approx(11)
    assert tiers.window_tokens([r], 1.5, 10.0) == pytest.approx(5)
    assert tiers.window_tokens([r], 0.0, 1.5) == pytest.approx(6)
    assert tiers.window_tokens([r], 3.0, 4.0) == 0.0
    one = ok(1, "std-a", 1.0, 0.1, n=1)  # a one-token answer: its token at its first-token time
    assert tiers.window_tokens([one], 0.5, 1.5) == 1.0 and tiers.window_tokens([one], 2, 3) == 0
    assert tiers.window_tokens([refused(2, "std-a"), failed(3, "std-a")], 0.0, 99.0) == 0.0
    # with the prompt (100 tokens), counted when the first token came
    assert tiers.window_tokens([r], 0.0, 1.5, prompt=True) == pytest.approx(106)
    assert tiers.window_tokens([r], 1.5, 10.0, prompt=True) == pytest.approx(5)


def test_steady_fairness_leaves_out_the_ramp_and_the_drain() -> None:
    # Equal shares while both are backlogged (10..30 s); tenant-a alone in the drain after 30 s.
    rs = [ok(i, "std-a", 0.0, 0.1, n=11, start=10.0 + 2 * i) for i in range(10)]
    rs += [ok(100 + i, "std-b", 0.0, 0.1, n=11, start=10.0 + 2 * i) for i in range(10)]
    rs += [ok(200 + i, "std-a", 0.0, 0.1, n=11, start=31.0 + 2 * i) for i in range(10)]
    offered = {r.index: 11 for r in rs}
    window = tiers.steady_window(rs, 20.0)
    assert window == (15.0, 30.0)
    f = tiers.level_figures(rs, TARGETS, offered, span_s=40.0, steady=window)["fairness"]
    assert f["jain_throughput"] < 0.95  # over the whole span: a's drain counts
    assert f["jain_steady"] == 1.0 and f["jain_steady_service"] == 1.0
    assert f["steady_window_s"] == [15.0, 30.0]
    assert f["tenants"]["tenant-a"]["steady_output_tokens_per_s"] == pytest.approx(
        f["tenants"]["tenant-b"]["steady_output_tokens_per_s"])
    # each: 7 answers of 11 tokens inside 15..30 s (the one at 14 s streams before 15 s)
    assert tiers.steady_text(f) == "5.133 / 5.133"
    assert tiers.steady_text({"tenants": {"a": {}, "b": {}}}) == "-"
    assert tiers.steady_window([], 20.0) is None
    none = tiers.level_figures(rs, TARGETS, offered, span_s=40.0)["fairness"]
    assert none["jain_steady"] is None and none["steady_window_s"] is None
    assert none["jain_steady_service"] is None and none["below_share"] is None
    assert f["below_share"]["std-b"]["below"] and f["below_share"]["std-b"]["served"] == 1.0


def test_max_min_level_shares_the_service_by_weight() -> None:
    assert tiers.max_min_level([3, 20], [1, 1], 10) == 7  # 3 fits; 7 left for the other
    assert tiers.max_min_level([8, 20], [1, 1], 10) == 5
    assert tiers.max_min_level([8, 20], [1, 3], 10) == 2.5  # shares 2.5 and 7.5
    assert tiers.max_min_level([3, 4], [1, 1], 10) == float("inf")
    with pytest.raises(ValueError, match="positive"):
        tiers.max_min_level([1], [0], 1)


def test_below_share_judges_each_tenant_against_what_its_tier_served() -> None:
    # 10..30 s: the tier answers 12 (a 9, b 3); a sent 20, b 4 of which one was shed.
    rs = [ok(i, "std-a", 1.0, 0.1, start=10.0 + i) for i in range(9)]
    rs += [refused(100 + i, "std-a") for i in range(11)]
    for r in rs[9:]:
        r.start = 20.0
    rs += [ok(200 + i, "std-b", 1.0, 0.1, start=12.0 + i) for i in range(3)]
    shed_b = refused(300, "std-b")
    shed_b.start = 25.0
    rs += [shed_b, ok(400, "interactive", 0.1, 0.05, start=11.0)]
    rows = tiers.below_share(rs, (10.0, 30.0))
    assert set(rows) == {"std-a", "std-b"}  # one tier with tenants; interactive has none
    assert rows["std-b"] == {"tenant": "tenant-b", "below": True, "sent": 4, "ok": 3,
                             "served": 0.75, "share": 8.0, "tier_served": 12}
    assert rows["std-a"]["below"] is False and rows["std-a"]["sent"] == 20
    assert tiers.below_text(rows) == "below fair share (answered/sent): std-b 3/4"
    # with weights 4:1, b's share of the 12 served is 2.4, under the 4 it sent
    assert tiers.below_share(rs, (10.0, 30.0), weights={"tenant-a": 4.0})["std-b"]["below"] is False
    assert tiers.below_text(None) == "below fair share: -"
    with pytest.raises(ValueError, match="window"):
        tiers.below_share(rs, (5.0, 5.0))


def level_results() -> list[Result]:
    rs = [
        ok(0, "interactive", 0.5, 0.05, n=10), ok(1, "interactive", 5.0, 0.05, n=10),
        refused(2, "interactive", 503),
        ok(3, "std-a", 1.0, 0.1, n=30), ok(4, "std-a", 1.0, 0.1, n=30), refused(5, "std-a"),
        refused(6, "std-a"),
        ok(7, "std-b", 1.0, 0.6, n=30),
        ok(8, "batch", 30.0, 2.0, n=40), failed(9, "batch"),
    ]
    return rs


def test_level_figures_per_class_tier_and_all() -> None:
    rs = level_results()
    offered = {r.index: 40 for r in rs}
    lv = tiers.level_figures(rs, TARGETS, offered, span_s=10.0)
    g = lv["groups"]
    assert list(g) == ["interactive", "std-a", "std-b", "batch", "tier:standard", "all"]
    assert list(lv["tiers"]) == ["interactive", "standard", "batch"]
    assert lv["tiers"]["standard"] is g["tier:standard"]
    assert lv["tiers"]["interactive"] is g["interactive"]

    i = g["interactive"]
    assert (i["sent"], i["ok"], i["status_429"], i["status_503"], i["errors"]) == (3, 2, 0, 1, 0)
    assert i["attainment"] == {"n": 3, "both": round(1 / 3, 4), "ttft": round(1 / 3, 4),
                               "tpot": round(2 / 3, 4)}
    assert i["ttft_p50_s"] == pytest.approx(2.75) and i["ttft_p99_s"] == pytest.approx(4.955)
    assert i["tpot_p50_s"] == pytest.approx(0.05)
    assert i["output_tokens"] == 20 and i["output_tokens_per_s"] == 2.0
    assert i["offered_output_tokens"] == 120 and i["served_share"] == round(20 / 120, 4)

    a, b = g["std-a"], g["std-b"]
    assert (a["sent"], a["ok"], a["status_429"]) == (4, 2, 2)
    assert a["attainment"]["both"] == 0.5
    assert b["attainment"] == {"n": 1, "both": 0.0, "ttft": 1.0, "tpot": 0.0}  # 0.6 > 0.5
    assert g["tier:standard"]["sent"] == 5 and g["tier:standard"]["status_429"] == 2
    assert g["tier:standard"]["attainment"]["both"] == 0.4

    bt = g["batch"]  # no TPOT target: the answer meets it; the cancelled one misses
    assert bt["attainment"] == {"n": 2, "both": 0.5, "ttft": 0.5, "tpot": 0.5}
    assert bt["errors"] == 1

    # all: each request against its own tier's targets
    assert g["all"]["sent"] == 10
    assert g["all"]["attainment"]["both"] == round((1 + 2 + 0 + 1) / 10, 4)

    f = lv["fairness"]
    assert f["tenants"]["tenant-a"] == {"output_tokens_per_s": 6.0, "served_share": 0.375}
    assert f["tenants"]["tenant-b"] == {"output_tokens_per_s": 3.0, "served_share": 0.75}
    assert f["jain_throughput"] == round(81 / (2 * 45), 4)
    assert f["jain_served_share"] == tiers.jain([0.375, 0.75])


def scrape(samples: list[tuple[str, dict[str, str], float]]) -> Scrape:
    return Scrape(0.0, [Sample(n, lbl, v) for n, lbl, v in samples])


def test_counter_deltas_and_server_goodput() -> None:
    slo = tiers.SLO_REQUESTS
    before = scrape([
        (slo, {"tier": "interactive", "target": "both", "outcome": "met"}, 10.0),
        (slo, {"tier": "interactive", "target": "both", "outcome": "missed"}, 2.0),
        (tiers.FLOW_SHED, {"tier": "batch", "reason": "late"}, 1.0),
    ])
    after = scrape([
        (slo, {"tier": "interactive", "target": "both", "outcome": "met"}, 16.0),
        (slo, {"tier": "interactive", "target": "both", "outcome": "missed"}, 4.0),
        (slo, {"tier": "interactive", "target": "ttft", "outcome": "met", "replica": "x"}, 3.0),
        (slo, {"tier": "batch", "target": "ttft", "outcome": "missed"}, 5.0),
        (tiers.FLOW_SHED, {"tier": "batch", "reason": "late"}, 1.0),
        (tiers.FLOW_SHED, {"tier": "batch", "reason": "band_full"}, 7.0),
    ])
    d = tiers.labelled_delta(before, after, slo, ("tier", "target", "outcome"))
    assert d == {"batch": {"ttft": {"missed": 5.0}},
                 "interactive": {"both": {"met": 6.0, "missed": 2.0}, "ttft": {"met": 3.0}}}
    assert tiers.goodput(d) == {"batch": {"ttft": 0.0},
                                "interactive": {"both": 0.75, "ttft": 1.0}}
    assert tiers.labelled_delta(before, after, tiers.FLOW_SHED, ("tier", "reason")) == {
        "batch": {"band_full": 7.0}}
    assert tiers.labelled_delta(None, after, slo, ("tier",)) is None
    assert tiers.goodput(None) == {}


def test_idle_needs_every_replica_idle_and_nothing_held() -> None:
    waiting, running = "ray_tierserve_requests_waiting", "ray_tierserve_requests_running"
    idle = [(waiting, {"replica": "r1"}, 0.0), (running, {"replica": "r1"}, 0.0),
            (tiers.FLOW_HELD, {"tier": "batch"}, 0.0)]
    assert tiers.is_idle(scrape(idle))
    assert not tiers.is_idle(scrape([*idle[:2], (tiers.FLOW_HELD, {"tier": "batch"}, 3.0)]))
    assert not tiers.is_idle(scrape([*idle[1:], (waiting, {"replica": "r1"}, 2.0)]))
    assert not tiers.is_idle(scrape([]))  # no replica seen yet


def fake_report() -> dict[str, Any]:
    rs = level_results()
    levels = []
    for mult in (0.5, 1.0, 2.0):
        lv = tiers.level_figures(rs, TARGETS, {r.index: 40 for r in rs}, 10.0)
        lv.update(multiple=mult, rate=mult * 4.0, server={
            "preemptions": 3.0,
            "slo_requests": {"interactive": {"both": {"met": 3.0, "missed": 1.0}}}})
        levels.append(lv)
    targets = {t: {"ttft_s": v.ttft_s, "tpot_s": v.tpot_s} for t, v in TARGETS.items()}
    return {"capacity": {"requests_per_s": 4.0},
            "systems": {s: {"name": s, "description": tiers.DESCRIPTIONS[s], "targets": targets,
                            "levels": levels if s != "fcfs" else []} for s in tiers.SYSTEMS}}


def test_table_text_has_a_row_per_level_and_class() -> None:
    text = tiers.table_text(fake_report()["systems"]["tiers"])
    lines = text.splitlines()
    assert lines[0].startswith("system tiers:")
    assert "TTFT p50/p99 s" in lines[1] and "429" in lines[1]
    rows = [line for line in lines
            if line.strip().startswith(("0.5x", "1x", "2x")) and "Jain" not in line]
    assert len(rows) == 3 * 6
    assert any("std-a" in r and " 2 " in r for r in rows)
    assert "Jain(tenant-a, tenant-b)" in text and "interactive 0.75" in text
    assert "preemptions 3" in text
    assert "100 / 1930" in text  # TPOT in ms, no exponent


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    report = fake_report()
    tiers.plot_attainment(report, tmp_path / "a.png")
    tiers.plot_tpot(report, tmp_path / "t.png")
    for name in ("a.png", "t.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------- CLI


def test_dry_run_writes_the_configs_and_starts_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = tiers.main(["--dry-run", "--config", str(DEFAULT), "--out-dir", str(tmp_path),
                     "--systems", "tiers,fcfs", "--levels", "1", "--duration", "30"])
    assert rc == 0
    out = capsys.readouterr().out
    # without --capacity and without off, capacity is measured on the first system asked for
    assert "systems ['tiers', 'fcfs']" in out
    for s in ("tiers", "fcfs"):
        cfg = yaml.safe_load((tmp_path / f"tiers_{s}.yaml").read_text())
        ClusterConfig(**cfg["applications"][0]["args"])
    assert "key=env:TIERSERVE_BENCH_KEY_TENANT_A" in out


def test_the_capacity_system_runs_first() -> None:
    args = tiers.parse_args(["--systems", "tiers,fcfs,off"])
    assert tiers.check_args(args) == (["off", "tiers", "fcfs"], [0.5, 1.0, 1.5, 2.0, 4.0])
    args = tiers.parse_args(["--systems", "tiers,fcfs,off", "--capacity", "3"])
    assert tiers.check_args(args)[0] == ["tiers", "fcfs", "off"]
    args = tiers.parse_args(["--systems", "fcfs,tiers", "--capacity-on", "tiers"])
    assert tiers.check_args(args)[0] == ["tiers", "fcfs"]


@pytest.mark.parametrize("argv, message", [
    (["--systems", "tiers,vllm"], "--systems takes"),
    (["--systems", "tiers,tiers"], "--systems takes"),
    (["--levels", "1,x"], "--levels"),
    (["--levels", "0,1"], "positive multiples"),
    (["--duration", "0"], "--duration must be positive"),
    (["--capacity", "-1"], "--capacity must be"),
    (["--capacity", "5000", "--levels", "4"], "10000"),
    (["--prompt-len", "uniform:9:1"], "bad length"),
    (["--name", "a/b"], "--name"),
    (["--config", "configs/no-such.yaml"], "no-such.yaml"),
    (["--client-nice", "20"], "--client-nice must be in [0, 19]"),
    (["--client-nice", "-1"], "--client-nice must be in [0, 19]"),
])
def test_bad_arguments_are_refused_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    assert tiers.main([*argv, "--out-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_load_client_runs_at_its_niceness_and_so_do_its_threads() -> None:
    """``--client-nice``: the run goes on a thread of its own at that niceness (Linux sets it
    per thread), and threads it starts inherit it; this thread, the one that starts the
    clusters, keeps its own; a niceness not above this thread's runs here."""
    import os
    import threading

    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    mine = nice_here()
    target = min(mine + 5, 19)

    async def run() -> tuple[int, int, int]:
        seen: list[int] = []
        child = threading.Thread(target=lambda: seen.append(nice_here()))
        child.start()
        child.join()
        return threading.get_native_id(), nice_here(), seen[0]

    tid, nice, child = tiers.run_niced(run, target)
    assert tid != threading.get_native_id() and nice == child == target
    assert nice_here() == mine

    async def here() -> int:
        return threading.get_native_id()

    assert tiers.run_niced(here, mine) == threading.get_native_id()


def test_ctrl_c_stops_a_niced_run() -> None:
    """Ctrl-C in the thread that waits cancels the run on the client's thread, and is raised
    once that run has stopped (before, the level ran on to its end)."""
    import os
    import signal
    import threading

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    cancelled = threading.Event()

    async def forever() -> None:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            await asyncio.sleep(600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    # Python's own handler, also where SIGINT is ignored (a background job's).
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            tiers.run_niced(forever, min(mine + 1, 19))
    finally:
        signal.signal(signal.SIGINT, before)
    assert cancelled.is_set()


def test_results_are_written_a_request_a_line(tmp_path: Path) -> None:
    """``--results``: every request of a level as the client saw it, appended level by level."""
    path = tmp_path / "run_requests.jsonl"
    ok = Result(3, "interactive", 1.0, 2.5, 200, first_token=1.4, last_token=2.5,
                prompt_tokens=120, completion_tokens=12, finish_reason="length")
    shed = Result(4, "batch", 1.1, 1.2, 429, code="shed", retry_after=2.0)
    tiers.append_results(path, "tiers", 2.0, [ok])
    tiers.append_results(path, "tiers", 4.0, [shed])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["multiple"], r["index"], r["status"]) for r in lines] == [(2.0, 3, 200),
                                                                         (4.0, 4, 429)]
    assert lines[0]["first_token"] == 1.4 and lines[1]["code"] == "shed"
    assert tiers.parse_args(["--results"]).results and not tiers.parse_args([]).results
