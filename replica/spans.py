"""The replica's trace spans of one request (``tierserve.cluster.tracing`` sets the tracer up).

``request_span`` opens ``tierserve.replica.generate`` as the child of the ingress's span that sent
the request (``GenerateRequest.traceparent``); it lives as long as the request's stream here.
Each sample's engine phases are recorded when the sample ends, from the times its last delta
carries (``RequestOutput.queue_s``, ``ttft_s``, ``e2e_s``: one clock, the engine's), as spans with
explicit start and end times: ``tierserve.engine.queue`` (arrival to admission, a structured
output's grammar compile included), ``tierserve.engine.prefill`` (admission to the first
token) and ``tierserve.engine.decode`` (first token to the end: its finish reason, tokens and
preemptions). Nothing is held open across the engine's step loop, and nothing is done per token.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from tierserve.records import ErrorRecord, GenerateRequest, RequestOutput
from tierserve.replica import tracing


def request_span(request: GenerateRequest, replica_id: str) -> Span:
    """The span of ``request`` on this replica (a no-op one when tracing is off)."""
    return tracing.tracer().start_span(
        "tierserve.replica.generate", context=tracing.context_of(request.traceparent),
        kind=SpanKind.SERVER, attributes={
            "tierserve.request_id": request.request_id,
            "tierserve.tier": request.tier,
            "tierserve.replica.id": replica_id,
            "tierserve.n": request.n,
            "gen_ai.usage.input_tokens": len(request.prompt_ids),
            "gen_ai.request.max_tokens": request.sampling.max_tokens,
        })


def sample_ended(span: Span, out: RequestOutput, now: float | None = None) -> None:
    """Record the engine phases of the sample whose last delta is ``out`` under ``span``
    (``now``: ``time.time()`` when it arrived here; its end)."""
    if not span.is_recording() or out.e2e_s is None:
        return
    end = time.time() if now is None else now
    arrival = end - out.e2e_s
    admitted = None if out.queue_s is None else arrival + out.queue_s
    first = None if out.ttft_s is None else arrival + out.ttft_s
    ctx = trace.set_span_in_context(span)
    t = tracing.tracer()
    ns = tracing.seconds_ns
    common: dict[str, str | int | float] = {"tierserve.sample": out.index}
    queue = t.start_span("tierserve.engine.queue", context=ctx, start_time=ns(arrival),
                         attributes=common)
    queue.end(end_time=ns(admitted if admitted is not None else end))
    if admitted is None:
        return
    prefill_end = first if first is not None else end
    prefill = t.start_span("tierserve.engine.prefill", context=ctx, start_time=ns(admitted),
                           attributes=common | {"gen_ai.usage.input_tokens": out.prompt_tokens,
                                                "tierserve.cached_tokens": out.cached_tokens or 0})
    prefill.end(end_time=ns(prefill_end))
    if first is None:
        return
    attrs: dict[str, str | int | float] = common | {
        "gen_ai.usage.output_tokens": out.completion_tokens,
        "gen_ai.response.finish_reason": out.finish_reason or "",
        "tierserve.preemptions": out.preemptions}
    if out.tpot_s is not None:
        attrs["tierserve.tpot_ms"] = round(out.tpot_s * 1000, 3)
    decode = t.start_span("tierserve.engine.decode", context=ctx, start_time=ns(first),
                          attributes=attrs)
    decode.add_event("first_token", timestamp=ns(first))
    decode.end(end_time=ns(end))


def refused(span: Span, error: ErrorRecord) -> None:
    """The replica refused the request with ``error``: an exception event and the span's error
    status (the ingress's trace shows why)."""
    span.add_event("exception", {"exception.type": "ErrorRecord",  # (no message: as the ingress)
                                 "http.response.status_code": error.status,
                                 "error.type": error.code})
    span.set_status(Status(StatusCode.ERROR, error.code))
