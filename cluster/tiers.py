"""Who is calling and how urgent it is: API key -> tier, ``X-TL-Priority`` -> priority in the tier.

Without any API key in the config, an ``Authorization`` header is accepted and ignored (as vLLM
does without ``--api-key``: the ``openai`` SDK always sends one) and every caller gets the
anonymous tier. With keys, a key must be one of them (else 401), and a request without one is
refused (401) unless the config names an ``anonymous_tier``, which may not rank above any keyed
tier (``ClusterConfig`` checks it): dropping a key never raises a caller's tier.
Keys are compared in constant time (``hmac.compare_digest`` against every configured key, no early
exit) and never logged. A caller never gets above its tier: the header may choose any priority
from the tier's ``base_priority`` to its ``max_priority``; a value outside that range is a 400.

The tenant (fairness inside a tier, ``cluster/flow.py``): the tenant whose key was sent (a key of
a tier's ``api_keys`` is a tenant of its own), else, when the operator names a tenant header
(``flow.tenant_header``), the header's value, else ``default``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from tierserve.cluster.config import TENANT_NAME, ClusterConfig, TierConfig, resolve_key
from tierserve.records import BadRequest, Unauthorized


class AuthError(Unauthorized):
    """Missing or unknown API key (401)."""


class PriorityError(BadRequest, ValueError):
    """A bad ``X-TL-Priority`` header (400)."""

    code = "invalid_priority"
    param = "X-TL-Priority"


class TenantError(BadRequest, ValueError):
    """A bad tenant header (400); ``param`` names the header (``flow.tenant_header``)."""

    code = "invalid_tenant"


DEFAULT_TENANT = "default"
_TENANT = re.compile(TENANT_NAME)


@dataclass(frozen=True, slots=True)
class Caller:
    """A resolved caller. ``latency``: its requests are routed for their first token: its
    priority reaches the top tier's ``base_priority`` (the interactive tier by default)."""

    tier: TierConfig
    priority: int
    latency: bool = False
    tenant: str = DEFAULT_TENANT
    weight: float = 1.0
    # The served models it may use (its tier's and tenant's ``models``); None: every one. Set
    # by its key, never moved by a priority or ``service_tier`` it asks for.
    models: frozenset[str] | None = None
    # Its key is one of the config's ``admin_keys`` (it may load and unload LoRA adapters);
    # never a caller without a key.
    admin: bool = False
    # Its tenant was identified by a valid API key (not claimed by the tenant header, nor the
    # default): only such a tenant may own a LoRA adapter (``Adapter.tenants``).
    keyed: bool = False

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


# What X-TL-Priority may hold (also the pattern in the OpenAPI document).
PRIORITY_PATTERN = "^[ \t]*(-?[0-9]{1,9})?[ \t]*$"
_PRIORITY = re.compile(r"-?[0-9]{1,9}")


def cache_partition(caller: Caller, salt: str | None, scope: str = "tenant") -> str | None:
    """The prefix-cache partition of a request (``GenerateRequest.cache_partition``): its
    tenant's with ``scope`` ``tenant`` (callers who name none share the common one), and within
    it its ``cache_salt``'s; None: the shared partition."""
    parts = []
    if scope == "tenant" and caller.tenant != DEFAULT_TENANT:
        parts.append(f"tenant={caller.tenant}")
    if salt is not None:
        parts.append(f"salt={salt}")
    return "\x1f".join(parts) or None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


# The ``service_tier`` values served as ``priority`` (OpenAI's ``fast`` is its alias there;
# ``ultrafast``, a faster tier still at OpenAI, has nothing faster to run in here).
PRIORITY_ALIASES = frozenset({"priority", "fast", "ultrafast"})


