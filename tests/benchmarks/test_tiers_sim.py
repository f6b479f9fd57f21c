"""``benchmarks.tiers_sim``: the simulated cluster is deterministic, answers or sheds every
request, leaks nothing, and refuses what it cannot run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import tiers_sim as ts
from tierserve.replica.scheduler import Chunk, Decode, StepPlan


def setup(headroom: float | None = 0.85, **kw: object) -> ts.Setup:
    return ts.load_setup(ts.DEFAULT_CONFIG, 728, headroom, **kw)


def run(headroom: float | None, seed: int = 0) -> list[ts.SimRequest]:
    s = setup(headroom, truth=ts.StepTruth(scale=1.6))
    return ts.simulate(ts.traffic(4 * 2.963, 12.0, 7, s), s, seed)


def test_the_step_truth_is_its_linear_cost() -> None:
    plan = StepPlan(prefill=[Chunk(1, 10, 20, False, [1] * 20, [0], 40)],
                    decodes=[Decode(2, 1, 5, [0]), Decode(3, 1, 7, [0])])
    truth = ts.StepTruth(base_s=0.01, per_position_s=0.001, per_decode_s=0.002,
                         per_pair_s=1e-6, scale=2.0)
    pairs = 20 * (10 + 21 / 2)
    assert truth.seconds(plan) == pytest.approx(2 * (0.01 + 0.02 + 0.004 + pairs * 1e-6))


def test_the_config_gives_the_tiers_and_the_engine() -> None:
    s = setup(None)
    assert s.engine.slo_prefill_headroom is None and s.engine.num_kv_blocks == 728
    assert {t.name for t in s.tiers.values()} == {"interactive", "standard", "batch"}
    assert s.tiers["interactive"].tpot_s == 0.1 and s.starting_per_replica == 8


def test_every_request_is_answered_or_shed_and_the_same_seed_gives_the_same_run() -> None:
    first = run(0.85)
    again = run(0.85)
    assert [(r.first, r.last, r.tokens, r.shed) for r in first] == [
        (r.first, r.last, r.tokens, r.shed) for r in again]
    assert first and all(r.shed != (r.tokens == r.output) for r in first)
    assert all(r.shed == (r.first is None) for r in first)
    shed = {r.tier for r in first if r.shed}
    assert "interactive" not in shed  # 4x: the lower tiers are shed, never the top one
    figs = ts.level_figures(first, setup(), 12.0)
    assert 0.0 <= figs["within"] <= 1.0 and figs["requests"] == len(first)


def test_the_budget_changes_the_steps() -> None:
    """With the budget on, the top tier's first tokens come at other times than with it off
    (not a figure of merit: only that the setting reaches the scheduler)."""
    on = [r.ttft for r in run(0.85) if r.tier == "interactive"]
    off = [r.ttft for r in run(None) if r.tier == "interactive"]
    assert on != off


def test_each_request_reaches_its_replica_with_what_is_left_of_its_first_token_target(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the ingress hands it: the tier's TTFT target less what the request waited at the
    gate (at 4x the lower tiers wait there, so some get less than their whole target)."""
    from tierserve.replica.scheduler import Scheduler

    seen: list[tuple[int, float | None]] = []
    add = Scheduler.add

    def spy(self: Scheduler, req: Any) -> int:
        seen.append((req.priority, req.ttft_left_s))
        return add(self, req)

    monkeypatch.setattr(Scheduler, "add", spy)
    s = setup(0.85, late_headroom=0.95, truth=ts.StepTruth(scale=1.6))
    assert s.engine.slo_prefill_headroom_late == 0.95
    ts.simulate(ts.traffic(4 * 2.963, 12.0, 7, s), s, 0)
    targets = {t.priority: t.ttft_s for t in s.tiers.values()}
    assert seen and all(left is not None and left <= targets[p] for p, left in seen)
    assert any(left is not None and left < targets[p] for p, left in seen)


def test_a_config_without_the_traffics_tiers_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(ts.DEFAULT_CONFIG.read_text().replace("name: interactive", "name: gold"))
    with pytest.raises(ValueError, match=r"\['interactive'\] are not configured"):
        ts.load_setup(cfg, 728, None)


def test_main_prints_the_table_and_writes_json(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.json"
    assert ts.main(["--levels", "2", "--duration", "6", "--scale", "1.6", "--seeds", "1",
                    "--traffic-seeds", "1", "--prefill-headroom", "none,0.85",
                    "--late-headroom", "none,0.95", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "prefill_headroom late" in text and "\n            none none  1.60 |" in text
    assert "\n            0.85 0.95  1.60 |" in text
    rows = json.loads(out.read_text())["rows"]
    # Without the budget the late share changes nothing: that pair is not run twice.
    assert [(r["prefill_headroom"], r["late_headroom"]) for r in rows] == [
        (None, None), (0.85, None), (0.85, 0.95)]


@pytest.mark.parametrize("argv, message", [
    (["--levels", "2,x"], "not a number"),
    (["--seeds", "0"], "must be positive"),
    (["--prefill-headroom", "lots"], "not a number"),
    (["--prefill-headroom", "1.5"], "slo_prefill_headroom"),
    (["--late-headroom", "2"], "slo_prefill_headroom_late"),
    (["--config", "/nonexistent.yaml"], "cannot run /nonexistent.yaml"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        ts.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_reports_are_taken_every_period_and_the_router_ranks_by_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every report is taken at a multiple of ``report_s`` (so a dispatch sees one as old as
    it is by then), and each replica reports at each of them."""
    times: list[float] = []
    real = ts._report

    def spy(rep: Any, now: float) -> Any:
        times.append(now)
        return real(rep, now)

    monkeypatch.setattr(ts, "_report", spy)
    s = setup(0.85, report_s=0.5)
    ts.simulate(ts.traffic(2 * 2.963, 6.0, 3, s), s, 0)
    assert times and all(abs(t / 0.5 - round(t / 0.5)) < 1e-9 for t in times)
    counts = {round(t / 0.5): times.count(t) for t in times}
    assert set(counts.values()) == {s.replicas}


def test_a_tier_whose_queue_is_full_is_shed_at_once() -> None:
    """With ``max_held`` 0 for batch, a batch request that finds no room is refused when it
    arrives (the TTL never comes into it): more are shed than with the config's 128."""
    base = setup(0.85, truth=ts.StepTruth(scale=1.6))
    tiers = dict(base.tiers)
    tiers["batch"] = dataclasses.replace(tiers["batch"], max_held=0)
    full = dataclasses.replace(base, tiers=tiers)
    traffic = ts.traffic(4 * 2.963, 12.0, 5, base)
    shed_base = sum(r.shed for r in ts.simulate(traffic, base, 0) if r.tier == "batch")
    traffic = ts.traffic(4 * 2.963, 12.0, 5, base)
    done = ts.simulate(traffic, full, 0)
    shed_full = sum(r.shed for r in done if r.tier == "batch")
    assert shed_full > shed_base
    assert all(r.first is None for r in done if r.shed)
