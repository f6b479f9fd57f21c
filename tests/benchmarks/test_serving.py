"""``benchmarks.serving``'s own logic (the servers and aiperf run by hand: ``python -m benchmarks.serving``):
aiperf's export read into figures, the medians and targets, and bad arguments refused before
anything starts."""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from benchmarks import serving


def _export(ttft: tuple[float, float], itl: tuple[float, float], req_s: float) -> dict[str, object]:
    return {
        "request_count": {"avg": 16},
        "time_to_first_token": {"p50": ttft[0], "p99": ttft[1], "unit": "ms"},
        "inter_token_latency": {"p50": itl[0], "p99": itl[1], "unit": "ms"},
        "request_throughput": {"avg": req_s},
        "output_token_throughput": {"avg": req_s * 64},
    }


def test_figures_read_aiperfs_export_and_a_missing_metric_is_nan() -> None:
    f = serving.figures(_export((120.0, 900.0), (40.0, 85.0), 0.5))
    assert f == {"requests": 16.0, "ttft_p50_ms": 120.0, "ttft_p99_ms": 900.0,
                 "itl_p50_ms": 40.0, "itl_p99_ms": 85.0, "req_s": 0.5, "out_tok_s": 32.0}
    assert math.isnan(serving.figures({})["ttft_p99_ms"])


def test_summary_takes_medians_per_system_and_compares_with_vllm() -> None:
    runs = [
        serving.Result("tierserve", 0, 8.0, serving.figures(_export((100, 800), (30, 60), 0.6))),
        serving.Result("tierserve", 1, 12.0, serving.figures(_export((140, 1000), (34, 70), 0.5))),
        serving.Result("tierserve", 2, 9.0, serving.figures(_export((120, 700), (32, 65), 0.7))),
        serving.Result("vllm", 0, 150.0, serving.figures(_export((200, 900), (40, 80), 0.4))),
    ]
    s = serving.summarize(runs)
    assert s["tierserve"]["ttft_p99_ms"] == 800 and s["tierserve"]["startup_s"] == 9.0
    t = s["targets"]["tierserve"]
    assert t["ttft_p99_vs_vllm"] == pytest.approx(800 / 900)
    assert t["itl_p50_vs_vllm"] == pytest.approx(32 / 40)
    assert t["ttft_p99_met"] and t["itl_p50_met"] and t["startup_met"]
    slow = [serving.Result("tierserve", 0, 11.0, runs[0].figures), runs[3]]
    assert not serving.summarize(slow)["targets"]["tierserve"]["startup_met"]
    assert "targets" not in serving.summarize(runs[:3])  # one system: nothing to compare


def test_each_tierserve_config_is_its_own_server_compared_with_vllm() -> None:
    one = serving.servers(["tierserve", "vllm"], ["configs/cluster.yaml"])
    assert [(s.label, s.system, s.config) for s in one] == [
        ("tierserve", "tierserve", "configs/cluster.yaml"), ("vllm", "vllm", None)]
    two = serving.servers(["vllm", "tierserve"], ["configs/cluster.yaml", "x/cpu-single.yaml"])
    assert [s.label for s in two] == ["vllm", "tierserve:cluster", "tierserve:cpu-single"]
    fig = serving.figures(_export((100, 800), (30, 60), 0.6))
    slow = serving.figures(_export((100, 1200), (30, 60), 0.6))
    s = serving.summarize([serving.Result("tierserve:cluster", 0, 9.0, slow),
                           serving.Result("tierserve:cpu-single", 0, 9.0, fig),
                           serving.Result("vllm", 0, 90.0, serving.figures(
                               _export((200, 900), (40, 80), 0.4)))])
    assert not s["targets"]["tierserve:cluster"]["ttft_p99_met"]
    assert s["targets"]["tierserve:cpu-single"]["ttft_p99_met"]


@pytest.mark.parametrize("argv, message", [
    (["--config", "configs/no-such.yaml"], "--config configs/no-such.yaml: no such file"),
    (["--systems", "tierserve,sglang"], "--systems takes tierserve, vllm"),
    (["--systems", ","], "--systems takes"),
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--pace", "-1"], "--pace must be a finite number of requests per second, 0 or more"),
    (["--pace", "nan"], "--pace must be a finite number"),
    (["--pace", "inf"], "--pace must be a finite number"),
])
def test_bad_arguments_are_refused_before_anything_starts(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "tool_venv", lambda *a: pytest.fail("started"))
    with pytest.raises(SystemExit) as exc:
        serving.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_aiperf_is_paced_under_the_concurrency_cap_unless_told_not_to(tmp_path: Path) -> None:
    def cmd(load: serving.Load) -> list[str]:
        return serving.aiperf_command(tmp_path, "http://127.0.0.1:8000", tmp_path / "tok", load,
                                      tmp_path / "out")

    paced = cmd(serving.Load())
    assert paced[paced.index("--concurrency") + 1] == "8"
    assert paced[paced.index("--request-rate") + 1] == "20.0"
    assert paced[paced.index("--arrival-pattern") + 1] == "constant"
    slow = cmd(serving.Load(pace=2.5))
    assert slow[slow.index("--request-rate") + 1] == "2.5"
    unpaced = cmd(serving.Load(pace=0))
    assert "--request-rate" not in unpaced and "--arrival-pattern" not in unpaced
    assert unpaced == paced[:paced.index("--request-rate")]


def test_answers_is_a_200_and_a_connection_error_is_a_no() -> None:
    assert serving.answers(lambda: httpx.Response(200))
    assert not serving.answers(lambda: httpx.Response(503))

    def refused() -> httpx.Response:
        raise httpx.ConnectError("refused")

    assert not serving.answers(refused)


def test_wait_for_returns_once_ready_and_says_why_it_gave_up(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("line one\nthe last words\n")
    alive = subprocess.Popen(["sleep", "30"])
    try:
        calls = iter([False, False, True])
        serving.wait_for(alive, lambda: next(calls), log, time.perf_counter(), 30, poll_s=0.01)
        with pytest.raises(RuntimeError, match=r"the launcher did not answer within 0 s:\n"
                                               r"line one\nthe last words"):
            serving.wait_for(alive, lambda: False, log, time.perf_counter(), 0.2,
                             "the launcher", poll_s=0.01)
    finally:
        alive.kill()
        alive.wait()
    dead = subprocess.Popen(["sh", "-c", "exit 3"])
    dead.wait()
    with pytest.raises(RuntimeError, match=r"(?s)the server exited \(3\):\n.*the last words"):
        serving.wait_for(dead, lambda: pytest.fail("polled a dead server"), log,
                         time.perf_counter(), 30)
