"""bench.runner's own logic (its figures are run by hand: ``python -m bench.runner``): the busy
neighbour process it can run beside the measurement, and bad arguments refused."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from bench import runner


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_busy_neighbour_spins_while_the_block_runs_and_is_gone_after() -> None:
    with runner.busy_neighbour(0.5) as proc:
        assert proc is not None and proc.poll() is None
        start = _cpu_ticks(proc.pid)
        for _ in range(200):  # it uses CPU (half of every 10 ms): wait until some is counted
            if _cpu_ticks(proc.pid) > start:
                break
            time.sleep(0.05)
        assert _cpu_ticks(proc.pid) > start
    assert proc.poll() is not None  # killed and reaped at the end of the block


def test_no_neighbour_for_zero_and_bad_fractions_refused() -> None:
    with runner.busy_neighbour(0.0) as proc:
        assert proc is None
    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="busy fraction must be in"), runner.busy_neighbour(bad):
            pass


@pytest.mark.parametrize("argv, message", [
    (["--busy", "1"], "--busy takes a fraction in [0, 1)"),
    (["--busy", "-0.5"], "--busy takes a fraction in [0, 1)"),
    (["--batches", "1,x"], "--batches takes a comma list of sizes"),
    (["--batches", "0,8"], "--batches takes sizes of 1 or more"),
    (["--models", "nope"], "unknown model 'nope'"),
])
def test_bad_arguments_are_refused(argv: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        runner.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_quick_run_on_the_tiny_model_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "runner.json"
    assert runner.main(["--quick", "--models", "tiny", "--batches", "1,2", "--prefill", "16",
                        "--busy", "0.2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["busy_neighbour"] == 0.2
    cases = [r["case"] for r in data["rows"]]
    assert cases == ["decode x1 (ctx 128)", "decode x2 (ctx 128)", "prefill 16"]
    assert all(r["default_ms"] > 0 and r["det_ms"] > 0 for r in data["rows"])
