"""The ingress's LoRA adapters: which adapter names a request's ``model`` may give, each one's
parent model, PEFT folder and id, and the admin's loads and unloads at run time.

Two kinds of entry, in one namespace with the served models' names (a name is a model or an
adapter, never both):

- **static**: each served model's engine ``lora_modules`` (their parent is that model); they
  come from the config, so every ingress knows them from its start, and they cannot be
  unloaded;
- **dynamic**: loaded by an admin key (``POST /v1/load_lora_adapter``), at most
  ``max_dynamic_loras`` at once. They are runtime state, as vLLM's are: they live in one small
  named Ray actor per application (``AdapterStoreActor``, made with ``get_if_exists`` by
  whichever ingress replica comes first), so a load through one ingress replica is seen by all.
  Each ingress keeps a copy (``AdapterRegistry``) and reads the actor again on a miss (a name it
  does not know) or once its copy is older than ``ttl_s``. A restart of the actor loses them
  (an admin loads them again); static ones come back from the config. An admin may name the
  tenants that own one (``tenants``): only their keys may use or see it.

An adapter's identity is its name and id (``LoRARequest.key``): a static one's id is
``static_lora_id`` of its name and path (the replicas compute the same), a dynamic one's is
random per registration. Replicas key their adapter caches and the adapter's prefix-cache
blocks by it, so a name unloaded and loaded again (from any weights, or after the actor was
lost) never runs on, nor finds blocks of, the old weights; a replica's stale copy is an entry
no request names, which its cache evicts.

``DynamicAdapters`` is the actor's state and every rule on it, without Ray (tested so);
``LocalStore`` runs it in this process (the ingress outside Serve, and the tests), ``RayStore``
through the actor. A path is never the client's: only an admin's load carries one, checked
against ``lora_path_roots`` (``check_path``), and requests carry the path the registry holds.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tierserve.cluster.config import ClusterConfig, ModelConfig
from tierserve.records import (
    BadRequest,
    ErrorRecord,
    LoRARequest,
    NotFound,
    ServingError,
    Unavailable,
    static_lora_id,
)

log = logging.getLogger("tierserve.adapters")

# What an adapter may be called (``LoRAModule.name``'s pattern, at most 128 characters).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
ADMIN_STATUS = 403


class PermissionDenied(ServingError):
    """403: the key may not do this (an admin route called without an admin key)."""

    status = ADMIN_STATUS
    code = "permission_denied"


@dataclass(frozen=True, slots=True)
class Adapter:
    """One adapter the ingress knows: its name (what requests send as ``model``), its parent
    (the served model it runs on), its PEFT folder (resolved; never shown to a non-admin), its
    id (``LoRARequest.lora_int_id``: for a static one ``static_lora_id`` of its name and path,
    for a dynamic one random per registration, never reused), whether it comes from the config
    (``static``) and its owners (``tenants``: the key-identified tenants that alone may use and
    see it; None: whoever the allowlists let name it)."""

    name: str
    parent: str
    path: str
    int_id: int
    static: bool = False
    tenants: tuple[str, ...] | None = None

    @property
    def key(self) -> str:
        """Its identity (``LoRARequest.key``): what replicas and the prefix cache key it by."""
        return self.request().key

    def request(self) -> LoRARequest:
        """The ``LoRARequest`` a request under this adapter carries to the replica."""
        return LoRARequest(self.name, self.int_id, self.path)

    def open_to(self, tenant: str | None) -> bool:
        """Whether a caller whose key identifies ``tenant`` (None: no key-identified tenant)
        may use and see it, as far as its owners go (the allowlists are checked besides)."""
        return self.tenants is None or (tenant is not None and tenant in self.tenants)


def new_lora_id() -> int:
    """A dynamic adapter's id: a random positive 63-bit int, drawn per registration (so an id is
    never reused, even by a store actor made again after it was lost)."""
    return secrets.randbelow(2**63 - 1) + 1


def static_adapters(models: Sequence[ModelConfig]) -> dict[str, Adapter]:
    """The static adapters of ``models`` (each model's ``engine.lora_modules``), by name, each
    with ``static_lora_id`` of its name and path (the replicas compute the same). ``ValueError``
    where a name is a served model's or two models list the same name."""
    names = {m.name for m in models}
    out: dict[str, Adapter] = {}
    for m in models:
        for mod in m.engine.lora_modules or ():
            if mod.name in names:
                raise ValueError(f"model {m.name!r}: lora_modules adapter {mod.name!r} has a "
                                 "served model's name: adapters and models share one namespace")
            if mod.name in out:
                raise ValueError(f"lora_modules adapter {mod.name!r} is listed by models "
                                 f"{out[mod.name].parent!r} and {m.name!r}: adapter names must "
                                 "be unique in the application")
            out[mod.name] = Adapter(mod.name, m.name, mod.path,
                                    static_lora_id(mod.name, mod.path), static=True)
    return out


def open_tiers(cfg: ClusterConfig) -> list[str]:
    """The tiers some of whose callers have no ``models`` list (the anonymous tier, or a tier
    without a list with its own keys or a tenant without a list): they may use every static
    adapter and every dynamic one loaded without ``tenants``."""
    return [t.name for t in cfg.tiers if t.models is None and (
        t.name == cfg.anonymous_tier or bool(t.api_keys)
        or any(n.models is None for n in t.tenants))]


def check_path(path: str, roots: Sequence[str]) -> str:
    """The adapter folder ``path`` resolved (symlinks and ``..`` followed, on this node), if it
    is absolute and, with ``roots``, inside one of them (resolved too); else a 400
    ``lora_path_not_allowed`` that does not say what is on the disk."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise BadRequest("lora_path must be a non-empty path", "invalid_request", "lora_path")
    if not os.path.isabs(path):
        raise BadRequest(f"lora_path must be an absolute path, got {path[:256]!r}",
                         "lora_path_not_allowed", "lora_path")
    real = os.path.realpath(path)
    if roots:
        inside = False
        for root in roots:
            base = os.path.realpath(root)
            if os.path.commonpath([real, base]) == base:
                inside = True
        if not inside:
            raise BadRequest(f"lora_path {path[:256]!r} is outside the directories adapters may "
                             "be loaded from (lora_path_roots)", "lora_path_not_allowed",
                             "lora_path")
    return real


def check_name(name: str) -> str:
    """``name`` if it may name an adapter, else a 400 naming ``lora_name``."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise BadRequest("lora_name must be 1 to 128 letters, digits and `._:/-`, got "
                         f"{str(name)[:64]!r}", "invalid_request", "lora_name")
    return name


