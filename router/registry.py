"""The routers alive in this process, so that code in it can ask them what they see: the ingress
sizes its dispatch window by the replicas its handle's router can send to.

Serve pickles the router's module by value (``RequestRouterConfig`` registers it with
``cloudpickle.register_pickle_by_value``): the handle owner runs a copy of
``FreeKVBlocksRouter`` whose module globals are its own. Process-wide state therefore lives here,
in a module that is pickled by reference and so imported once per process.
"""

from __future__ import annotations

import threading
import weakref
from typing import Protocol


class RouterView(Protocol):
    """What a live router answers, from any thread."""

    def serves(self, app_name: str, deployment_name: str) -> bool: ...
    def replica_count(self) -> int: ...


_lock = threading.Lock()
_routers: weakref.WeakSet[RouterView] = weakref.WeakSet()


def register(router: RouterView) -> None:
    with _lock:
        _routers.add(router)


def routers(app_name: str, deployment_name: str) -> list[RouterView]:
    """The live routers of this process for one deployment (usually one per handle)."""
    with _lock:
        return [r for r in _routers if r.serves(app_name, deployment_name)]
