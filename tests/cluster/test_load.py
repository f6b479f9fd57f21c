"""``tierserve.cluster.load`` (``tierserve-load``) against a fake server: without ``--model`` it
sends the model ``/v1/models`` names; it fails (exit status 1, the reasons on stderr, the verdict
in its report) when no request succeeded or when requests got clear errors it does not ask
for, such as ``model_not_found``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.fake_api import MODEL, Behaviour, FakeApi
from tierserve.cluster import load as loadgen
from tierserve.cluster.load import Result


def run(api: FakeApi, tmp_path: Path, *extra: str) -> int:
    return loadgen.main(["--url", api.url, "--metrics-url", "", "--concurrency", "2", "-n", "6",
                         "--prompt-len", "4", "--output-len", "3", "--no-plots",
                         "--no-progress", "--out-dir", str(tmp_path), *extra])


def report(tmp_path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((tmp_path / "load.json").read_text())
    return data


def test_without_a_model_it_sends_the_served_one_and_passes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi() as api:
        assert run(api, tmp_path) == 0
    assert {b["model"] for b in api.completions} == {MODEL} and len(api.completions) == 6
    rep = report(tmp_path)
    assert rep["model"] == MODEL and rep["requests"]["ok"] == 6
    assert rep["verdict"]["passed"] is True and rep["verdict"]["succeeded"] == 6
    assert "FAILED" not in capsys.readouterr().err


def test_a_model_the_server_does_not_serve_fails_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi() as api:
        assert run(api, tmp_path, "--model", "tierserve-tiny") == 1
    assert {b["model"] for b in api.completions} == {"tierserve-tiny"}
    err = capsys.readouterr().err
    assert "tierserve-load: FAILED: no request succeeded (6 sent" in err
    assert ("tierserve-load: FAILED: 6 clear errors the mix does not ask for, by code: "
            "{'model_not_found': 6}") in err
    verdict = report(tmp_path)["verdict"]  # the report is written all the same
    assert verdict["passed"] is False and verdict["unexpected"] == {"model_not_found": 6}


def test_a_server_that_answers_404_model_not_found_to_everything_fails_before_sending(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi(Behaviour(models_status=404, refuse=(404, "model_not_found"))) as api:
        assert run(api, tmp_path) == 1
    assert api.completions == []
    err = capsys.readouterr().err
    assert f"tierserve-load: {api.url}/v1/models answered 404" in err
    assert "model_not_found" in err and "(or pass --model)" in err
    assert not (tmp_path / "load.json").exists()


def test_a_run_where_nothing_succeeds_fails_though_its_errors_are_a_loaded_servers(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi(Behaviour(refuse=(429, "queue_full"))) as api:
        assert run(api, tmp_path, "-n", "4") == 1
    err = capsys.readouterr().err
    assert ("tierserve-load: FAILED: no request succeeded (4 sent; clear errors by code: "
            "{'queue_full': 4})") in err
    assert "does not ask for" not in err  # a full queue is what a load may get


def test_one_wrong_key_among_answers_fails_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi(Behaviour(only_key="good")) as api:
        rc = run(api, tmp_path, "--class", "a=1,key=good", "--class", "b=1,key=bad")
    assert rc == 1
    verdict = report(tmp_path)["verdict"]
    assert verdict["succeeded"] > 0 and set(verdict["unexpected"]) == {"invalid_api_key"}
    assert "by code: {'invalid_api_key':" in capsys.readouterr().err


def test_error_codes_count_refusals_and_stream_error_events() -> None:
    results = [
        Result(0, "a", 0.0, status=429, code="queue_full"),
        Result(1, "a", 0.0, status=404),  # no error body
        Result(2, "a", 0.0, status=200, error=loadgen.STREAM_ERROR + "replica_failed"),
        Result(3, "a", 0.0, status=200, error="timeout"),  # not a clear error: not judged
        Result(4, "a", 0.0, status=200, aborted=True),
    ]
    assert loadgen.error_codes(results) == {"HTTP 404": 1, "queue_full": 1, "replica_failed": 1}
    v = loadgen.run_verdict(results)
    assert v.succeeded == 1  # the stream the client hung up on, on purpose
    assert v.unexpected == {"HTTP 404": 1, "replica_failed": 1}