class DynamicAdapters:
    """The dynamic adapters (the store actor's state; no Ray): at most ``max_dynamic``, each
    with the id its registration drew (``new_lora_id``). ``reserved``: the names of the served
    models and static adapters, which no dynamic adapter may take. ``version`` grows with each
    change, so that a copy knows it is behind. A name unloaded may be loaded again, from any
    path: its new registration has a new id, so replicas never mistake it for the old one."""

    def __init__(self, max_dynamic: int, reserved: Sequence[str] = ()) -> None:
        self.max_dynamic = max_dynamic
        self.reserved = frozenset(reserved)
        self.version = 0
        self._entries: dict[str, Adapter] = {}

    def snapshot(self) -> tuple[int, list[Adapter]]:
        """The version and every entry, in the order they were loaded."""
        return self.version, list(self._entries.values())

    def check(self, name: str, parent: str, path: str,
              tenants: tuple[str, ...] | None = None) -> Adapter | None:
        """Whether ``name`` may be loaded from ``path`` on ``parent`` for ``tenants``: the entry
        when it is loaded so already (a no-op), None when it may be added; else a 400 saying why
        (a taken name, another path, parent or owners, the bound reached)."""
        if name in self.reserved:
            raise BadRequest(f"lora_name {name!r} is a served model's or a static adapter's "
                             "name: adapters and models share one namespace",
                             "lora_name_taken", "lora_name")
        have = self._entries.get(name)
        if have is not None:
            if have.path == path and have.parent == parent and have.tenants == tenants:
                return have
            raise BadRequest(f"LoRA adapter {name!r} is loaded already from another path, for "
                             "another model or for other tenants: unload it first",
                             "lora_adapter_exists", "lora_name")
        if len(self._entries) >= self.max_dynamic:
            raise BadRequest(f"{len(self._entries)} LoRA adapters are loaded, the most "
                             f"max_dynamic_loras ({self.max_dynamic}) allows: unload one first",
                             "too_many_lora_adapters", "lora_name")
        return None

    def add(self, name: str, parent: str, path: str, int_id: int,
            tenants: tuple[str, ...] | None = None) -> Adapter:
        """Register ``name`` under ``int_id`` (``check``'s rules; when it is loaded so already,
        that entry, with its own id)."""
        have = self.check(name, parent, path, tenants)
        if have is not None:
            return have
        entry = Adapter(name, parent, path, int_id, tenants=tenants)
        self._entries[name] = entry
        self.version += 1
        return entry

    def remove(self, name: str) -> Adapter:
        """Forget ``name``: its entry; a 404 ``lora_not_found`` when it is not loaded."""
        have = self._entries.pop(name, None)
        if have is None:
            raise NotFound(f"LoRA adapter {name!r} is not loaded", "lora_not_found",
                           "lora_name")
        self.version += 1
        return have