class TierResolver:
    def __init__(self, config: ClusterConfig) -> None:
        self._tiers = {t.name: t for t in config.tiers}
        self._anonymous = (self._tiers.get(config.anonymous_tier) if config.anonymous_tier
                           else None)
        self._keys = [(_digest(resolve_key(k)), t, tenant)
                      for t in config.tiers for tenant, k in t.all_keys()]
        if len({d for d, _, _ in self._keys}) != len(self._keys):
            raise ValueError("an API key is listed more than once (after resolving env:/file:)")
        self.latency_floor = config.latency_floor
        # Tenants a key identifies: the tenant header may not claim them.
        self._keyed = {t.name: {name for name, _ in t.all_keys()} for t in config.tiers}
        self._tenant_header = config.flow.tenant_header
        # The admin keys' digests: each must be a tier's key too (it is served in that tier).
        self._admins = [_digest(resolve_key(k.get_secret_value())) for k in config.admin_keys]
        tier_keys = {d for d, _, _ in self._keys}
        for i, d in enumerate(self._admins):
            if d not in tier_keys:
                raise ValueError(f"admin_keys.{i} is not one of the tiers' api_keys: an admin "
                                 "key must also be a tier's key (the tier it is served in)")

    def resolve(self, authorization: str | None, priority_header: str | None,
                tenant_header: str | None = None) -> Caller:
        """The caller's tier, priority and tenant; raises ``AuthError``, ``PriorityError`` or
        ``TenantError``."""
        tier, tenant = self._tier(authorization)
        keyed = tenant is not None  # a key was sent and is valid
        priority = self._priority(tier, priority_header)
        if tenant is None:
            tenant = self._tenant(tenant_header)
            if tenant in self._keyed.get(tier.name, ()):
                raise TenantError(f"tenant {tenant!r} is identified by its API key, not by the "
                                  "tenant header", param=self._tenant_header)
        admin = keyed and self._is_admin(authorization)
        return Caller(tier, priority, priority >= self.latency_floor, tenant,
                      tier.weight_of(tenant), tier.models_of(tenant), admin, keyed)

    def _is_admin(self, authorization: str | None) -> bool:
        """Whether the (valid) key sent is one of ``admin_keys``, compared as keys are: in
        constant time against every admin key, no early exit."""
        if not self._admins or not authorization:
            return False
        token = authorization.partition(" ")[2].strip()
        probe = _digest(token)
        found = False
        for digest in self._admins:
            if hmac.compare_digest(probe, digest):
                found = True
        return found

    def shifted(self, caller: Caller, offset: int) -> Caller:
        """``caller`` with vLLM's ``priority`` applied: ``offset`` on vLLM's scale, where lower
        runs first and 0 is the default, so the priority becomes ``caller.priority - offset``,
        kept within the caller's tier (never above what its key allows, never below its base)."""
        tier = caller.tier
        value = min(max(caller.priority - offset, tier.base_priority), tier.max_priority)
        return Caller(tier, value, value >= self.latency_floor, caller.tenant, caller.weight,
                      caller.models, caller.admin, caller.keyed)

    def for_service_tier(self, caller: Caller, asked: str, priority_given: bool
                         ) -> tuple[Caller, str]:
        """OpenAI's ``service_tier`` on the tiers, never above what ``caller``'s key allows:
        ``flex`` runs in the lowest tier (at its base priority), ``priority`` in the caller's
        own tier at its highest priority, ``auto``, ``default`` and ``scale`` as the caller is.
        Returns the caller it runs as and the ``service_tier`` the answer names. ``fast`` and
        ``ultrafast`` are ``priority`` (the answer says ``priority``, as OpenAI's does for
        ``fast``: no tier runs faster than the caller's own at its highest priority). A priority
        asked for besides (``priority_given``) goes only with the last three (else a 400)."""
        if (asked == "flex" or asked in PRIORITY_ALIASES) and priority_given:
            raise PriorityError(f"service_tier {asked!r} sets the priority itself: send it "
                                "without priority or X-TL-Priority", param="service_tier")
        if asked == "flex":
            low = min(self._tiers.values(), key=lambda t: (t.base_priority, t.max_priority))
            if (low.base_priority, low.max_priority) >= (caller.tier.base_priority,
                                                         caller.tier.max_priority):
                low = caller.tier  # the caller's tier is the lowest already
            return Caller(low, low.base_priority, low.base_priority >= self.latency_floor,
                          caller.tenant, low.weight_of(caller.tenant), caller.models,
                          caller.admin, caller.keyed), "flex"
        if asked in PRIORITY_ALIASES:
            top = caller.tier.max_priority
            return Caller(caller.tier, top, top >= self.latency_floor, caller.tenant,
                          caller.weight, caller.models, caller.admin, caller.keyed), "priority"
        return caller, "default"

    def _tenant(self, header: str | None) -> str:
        if header is None or not header.strip():
            return DEFAULT_TENANT
        text = header.strip()
        if not _TENANT.fullmatch(text):
            raise TenantError("the tenant header must be 1 to 64 letters, digits, '.', '_' or "
                              f"'-', starting with a letter or digit; got {text[:32]!r}",
                              param=self._tenant_header)
        return text

    def _tier(self, authorization: str | None) -> tuple[TierConfig, str | None]:
        if not self._keys and self._anonymous is not None:
            return self._anonymous, None  # no keys configured: whatever the client sends is ignored
        if not authorization:
            if self._anonymous is None:
                raise AuthError("this server needs an API key: send 'Authorization: Bearer <key>'")
            return self._anonymous, None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("the Authorization header must be 'Bearer <key>'")
        probe = _digest(token.strip())
        found: tuple[TierConfig, str] | None = None
        for digest, tier, tenant in self._keys:  # no early exit: time independent of the match
            if hmac.compare_digest(probe, digest):
                found = (tier, tenant)
        if found is None:
            raise AuthError("the API key is not valid")
        return found

    @staticmethod
    def _priority(tier: TierConfig, header: str | None) -> int:
        if header is None or header.strip(" \t") == "":
            return tier.base_priority
        text = header.strip(" \t")
        if not _PRIORITY.fullmatch(text):
            raise PriorityError(
                f"X-TL-Priority must be an integer of at most 9 digits, got {text[:32]!r}"
            )
        value = int(text, 10)
        if not tier.base_priority <= value <= tier.max_priority:
            raise PriorityError(
                f"X-TL-Priority {value} is outside what tier {tier.name!r} allows "
                f"({tier.base_priority} to {tier.max_priority})"
            )
        return value
