"""The replica's spans of a request (outside Serve, on the embedded model): its span joins the
trace its ``GenerateRequest.traceparent`` names, and each sample's engine phases (queue,
prefill, decode) are child spans recorded when it ends; a refusal is the span's error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.replica.llm_server import collect as run
from tests.replica.llm_server import llm_server
from tests.spans import recorded_spans
from tierserve.cluster import tracing
from tierserve.records import ErrorRecord, GenerateRequest, RequestOutput, SamplingParams
from tierserve.replica.deployment import LLMServer
from tierserve.replica.models.embedded import EMBEDDED_MODEL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def server() -> Iterator[LLMServer]:
    with llm_server() as s:
        yield s


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


def collect(server: LLMServer, n: int = 1, traceparent: str = ""
            ) -> list[RequestOutput | ErrorRecord]:
    return run(server, GenerateRequest((1, 2, 3), SamplingParams(max_tokens=3, ignore_eos=True),
                                       n=n, request_id="span-1", tier="paid",
                                       traceparent=traceparent))


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def test_the_replica_span_joins_the_ingress_trace(server: LLMServer,
                                                  spans: InMemorySpanExporter) -> None:
    items = collect(server, n=2, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    assert all(isinstance(i, RequestOutput) for i in items)
    (top,) = named(spans, "tierserve.replica.generate")
    assert top.kind is SpanKind.SERVER
    assert format(top.context.trace_id, "032x") == TRACE_ID
    assert top.parent is not None and format(top.parent.span_id, "016x") == PARENT_ID
    attrs = dict(top.attributes or {})
    assert attrs["tierserve.request_id"] == "span-1" and attrs["tierserve.tier"] == "paid"
    assert attrs["tierserve.replica.id"] == "replica-7" and attrs["tierserve.n"] == 2
    for phase in ("queue", "prefill", "decode"):
        got = named(spans, f"tierserve.engine.{phase}")
        assert sorted(dict(s.attributes or {})["tierserve.sample"] for s in got) == [0, 1]
        assert all(s.parent is not None and s.parent.span_id == top.context.span_id
                   for s in got), phase
    for decode in named(spans, "tierserve.engine.decode"):
        a = dict(decode.attributes or {})
        assert a["gen_ai.usage.output_tokens"] == 3
        assert a["gen_ai.response.finish_reason"] == "length"
        assert a["tierserve.preemptions"] == 0
        assert [e.name for e in decode.events] == ["first_token"]
    # Each sample's phases follow one another on the engine's one clock.
    for i in (0, 1):
        q, p, d = (next(s for s in named(spans, f"tierserve.engine.{phase}")
                        if dict(s.attributes or {})["tierserve.sample"] == i)
                   for phase in ("queue", "prefill", "decode"))
        assert q.end_time == p.start_time and p.end_time == d.start_time


def test_the_last_delta_carries_the_times_the_spans_are_drawn_from(server: LLMServer) -> None:
    last = collect(server)[-1]
    assert isinstance(last, RequestOutput) and last.finished
    assert last.queue_s is not None and last.ttft_s is not None and last.e2e_s is not None
    assert last.queue_s <= last.ttft_s <= last.e2e_s
    assert last.preemptions == 0


def test_without_a_traceparent_the_replica_starts_a_trace(server: LLMServer,
                                                          spans: InMemorySpanExporter) -> None:
    collect(server)
    (top,) = named(spans, "tierserve.replica.generate")
    assert top.parent is None


def test_tracing_off_the_replica_records_nothing(server: LLMServer) -> None:
    items = collect(server, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    assert isinstance(items[-1], RequestOutput) and items[-1].finished
    assert not tracing.tracer().start_span("probe").is_recording()


def test_each_preemption_is_counted_on_its_sample(spans: InMemorySpanExporter) -> None:
    """A pool too small for the batch preempts; every preemption is on some sample's decode
    span, and their sum is the engine's count."""
    import random

    tight = LLMServer(engine={"model": EMBEDDED_MODEL, "device": "cpu", "num_kv_blocks": 14,
                              "block_size": 16, "max_num_seqs": 12, "num_threads": 1})
    rng = random.Random(2)
    prompts = [tuple(rng.randrange(3, 259) for _ in range(rng.randint(20, 40)))
               for _ in range(12)]

    async def one(ids: tuple[int, ...]) -> list[RequestOutput | ErrorRecord]:
        request = GenerateRequest(ids, SamplingParams(max_tokens=24, temperature=0.0,
                                                      ignore_eos=True))
        return [item async for item in tight.generate(request)]

    async def every() -> list[list[RequestOutput | ErrorRecord]]:
        return list(await asyncio.gather(*(one(p) for p in prompts)))

    try:
        before = tight.engine.stats().preemptions
        outs = asyncio.run(asyncio.wait_for(every(), timeout=120))
        preempted = tight.engine.stats().preemptions - before
    finally:
        tight.engine.shutdown()
    lasts = [items[-1] for items in outs]
    assert all(isinstance(last, RequestOutput) and last.finished for last in lasts)
    counted = [dict(s.attributes or {})["tierserve.preemptions"]
               for s in named(spans, "tierserve.engine.decode")]
    assert len(counted) == 12 and preempted > 0
    assert sum(counted) == preempted == sum(
        last.preemptions for last in lasts if isinstance(last, RequestOutput))


def test_a_refusal_is_the_span_error(server: LLMServer, spans: InMemorySpanExporter) -> None:
    # Last: the fault breaks this module's engine.
    server.inject_fault("injected: the GPU fell off the bus")
    (first,) = collect(server, traceparent=f"00-{TRACE_ID}-{PARENT_ID}-01")
    assert isinstance(first, ErrorRecord)
    (top,) = named(spans, "tierserve.replica.generate")
    assert top.status.status_code is StatusCode.ERROR
    event = next(e for e in top.events if e.name == "exception")
    assert dict(event.attributes or {})["error.type"] == "replica_unavailable"
