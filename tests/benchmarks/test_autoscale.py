"""``benchmarks.autoscale``'s own logic, without a cluster (the run is by hand: ``python -m
benchmarks.autoscale``): the autoscaled deployment found in a config, the outcomes and the
attainment of fake results, the timeline's bins from a fake trace, and its plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import autoscale
from benchmarks import tiers as tb
from tierserve.cluster.load import Result

ROOT = Path(__file__).resolve().parents[2]


def result(cls: str, start: float, ttft: float | None = 0.5, status: int = 200,
           error: str | None = None) -> Result:
    if ttft is None:
        return Result(0, cls, start, end=start + 0.1, status=status, code="shed")
    first = start + ttft
    return Result(0, cls, start, end=first + 1.0, status=status, first_token=first,
                  last_token=first + 1.0, completion_tokens=21, finish_reason="length",
                  error=error)


def test_the_autoscaled_deployment_is_found_and_a_config_without_one_refused() -> None:
    config = yaml.safe_load((ROOT / "configs" / "cluster-autoscale.yaml").read_text())
    scaling = autoscale.autoscaling(tb.derive_config(config, "tiers"))
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)
    assert scaling["policy"]["policy_kwargs"]["downscale_after_s"] == 60
    plain = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    with pytest.raises(ValueError, match="no deployment autoscaled by"):
        autoscale.autoscaling(plain)


def test_outcomes_and_attainment() -> None:
    rs = [result("interactive", 0.0), result("interactive", 1.0, ttft=4.0),
          result("batch", 2.0, ttft=None, status=429),
          result("batch", 3.0, error="stream error: replica_unavailable"),
          Result(0, "batch", 4.0, status=0, error="timeout")]
    assert autoscale.outcomes(rs) == {"sent": 5, "answered": 2, "refused_429": 1,
                                      "refused_503": 0, "refused_other": 0, "lost": 2}
    target = tb.Targets(ttft_s=3.0, tpot_s=0.1)
    timed = [(r.start, r) for r in rs if r.cls == "interactive"]
    assert autoscale.attainment(timed, target, 0.0, 10.0) == {"n": 2, "both": 0.5}
    assert autoscale.attainment(timed, target, 0.5, 10.0) == {"n": 1, "both": 0.0}
    assert autoscale.attainment(timed, target, 5.0, 10.0) == {"n": 0, "both": None}


def trace() -> list[dict[str, Any]]:
    out = []
    for t in range(100, 160):
        target = 2 if t >= 120 else 1
        running = 2 if t >= 130 else 1
        out.append({"t": float(t), "running": running, "target": target,
                    "replicas": target, "action": "up" if t == 120 else "hold",
                    "reason": "waiting", "reports": []})
    return out


def test_the_timeline_bins_load_replicas_and_attainment(tmp_path: Path) -> None:
    rs = [(100.0 + i, result("interactive" if i % 4 == 0 else "batch", 100.0 + i))
          for i in range(0, 40)]
    rows = autoscale.timeline(rs, trace(), tb.Targets(3.0, 0.1), 100.0, 150.0)
    assert [r["t"] for r in rows] == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert [r["sent_per_s"] for r in rows] == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert [(r["target"], r["running"]) for r in rows] == [(1, 1), (1, 1), (2, 1), (2, 2),
                                                             (2, 2)]
    assert rows[0]["interactive"] == {"n": 3, "both": 1.0}
    assert autoscale.first_time(trace(), 0.0, lambda x: x["action"] == "up") == 120.0
    assert autoscale.first_time(trace(), 121.0, lambda x: x["action"] == "up") is None
    png = tmp_path / "timeline.png"
    autoscale.plot(rows, {"up asked": 20.0, "never": None}, png, "test",
                   [(x["t"] - 100.0, x["replicas"], x["running"]) for x in trace()])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
