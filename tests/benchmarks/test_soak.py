"""``benchmarks.soak`` against a fake server (a second or so of load): without ``--model`` it
sends the model ``/v1/models`` names; a soak where every request got ``model_not_found``, or
where nothing succeeded, fails; a mix with invalid requests expects their ``invalid_request``
and nothing more."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from benchmarks import soak as soak_tool
from benchmarks.soak import ReplicaState, SoakConfig, SoakReport, soak
from tests.fake_api import MODEL, Behaviour, FakeApi
from tierserve.cluster.load import TrafficClass

CLASSES = [TrafficClass("a")]


async def idle() -> ReplicaState:
    """One replica, idle with every block free, its memory flat: the other checks pass."""
    return {"r1": {"waiting": 0, "running": 0, "free_blocks": 16, "total_blocks": 16,
                   "rss_bytes": 100 * 2**20}}


def config(**kw: object) -> SoakConfig:
    base: dict[str, object] = {"duration_s": 1.0, "rate": 25.0, "sample_every_s": 0.05,
                               "settle_timeout_s": 5.0, "request_timeout_s": 10.0,
                               "prompt": (4, 8), "long_prompt": (8, 12), "output": (2, 4)}
    return SoakConfig(**(base | kw))  # type: ignore[arg-type]


def run(api: FakeApi, model: str | None, cfg: SoakConfig | None = None) -> SoakReport:
    return asyncio.run(soak(api.url, model, CLASSES, cfg or config(), idle,
                            log=lambda line: None))


def test_without_a_model_it_soaks_the_served_one_and_passes() -> None:
    with FakeApi() as api:
        report = run(api, None)
    assert report.failures == [] and report.passed
    assert report.model == MODEL and {b["model"] for b in api.completions} == {MODEL}
    assert report.requests >= 10 and report.results.get("ok", 0) > 0


def test_every_request_model_not_found_fails_the_soak() -> None:
    with FakeApi() as api:
        report = run(api, "tierserve-tiny")
    n = report.requests
    assert n >= 10 and report.results == {"clear_error": n}  # each a clear error, as before
    assert report.failures == [
        f"no request succeeded ({n} sent; clear errors by code: {{'model_not_found': {n}}})",
        f"{n} clear errors the mix does not ask for, by code: {{'model_not_found': {n}}} "
        f"(all clear errors: {{'model_not_found': {n}}})",
    ]
    assert not report.passed


def test_a_soak_where_nothing_succeeds_fails_though_its_errors_are_a_full_queue() -> None:
    with FakeApi(Behaviour(refuse=(429, "queue_full"))) as api:
        report = run(api, None)
    n = report.requests
    assert report.failures == [
        f"no request succeeded ({n} sent; clear errors by code: {{'queue_full': {n}}})"]


def test_invalid_requests_expect_their_refusal_and_nothing_more() -> None:
    kinds = SoakConfig.with_invalid(SoakConfig.kinds, 0.4)
    with FakeApi() as api:
        report = run(api, None, config(kinds=kinds))
    invalid = report.by_kind["invalid"].get("clear_error", 0)
    assert invalid > 0 and report.error_codes == {"invalid_request": invalid}
    assert report.passed, report.failures
    assert any(b["max_tokens"] == -1 and b["stream"] is False for b in api.completions)
    # a server that answers an invalid request has not refused it
    with FakeApi(Behaviour(validates=False)) as api:
        report = run(api, None, config(kinds=kinds))
    assert report.by_kind["invalid"].get("bad", 0) > 0
    assert any("an invalid request was answered" in str(b["detail"]) for b in report.bad)
    assert not report.passed


def test_the_invalid_fraction_of_the_mix() -> None:
    assert SoakConfig.with_invalid(SoakConfig.kinds, 0.0) == SoakConfig.kinds
    kinds = dict(SoakConfig.with_invalid(SoakConfig.kinds, 0.2))
    assert kinds["invalid"] == 0.2 and sum(kinds.values()) == pytest.approx(1.0)
    assert kinds["stream"] == pytest.approx(0.55 * 0.8)
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="invalid fraction"):
            SoakConfig.with_invalid(SoakConfig.kinds, bad)


def main_args(api: FakeApi, tmp_path: Path, *extra: str) -> list[str]:
    return ["--url", api.url, "--metrics-url", f"{api.url}/metrics", "--duration", "1",
            "--rate", "20", "--settle-timeout", "5", "--request-timeout", "10",
            "--json", str(tmp_path / "soak.json"), *extra]


def test_the_command_line_fails_on_a_model_the_server_does_not_serve(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi() as api:
        assert soak_tool.main(main_args(api, tmp_path, "--model", "tierserve-tiny")) == 1
    out = capsys.readouterr().out
    assert "clear errors the mix does not ask for, by code: {'model_not_found':" in out
    assert "PASSED" not in out
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["model"] == "tierserve-tiny"
    assert any("model_not_found" in f for f in saved["failures"])


def test_the_command_line_takes_the_served_model_by_default(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi() as api:
        soak_tool.main(main_args(api, tmp_path))  # one second: too short for the memory check
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["model"] == MODEL and saved["results"].get("ok", 0) > 0
    assert saved["error_codes"] == {}
    assert not any("succeeded" in f or "ask for" in f for f in saved["failures"])
    assert f"model: {MODEL}" in capsys.readouterr().out


def test_the_command_line_stops_before_sending_when_no_model_is_served(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi(Behaviour(models_status=404, refuse=(404, "model_not_found"))) as api:
        assert soak_tool.main(main_args(api, tmp_path)) == 1
    assert api.completions == []
    err = capsys.readouterr().err
    assert f"benchmarks.soak: {api.url}/v1/models answered 404" in err
    assert "(or pass --model)" in err and not (tmp_path / "soak.json").exists()
    with FakeApi(Behaviour(models=[])) as api:
        assert soak_tool.main(main_args(api, tmp_path)) == 1
    assert f"{api.url}/v1/models serves no model" in capsys.readouterr().err


def test_a_bad_invalid_fraction_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        soak_tool.main(["--invalid-fraction", "1"])
    assert exc.value.code == 2 and "--invalid-fraction" in capsys.readouterr().err
