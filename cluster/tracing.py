"""Tracing at the ingress: the set-up, tracer and trace-context helpers every tierserve process
shares (``tierserve.replica.tracing``, in the lowest layer that traces, since each replica sets
itself up too), under the cluster's name. ``tierserve.cluster.access`` opens the server span of
each HTTP request; the ingress adds ``tierserve.auth``, ``tierserve.gate`` and
``tierserve.dispatch`` under it and sends the dispatch span's ``traceparent`` to the replica.
See docs/observability.md for the variables, the spans and their attributes.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry.trace import Span, Status, StatusCode

from tierserve.records import ServingError
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
           "TracingSettings", "context_of", "failed", "make_provider", "seconds_ns", "settings",
           "setup", "span", "traceparent", "tracer", "use_provider"]


def failed(span: Span, exc: BaseException) -> None:
    """``exc`` on ``span`` by its type and, for a ``ServingError``, its status and code, never
    its message: a message may quote what the client sent (a header, a template's complaint)."""
    if isinstance(exc, ServingError):
        span.add_event("exception", {"exception.type": type(exc).__name__,
                                     "http.response.status_code": exc.status,
                                     "error.type": exc.code or ""})
        span.set_status(Status(StatusCode.ERROR, exc.code or type(exc).__name__))
    else:
        span.add_event("exception", {"exception.type": type(exc).__name__})
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))


@contextmanager
def span(name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span]:
    """A child span of the current one, current while the block runs; an exception out of the
    block is recorded by ``failed`` (OpenTelemetry's own recording would put the exception's
    message in the span's status) and goes on. A cancellation is not an error: it is left as
    is."""
    with tracer().start_as_current_span(name, attributes=attributes, record_exception=False,
                                        set_status_on_exception=False) as current:
        try:
            yield current
        except Exception as exc:
            failed(current, exc)
            raise

