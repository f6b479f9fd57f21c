"""The ``vllm bench serve`` driver's command line and its reading of vLLM's result file (no vLLM
here: the run itself is ``make bench-vllm``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import vllm_bench


def _args(**over: object) -> argparse.Namespace:
    base = {"input_len": 128, "output_len": 32, "num_prompts": 64, "max_concurrency": 16, "seed": 0}
    return argparse.Namespace(**(base | over))


@pytest.mark.parametrize(("endpoint", "backend", "route"), [
    ("completions", "openai", "/v1/completions"),
    ("chat", "openai-chat", "/v1/chat/completions"),
])
def test_command_names_the_endpoint_and_the_random_dataset(endpoint: str, backend: str,
                                                           route: str, tmp_path: Path) -> None:
    cmd = vllm_bench.bench_command(Path("/v/bin/python"), "http://h:8000", "m", tmp_path / "tok",
                                   endpoint, _args(num_prompts=7), tmp_path)
    assert cmd[:4] == ["/v/bin/python", str(vllm_bench.CLI), "bench", "serve"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert (value("--backend"), value("--endpoint")) == (backend, route)
    assert value("--dataset-name") == "random" and value("--num-prompts") == "7"
    assert value("--base-url") == "http://h:8000" and value("--model") == "m"
    assert value("--result-filename") == f"{endpoint}.json" and "--ignore-eos" in cmd


def _result(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "num_prompts": 4, "completed": 4, "failed": 0, "duration": 2.0,
        "request_throughput": 2.0, "output_throughput": 64.0, "p50_ttft_ms": 10.0,
        "p99_ttft_ms": 30.0, "p50_tpot_ms": 5.0, "p99_tpot_ms": 9.0, "errors": ["", "", "", ""]}
    return base | over


def test_a_clean_run_is_ok(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    run = vllm_bench.read_result("chat", path)
    assert run.ok and run.errors == [] and run.output_throughput == 64.0
    assert "4/4 completed, 0 failed" in vllm_bench.fmt(run)


@pytest.mark.parametrize("over", [
    {"completed": 3, "failed": 1, "errors": ["", "", "", "HTTP 500: boom"]},
    {"completed": 3, "failed": 0},  # a request neither completed nor counted failed
])
def test_a_failed_or_missing_request_fails_the_run(over: dict[str, object], tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result(**over)))
    run = vllm_bench.read_result("completions", path)
    assert not run.ok
    assert run.errors == [e for e in over.get("errors", []) if e]  # type: ignore[attr-defined]


def test_an_unknown_endpoint_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        vllm_bench.main(["--endpoints", "completions,embeddings"])
    assert "unknown endpoint(s) ['embeddings']" in capsys.readouterr().err
