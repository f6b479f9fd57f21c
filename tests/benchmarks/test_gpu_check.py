"""``benchmarks.gpu_check``'s dry run (CPU, Triton interpreted, tiny shapes) writes every section, and
runs where the GPU image runs it: without pydantic and Ray, nothing downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import SECTIONS

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def hide(folder: Path, *packages: str) -> Path:
    """A folder that, first on ``PYTHONPATH``, makes ``packages`` fail to import."""
    for name in packages:
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(
            f"raise ImportError('{name} is hidden: the GPU image has none')\n")
    return folder


def dry_run(out: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out), *args],
        cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.read_text())
    assert list(data["sections"]) == list(SECTIONS)
    return data


def test_the_dry_run_writes_every_section_without_pydantic_or_ray(tmp_path: Path) -> None:
    shim = hide(tmp_path / "shim", "pydantic", "ray")
    data = dry_run(tmp_path / "out.json", env={
        "PYTHONPATH": os.pathsep.join([str(shim), os.environ.get("PYTHONPATH", "")]),
        # the suite's own pytest plugins may import pydantic; the GPU image has none of them
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    s = data["sections"]
    assert data["dry_run"] is True and data["ok"] is True
    for name in SECTIONS:
        assert isinstance(s[name]["seconds"], float)
    env = s["environment"]
    assert env["status"] == "ok" and env["torch"] and env["triton"] and env["device_name"]
    assert env["triton_interpret"] == "1" and env["copy_bandwidth_bytes_per_s"] > 0

    shapes = s["kernels_real_shapes"]
    assert shapes["status"] == "ok"
    got = {(c["head_dim"], c["q_heads"] // c["kv_heads"]) for c in shapes["cases"].values()}
    assert got == {(64, 3), (128, 4)}
    for case in shapes["cases"].values():
        for mode in ("fast", "deterministic"):
            assert case[mode]["kv_stored_as_reference"]
            assert case[mode]["max_abs_err"] <= case["tolerance"]

    step = s["model_step"]
    assert step["status"] == "ok" and [r["batch"] for r in step["rows"]] == [1, 2, 4]
    for row in step["rows"]:
        assert row["logits_finite"] and row["forward"]["median_ms"] > 0
        assert row["kv_bytes_read"] > 0 and row["kv_bytes_per_s"] > 0
        assert set(row["launches"]) >= {"gpu_kernels_per_step", "launch_calls_per_step"}
        assert row["graph"]["max_abs_diff_vs_eager"] == 0.0  # the same inputs, replayed eagerly

    sampler = s["sampler"]
    assert sampler["status"] == "ok" and sampler["checks"]
    assert all(v is True for v in sampler["checks"].values())

    e2e = s["engine_e2e"]
    assert e2e["status"] == "skipped" and "--wheels" in e2e["reason"]

    tests = s["kernel_tests"]
    assert tests["status"] == "ok" and tests["counts"]["passed"] > 0


def test_the_dry_run_serves_the_offline_engine_end_to_end(tmp_path: Path) -> None:
    others = ",".join(n for n in SECTIONS if n != "engine_e2e")
    e2e = dry_run(tmp_path / "out.json", "--skip", others)["sections"]["engine_e2e"]
    assert e2e["status"] == "ok", e2e
    assert e2e["checks"] == {
        "prompt_logprobs": True, "logprobs": True, "penalised_biased_sampling": True}
    assert e2e["all_full_length"] and e2e["output_tokens"] == e2e["prompts"] * 8
    assert e2e["kv_blocks"] == 64 and e2e["kv_pool_bytes"] > 0
    assert e2e["activation_source"] == "estimated" and not e2e["activation_subtracted"]


def test_unknown_sections_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "x.json"), "--skip", "nope"])
    assert e.value.code == 2


def test_wheels_are_installed_from_the_folder_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--wheels``: pip without an index (nothing downloaded), into a folder first on the path."""
    name, version = "tierserve_gpu_check_probe", "0.1"
    info = f"{name}-{version}.dist-info"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = {
        f"{name}.py": "VALUE = 42\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(wheels / f"{name}-{version}-py3-none-any.whl", "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    got = gpu_check.vendor_wheels(wheels)
    assert got["wheels"] == [f"{name}-{version}-py3-none-any.whl"]
    assert sys.path[0] == got["site"] and os.environ["PYTHONPATH"] == got["site"]
    probe = __import__(name)
    try:
        assert probe.VALUE == 42
    finally:
        sys.modules.pop(name, None)
    with pytest.raises(FileNotFoundError):
        gpu_check.vendor_wheels(tmp_path)
