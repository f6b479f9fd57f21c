"""``benchmarks.serving`` and ``benchmarks.startup``, which start their servers
themselves, against a fake server (the launcher replaced by a process that only sleeps): both
wait for the model ``/v1/models`` names and send that one; a completion refused for good
(``model_not_found``) stops the wait at once instead of after its timeout; an aiperf run with no
answer or with clear errors it does not ask for fails ``serving``."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import serving, startup
from tests.fake_api import MODEL, Behaviour, FakeApi
from tierserve.cluster.measure import RequestsFailed

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "cluster.yaml"


def _default_sigint() -> None:
    """In the stand-in process: Ctrl-C (``stop``'s SIGINT) ends it, as it ends the real
    launcher, even where the tests run with SIGINT ignored (a background job of a shell)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=_default_sigint)
    yield proc
    serving.stop(proc)


@pytest.fixture
def log(tmp_path: Path) -> Path:
    path = tmp_path / "server.log"
    path.write_text("the server's last words\n")
    return path


# ---------------------------------------------------------------------------------- serving


def test_wait_ready_returns_the_served_model_once_a_completion_of_it_is_answered(
        sleeper: subprocess.Popen[bytes], log: Path) -> None:
    with FakeApi() as api:
        assert serving.wait_ready(sleeper, api.url, log, timeout_s=30) == MODEL
    assert [b["model"] for b in api.completions] == [MODEL]


def test_wait_ready_stops_at_once_on_a_refusal_for_good(
        sleeper: subprocess.Popen[bytes], log: Path) -> None:
    with FakeApi(Behaviour(refuse=(404, "model_not_found"))) as api, pytest.raises(
            RequestsFailed, match=r"was refused: 404 model_not_found"):
        serving.wait_ready(sleeper, api.url, log, timeout_s=60)
    assert len(api.completions) == 1  # at once: no second try (not timed: a shared machine)
    with FakeApi(Behaviour(models=[])) as api, pytest.raises(RequestsFailed,
                                                             match="serves no model"):
        serving.wait_ready(sleeper, api.url, log, timeout_s=60)


def test_wait_ready_waits_while_nothing_names_a_model(
        sleeper: subprocess.Popen[bytes], log: Path) -> None:
    with FakeApi(Behaviour(models_status=503)) as api, pytest.raises(
            RuntimeError, match=r"did not answer within 1 s:\nthe server's last words") as e:
        serving.wait_ready(sleeper, api.url, log, timeout_s=0.6)
    assert not isinstance(e.value, RequestsFailed) and api.completions == []
    assert not serving.names_a_model(api.url, [])  # the server is gone: not yet, no error


def test_aiperf_is_sent_the_served_model(tmp_path: Path) -> None:
    cmd = serving.aiperf_command(tmp_path, "http://127.0.0.1:8000", tmp_path / "tok",
                                 serving.Load(), tmp_path / "out", "other-model")
    assert cmd[cmd.index("--model") + 1] == "other-model"


def _export(requests: float | None, errors: list[tuple[int, str, int]]) -> dict[str, Any]:
    report: dict[str, Any] = {"error_summary": [
        {"error_details": {"code": status, "type": "Bad Request", "message": message},
         "count": n} for status, message, n in errors]}
    if requests is not None:
        report["request_count"] = {"avg": requests}
    return report


NOT_FOUND = '{"error": {"message": "no", "type": "x", "code": "model_not_found", "param": null}}'
QUEUE_FULL = '{"error": {"message": "busy", "type": "x", "code": "queue_full", "param": null}}'


def test_aiperf_errors_by_code() -> None:
    report = _export(10, [(404, NOT_FOUND, 3), (429, QUEUE_FULL, 2), (502, "Bad Gateway", 1),
                          (404, NOT_FOUND, 1)])
    report["error_summary"].append({"error_details": {"type": "SSEResponseError",
                                                      "message": "broken"}, "count": 4})
    assert serving.aiperf_errors(report) == {"model_not_found": 4, "queue_full": 2,
                                             "HTTP 502": 1, "SSEResponseError": 4}
    assert serving.aiperf_errors({}) == {}


