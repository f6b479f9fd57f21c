"""The cluster's configuration: the application ``args`` of ``configs/cluster.yaml``, validated.

Serve's own keys (replicas, resources, the router class, back-pressure) stay in the YAML's
``deployments`` section, where Serve reads them; everything tierserve reads is here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from tierserve.cluster.structured import SchemaLimits
from tierserve.records import MAX_STOP_STRINGS
from tierserve.replica.config import EngineConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class TenantConfig(_Strict):
    """A tenant of a tier: its name (in metrics), its weight in the tier's fair share (a tenant
    of weight 2 gets twice the tokens of one of weight 1 while both are backlogged) and the API
    keys that identify it (written as a tier's ``api_keys`` are)."""

    name: str = Field(pattern=TENANT_NAME)
    weight: float = Field(default=1.0, gt=0.0, le=1000.0)
    api_keys: list[SecretStr] = Field(default_factory=list)


class TierConfig(_Strict):
    """A priority tier: callers with one of ``api_keys`` (or, for the anonymous tier, no key).

    An API key is written as ``env:VAR`` (the value of environment variable ``VAR`` in the
    ingress's process), ``file:PATH`` (the file's content, stripped) or literally. Serve logs an
    application's ``args`` when it deploys them, so use the references for real keys.

    base_priority: the priority of a request that asks for none. max_priority: the highest the
    ``X-TL-Priority`` header may ask for. queue_share: the fraction of a replica's waiting queue
    this tier may fill before its requests are refused with 429 (lower tiers get smaller shares,
    so under overload they are refused first); with flow control, also the share of the
    ingress's dispatch window (``FlowConfig``) its requests may occupy.

    ttft_target_s, tpot_target_s: the latency the tier promises (time to first token, time per
    output token after it; None: no target). The replicas' SLO-aware steps keep the TPOT
    target (docs/scheduler.md §8); both are counted as met or missed per request
    (``tierserve_slo_requests``). max_held: with flow control, how many of its requests the
    ingress may hold while no replica can start them. late_after_s: how long one may be held
    before it is late (best below ``ttft_target_s``: past it, it can only miss its target): a
    late request yields its turn to every on-time one and is shed only while an on-time request
    of its tier or a higher one that arrived after it became late is held, or when its tier's
    queue is full (``cluster/flow.py``); a burst is served in full. max_stream_bytes: the bytes
    its open streams may have sent, all together (Ray Serve's proxy keeps what a client has not
    read: this bounds what a tier's readers that never read make it keep; beyond, its new
    requests get 429 ``stream_budget`` until streams end). tenants: named tenants with
    weights and keys; each key of ``api_keys`` is a tenant of its own (named ``<tier>-key<N>``,
    weight 1).
    """

    name: str = Field(pattern=r"^[a-z][a-z0-9_-]{0,31}$")
    base_priority: int = Field(ge=-1000, le=1000)
    max_priority: int = Field(ge=-1000, le=1000)
    queue_share: float = Field(default=1.0, gt=0.0, le=1.0)
    api_keys: list[SecretStr] = Field(default_factory=list)
    ttft_target_s: float | None = Field(default=None, gt=0.0, le=3600.0)
    tpot_target_s: float | None = Field(default=None, gt=0.0, le=60.0)
    max_held: int = Field(default=256, ge=0)
    late_after_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    max_stream_bytes: int = Field(default=256 << 20, gt=0)
    tenants: list[TenantConfig] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "held_ttl_s" in data:
            raise ValueError("held_ttl_s is now late_after_s: a request held longer is late "
                             "(it yields to on-time requests), no longer refused on a timer")
        return data

    @model_validator(mode="after")
    def _ordered(self) -> TierConfig:
        if self.max_priority < self.base_priority:
            raise ValueError(
                f"tier {self.name!r}: max_priority ({self.max_priority}) is below base_priority "
                f"({self.base_priority})"
            )
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tier {self.name!r}: tenant names must be unique, got {names}")
        reserved = [n for n in names if n.startswith(f"{self.name}-key")]
        if reserved:
            raise ValueError(f"tier {self.name!r}: tenant names {reserved} are reserved for the "
                             f"keys of api_keys ({self.name}-key<N>)")
        return self

    def all_keys(self) -> list[tuple[str, str]]:
        """(tenant name, key reference) of every key of this tier."""
        keys = [(f"{self.name}-key{i}", k.get_secret_value()) for i, k in enumerate(self.api_keys)]
        return keys + [(t.name, k.get_secret_value()) for t in self.tenants for k in t.api_keys]

    def weight_of(self, tenant: str) -> float:
        return next((t.weight for t in self.tenants if t.name == tenant), 1.0)


def _default_tiers() -> list[TierConfig]:
    """The default config's tiers and targets (sized for SmolLM2-135M on a CPU core, where a
    lone request's time per output token is about 25 ms and its p99 about 50 ms)."""
    return [
        TierConfig(name="interactive", base_priority=10, max_priority=15, queue_share=1.0,
                   ttft_target_s=3.0, tpot_target_s=0.1, max_held=256, late_after_s=10.0),
        TierConfig(name="standard", base_priority=5, max_priority=9, queue_share=0.8,
                   ttft_target_s=15.0, tpot_target_s=0.5, max_held=256, late_after_s=10.0),
        TierConfig(name="batch", base_priority=0, max_priority=4, queue_share=0.5,
                   ttft_target_s=60.0, max_held=128, late_after_s=40.0),
    ]


class FlowConfig(_Strict):
    """Flow control at the ingress (``cluster/flow.py``).

    enabled: hold requests at the ingress while the replicas cannot start them (off: every
    request goes straight to a replica, as before). starting_per_replica: requests dispatched
    to a replica and not yet answering (no first token yet) per replica: the dispatch window
    (a tier dispatches while those it counts fill less than its ``queue_share`` of it; under
    priority scheduling it counts only its own requests and those of the tiers above it, which
    a replica admits ahead of the lower tiers' waiting there, so all tiers together may pass
    it). max_held: requests held at most, all tiers (a full queue sheds late requests, then
    evicts, from the lowest tier first). max_hold_s: the longest any request is held, late or
    not (the hard ceiling; a client that leaves sooner is dropped at once). shed_status: the
    status of a shed request (429 or 503, with a ``Retry-After`` estimated from how fast its
    tier starts requests). tenant_header: a header naming the tenant inside the caller's tier
    (for gateways that authenticate upstream); None: tenants are API keys. aging_s,
    aged_share: a request held longer than ``aging_s`` goes ahead of higher tiers, for at most
    ``aged_share`` of the dispatches (no tier starves; under overload the lower tiers still
    absorb it); ``aging_s`` None: strict priority. tenant_burst_s: a tenant coming back from
    idle to a tier whose other tenants are backlogged first catches up what it missed in the
    last ``tenant_burst_s`` seconds, so that its burst goes ahead of them while a higher tier
    leaves its tier short, at the cost of their shares over that span (0, the default: the
    plain Virtual Token Counter, idle time banks nothing).
    """

    enabled: bool = True
    starting_per_replica: int = Field(default=8, ge=1, le=4096)
    max_held: int = Field(default=1024, ge=0)
    max_hold_s: float = Field(default=300.0, gt=0.0, le=86400.0)
    shed_status: Literal[429, 503] = 429
    tenant_header: str | None = Field(default=None, pattern=r"^[A-Za-z0-9-]{1,64}$")
    aging_s: float | None = Field(default=20.0, gt=0.0)
    aged_share: float = Field(default=0.05, ge=0.0, le=1.0)
    tenant_burst_s: float = Field(default=0.0, ge=0.0, le=3600.0)


class ClusterConfig(_Strict):
    """The whole application's settings.

    served_model_name: the name clients pass as ``model`` (default: the engine's model).
    anonymous_tier: the tier of a request without an API key (without any key configured:
    every request's); ``None`` makes a key mandatory. With keys configured it may not rank
    above any tier that has keys (a caller would raise its tier by dropping its key).
    max_request_bytes: requests with a larger body get 413. body_timeout_s: a body not all
    received this long after its headers gets 408 (a client that trickles its body holds no
    more than this). max_tokens_limit: the largest
    ``max_tokens`` a request may ask for. max_stop_strings: the most ``stop`` strings per request.
    retry_after_s: the least ``Retry-After`` of a 429 (flow control estimates more when a tier
    starts its held requests slowly). max_inflight_requests: requests in flight
    through the ingress at most (a tier may use its ``queue_share`` of them); beyond, 429.
    max_n: the most samples (``n``) one request may ask for. replica_retries: how many times a request whose
    replica failed before its first token is sent again (to another replica). fault_injection:
    lets ``LLMServer.inject_fault`` break a replica (for the fault tests only).
    prefix_cache_scope: ``tenant`` (the default): a prompt's cached blocks are shared only
    between requests of the same tenant (and the same ``cache_salt``), so ``cached_tokens`` never
    tells one tenant about another's prompts; callers who name no tenant (no keys, no tenant
    header) are one tenant. ``shared``: every tenant shares (more hits, and that side channel):
    an explicit choice. structured_limits: what the ingress takes in a request's JSON schemas
    (``tierserve.cluster.structured.SchemaLimits``). flow: flow control at the ingress
    (``FlowConfig``).
    """

    engine: EngineConfig = Field(default_factory=EngineConfig)
    served_model_name: str | None = None
    tiers: list[TierConfig] = Field(default_factory=_default_tiers, min_length=1)
    anonymous_tier: str | None = "standard"
    max_request_bytes: int = Field(default=1 << 20, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    max_tokens_limit: int = Field(default=4096, gt=0)
    max_stop_strings: int = Field(default=8, ge=0, le=MAX_STOP_STRINGS)
    retry_after_s: int = Field(default=1, ge=0)
    replica_retries: int = Field(default=2, ge=0, le=10)
    max_inflight_requests: int = Field(default=1024, gt=0)
    max_n: int = Field(default=8, ge=1, le=128)
    fault_injection: bool = False
    prefix_cache_scope: Literal["tenant", "shared"] = "tenant"
    structured_limits: SchemaLimits = Field(default_factory=SchemaLimits)
    flow: FlowConfig = Field(default_factory=FlowConfig)

    @field_validator("tiers")
    @classmethod
    def _unique(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        keys = [k for t in tiers for _, k in t.all_keys()]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key is listed in more than one tier")
        return tiers

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "default_tier" in data:
            raise ValueError(
                "default_tier is now anonymous_tier: the tier of a request without an API key. "
                "With keys configured it may not rank above any tier that has keys (null: a key "
                "is required)")
        return data

    @model_validator(mode="after")
    def _anonymous_tier(self) -> ClusterConfig:
        tiers = {t.name: t for t in self.tiers}
        anon = tiers.get(self.anonymous_tier) if self.anonymous_tier is not None else None
        if self.anonymous_tier is not None and anon is None:
            raise ValueError(
                f"anonymous_tier {self.anonymous_tier!r} is not one of the tiers {list(tiers)}")
        keyed = [t for t in self.tiers if t.all_keys()]
        if anon is None and not keyed:
            raise ValueError(
                "anonymous_tier is null (an API key is required) but no tier has api_keys: no "
                "request could ever be served; add keys or name an anonymous tier"
            )
        if anon is not None:
            above = [t.name for t in keyed if t is not anon and (
                anon.base_priority > t.base_priority or anon.max_priority > t.max_priority)]
            if above:
                raise ValueError(
                    f"anonymous_tier {anon.name!r} (priorities {anon.base_priority} to "
                    f"{anon.max_priority}) ranks above the keyed tier(s) {above}: a caller "
                    "would raise its tier by dropping its key; name the lowest tier, a tier of "
                    "its own below every keyed one, or null (a key is required)")
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def latency_floor(self) -> int:
        """The top tier's ``base_priority``: requests at or above it are routed for their first
        token (``GenerateRequest.latency``), the others for room and balance."""
        return max(t.base_priority for t in self.tiers)


def resolve_key(ref: str) -> str:
    """The key an ``api_keys`` entry stands for (see ``TierConfig``). Raises ``ValueError`` for a
    missing variable, an unreadable file or an empty key, without showing any key."""
    if ref.startswith("env:"):
        name = ref[4:]
        value = os.environ.get(name)
        if value is None:
            raise ValueError(f"API key reference {ref!r}: environment variable {name!r} is not set")
    elif ref.startswith("file:"):
        try:
            value = Path(ref[5:]).expanduser().read_text()
        except OSError as e:
            raise ValueError(f"API key reference {ref!r}: cannot read the file ({e.strerror})") from None
    else:
        value = ref
    value = value.strip()
    if not value:
        raise ValueError(f"API key {ref!r} is empty" if ref.startswith(("env:", "file:"))
                         else "an API key is empty")
    return value
