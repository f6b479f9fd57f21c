"""benchmarks.profile_ops: every op of the forward is timed, inside the forward's own time."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.profile_ops import main, profile
from benchmarks.throughput import tiny_checkpoint


def test_the_op_table_covers_the_forward(tmp_path: Path) -> None:
    out = profile(tiny_checkpoint(tmp_path / "tiny"), "shared", 5)
    ops = {r["op"]: r for r in out["ops"]}
    assert out["generated_tokens"] > 0 and out["steps"] > 0
    assert out["prefix_hit_tokens"] > 0  # request 4 shares request 0's prefix
    linear = [r for k, r in ops.items() if k.startswith("linear ")]
    assert linear and all(r["calls"] > 0 and r["gflops"] > 0 for r in linear)
    assert any(k.startswith("attention, ") for k in ops)
    # The ops are timed inside the forward: together they never exceed it (``rest`` is what is
    # left of it, so it is not negative).
    assert all(0 < r["share"] <= 1 for k, r in ops.items() if k != "rest")
    assert ops["rest"]["seconds"] >= 0


def test_the_cli_refuses_no_requests(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--model", "tiny", "--requests", "0"])
    assert exc.value.code == 2
    assert "--requests must be at least 1, got 0" in capsys.readouterr().err
