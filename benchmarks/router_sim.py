"""A simulated replica for the router's tests and benchmarks (``benchmarks.router``,
``benchmarks.prefix``): the real scheduler, a step-time model.

``SimCore`` is a replica's engine without a model (Ray-free): the replica's own
``tierserve.replica.scheduler.Scheduler`` over the pool a replica builds (``FreeListBlocks``, or the
prefix cache ``tierserve.replica.prefix_cache.PrefixCachingBlocks`` with ``enable_prefix_caching``,
which ``sim_config`` leaves off unless asked; here ``SimPrefixCache``, which also tells a
benchmark's oracle what it holds), configured by a ``tierserve.replica.config.EngineConfig`` as a
real replica is (``num_kv_blocks``, ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
``max_waiting``, ``scheduling_policy``, ``aging_steps``, ``prefill_chunk_tokens``,
``max_model_len``). A prompt is a length (every position ``TOKEN``) or real token ids (what a prefix
cache tells apart); a cached prefix is not computed, so it costs no step time. So admission by free
blocks, priority with aging, chunked prefill, preemption by recompute and the refusals
(``tierserve.replica.scheduler.AdmitError``) are the ones the replicas run. In place of the forward
pass a step of ``t`` tokens takes ``base_s + per_token_s * t`` (``StepModel``); every sampled row
gets the same token, and a request ends at its ``max_tokens``.

``SimEngine`` is the Serve deployment around it, with the same ``generate`` and
``record_routing_stats`` as the real replica (``tierserve.replica.deployment.LLMServer``): it takes
one ``tierserve.records.GenerateRequest`` (the router sizes it from that record, as for a real
replica) and streams ``SimOutput`` deltas (``tierserve.records.RequestOutput`` with the replica's
name and timestamps) or one ``ErrorRecord`` for a request the scheduler refuses. It runs one sample
per request and does not apply ``queue_share``. ``pool_blocks`` may be a list: replica ``rank``
takes ``pool_blocks[rank % len(pool_blocks)]``, so one deployment can mix pool sizes. Its report
also carries ``rejections`` (requests ``SimCore.add`` refused; the router ignores the key), and
``stream_every`` thins the stream for benchmarks (the first and last token always come).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tierserve.records import (
    ErrorRecord,
    GenerateRequest,
    RequestOutput,
    RoutingStats,
    SamplingParams,
)
from tierserve.replica.block_space import BlockSpace, FreeListBlocks
from tierserve.replica.config import CONTEXT_CAP, EngineConfig
from tierserve.replica.prefix_cache import PrefixCachingBlocks
from tierserve.replica.scheduler import (
    AdmitError,
    FinishedEvent,
    Request,
    SampledToken,
    Scheduler,
    StepPlan,
    TokenEvent,
)

ROUTER_CLASS = "tierserve.router.free_blocks_router:FreeKVBlocksRouter"

# The token of every sampled row, and of every prompt position of a prompt given as a length.
TOKEN = 1

# SimEngine's replica unless told otherwise: a small pool and batch (EngineConfig's defaults
# for the rest).
SIM_POOL_BLOCKS = 256
SIM_MAX_NUM_SEQS = 16


@dataclass(frozen=True, slots=True)
class StepModel:
    """Seconds one engine step takes for the tokens it processes."""

    base_s: float = 0.004
    per_token_s: float = 0.0001

    def step_time(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens


def sim_config(total_blocks: int, **fields: Any) -> EngineConfig:
    """The engine config of a simulated replica with ``total_blocks`` KV blocks; ``fields`` are
    any other ``EngineConfig`` fields (validated as in a real replica's config). The prefix cache
    is off unless ``enable_prefix_caching`` is given (prompts given as lengths are all alike)."""
    return EngineConfig(num_kv_blocks=total_blocks, **{"enable_prefix_caching": False, **fields})


@dataclass(slots=True)
class SimOutput(RequestOutput):
    """A simulated replica's delta: a ``RequestOutput`` and where and when it was made.

    ``replica``: the replica's name; ``total_blocks``: its pool; ``arrived``: ``time.time()``
    when the call reached the replica; ``at``: when the delta was handed to the stream."""

    replica: str = ""
    total_blocks: int = 0
    arrived: float = 0.0
    at: float = 0.0


class SimPrefixCache(PrefixCachingBlocks):
    """The replica's prefix cache, which also says how much of a prompt it holds (the oracle
    router of ``benchmarks.router`` asks; a replica never does)."""

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Positions of ``tokens`` that ``allocate`` would find cached now (no change)."""
        return len(self._matches(tokens)[0]) * self.block_size


