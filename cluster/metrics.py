"""The ingress's metric: the requests it refuses itself, on the definitions of
``replica.metrics`` (the one place every tierserve metric is defined)."""

from __future__ import annotations

from collections.abc import Sequence

from replica.metrics import COUNTERS, INGRESS_REJECTIONS, NO_TIER, zero_counters


class IngressMetrics:
    """What the ingress refuses before any replica sees the request: ``shed`` (a tier past its
    share of ``max_inflight_requests``) and ``queue_full`` (``max_inflight_requests`` reached).

    The same ``tierserve_rejections`` series as the replicas' (Serve's ``deployment`` label tells
    them apart), so a dashboard's ``sum by (reason)`` counts every refusal once.
    """

    def __init__(self, tiers: Sequence[str] = ()) -> None:
        from ray.serve.metrics import Counter

        doc, tags = COUNTERS["tierserve_rejections"]
        self.rejections = Counter("tierserve_rejections", description=doc,
                                  tag_keys=tags)  # type: ignore[arg-type]
        zero_counters({"tierserve_rejections": self.rejections}, tiers, INGRESS_REJECTIONS)

    def rejected(self, reason: str, tier: str) -> None:
        self.rejections.inc(1, tags={"reason": reason, "tier": tier or NO_TIER})
