"""Who is calling and how urgent it is: API key -> tier, ``X-TL-Priority`` -> priority in the tier.

Without any API key in the config, an ``Authorization`` header is accepted and ignored (as vLLM
does without ``--api-key``: the ``openai`` SDK always sends one) and every caller gets the default
tier. With keys, a key must be one of them (else 401) and no key means the default tier.
Keys are compared in constant time (``hmac.compare_digest`` against every configured key, no early
exit) and never logged. A caller never gets above its tier: the header may choose any priority
from the tier's ``base_priority`` to its ``max_priority``; a value outside that range is a 400.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from cluster.config import ClusterConfig, TierConfig, resolve_key


class AuthError(Exception):
    """Missing or unknown API key (401)."""


class PriorityError(ValueError):
    """A bad ``X-TL-Priority`` header (400)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """A resolved caller. ``latency``: its requests are routed for their first token: its
    priority reaches the top tier's ``base_priority`` (the interactive tier by default)."""

    tier: TierConfig
    priority: int
    latency: bool = False


# What X-TL-Priority may hold (also the pattern in the OpenAPI document).
PRIORITY_PATTERN = "^[ \t]*(-?[0-9]{1,9})?[ \t]*$"
_PRIORITY = re.compile(r"-?[0-9]{1,9}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class TierResolver:
    def __init__(self, config: ClusterConfig) -> None:
        self._tiers = {t.name: t for t in config.tiers}
        self._default = self._tiers.get(config.default_tier) if config.default_tier else None
        self._keys = [(_digest(resolve_key(k.get_secret_value())), t)
                      for t in config.tiers for k in t.api_keys]
        if len({d for d, _ in self._keys}) != len(self._keys):
            raise ValueError("an API key is listed more than once (after resolving env:/file:)")
        self.latency_floor = config.latency_floor

    def resolve(self, authorization: str | None, priority_header: str | None) -> Caller:
        """The caller's tier and priority; raises ``AuthError`` or ``PriorityError``."""
        tier = self._tier(authorization)
        priority = self._priority(tier, priority_header)
        return Caller(tier, priority, priority >= self.latency_floor)

    def _tier(self, authorization: str | None) -> TierConfig:
        if not self._keys and self._default is not None:
            return self._default  # no keys configured: whatever the client sends is ignored
        if not authorization:
            if self._default is None:
                raise AuthError("this server needs an API key: send 'Authorization: Bearer <key>'")
            return self._default
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError("the Authorization header must be 'Bearer <key>'")
        probe = _digest(token.strip())
        found: TierConfig | None = None
        for digest, tier in self._keys:  # no early exit: the time does not depend on the match
            if hmac.compare_digest(probe, digest):
                found = tier
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
