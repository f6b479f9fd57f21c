"""What the router's tests read inside a live ``FreeKVBlocksRouter``.

The router answers Serve's hooks and the ingress (``tierserve.router.registry.RouterView``); the
tests also look at its in-flight ledger, read here from its state under its lock (the router's
hooks run on Serve's router loop, a thread of its own). A router found through the registry in a
handle owner is an instance of Serve's by-value copy of the class, with the same attributes.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import ReplicaID


def outstanding_blocks(router: Any) -> dict[ReplicaID, int]:
    """Blocks ``router`` has charged each of its replicas, confirmed and tentative."""
    with router._lock:
        return {r: router._state.ledger.outstanding_blocks(r) for r in router._replicas}
