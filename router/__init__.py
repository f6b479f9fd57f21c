"""Request routing for the engine deployment: each request where its prefix, its room and its
tier say.

What it does
    ``FreeKVBlocksRouter`` (``router.free_blocks_router``) is a Serve ``RequestRouter`` driving a
    ``router.routing.RouterState``: the ledger of requests it sent that have not completed, a
    bounded index of the prompt block names it sent each replica (``router.prefix_index``), and
    the replicas' last reports. For each request ``router.policy.rank_replicas`` (pure and
    Ray-free) ranks the replicas: the top tier's requests for their first token (free blocks
    now, then the prefill queued ahead plus their own uncached positions, so a cached system
    prompt weighs against a queue), the others for room (no overcommitted pool, then the replica
    holding most of their prompt when that is at least ``min_hit_fraction`` of it, then the
    fewest requests outstanding). When the replicas are imbalanced (``balance_abs``,
    ``balance_rel``) both fall back to load, prefix hits only breaking ties. It returns one
    replica per group, best first, so Serve takes the best replica below its
    ``max_ongoing_requests``. Ties are broken at random. A replica that has not reported yet is
    assumed to be as large as the largest reported pool, minus what this router has sent it.

Configuration (engine deployment)::

    request_router_config:
      request_router_class: router.free_blocks_router:FreeKVBlocksRouter
      request_routing_stats_period_s: 1
      request_router_kwargs: {saturation_waiting: 8}   # optional: router.routing.RouterSettings
      # prefix_affinity (true), prefix_index_blocks, balance_abs, balance_rel, min_hit_fraction

    Give the engine a large ``max_ongoing_requests`` (its own scheduler queues): Serve skips a
    replica at that limit whatever the ranking says.

The replica's side (``router.stats``)
    ``async def record_routing_stats(self) -> dict`` returns ``RoutingStats(...).to_dict()``
    (its fields and their meaning: the ``router.stats.RoutingStats`` class), built from the
    engine's ``EngineStats`` by ``RoutingStats.from_engine`` and dated by ``report_time``
    (``time.time()`` when the snapshot was taken). Requests that were waiting at the replica are
    not in ``free_blocks``: without ``waiting_blocks`` the router overestimates a replica with a
    queue.

The request (ingress -> engine ``generate``)
    ``generate(request)`` with one ``replica.api.GenerateRequest``: the router reads its size
    (``prompt_tokens`` and ``max_new_tokens``, all ``n`` samples), whether to route it for its
    first token (``latency``, set by the ingress for the top tier) and the names of its prompt's
    full blocks (``prefix_hashes``: the ingress hashes the ids it tokenized, as the replicas'
    prefix caches name their blocks) through ``RequestShape.from_request``. A request is charged
    ``ceil((prompt_tokens + 1) / block_tokens)`` blocks (its prompt and first token). Simulated
    replicas (``router.sim``) take the same record; a call without one never fails routing (it
    is ranked as an empty request).

Saturation and priority
    A replica is saturated for a request when its estimated free blocks cannot hold it and its
    estimated queue (reported waiting plus requests sent since) is at least
    ``saturation_waiting``. Saturated replicas rank after the others. The router does not
    reorder or hold requests by ``priority``: it passes it on, and the replica's scheduler runs
    higher priorities first. (Holding a low-priority request in the router does not work with
    Serve 2.60: the FIFO hand-off gives the next free replica to the oldest pending request,
    held or not.) ``router.registry.routers(app, deployment)`` finds the routers of a process
    (their ledgers and prefix indexes) for tests and tools.

Limits
    - One router per handle owner (each ingress replica, each proxy), each with its own view:
      routers do not see each other's in-flight requests, only the replicas' reports.
    - The report's ``report_time`` (replica clock) is compared with the router's clock: keep
      the nodes' clocks in sync (NTP); a skew of s seconds misplaces charges by s.
    - Under Ray Client the rejection protocol is off, so ``on_request_routed`` never fires and
      only the short-lived tentative charges (``tentative_ttl_s``) correct stale reports.
    - The charge is the admission footprint; the growth of running requests shows up only in the
      next report.
    - The prefix index is what this router sent, not what the replica holds: a block the
      replica has evicted, or one another router put there, is not known (bounded per replica
      by its pool size, least recently routed first out).
"""

from router.stats import RoutingStats

__all__ = ["RoutingStats"]
