"""What every benchmark and tool of ``bench/`` shares: the machine record, percentiles, plotting.

- ``machine(**extra)``: the machine a figure was measured on (CPU model, cores, memory, Python,
  platform, the load average at the start and, where torch imports, its version, its thread
  count and the CPU capability its kernels dispatch to). A benchmark adds its own keys through
  ``extra``; ``load_avg_1m()`` reads the load again at the end.
- ``percentile(values, q)``: one definition of a percentile for every figure (linear
  interpolation between the closest ranks, numpy's default), so that a p99 of one tool compares
  with a p99 of another.
- ``pyplot()``: matplotlib on its file-only backend (a benchmark runs without a display).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
from collections.abc import Iterable
from types import ModuleType
from typing import Any


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    model = platform.processor() or platform.machine() or "unknown"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo", encoding="utf-8") as f:
        model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return model


def load_avg_1m() -> float:
    """The 1-minute load average (NaN where the OS has none): other work on the machine adds
    noise to every timing, so each run records it before and after."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; a container may allow fewer than the
    machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def torch_record() -> dict[str, Any]:
    """torch's version, threads and CPU capability; empty where torch does not import."""
    try:
        import torch
    except ImportError:
        return {}
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def machine(*, torch_info: bool = True, **extra: Any) -> dict[str, Any]:
    """The machine record of a run, with the benchmark's own keys (``extra``) last.

    ``torch_info=False`` leaves torch out: the HTTP tools (load, soak) have no use for it and
    should not pay its import.
    """
    record: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable_cores(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m_before": load_avg_1m(),
    }
    if torch_info:
        record.update(torch_record())
    record.update(extra)
    return record


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used so far, from ``/proc`` (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, NaNs left out; NaN when none is left.

    Linear interpolation between the closest ranks (numpy's default method).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    frac = k - lo
    if frac == 0 or xs[lo] == xs[hi]:  # keeps an inf (never served) from turning into NaN
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (PNG files, no display); ``ImportError`` when
    matplotlib is not installed (it comes with the ``dev`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
