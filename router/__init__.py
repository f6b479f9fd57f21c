"""Request routing for the engine deployment: send each request where the most KV blocks are free.

What it does
    ``FreeKVBlocksRouter`` (``router.free_blocks_router``) is a Serve ``RequestRouter``. For each
    request it ranks the replicas by estimated free KV blocks: the replica's last report minus
    the blocks of the requests this router sent it after the report was taken and that have not
    completed (``router.policy``, pure and Ray-free). It returns one replica per group, best
    first, so Serve takes the best replica that is below its ``max_ongoing_requests``. Ties are
    broken at random. A replica that has not reported yet is assumed to be as large as the
    largest reported pool, minus what this router has sent it.

Configuration (engine deployment)::

    request_router_config:
      request_router_class: router.free_blocks_router:FreeKVBlocksRouter
      request_routing_stats_period_s: 1
      request_router_kwargs: {saturation_waiting: 8}   # optional, see RouterSettings

    Give the engine a large ``max_ongoing_requests`` (its own scheduler queues): Serve skips a
    replica at that limit whatever the ranking says.

The replica's side (``router.stats``)
    ``async def record_routing_stats(self) -> dict`` returns ``RoutingStats(...).to_dict()``:
    ``free_blocks``, ``total_blocks``, ``block_tokens``, ``waiting``, ``running``,
    ``preemptions``, ``report_time`` (``time.time()`` when the snapshot was taken) and
    ``waiting_blocks`` (what the waiting queue needs at admission; 0 if unknown), built from the
    engine's ``EngineStats`` by ``RoutingStats.from_engine``. Requests that
    were waiting at the replica are not in ``free_blocks``: without ``waiting_blocks`` the router
    overestimates a replica with a queue.

The request (ingress -> engine ``generate``)
    ``generate(request)`` with one ``replica.api.GenerateRequest``: the router reads its size
    (``prompt_tokens`` and ``max_new_tokens``, all ``n`` samples) and whether to route it for its
    first token (``latency``, set by the ingress for the top tier) through
    ``RequestShape.from_request``. A request is charged ``ceil((prompt_tokens + 1) /
    block_tokens)`` blocks (its prompt and first token). Simulated replicas may send loose
    ``priority``/``prompt_tokens``/``max_tokens`` keyword arguments instead; anything else never
    fails routing (it is ranked as an empty request).

Saturation and priority
    A replica is saturated for a request when its estimated free blocks cannot hold it and its
    estimated queue (reported waiting plus requests sent since) is at least
    ``saturation_waiting``. Saturated replicas rank after the others. Any code in the router's
    process can find the router with ``router.registry.routers(app, deployment)`` and ask its
    ``saturated(RequestShape(prompt_tokens))`` (any thread) whether every replica is saturated; the ingress does not shed by it (it ignored the tiers'
    queue shares), it bounds its requests in flight per tier instead. The router does not reorder
    or hold requests
    by ``priority``: it passes it on, and the replica's scheduler runs higher priorities first.
    (Holding a low-priority request in the router does not work with Serve 2.60: the FIFO
    hand-off gives the next free replica to the oldest pending request, held or not.)

Limits
    - One router per handle owner (each ingress replica, each proxy), each with its own view:
      routers do not see each other's in-flight requests, only the replicas' reports.
    - The report's ``report_time`` (replica clock) is compared with the router's clock: keep
      the nodes' clocks in sync (NTP); a skew of s seconds misplaces charges by s.
    - Under Ray Client the rejection protocol is off, so ``on_request_routed`` never fires and
      only the short-lived tentative charges (``tentative_ttl_s``) correct stale reports.
    - The charge is the admission footprint; the growth of running requests shows up only in the
      next report.
"""

from router.stats import RoutingStats

__all__ = ["RoutingStats"]