def sampled(plan: StepPlan) -> list[SampledToken]:
    """What the model would hand back for ``plan``: a token per decode and per last chunk."""
    outs = [SampledToken(rid, TOKEN) for rid in plan.decode]
    outs += [SampledToken(c.id, TOKEN) for c in plan.prefill if c.last]
    return outs


class SimCore:
    """The scheduler of a replica with a step-time model. Not thread-safe: use from one loop."""

    def __init__(
        self,
        cfg: EngineConfig,
        model: StepModel | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """A pool of ``cfg.num_kv_blocks`` blocks (required: there is no memory to size it
        from); the context is ``max_model_len``, else ``cfg.max_model_len``, else the cap a
        real replica puts on a model's (``CONTEXT_CAP``)."""
        if cfg.num_kv_blocks is None:
            raise ValueError("a simulated replica needs num_kv_blocks in its config")
        self.cfg = cfg
        self.model = model or StepModel()
        self.blocks: BlockSpace
        if cfg.enable_prefix_caching:
            self.blocks = SimPrefixCache(cfg.block_size, range(cfg.num_kv_blocks),
                                         cfg.prefix_root())
        else:
            self.blocks = FreeListBlocks(cfg.block_size, range(cfg.num_kv_blocks))
        context = max_model_len or cfg.max_model_len or CONTEXT_CAP
        self.scheduler = Scheduler(cfg, self.blocks, max_model_len=context)
        # Request id -> prompt positions found cached at its first admission.
        self.cached: dict[int, int] = {}

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def total_blocks(self) -> int:
        return self.blocks.total_blocks

    @property
    def free_blocks(self) -> int:
        return self.blocks.free_blocks

    @property
    def waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def preemptions(self) -> int:
        return self.scheduler.stats().preemptions

    @property
    def rejections(self) -> int:
        """Requests ``add`` refused (every reason)."""
        return sum(self.scheduler.stats().rejected.values())

    def add(self, prompt: int | Sequence[int], max_tokens: int, priority: int = 0) -> int:
        """Queue a request (``prompt``: its length, or its token ids); the scheduler's
        ``AdmitError`` (``NeverFits``, ``QueueFull``, ...) when it refuses it, ``ValueError`` for
        ``max_tokens < 1``."""
        ids = [TOKEN] * max(prompt, 0) if isinstance(prompt, int) else list(prompt)
        return self.scheduler.add(Request(ids, max_tokens, priority))

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Positions of ``tokens`` this replica's cache holds now (0 without a cache)."""
        blocks = self.blocks
        return blocks.cached_prefix(tokens) if isinstance(blocks, SimPrefixCache) else 0

    def abort(self, id: int) -> None:
        self.scheduler.abort(id)

    def step(self) -> tuple[float, list[tuple[int, int, bool]]]:
        """One step: ``(seconds it takes, [(request id, token, finished)])``."""
        plan = self.scheduler.schedule()
        if plan.is_empty:  # time still passes, so a caller's loop cannot spin
            return self.model.step_time(0), []
        for c in plan.prefill:
            if c.id not in self.cached:
                self.cached[c.id] = self.scheduler.cached_tokens(c.id) or 0
        events = self.scheduler.on_step(sampled(plan))
        done = {e.id for e in events if isinstance(e, FinishedEvent)}
        out = [(e.id, e.token, e.id in done) for e in events if isinstance(e, TokenEvent)]
        return self.model.step_time(plan.num_tokens), out

    def stats(self, now: float) -> RoutingStats:
        """The report a real replica makes of the same scheduler state (``Engine.stats``)."""
        return RoutingStats.from_engine(self.scheduler.engine_stats(), now, True)


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
        pool_blocks: int | Sequence[int] = SIM_POOL_BLOCKS,
        step_base_s: float = 0.004,
        step_per_token_s: float = 0.0001,
        stream_every: int = 1,
        **engine: Any,
    ) -> None:
        """``engine``: ``EngineConfig`` fields of every replica (``max_num_seqs`` defaults to
        ``SIM_MAX_NUM_SEQS`` here; the others to ``EngineConfig``'s)."""
        if stream_every <= 0:
            raise ValueError(f"stream_every must be positive, got {stream_every}")
        self.stream_every = stream_every
        rank = _replica_rank()
        total = (
            pool_blocks if isinstance(pool_blocks, int) else pool_blocks[rank % len(pool_blocks)]
        )
        cfg = sim_config(total, **{"max_num_seqs": SIM_MAX_NUM_SEQS, **engine})
        self.core = SimCore(cfg, StepModel(step_base_s, step_per_token_s))
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

    async def generate(self, request: GenerateRequest) -> AsyncIterator[SimOutput | ErrorRecord]:
        """Stream one request's deltas: its sampled tokens (every position the token ``TOKEN``),
        the last ``finished`` at its ``max_tokens``; ``completion_tokens`` counts the tokens so
        far. With ``stream_every`` k > 1 only the first token's delta, every k-th and the last
        are sent, each with the tokens since the previous one. A request the scheduler refuses
        gets one ``ErrorRecord`` (as from a real replica)."""
        arrived = time.time()
        if not isinstance(request, GenerateRequest):
            yield ErrorRecord(
                400, "invalid_request", f"expected a GenerateRequest, got {type(request).__name__}"
            )
            return
        if request.n != 1:
            yield ErrorRecord(400, "invalid_request", f"a simulated replica runs one sample, "
                              f"got n={request.n}", "n")
            return
        try:
            id = self.core.add(request.prompt_ids, request.sampling.max_tokens, request.priority)
        except AdmitError as e:
            yield e.record()
            return
        except ValueError as e:
            yield ErrorRecord(400, "invalid_request", str(e))
            return
        sink: asyncio.Queue[tuple[int, bool]] = asyncio.Queue()
        self._sinks[id] = sink
        self._kick()
        done = False
        count = 0
        tokens: list[int] = []
        try:
            while not done:
                token, done = await sink.get()
                count += 1
                tokens.append(token)
                if count == 1 or done or count % self.stream_every == 0:
                    yield SimOutput(
                        id,
                        "",
                        tokens,
                        finished=done,
                        finish_reason="length" if done else None,
                        prompt_tokens=len(request.prompt_ids),
                        completion_tokens=count,
                        cached_tokens=self.core.cached.get(id) if count == 1 or done else None,
                        replica=self.name,
                        total_blocks=self.core.total_blocks,
                        arrived=arrived,
                        at=time.time(),
                    )
                    tokens = []
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

    async def _one(
        self, prompt_tokens: int, max_tokens: int, priority: int, latency: bool
    ) -> dict[str, Any]:
        request = GenerateRequest(
            (TOKEN,) * prompt_tokens,
            SamplingParams(max_tokens=max_tokens),
            priority=priority,
            latency=latency,
        )
        stream = self.engine.generate.remote(request)
        assert isinstance(stream, DeploymentResponseGenerator)
        items = [item async for item in stream]
        last = items[-1]
        if isinstance(last, ErrorRecord):
            raise RuntimeError(f"refused: {last.code}: {last.message}")
        return {
            "replica": last.replica,
            "total_blocks": last.total_blocks,
            "tokens": last.completion_tokens,
        }

    async def run(
        self, n: int, prompt_tokens: int, max_tokens: int, priority: int = 0,
        latency: bool = False,
    ) -> list[dict[str, Any]]:
        """``n`` concurrent streaming calls (``latency``: routed for their first token, as the
        ingress marks its top tier's requests); per call: replica, its pool size, tokens
        received."""
        calls = [self._one(prompt_tokens, max_tokens, priority, latency) for _ in range(n)]
        return list(await asyncio.gather(*calls))