class AdapterStore(Protocol):
    """Where the dynamic adapters live (``DynamicAdapters``' methods, awaited)."""

    async def snapshot(self) -> tuple[int, list[Adapter]]: ...
    async def check(self, name: str, parent: str, path: str,
                    tenants: tuple[str, ...] | None = None) -> Adapter | None: ...
    async def add(self, name: str, parent: str, path: str, int_id: int,
                  tenants: tuple[str, ...] | None = None) -> Adapter: ...
    async def remove(self, name: str) -> Adapter: ...


class LocalStore:
    """``DynamicAdapters`` in this process (one ingress; the tests)."""

    def __init__(self, state: DynamicAdapters) -> None:
        self.state = state

    async def snapshot(self) -> tuple[int, list[Adapter]]:
        return self.state.snapshot()

    async def check(self, name: str, parent: str, path: str,
                    tenants: tuple[str, ...] | None = None) -> Adapter | None:
        return self.state.check(name, parent, path, tenants)

    async def add(self, name: str, parent: str, path: str, int_id: int,
                  tenants: tuple[str, ...] | None = None) -> Adapter:
        return self.state.add(name, parent, path, int_id, tenants)

    async def remove(self, name: str) -> Adapter:
        return self.state.remove(name)


class AdapterStoreActor:
    """The Ray actor's class: ``DynamicAdapters`` whose refusals come back as ``ErrorRecord``
    values (an exception raised in an actor would reach the caller wrapped)."""

    def __init__(self, max_dynamic: int, reserved: Sequence[str]) -> None:
        self.state = DynamicAdapters(max_dynamic, reserved)

    def snapshot(self) -> tuple[int, list[Adapter]]:
        return self.state.snapshot()

    def check(self, name: str, parent: str, path: str,
              tenants: tuple[str, ...] | None = None) -> Adapter | ErrorRecord | None:
        try:
            return self.state.check(name, parent, path, tenants)
        except ServingError as e:
            return e.record()

    def add(self, name: str, parent: str, path: str, int_id: int,
            tenants: tuple[str, ...] | None = None) -> Adapter | ErrorRecord:
        try:
            return self.state.add(name, parent, path, int_id, tenants)
        except ServingError as e:
            return e.record()

    def remove(self, name: str) -> Adapter | ErrorRecord:
        try:
            return self.state.remove(name)
        except ServingError as e:
            return e.record()


