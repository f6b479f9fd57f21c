"""An in-memory span exporter for the tracing tests: spans go to it through
``tracing.use_provider`` (never the process's global provider) while the context is open."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tierserve.cluster import tracing


@contextmanager
def recorded_spans() -> Iterator[InMemorySpanExporter]:
    """The exporter that receives every span ended while the context is open."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        with tracing.use_provider(provider):
            yield exporter
    finally:
        provider.shutdown()