def test_an_aiperf_run_fails_on_no_answer_or_errors_it_does_not_ask_for() -> None:
    load = serving.Load(requests=16)
    assert serving.aiperf_verdict(_export(16, []), load).passed
    assert serving.aiperf_verdict(_export(14, [(429, QUEUE_FULL, 2)]), load).passed
    none = serving.aiperf_verdict(_export(None, [(404, NOT_FOUND, 16)]), load)
    assert none.reasons[0] == ("no request succeeded (16 sent; clear errors by code: "
                               "{'model_not_found': 16})")
    assert none.unexpected == {"model_not_found": 16}
    assert not serving.aiperf_verdict(_export(15, [(404, NOT_FOUND, 1)]), load).passed


def test_the_command_line_fails_when_a_run_failed(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    load = serving.Load(requests=16)
    good = serving.Result("vllm", 0, 90.0, serving.figures(_export(16, [])), None, MODEL,
                          serving.aiperf_verdict(_export(16, []), load))
    bad_export = _export(None, [(404, NOT_FOUND, 16)])
    bad = serving.Result("tierserve", 0, 9.0, serving.figures(bad_export), None, MODEL,
                         serving.aiperf_verdict(bad_export, load))
    results = {"tierserve": bad, "vllm": good}

    class Tokenizer:
        def save_pretrained(self, path: str) -> None:
            pass

    monkeypatch.setattr(serving, "tool_venv", lambda *a: tmp_path)
    monkeypatch.setattr("tierserve.replica.models.loader.load_tokenizer", lambda *a: Tokenizer())
    monkeypatch.setattr(serving, "run_one", lambda server, *a: results[server.label])
    monkeypatch.setattr(serving, "summarize", lambda rs: {})
    assert serving.main(["--json", str(tmp_path / "s.json")]) == 1
    err = capsys.readouterr().err
    assert ("benchmarks.serving: tierserve round 0: FAILED: no request succeeded "
            "(16 sent; clear errors by code: {'model_not_found': 16})") in err
    assert "vllm round 0: FAILED" not in err
    results["tierserve"] = good
    assert serving.main([]) == 0


# ---------------------------------------------------------------------------------- start-up


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's process replaced by one that sleeps (in its own process group, as
    ``stop`` expects); the fake server plays the cluster."""
    real = subprocess.Popen

    def popen(cmd: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        assert cmd[1:3] == ["-m", "tierserve.cluster.launch"]
        return real(["sleep", "60"], preexec_fn=_default_sigint, **kw)

    monkeypatch.setattr(startup.subprocess, "Popen", popen)


def config_on(tmp_path: Path, port: int) -> Path:
    config = yaml.safe_load(DEFAULT.read_text())
    config["http_options"]["port"] = port
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.usefixtures("no_launcher")
def test_startup_sends_the_served_model(tmp_path: Path) -> None:
    with FakeApi() as api:
        s = startup.measure("tierserve", 0, tmp_path / "c.yaml", api.port, tmp_path / "t.log")
    assert 0 < s.http_s <= s.ready_s
    assert [b["model"] for b in api.completions] == [MODEL]


@pytest.mark.usefixtures("no_launcher")
def test_startup_stops_at_once_on_a_refusal_for_good(tmp_path: Path) -> None:
    with FakeApi(Behaviour(refuse=(404, "model_not_found"))) as api, pytest.raises(
            RequestsFailed, match="404 model_not_found"):
        startup.measure("tierserve", 0, tmp_path / "c.yaml", api.port, tmp_path / "t.log")
    # At once: the first refusal ends the wait, no second try (no assertion on time: the
    # machine is shared).
    assert len(api.completions) == 1


@pytest.mark.usefixtures("no_launcher")
def test_the_startup_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with FakeApi() as api:
        assert startup.main(["--config", str(config_on(tmp_path, api.port)),
                             "--rounds", "1"]) == 0
    assert [b["model"] for b in api.completions] == [MODEL]
    with FakeApi(Behaviour(refuse=(404, "model_not_found"))) as api:
        assert startup.main(["--config", str(config_on(tmp_path, api.port)),
                             "--rounds", "1"]) == 1
    err = capsys.readouterr().err
    assert "benchmarks.startup: tierserve round 0:" in err and "model_not_found" in err
    with FakeApi(Behaviour(models=[])) as api:
        assert startup.main(["--config", str(config_on(tmp_path, api.port)),
                             "--rounds", "1"]) == 1
    assert "serves no model" in capsys.readouterr().err
