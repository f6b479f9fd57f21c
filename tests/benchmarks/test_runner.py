"""benchmarks.runner's own logic (its figures are run by hand: ``python -m benchmarks.runner``): the busy
neighbour process it can run beside the measurement, and bad arguments refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import runner
from benchmarks.common import process_cpu_seconds


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_busy_neighbour_spins_while_the_block_runs_and_is_gone_after() -> None:
    with runner.busy_neighbour(0.5) as proc:
        assert proc is not None and proc.poll() is None
        time.sleep(1.0)  # past its interpreter's start-up, which uses CPU of its own
        start, t0 = process_cpu_seconds(proc.pid), time.perf_counter()
        time.sleep(1.0)
        share = (process_cpu_seconds(proc.pid) - start) / (time.perf_counter() - t0)
        # Half of every 10 ms on a machine with a core to spare; well above nothing even when
        # the machine is busy (a loop that never spun would use next to no CPU).
        assert share > 0.1, share
    assert proc.poll() is not None  # killed and reaped at the end of the block


def test_the_busy_neighbour_stops_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="inside"), runner.busy_neighbour(0.3) as proc:
        raise RuntimeError("inside")
    assert proc is not None and proc.poll() is not None


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
    (["--models", "tiny,nope"], "unknown model 'nope'"),
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


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_the_busy_neighbour_stops_by_itself_when_the_benchmark_is_killed() -> None:
    code = ("import sys, time\nfrom benchmarks import runner\n"
            "with runner.busy_neighbour(0.2) as p:\n"
            "    print(p.pid, flush=True)\n    time.sleep(60)\n")
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert bench.stdout is not None
        neighbour = int(bench.stdout.readline())
        assert _running(neighbour)
        bench.send_signal(signal.SIGKILL)  # no finally runs in the benchmark
        bench.wait()
        for _ in range(100):
            if not _running(neighbour):
                break
            time.sleep(0.05)
        assert not _running(neighbour)
    finally:
        bench.kill()