def store_actor_name(app_name: str, max_dynamic: int, reserved: Sequence[str]) -> str:
    """The named actor of application ``app_name``'s dynamic adapters under these settings (a
    digest of them in the name: an application deployed again with other models, static
    adapters or bound gets a store of its own, never one made for the old settings)."""
    digest = hashlib.sha256(json.dumps([max_dynamic, sorted(reserved)]).encode())
    return f"tierserve-adapters:{app_name}:{digest.hexdigest()[:12]}"


class RayStore:
    """The application's ``AdapterStoreActor`` (made on first use by whichever ingress replica
    asks first, ``get_if_exists``; detached, so it outlives an ingress replica's restart). A
    call that fails (the actor lost with its node) is made once more on a fresh handle, which
    finds or makes the actor again (empty: the dynamic adapters are lost with it); failing
    again, a 503."""

    def __init__(self, app_name: str, max_dynamic: int, reserved: Sequence[str]) -> None:
        self._args = (max_dynamic, list(reserved))
        self._name = store_actor_name(app_name, max_dynamic, reserved)
        self._actor: Any = None

    def _handle(self) -> Any:
        if self._actor is None:
            import ray

            cls = ray.remote(num_cpus=0)(AdapterStoreActor)
            self._actor = cls.options(
                name=self._name, namespace="tierserve", get_if_exists=True,
                lifetime="detached").remote(*self._args)
        return self._actor

    async def _call(self, method: str, *args: Any) -> Any:
        for attempt in (1, 2):
            try:
                return await getattr(self._handle(), method).remote(*args)
            except Exception as e:
                log.warning("the adapter registry's actor %s failed (%s, try %d of 2)",
                            self._name, type(e).__name__, attempt)
                self._actor = None
        raise Unavailable("the LoRA adapter registry cannot be reached; try again",
                          "adapter_registry_unavailable")

    async def snapshot(self) -> tuple[int, list[Adapter]]:
        out: tuple[int, list[Adapter]] = await self._call("snapshot")
        return out

    async def check(self, name: str, parent: str, path: str,
                    tenants: tuple[str, ...] | None = None) -> Adapter | None:
        got = await self._call("check", name, parent, path, tenants)
        return None if got is None else _unwrapped(got)

    async def add(self, name: str, parent: str, path: str, int_id: int,
                  tenants: tuple[str, ...] | None = None) -> Adapter:
        return _unwrapped(await self._call("add", name, parent, path, int_id, tenants))

    async def remove(self, name: str) -> Adapter:
        return _unwrapped(await self._call("remove", name))


def _unwrapped(got: Adapter | ErrorRecord) -> Adapter:
    if isinstance(got, ErrorRecord):
        raise ServingError.of(got)
    return got


@dataclass(frozen=True, slots=True)
class Unloaded:
    """What an unload did: the entry forgotten, and the replicas that still hold it (their
    requests on it running: they keep it until those end, no new request may name it)."""

    adapter: Adapter
    still_in_use: int = 0


