"""A simulated replica for router tests and benchmarks: block accounting and a step-time model.

``SimCore`` is the engine without a model (Ray-free): a KV pool counted in blocks, admission by
free blocks, a waiting queue ordered by priority then arrival, decodes that grow by a block when
they need one and preempt (by recompute) the lowest-ranked running request when the pool is out,
and one token per running request per step. A step of ``t`` tokens takes ``base_s + per_token_s * t``.

``SimEngine`` is the Serve deployment around it, with the same ``generate`` and
``record_routing_stats`` as the real replica. ``pool_blocks`` may be a list: replica ``rank``
takes ``pool_blocks[rank % len(pool_blocks)]``, so one deployment can mix pool sizes. Its report
also carries ``rejections`` (requests ``SimCore.add`` refused; the router ignores the key), and
``stream_every`` thins the stream for benchmarks (the first and last token always come).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from router.policy import blocks_for
from router.stats import RoutingStats

ROUTER_CLASS = "router.free_blocks_router:FreeKVBlocksRouter"


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds one engine step takes for the tokens it processes."""

    base_s: float = 0.004
    per_token_s: float = 0.0001

    def step_time(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


@dataclass(slots=True)
class _Seq:
    id: int
    prompt: int
    max_tokens: int
    priority: int
    generated: int = 0
    blocks: int = 0
    running: bool = False

    @property
    def rank(self) -> tuple[int, int]:
        return (-self.priority, self.id)  # higher priority first, then older


class SimCore:
    """The scheduler of a replica, without a model. Not thread-safe: use from one loop."""

    def __init__(
        self,
        total_blocks: int,
        block_tokens: int = 16,
        max_seqs: int = 16,
        max_waiting: int = 256,
        model: StepModel | None = None,
    ) -> None:
        if total_blocks <= 0 or block_tokens <= 0 or max_seqs <= 0:
            raise ValueError("total_blocks, block_tokens and max_seqs must be positive")
        self.total_blocks = total_blocks
        self.block_tokens = block_tokens
        self.max_seqs = max_seqs
        self.max_waiting = max_waiting
        self.model = model or StepModel()
        self.free_blocks = total_blocks
        self.preemptions = 0
        self.rejections = 0  # requests add() refused (never fits, queue full)
        self._next_id = 0
        self._seqs: dict[int, _Seq] = {}
        self._waiting: list[tuple[tuple[int, int], int]] = []  # heap of (rank, id); lazy deletion
        self._running: list[_Seq] = []  # best rank first

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    def add(self, prompt_tokens: int, max_tokens: int, priority: int = 0) -> int:
        """Queue a request; ``ValueError`` if it can never fit or the queue is full."""
        if prompt_tokens <= 0 or max_tokens <= 0:
            raise ValueError(
                f"prompt_tokens and max_tokens must be positive, got {prompt_tokens}, {max_tokens}"
            )
        need = blocks_for(prompt_tokens + max_tokens, self.block_tokens)
        if need > self.total_blocks:
            self.rejections += 1
            raise ValueError(f"request needs {need} blocks; this pool has {self.total_blocks}")
        if self.waiting >= self.max_waiting:
            self.rejections += 1
            raise ValueError(f"waiting queue is full ({self.max_waiting})")
        seq = _Seq(self._next_id, prompt_tokens, max_tokens, priority)
        self._next_id += 1
        self._seqs[seq.id] = seq
        heapq.heappush(self._waiting, (seq.rank, seq.id))
        return seq.id

    def abort(self, id: int) -> None:
        seq = self._seqs.pop(id, None)
        if seq is not None and seq.running:
            self._running.remove(seq)
            self._release(seq)

    @property
    def waiting(self) -> int:
        return len(self._seqs) - len(self._running)

    def _release(self, seq: _Seq) -> None:
        self.free_blocks += seq.blocks
        seq.blocks = 0
        seq.running = False

    def _preempt(self, victim: _Seq) -> None:
        self._running.remove(victim)
        self._release(victim)
        heapq.heappush(self._waiting, (victim.rank, victim.id))
        self.preemptions += 1

    def _need(self, seq: _Seq) -> int:
        """Blocks for every token the request has plus the one it makes next."""
        return blocks_for(seq.prompt + seq.generated + 1, self.block_tokens)

    def step(self) -> tuple[float, list[tuple[int, int, bool]]]:
        """One step: ``(seconds it takes, [(request id, token, finished)])``."""
        tokens = 0
        fed: list[_Seq] = []
        # Decodes, best rank first; out of blocks: preempt from the bottom (recompute later).
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            grow = self._need(seq) - seq.blocks
            while grow > self.free_blocks and self._running[-1] is not seq:
                self._preempt(self._running[-1])
            if grow > self.free_blocks:
                self._preempt(seq)
                break
            self.free_blocks -= grow
            seq.blocks += grow
            fed.append(seq)
            tokens += 1
            i += 1
        # Admissions in rank order, all or nothing, no skipping ahead.
        while self._waiting and len(self._running) < self.max_seqs:
            _, id = self._waiting[0]
            head = self._seqs.get(id)
            if head is None or head.running:
                heapq.heappop(self._waiting)  # aborted or stale
                continue
            need = self._need(head)
            if need > self.free_blocks:
                break
            heapq.heappop(self._waiting)
            self.free_blocks -= need
            head.blocks = need
            head.running = True
            self._running.append(head)
            self._running.sort(key=lambda s: s.rank)
            fed.append(head)
            tokens += head.prompt + head.generated  # prefill (or recompute)
        events: list[tuple[int, int, bool]] = []
        for seq in fed:
            seq.generated += 1
            done = seq.generated >= seq.max_tokens
            events.append((seq.id, seq.generated % 256, done))
            if done:
                self._running.remove(seq)
                self._release(seq)
                del self._seqs[seq.id]
        return self.model.step_time(tokens), events

    def stats(self, now: float) -> RoutingStats:
        waiting = [s for s in self._seqs.values() if not s.running]
        return RoutingStats(
            free_blocks=self.free_blocks,
            total_blocks=self.total_blocks,
            block_tokens=self.block_tokens,
            waiting=len(waiting),
            running=len(self._running),
            preemptions=self.preemptions,
            report_time=now,
            waiting_blocks=sum(self._need(s) for s in waiting),
            committed_blocks=sum(
                blocks_for(s.prompt + s.max_tokens, self.block_tokens) for s in self._seqs.values()
            ),
        )


def _replica_rank() -> int:
    try:
        rank: Any = serve.get_replica_context().rank
    except RayServeException:
        return 0  # not inside a replica
    value = getattr(rank, "rank", rank)
    return value if isinstance(value, int) else 0


@serve.deployment(
    max_ongoing_requests=1000,
    ray_actor_options={"num_cpus": 0},
    request_router_config={
        "request_router_class": ROUTER_CLASS,
        "request_routing_stats_period_s": 1,
    },
)
class SimEngine:
    """A replica whose engine is ``SimCore`` stepping in an asyncio task."""

    def __init__(
        self,
        pool_blocks: int | Sequence[int] = 256,
        block_tokens: int = 16,
        max_seqs: int = 16,
        max_waiting: int = 256,
        step_base_s: float = 0.004,
        step_per_token_s: float = 0.0001,
        stream_every: int = 1,
    ) -> None:
        if stream_every <= 0:
            raise ValueError(f"stream_every must be positive, got {stream_every}")
        self.stream_every = stream_every
        rank = _replica_rank()
        total = (
            pool_blocks if isinstance(pool_blocks, int) else pool_blocks[rank % len(pool_blocks)]
        )
        self.core = SimCore(
            total, block_tokens, max_seqs, max_waiting, StepModel(step_base_s, step_per_token_s)
        )
        try:
            self.name = serve.get_replica_context().replica_tag
        except RayServeException:
            self.name = f"sim-{rank}"
        self._sinks: dict[int, asyncio.Queue[tuple[int, bool]]] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.Task[None] | None = None

    def _kick(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            if not self.core.has_work:
                self._wake.clear()
                await self._wake.wait()
                continue
            seconds, events = self.core.step()
            await asyncio.sleep(seconds)
            for id, token, done in events:
                sink = self._sinks.get(id)
                if sink is not None:
                    sink.put_nowait((token, done))

    async def generate(
        self,
        prompt_ids: Sequence[int],
        sampling: Any = None,
        *,
        priority: int = 0,
        prompt_tokens: int | None = None,
        max_tokens: int = 16,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream ``{"token", "tokens", "replica", "total_blocks", "arrived", "at"}`` per token.

        ``tokens`` counts the tokens generated so far; ``arrived`` is ``time.time()`` when the call
        reached the replica, ``at`` when the token was handed to the stream. With ``stream_every`` k > 1 only the first token, every k-th and the
        last are sent.
        """
        arrived = time.time()
        n = prompt_tokens if prompt_tokens is not None else len(prompt_ids)
        id = self.core.add(n, max_tokens, priority)
        sink: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        self._sinks[id] = sink
        self._kick()
        done = False
        count = 0
        try:
            while not done:
                token, done = await sink.get()
                count += 1
                if count == 1 or done or count % self.stream_every == 0:
                    yield {
                        "token": token,
                        "tokens": count,
                        "replica": self.name,
                        "total_blocks": self.core.total_blocks,
                        "arrived": arrived,
                        "at": time.time(),
                    }
        finally:
            self._sinks.pop(id, None)
            if not done:
                self.core.abort(id)

    async def record_routing_stats(self) -> dict[str, Any]:
        return {**self.core.stats(time.time()).to_dict(), "rejections": self.core.rejections}


@serve.deployment(ray_actor_options={"num_cpus": 0})
class SimClient:
    """Load from inside the cluster, as the ingress sends it: its handle's router is the one used.

    Calls made while serving one request share that request's ``internal_request_id``.
    """

    def __init__(self, engine: DeploymentHandle) -> None:
        self.engine = engine.options(stream=True)

    async def _one(self, prompt_tokens: int, max_tokens: int, priority: int) -> dict[str, Any]:
        stream = self.engine.generate.remote(
            [1] * prompt_tokens,
            None,
            priority=priority,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
        )
        assert isinstance(stream, DeploymentResponseGenerator)
        items = [item async for item in stream]
        return {
            "replica": items[-1]["replica"],
            "total_blocks": items[-1]["total_blocks"],
            "tokens": len(items),
        }

    async def run(
        self, n: int, prompt_tokens: int, max_tokens: int, priority: int = 0
    ) -> list[dict[str, Any]]:
        """``n`` concurrent streaming calls; per call: replica, its pool size, tokens received."""
        calls = [self._one(prompt_tokens, max_tokens, priority) for _ in range(n)]
        return list(await asyncio.gather(*calls))
