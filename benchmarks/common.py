"""What the benchmarks share beyond ``tierserve.cluster.measure`` (the machine record, the one
percentile, plotting and the HTTP tools' checks, which the installed load generator needs too
and so live in the package):

- ``process_cpu_seconds(pid)``: the CPU time a process has used, from ``/proc`` (the runner
  benchmark's busy neighbour is checked with it).
"""

from __future__ import annotations

import os


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) process ``pid`` has used so far, from ``/proc`` (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