class AdapterRegistry:
    """The ingress's view of the adapters: the static ones (from ``models``) and a copy of the
    store's dynamic ones, read again on a miss or once older than ``ttl_s``. ``lookup`` is what
    a request's ``model`` goes through; ``load`` and ``unload`` are the admin routes' work.

    Reads of the store are single-flight: at most one is in flight, and every caller that
    wants one while it runs awaits that one (so a burst of made-up names costs one read, and
    then none for ``miss_s``). ``tenants``: the tenants the config identifies by an API key,
    the only ones a load may name as an adapter's owners."""

    def __init__(self, models: Sequence[ModelConfig], store: AdapterStore | None = None, *,
                 max_dynamic: int = 64, path_roots: Sequence[str] = (),
                 ttl_s: float = 2.0, miss_s: float = 0.2,
                 tenants: Sequence[str] = ()) -> None:
        self.models = {m.name: m for m in models}
        self.static = static_adapters(models)
        self.path_roots = tuple(path_roots)
        self.ttl_s = ttl_s
        self.miss_s = miss_s
        self.tenants = frozenset(tenants)
        reserved = [*self.models, *self.static]
        self.store: AdapterStore = store if store is not None else LocalStore(
            DynamicAdapters(max_dynamic, reserved))
        self.dynamic: dict[str, Adapter] = {}
        self.version = -1
        self.read_at = float("-inf")
        # The read in flight (None: none) and when it started.
        self._reading: asyncio.Future[None] | None = None
        self._reading_since = float("-inf")

    @property
    def enabled(self) -> bool:
        """Whether any served model takes adapters."""
        return any(m.engine.enable_lora for m in self.models.values())

    def known(self) -> list[Adapter]:
        """Every adapter of this copy: the static ones, then the dynamic ones."""
        return [*self.static.values(), *self.dynamic.values()]

    def get(self, name: str) -> Adapter | None:
        """``name``'s adapter in this copy (None: not an adapter it knows)."""
        return self.static.get(name) or self.dynamic.get(name)

    async def refresh(self, since: float | None = None) -> None:
        """Read the store's dynamic adapters again: join the read in flight if it started at or
        after ``since`` (None: join any), else wait for it to end and start one. A caller
        cancelled while waiting does not cancel the read the others await."""
        while True:
            reading = self._reading
            if reading is None:
                reading = self._reading = asyncio.ensure_future(self._read())
                self._reading_since = time.monotonic()
                # Its failure is each waiter's; retrieved here too, for when none is left.
                reading.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.shield(reading)
                return
            joined = since is None or self._reading_since >= since
            try:
                await asyncio.shield(reading)
            except ServingError:
                if joined:
                    raise
            if joined:
                return

    async def _read(self) -> None:
        try:
            # Taken whole each time (at most ``max_dynamic_loras`` entries): a store made
            # again after its actor was lost counts its versions from 0 again.
            version, entries = await self.store.snapshot()
            self.dynamic = {a.name: a for a in entries}
            self.version = version
            self.read_at = time.monotonic()
        finally:
            self._reading = None

    async def fresh(self) -> None:
        """The copy read again if older than ``miss_s`` (a listing: at most one read per
        ``miss_s``, however many listings come at once)."""
        if self.enabled and time.monotonic() - self.read_at > self.miss_s:
            await self.refresh()

    async def lookup(self, name: str) -> Adapter | None:
        """The adapter a request's ``model`` names, or None. The store is read first when this
        copy is older than ``ttl_s``, or when ``name`` is not in it (an adapter loaded through
        another ingress replica) and the copy is older than ``miss_s``: the read is shared by
        every lookup that wants one meanwhile, so a flood of made-up names, however many come
        at once, costs at most one read in flight and one read per ``miss_s``. Never without
        ``enable_lora`` on some model."""
        if not self.enabled or name in self.static:
            return self.static.get(name)
        age = time.monotonic() - self.read_at
        if age > self.ttl_s or (name not in self.dynamic and age > self.miss_s):
            await self.refresh()
        return self.dynamic.get(name)

    def parent_of(self, model: str | None) -> str:
        """The model a load is for: ``model`` (a served model with ``enable_lora``), else the
        only such model; else a 400 naming the choices."""
        lora = [n for n, m in self.models.items() if m.engine.enable_lora]
        if model is None:
            if len(lora) == 1:
                return lora[0]
            if not lora:
                raise BadRequest("no served model has enable_lora: adapters cannot be loaded",
                                 "lora_disabled", "model")
            raise BadRequest(f"several models take adapters ({lora}): name the one to load it "
                             "for in `model`", "invalid_request", "model")
        if model not in self.models:
            raise NotFound(f"model {model[:256]!r} is not a served model; the models that take "
                           f"adapters: {lora}", "model_not_found", "model")
        if model not in lora:
            raise BadRequest(f"model {model!r} does not have enable_lora; the models that take "
                             f"adapters: {lora}", "lora_disabled", "model")
        return model

    def owners(self, tenants: Sequence[str] | None) -> tuple[str, ...] | None:
        """A load's ``tenants`` checked: sorted, without repeats, each a tenant an API key of the
        config identifies (a ``tiers[].tenants[]`` name with keys, or a tier's own key's label,
        ``<tier>-key<N>``); None stays None (no owner). Else a 400 naming the unknown one."""
        if tenants is None:
            return None
        if not tenants:
            raise BadRequest("tenants must name at least one tenant (leave it out for an "
                             "adapter with no owner)", "invalid_request", "tenants")
        for t in tenants:
            if t not in self.tenants:
                raise BadRequest(f"tenants: {str(t)[:64]!r} is not a tenant an API key of the "
                                 "config identifies (a tiers[].tenants[] name with api_keys, "
                                 "or <tier>-key<N> for a tier's own key)", "invalid_request",
                                 "tenants")
        return tuple(sorted(set(tenants)))

    async def load(self, name: str, path: str, model: str | None,
                   validate: Callable[[Adapter], Awaitable[None]],
                   tenants: Sequence[str] | None = None) -> tuple[Adapter, bool]:
        """Register ``name`` from ``path`` for ``model`` (``parent_of``), owned by ``tenants``
        (``owners``), once ``validate`` (a replica of the parent loading it under a fresh id)
        succeeds: the entry and whether it is new. Loaded so already: that entry, nothing
        asked. Refused (400: a bad name, path or tenant, a taken name, another path, the bound;
        or ``validate``'s error): nothing is registered. Refused by the store after ``validate``
        (another ingress replica registered the name meanwhile, or took the last place): the
        refusal; the copy the replica loaded has an id no request will carry, so it is an
        unreachable entry its cache evicts in time. A registration done stays done: a failed
        read of the store after it is logged, not answered."""
        check_name(name)
        if name in self.models or name in self.static:
            raise BadRequest(f"lora_name {name!r} is a served model's or a static adapter's "
                             "name: adapters and models share one namespace",
                             "lora_name_taken", "lora_name")
        parent = self.parent_of(model)
        owners = self.owners(tenants)
        # realpath may block (a network file system): off the event loop.
        real = await asyncio.to_thread(check_path, path, self.path_roots)
        have = await self.store.check(name, parent, real, owners)
        if have is not None:
            return have, False
        # This registration's id, drawn now and kept only if the store takes it: the replica
        # that validates holds the adapter under it, ready for the first request.
        adapter = Adapter(name, parent, real, new_lora_id(), tenants=owners)
        await validate(adapter)
        entry = await self.store.add(name, parent, real, adapter.int_id, owners)
        self.dynamic[entry.name] = entry
        await self._refresh_quietly(f"after loading LoRA adapter {name!r}")
        return entry, True

    async def unload(self, name: str) -> Adapter:
        """Forget dynamic adapter ``name`` (the caller then asks the replicas to drop it, to
        free their memory sooner): its entry; 400 for a static one, 404 for one not loaded."""
        check_name(name)
        if name in self.static:
            raise BadRequest(f"LoRA adapter {name!r} is static (the config's lora_modules): it "
                             "cannot be unloaded", "static_lora_adapter", "lora_name")
        try:
            gone = await self.store.remove(name)
        except NotFound:
            self.dynamic.pop(name, None)
            raise
        self.dynamic.pop(name, None)
        await self._refresh_quietly(f"after unloading LoRA adapter {name!r}")
        return gone

    async def _refresh_quietly(self, what: str) -> None:
        """A read that starts after this call (an older one in flight may miss the change), its
        failure logged: the change is done, and the next miss or ``ttl_s`` reads again."""
        try:
            await self.refresh(since=time.monotonic())
        except Exception as e:
            log.warning("reading the adapter registry %s failed (%s); the next lookup reads it "
                        "again", what, type(e).__name__)
