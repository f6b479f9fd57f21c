"""``benchmarks.tiers`` against a fake server (the cluster's start replaced): the cluster is
ready when it answers a completion of the model ``/v1/models`` names, a refusal for good stops
the wait at once, and every run of load must pass ``tierserve.cluster.load``'s verdict, else the
bench stops with exit status 1 and the level's verdict in its report."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import tiers
from tests.fake_api import MODEL, Behaviour, FakeApi
from tierserve.cluster.load import LengthDist
from tierserve.cluster.measure import RequestsFailed

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "cluster.yaml"
KEYS = {var: f"key-{i}" for i, var in enumerate(tiers.KEY_VARS.values())}


def plan(api: FakeApi) -> tiers.Plan:
    return tiers.Plan(api.url, f"{api.url}/metrics", LengthDist.parse("4"), LengthDist.parse("3"),
                      duration_s=1.0, drain_s=5.0, seed=0, progress=False)


def test_ready_is_a_completion_of_the_served_model_with_the_key() -> None:
    with FakeApi(Behaviour(only_key="k")) as api:
        assert tiers.ready(api.url, "k")
        with pytest.raises(RequestsFailed, match="401 invalid_api_key"):
            tiers.ready(api.url, "wrong")
    assert [b["model"] for b in api.completions] == [MODEL, MODEL]
    assert not tiers.ready(api.url, "k")  # gone: not ready, no error
    with FakeApi(Behaviour(models_status=503)) as api:
        assert not tiers.ready(api.url, "k")
    with FakeApi(Behaviour(models=[])) as api, pytest.raises(RequestsFailed,
                                                             match="serves no model"):
        tiers.ready(api.url, "k")


def test_a_run_of_load_must_pass_the_verdict() -> None:
    classes = tiers.traffic(KEYS)
    with FakeApi() as api:
        run, _, _ = tiers.run_load(plan(api), classes, seed=0, rate=20.0)
        assert run.model == MODEL and tiers.check_run(run, "tiers: level 1x").passed
        run, _, _ = tiers.run_load(plan(api), classes, seed=0, rate=20.0,
                                   model="tierserve-tiny")
    n = len(run.results)
    with pytest.raises(RuntimeError) as e:
        tiers.check_run(run, "tiers: level 1x")
    assert str(e.value) == (
        f"tiers: level 1x: no request succeeded ({n} sent; clear errors by code: "
        f"{{'model_not_found': {n}}}); {n} clear errors the mix does not ask for, by code: "
        f"{{'model_not_found': {n}}} (all clear errors: {{'model_not_found': {n}}})")


def run_main(tmp_path: Path, api: FakeApi, monkeypatch: pytest.MonkeyPatch,
             accept_only_the_interactive_key: bool = False) -> int:
    config = yaml.safe_load(DEFAULT.read_text())
    config["http_options"]["port"] = api.port
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))

    def start(config_path: Path, env: Mapping[str, str], log: Path, url: str, metrics_port: int,
              key: str, timeout_s: float) -> tuple[subprocess.Popen[bytes], float]:
        assert url == api.url and metrics_port == api.port
        if accept_only_the_interactive_key:
            api.behaviour.only_key = key
        assert tiers.ready(url, key)
        # Ctrl-C (the bench's stop) ends it, even where SIGINT is ignored (a background job).
        return subprocess.Popen(["sleep", "60"], start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                 signal.SIG_DFL)), 0.1

    monkeypatch.setattr(tiers, "start_cluster", start)
    monkeypatch.setattr(tiers, "answers", lambda call: False)  # "nothing serves there yet"
    return tiers.main(["--config", str(path), "--systems", "tiers", "--capacity", "20",
                       "--levels", "1", "--duration", "1", "--drain-timeout", "5",
                       "--settle", "0", "--settle-timeout", "5", "--warmup", "0",
                       "--metrics-port", str(api.port), "--prompt-len", "4",
                       "--output-len", "3", "--no-plots", "--no-progress",
                       "--out-dir", str(tmp_path)])


def level(tmp_path: Path) -> dict[str, Any]:
    report = json.loads((tmp_path / "tiers.json").read_text())
    (only,) = report["systems"]["tiers"]["levels"]
    return dict(only)


def test_the_bench_passes_on_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with FakeApi() as api:
        assert run_main(tmp_path, api, monkeypatch) == 0
    assert level(tmp_path)["verdict"]["passed"] is True
    assert {b["model"] for b in api.completions} == {MODEL}


def test_the_bench_fails_on_clear_errors_it_does_not_ask_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi() as api:
        assert run_main(tmp_path, api, monkeypatch, accept_only_the_interactive_key=True) == 1
    verdict = level(tmp_path)["verdict"]
    assert verdict["passed"] is False and verdict["succeeded"] > 0
    assert set(verdict["unexpected"]) == {"invalid_api_key"}
    err = capsys.readouterr().err
    assert "benchmarks.tiers: tiers: level 1x:" in err
    assert "clear errors the mix does not ask for, by code: {'invalid_api_key':" in err


def test_the_bench_stops_at_once_when_the_cluster_refuses_for_good(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi(Behaviour(refuse=(404, "model_not_found"))) as api:
        assert run_main(tmp_path, api, monkeypatch) == 1
    assert "404 model_not_found" in capsys.readouterr().err
    assert len(api.completions) == 1  # the readiness probe's, and no load
