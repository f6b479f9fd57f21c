"""Suite-wide hooks.

Every test that is marked neither ``ray`` nor ``model`` is marked ``unit`` (the markers are
pyproject.toml's).

The process ends with ``os._exit`` once pytest has finished and printed its summary: the test
session starts and stops several Ray instances (and Serve handles, whose routers run threads in
this process), and Python's own teardown of those native libraries at interpreter exit crashed
once on CI with a segmentation fault after every test had passed. Skipping that teardown keeps
pytest's exit status as the process's, and nothing is left to flush (stdout and stderr are flushed
first).
"""

from __future__ import annotations

import os
import sys

import pytest

_status: list[int] = []


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The CPU the suite runs on (the deterministic mode's tests must pass on every one)."""
    import platform

    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return [
        f"cpu: {model}; torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    ]


LEVELS = ("ray", "model")  # the markers of a test that is not a unit test


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked neither ``ray`` (it starts a Ray cluster) nor ``model`` (it loads the real
    model) is a unit test: marked ``unit`` here, so ``-m unit`` selects it (``make test-fast``
    runs ``-m "unit and not slow"``)."""
    for item in items:
        if not any(item.get_closest_marker(level) for level in LEVELS):
            item.add_marker(pytest.mark.unit)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if not _status or os.environ.get("TIERSERVE_NORMAL_EXIT"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status[-1])
