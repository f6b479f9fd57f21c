"""The ingress's metrics, on the definitions of ``tierserve.replica.metrics`` (the one place every tierserve
metric is defined): what it refuses itself, goodput per tier, flow control."""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.replica.metrics import (
    COUNTERS,
    INGRESS_COUNTERS,
    INGRESS_GAUGES,
    INGRESS_REJECTIONS,
    NO_TIER,
    SHED_REASONS,
    SLO_OUTCOMES,
    SLO_TARGETS,
    STRUCTURED_KINDS,
    _zero,
    zero_counters,
)

# Requests per LoRA adapter (the ingress's; defined here beside its use, with the label values
# bounded by ``IngressMetrics.adapter_labels``).
ADAPTER_COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tierserve_adapter_requests": (
        "Requests the ingress admitted under a LoRA adapter, per parent model, adapter (a "
        "registered name; `_other` past the bound) and tier.", ("model", "adapter", "tier")),
}
OTHER_ADAPTER = "_other"


class IngressMetrics:
    """What the ingress refuses before any replica sees the request: ``shed`` (a tier past its
    share of ``max_inflight_requests``, or shed by flow control) and ``queue_full``
    (``max_inflight_requests`` reached); whether each request met its tier's targets; what flow
    control holds and sheds; tokens served per tenant.

    The same ``tierserve_rejections`` series as the replicas' (Serve's ``deployment`` label tells
    them apart), so a dashboard's ``sum by (reason)`` counts every refusal once.
    """

    def __init__(self, tiers: Sequence[str] = (), models: Sequence[str] = ()) -> None:
        from ray.serve.metrics import Counter, Gauge

        doc, tags = COUNTERS["tierserve_rejections"]
        self.rejections = Counter("tierserve_rejections", description=doc,
                                  tag_keys=tags)  # type: ignore[arg-type]
        zero_counters({"tierserve_rejections": self.rejections}, tiers, INGRESS_REJECTIONS)
        self.counters = {
            name: Counter(name, description=doc, tag_keys=tags)  # type: ignore[arg-type]
            for name, (doc, tags) in INGRESS_COUNTERS.items()}
        self.counters.update({
            name: Counter(name, description=doc, tag_keys=tags)  # type: ignore[arg-type]
            for name, (doc, tags) in ADAPTER_COUNTERS.items()})
        self._adapters: set[str] = set()
        self._max_adapters = 0
        self.gauges = {
            name: Gauge(name, description=doc, tag_keys=tags)  # type: ignore[arg-type]
            for name, (doc, tags) in INGRESS_GAUGES.items()}
        for tier in tiers:
            for target in SLO_TARGETS:
                for outcome in SLO_OUTCOMES:
                    _zero(self.counters["tierserve_slo_requests"],
                          {"tier": tier, "target": target, "outcome": outcome})
            for reason in SHED_REASONS:
                _zero(self.counters["tierserve_flow_shed"], {"tier": tier, "reason": reason})
            for kind in STRUCTURED_KINDS:
                _zero(self.counters["tierserve_structured_requests"], {"tier": tier, "kind": kind})
            for model in models:
                _zero(self.counters["tierserve_model_requests"], {"model": model, "tier": tier})

    def rejected(self, reason: str, tier: str) -> None:
        self.rejections.inc(1, tags={"reason": reason, "tier": tier or NO_TIER})

    def slo(self, tier: str, ttft_met: bool | None, tpot_met: bool | None, both: bool) -> None:
        """One request against its tier's targets (``ttft_met``/``tpot_met`` None: the tier has
        no such target, the request made too few tokens to have a time per output token, or it
        failed first; ``both``: it was answered and met every target it could be measured on)."""
        c = self.counters["tierserve_slo_requests"]
        for target, met in (("ttft", ttft_met), ("tpot", tpot_met)):
            if met is not None:
                c.inc(1, tags={"tier": tier, "target": target,
                               "outcome": "met" if met else "missed"})
        c.inc(1, tags={"tier": tier, "target": "both", "outcome": "met" if both else "missed"})

    def structured(self, tier: str, kind: str) -> None:
        """A request whose output is constrained (``kind``: one of ``STRUCTURED_KINDS``)."""
        self.counters["tierserve_structured_requests"].inc(1, tags={"tier": tier, "kind": kind})

    def model_request(self, model: str, tier: str) -> None:
        """A request admitted for ``model`` (a configured name: the label's values are bounded)."""
        self.counters["tierserve_model_requests"].inc(1, tags={"model": model, "tier": tier})

    def adapter_labels(self, static: Sequence[str], most: int) -> None:
        """The adapter label's values: ``static``'s names from the start, then each dynamic
        adapter's as it is first counted, ``most`` in all (the static ones and
        ``max_dynamic_loras``); past that (names loaded and unloaded over time), ``_other``."""
        self._adapters = set(static)
        self._max_adapters = max(most, len(self._adapters))

    def adapter_request(self, model: str, adapter: str, tier: str) -> None:
        """A request admitted under ``adapter`` of ``model`` (its label bounded:
        ``adapter_labels``)."""
        if adapter not in self._adapters:
            if len(self._adapters) >= self._max_adapters:
                adapter = OTHER_ADAPTER
            else:
                self._adapters.add(adapter)
        self.counters["tierserve_adapter_requests"].inc(
            1, tags={"model": model, "adapter": adapter, "tier": tier})

    def shed(self, tier: str, reason: str) -> None:
        self.counters["tierserve_flow_shed"].inc(1, tags={"tier": tier, "reason": reason})
        self.rejected("shed", tier)

    def tenant_tokens(self, tier: str, tenant: str, tokens: int) -> None:
        if tokens > 0:
            self.counters["tierserve_tenant_tokens"].inc(tokens,
                                                         tags={"tier": tier, "tenant": tenant})

    def flow(self, held: dict[str, int], starting: int, window: int, model: str = "") -> None:
        """One model's gate's gauges (``model``: its served name)."""
        for tier, n in held.items():
            self.gauges["tierserve_flow_held"].set(n, tags={"tier": tier, "model": model})
        self.gauges["tierserve_flow_starting"].set(starting, tags={"model": model})
        self.gauges["tierserve_flow_window"].set(window, tags={"model": model})
