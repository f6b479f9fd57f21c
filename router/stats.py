"""What a replica tells the router about its KV pool: the ``record_routing_stats`` contract.

The replica's deployment returns ``RoutingStats(...).to_dict()`` from ``record_routing_stats``;
Serve's controller calls it about once per ``request_routing_stats_period_s`` and hands the dict
to every router as ``RunningReplica.routing_stats`` (an empty dict until the first report).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from replica.api import EngineStats


@dataclass(frozen=True, slots=True)
class RoutingStats:
    """One snapshot of a replica's scheduler, taken at ``report_time``."""

    free_blocks: int  # KV blocks not held by any running request
    total_blocks: int  # KV blocks in the pool
    block_tokens: int  # positions per block
    waiting: int = 0  # requests in the waiting queue (including preempted ones)
    running: int = 0  # requests holding blocks
    preemptions: int = 0  # total since the replica started
    report_time: float = 0.0  # time.time() on the replica when the snapshot was taken
    # Blocks the waiting queue needs to be admitted: for each waiting request,
    # ceil((its tokens + 1) / block_tokens). 0 when the replica does not compute it.
    waiting_blocks: int = 0
    # Blocks every unfinished request (running or waiting) holds once it has generated all its
    # max_tokens: what the pool is promised. 0 when the replica does not compute it.
    committed_blocks: int = 0
    # 0 once the replica's engine has failed (Serve replaces it after its next health check;
    # until then the router sends it nothing it can avoid).
    alive: int = 1
    # For operators and tests (the router ignores them): engine steps run since the replica
    # started, and the replica process's resident memory.
    steps: int = 0
    rss_bytes: int = 0
    # Free blocks that hold a cached prefix (evictable; counted in free_blocks).
    cached_blocks: int = 0
    # SLO-aware steps: the last step's limit in ms (0: no target present) and how many more
    # decoding requests the step could carry within it (by max_num_seqs without a limit).
    step_limit_ms: int = 0
    seats: int = 0
    # The strictest TPOT target of its unfinished requests, in ms (0: none), and how many hold it.
    tpot_target_ms: int = 0
    target_requests: int = 0

    @classmethod
    def from_engine(cls, stats: EngineStats, report_time: float, alive: bool) -> RoutingStats:
        """The routing view of an engine's own stats."""
        return cls(
            free_blocks=stats.free_blocks,
            total_blocks=stats.total_blocks,
            block_tokens=stats.block_tokens,
            waiting=stats.waiting,
            running=stats.running,
            preemptions=stats.preemptions,
            report_time=report_time,
            waiting_blocks=stats.waiting_blocks,
            committed_blocks=stats.committed_blocks,
            alive=int(alive),
            steps=stats.steps,
            rss_bytes=stats.rss_bytes,
            cached_blocks=stats.cached_blocks,
            step_limit_ms=round(stats.step_limit_s * 1000),
            seats=stats.seats,
            tpot_target_ms=round(stats.tpot_target_s * 1000),
            target_requests=stats.target_requests,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (ints and one float)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RoutingStats | None:
        """Parse a report; ``None`` for an empty dict (no report yet).

        Unknown keys are ignored (a newer replica may report more). Raises ``ValueError`` when a
        non-empty dict lacks a required key or holds a value of the wrong kind.
        """
        if not data:
            return None
        required = ("free_blocks", "total_blocks", "block_tokens", "report_time")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"routing stats lack {', '.join(missing)}: got keys {sorted(data)}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            raw = data[f.name]
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise ValueError(f"routing stats field {f.name} must be a number, got {raw!r}")
            if f.name == "report_time":
                values[f.name] = float(raw)
            else:
                if not math.isfinite(raw) or raw != int(raw):
                    raise ValueError(
                        f"routing stats field {f.name} must be an integer, got {raw!r}"
                    )
                values[f.name] = int(raw)
        if values["block_tokens"] <= 0:
            raise ValueError(
                f"routing stats block_tokens must be positive, got {values['block_tokens']}"
            )
        return cls(**values)
