"""The routers alive in this process, so that the ingress can ask them about saturation.

Serve pickles the router's module by value (``RequestRouterConfig`` registers it with
``cloudpickle.register_pickle_by_value``): the handle owner runs a copy of
``FreeKVBlocksRouter`` whose module globals are its own. Process-wide state therefore lives here,
in a module that is pickled by reference and so imported once per process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from router.policy import RequestShape


class RouterView(Protocol):
    """What a live router answers, from any thread."""

    def serves(self, app_name: str, deployment_name: str) -> bool: ...
    def saturated(self, request: RequestShape) -> bool: ...
    def outstanding(self) -> Mapping[Any, int]: ...


_lock = threading.Lock()
_routers: weakref.WeakSet[RouterView] = weakref.WeakSet()


def register(router: RouterView) -> None:
    with _lock:
        _routers.add(router)


def routers(app_name: str, deployment_name: str) -> list[RouterView]:
    """The live routers of this process for one deployment (usually one per handle)."""
    with _lock:
        return [r for r in _routers if r.serves(app_name, deployment_name)]


def saturated(app_name: str, deployment_name: str, prompt_tokens: int, max_tokens: int = 0) -> bool:
    """Whether a router of this process sees every replica of the deployment saturated.

    For the ingress, whose handle's router lives in its process: shed the lowest tier when this
    is True. False while no router for the deployment exists (before the first call). Each
    router knows only its own in-flight requests, so the most loaded view decides. Any thread.
    """
    request = RequestShape(prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    return any(r.saturated(request) for r in routers(app_name, deployment_name))
