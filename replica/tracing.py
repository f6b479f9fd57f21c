"""OpenTelemetry tracing: its set-up from the standard ``OTEL_*`` variables, the tracer the
ingress and the replicas take their spans from, and W3C trace context across the handle call.
It lives in the replica's layer, the lowest that traces, so that both processes set themselves
up with the same code; the ingress takes it as ``tierserve.cluster.tracing``.

Off by default: with ``OTEL_TRACES_EXPORTER`` unset (or ``none``) no tracer provider is set, so
every span comes from the API's no-op tracer (no recording, no export, next to no cost). On with
``OTEL_TRACES_EXPORTER`` ``otlp`` (OTLP over HTTP: the ``tracing`` extra's package,
``opentelemetry-exporter-otlp-proto-http``; its endpoint from
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``,
else the exporter's default, ``http://localhost:4318/v1/traces``), ``console`` (spans printed
as JSON on stdout), or a comma-separated list of them. ``OTEL_SERVICE_NAME`` names the service
(default ``tierserve``); ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` pick the
sampler by the SDK's names (default ``parentbased_always_on``: a client's sampled
``traceparent`` is followed). A value this module cannot use is a ``TracingConfigError`` at
start (``tierserve serve`` checks before Ray starts), never a silent fallback.

Every process sets itself up (``setup``): the ingress and each replica are separate Ray actors,
which read the variables of the environment Ray's workers inherit (see docs/observability.md).
The request's context goes to the replica as a ``traceparent`` string on
``tierserve.records.GenerateRequest`` (``traceparent`` here, ``context_of`` there), so the
replica's spans join the ingress's trace.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACER_NAME = "tierserve"
DEFAULT_SERVICE_NAME = "tierserve"
EXPORTERS = ("otlp", "console", "none")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
# The longest traceparent taken from a client or a record (W3C's is 55 characters; a later
# version may append fields): anything longer is ignored, not parsed.
MAX_TRACEPARENT = 256
MAX_TRACESTATE = 512
OTLP_PACKAGE = "opentelemetry-exporter-otlp-proto-http"

_propagator = TraceContextTextMapPropagator()


class TracingConfigError(ValueError):
    """An ``OTEL_*`` variable this server cannot use (named in the message)."""


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """What the ``OTEL_*`` variables ask for. ``exporters``: empty when tracing is off;
    ``endpoint``: the OTLP traces URL (None: the exporter's default)."""

    exporters: tuple[str, ...] = ()
    service_name: str = DEFAULT_SERVICE_NAME
    endpoint: str | None = None
    sampler: str = "parentbased_always_on"
    sampler_arg: float | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)


def settings(env: Mapping[str, str] | None = None) -> TracingSettings:
    """The tracing settings of ``env`` (default: this process's environment); raises
    ``TracingConfigError`` naming a variable whose value is not one this server takes."""
    env = os.environ if env is None else env
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    names = [n.strip() for n in raw.split(",") if n.strip()]
    bad = [n for n in names if n not in EXPORTERS]
    if bad:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER: unknown exporter {bad[0]!r}; this server takes "
            f"{', '.join(EXPORTERS)} (or a comma-separated list of them)")
    exporters = tuple(dict.fromkeys(n for n in names if n != "none"))
    service = env.get("OTEL_SERVICE_NAME", "").strip() or DEFAULT_SERVICE_NAME
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or None
    if endpoint is None:
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        endpoint = f"{base.rstrip('/')}/v1/traces" if base else None
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise TracingConfigError(f"the OTLP endpoint must be an http:// or https:// URL, got "
                                 f"{endpoint[:64]!r}")
    sampler = env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if sampler not in SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER: unknown sampler {sampler!r}; this "
                                 f"server takes {', '.join(SAMPLERS)}")
    arg: float | None = None
    text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
    if text and sampler.endswith("traceidratio"):
        try:
            arg = float(text)
        except ValueError:
            arg = -1.0
        if not 0.0 <= arg <= 1.0:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG: a ratio from 0 to 1, got "
                                     f"{text[:32]!r}")
    return TracingSettings(exporters, service, endpoint, sampler, arg)


def _sampler(s: TracingSettings) -> Any:
    from opentelemetry.sdk.trace import sampling

    ratio = 1.0 if s.sampler_arg is None else s.sampler_arg
    base: Any = {"always_on": sampling.ALWAYS_ON, "always_off": sampling.ALWAYS_OFF,
                 "traceidratio": sampling.TraceIdRatioBased(ratio)}[
        s.sampler.removeprefix("parentbased_")]
    return sampling.ParentBased(base) if s.sampler.startswith("parentbased_") else base


def _otlp_exporter(endpoint: str | None) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise TracingConfigError(
            f"OTEL_TRACES_EXPORTER=otlp needs the package {OTLP_PACKAGE!r}, which is not "
            f"installed: pip install 'tierserve[tracing]' (or {OTLP_PACKAGE})") from None
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


def make_provider(s: TracingSettings) -> Any:
    """An SDK tracer provider exporting as ``s`` asks (None when tracing is off): batched, so a
    request never waits on an export."""
    if not s.enabled:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    exporters = [_otlp_exporter(s.endpoint) if name == "otlp" else ConsoleSpanExporter()
                 for name in s.exporters]
    provider = TracerProvider(sampler=_sampler(s),
                              resource=Resource.create({SERVICE_NAME: s.service_name}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


_lock = threading.Lock()
_set_up: TracingSettings | None = None
_override: Any = None  # a provider set by ``use_provider`` (tests), before the global one


def setup(env: Mapping[str, str] | None = None) -> TracingSettings:
    """Set this process's tracer provider from ``env`` once (later calls return the first
    call's settings); raises ``TracingConfigError`` on a bad value. Off: nothing is set."""
    global _set_up
    with _lock:
        if _set_up is not None:
            return _set_up
        s = settings(env)
        provider = make_provider(s)
        if provider is not None:
            trace.set_tracer_provider(provider)
        _set_up = s
        return s


def tracer() -> Tracer:
    """The tracer spans come from: ``use_provider``'s, else the process's (no-op when off)."""
    provider = _override if _override is not None else trace.get_tracer_provider()
    return provider.get_tracer(TRACER_NAME)


@contextmanager
def use_provider(provider: Any) -> Iterator[None]:
    """Take spans from ``provider`` inside the block (a test's, with an in-memory exporter),
    without touching the process's global one (which can be set only once)."""
    global _override
    before = _override
    _override = provider
    try:
        yield
    finally:
        _override = before


def context_of(traceparent: str | None, tracestate: str | None = None) -> otel_context.Context:
    """The context of a W3C ``traceparent`` (and ``tracestate``): a span started in it is the
    sender's child. An absent, oversized or malformed one gives an empty context (a new
    trace)."""
    carrier: dict[str, str] = {}
    if traceparent and len(traceparent) <= MAX_TRACEPARENT:
        carrier["traceparent"] = traceparent
        if tracestate and len(tracestate) <= MAX_TRACESTATE:
            carrier["tracestate"] = tracestate
    return _propagator.extract(carrier, context=otel_context.Context())


def traceparent(span: Span | None = None) -> str:
    """The W3C ``traceparent`` of ``span`` (default: the current one); "" for no valid span
    (tracing off)."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=ctx)
    return carrier.get("traceparent", "")


def seconds_ns(wall_s: float) -> int:
    """A ``time.time()`` instant as the nanoseconds spans take."""
    return int(wall_s * 1e9)
