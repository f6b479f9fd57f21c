"""Tracing at the ingress: the set-up, tracer and trace-context helpers every tierserve process
shares (``tierserve.replica.tracing``, in the lowest layer that traces, since each replica sets
itself up too), under the cluster's name. ``tierserve.cluster.access`` opens the server span of
each HTTP request; the ingress adds ``tierserve.auth``, ``tierserve.gate`` and
``tierserve.dispatch`` under it and sends the dispatch span's ``traceparent`` to the replica.
See docs/observability.md for the variables, the spans and their attributes.
"""

from tierserve.replica.tracing import (
    DEFAULT_SERVICE_NAME,
    EXPORTERS,
    SAMPLERS,
    TRACER_NAME,
    TracingConfigError,
    TracingSettings,
    context_of,
    make_provider,
    seconds_ns,
    settings,
    setup,
    traceparent,
    tracer,
    use_provider,
)

__all__ = ["DEFAULT_SERVICE_NAME", "EXPORTERS", "SAMPLERS", "TRACER_NAME", "TracingConfigError",
           "TracingSettings", "context_of", "make_provider", "seconds_ns", "settings", "setup",
           "traceparent", "tracer", "use_provider"]
