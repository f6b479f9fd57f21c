"""Tracing and the access log at the ingress (no Ray: the real ingress class and its middleware
over a stand-in engine, ``stub_ingress``; spans into the SDK's in-memory exporter through
``tracing.use_provider``, never the process's global provider), and the ``OTEL_*`` and
``TIERSERVE_ACCESS_LOG`` settings."""

from __future__ import annotations

import json
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.cluster.stub_ingress import StubIngress
from tests.spans import recorded_spans
from tierserve.cluster import launch, tracing
from tierserve.cluster.access import AccessLogConfigError, access_log_enabled

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
KEYED = {"tiers": [
    {"name": "paid", "base_priority": 5, "max_priority": 9,
     "tenants": [{"name": "acme", "api_keys": ["sk-acme-secret"]}]},
    {"name": "free", "base_priority": 0, "max_priority": 4},
], "anonymous_tier": "free"}
KEY = {"Authorization": "Bearer sk-acme-secret"}
# A client's W3C trace context (sampled).
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress(KEYED)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    with recorded_spans() as exporter:
        yield exporter


def chat(stub: StubIngress, **kw: Any) -> dict[str, Any]:
    return {"model": stub.model, "messages": [{"role": "user", "content": "a secret prompt"}],
            "max_tokens": 4, **kw}


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "tierserve.access"]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


# ------------------------------------------------------------------ spans

def test_a_chat_request_is_one_trace(stub: StubIngress, spans: InMemorySpanExporter) -> None:
    answer = stub.send(CHAT, chat(stub), {**KEY, "X-Request-Id": "trace-me-1"})
    assert answer.status == 200, answer.body
    got = by_name(spans)
    server = got[f"POST {CHAT}"]
    assert server.kind is SpanKind.SERVER and server.parent is None
    attrs = dict(server.attributes or {})
    assert attrs["http.response.status_code"] == 200
    assert attrs["tierserve.request_id"] == "trace-me-1"
    assert attrs["tierserve.tenant"] == "acme" and attrs["tierserve.tier"] == "paid"
    assert attrs["gen_ai.request.model"] == stub.model
    assert attrs["gen_ai.usage.input_tokens"] == len(stub.sent[-1].prompt_ids)
    assert attrs["gen_ai.usage.output_tokens"] == answer.body["usage"]["completion_tokens"]
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    sid = server.context.span_id
    for name in ("tierserve.auth", "tierserve.dispatch"):
        assert parent_of(got[name]) == sid, name
        assert got[name].context.trace_id == server.context.trace_id
    assert "first_token" in [e.name for e in server.events]
    assert server.status.status_code is not StatusCode.ERROR
    # Never the prompt, the answer or the key, in any span.
    for s in spans.get_finished_spans():
        text = json.dumps({k: str(v) for k, v in (s.attributes or {}).items()})
        assert "secret" not in text and "sk-acme" not in text


def test_the_trace_context_reaches_the_replica(stub: StubIngress,
                                               spans: InMemorySpanExporter) -> None:
    stub.send(CHAT, chat(stub), KEY)
    dispatch = by_name(spans)["tierserve.dispatch"]
    sent = stub.sent[-1].traceparent
    version, trace_id, span_id, flags = sent.split("-")
    assert trace_id == format(dispatch.context.trace_id, "032x")
    assert span_id == format(dispatch.context.span_id, "016x")  # the replica's span: its child
    assert version == "00" and int(flags, 16) & 1  # sampled


def test_a_client_traceparent_is_honoured(stub: StubIngress,
                                          spans: InMemorySpanExporter) -> None:
    stub.send(CHAT, chat(stub), {**KEY, "traceparent": TRACEPARENT})
    server = by_name(spans)[f"POST {CHAT}"]
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    assert stub.sent[-1].traceparent.split("-")[1] == TRACE_ID


@pytest.mark.parametrize("bad", ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01",
                                 "00-" + TRACE_ID + "-" + PARENT_ID + "-01" + "x" * 300])
def test_a_malformed_traceparent_starts_a_new_trace(stub: StubIngress, spans: InMemorySpanExporter,
                                                    bad: str) -> None:
    answer = stub.send(CHAT, chat(stub), {**KEY, "traceparent": bad})
    assert answer.status == 200, answer.body
    server = by_name(spans)[f"POST {CHAT}"]
    assert server.parent is None and format(server.context.trace_id, "032x") != TRACE_ID


def test_a_streamed_request_ends_its_span_with_the_stream(
        stub: StubIngress, spans: InMemorySpanExporter) -> None:
    answer = stub.send(CHAT, chat(stub, stream=True, stream_options={"include_usage": True}),
                       KEY)
    assert answer.status == 200 and answer.body[-1]["usage"] is not None
    server = by_name(spans)[f"POST {CHAT}"]
    attrs = dict(server.attributes or {})
    assert attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.usage.output_tokens"] == answer.body[-1]["usage"]["completion_tokens"]
    assert "first_token" in [e.name for e in server.events]
    assert parent_of(by_name(spans)["tierserve.dispatch"]) == server.context.span_id


def test_an_error_is_the_span_status_and_an_exception_event(
        stub: StubIngress, spans: InMemorySpanExporter) -> None:
    answer = stub.send(CHAT, chat(stub), {"Authorization": "Bearer wrong-key"})
    assert answer.status == 401
    got = by_name(spans)
    server = got[f"POST {CHAT}"]
    assert dict(server.attributes or {})["http.response.status_code"] == 401
    event = next(e for e in server.events if e.name == "exception")
    assert dict(event.attributes or {})["error.type"] == "invalid_api_key"
    assert server.status.status_code is StatusCode.ERROR
    assert got["tierserve.auth"].status.status_code is StatusCode.ERROR
    assert "tierserve.dispatch" not in got  # refused before any replica was asked


def test_an_unexpected_exception_is_a_500_span(stub: StubIngress,
                                               spans: InMemorySpanExporter) -> None:
    answer = stub.send(CHAT, chat(stub), KEY, fail=RuntimeError("secret detail"))
    assert answer.status == 500 and answer.body["error"]["code"] == "internal_error"
    server = by_name(spans)[f"POST {CHAT}"]
    assert dict(server.attributes or {})["http.response.status_code"] == 500
    assert server.status.status_code is StatusCode.ERROR
    assert any(e.name == "exception" and (e.attributes or {}).get("exception.type") ==
               "RuntimeError" for e in server.events)
    # Its type only: a message may quote what the client sent.
    assert all("secret" not in str(dict(e.attributes or {})) for e in server.events)


def test_the_gate_wait_is_a_span() -> None:
    gated = StubIngress({**KEYED, "flow": {"enabled": True}})
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with tracing.use_provider(provider):
        assert gated.send(CHAT, chat(gated), KEY).status == 200
    got = by_name(exporter)
    gate = got["tierserve.gate"]
    assert parent_of(gate) == got[f"POST {CHAT}"].context.span_id
    assert dict(gate.attributes or {})["tierserve.tier"] == "paid"


def test_tracing_off_records_nothing(stub: StubIngress) -> None:
    assert not tracing.settings({}).enabled
    assert tracing.make_provider(tracing.settings({})) is None
    assert not tracing.tracer().start_span("probe").is_recording()
    assert stub.send(CHAT, chat(stub), KEY).status == 200
    assert stub.sent[-1].traceparent == ""  # no context to carry


# ------------------------------------------------------------------ the access log

def test_the_access_log_line_of_a_request(stub: StubIngress,
                                          caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        answer = stub.send(CHAT, chat(stub), {**KEY, "X-Request-Id": "log-me-1"})
    (line,) = access_lines(caplog)
    usage = answer.body["usage"]
    assert line["request_id"] == "log-me-1" and line["method"] == "POST"
    assert line["path"] == CHAT and line["status"] == 200
    assert line["tenant"] == "acme" and line["tier"] == "paid" and line["model"] == stub.model
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["cached_tokens"] == 0 and line["finish_reason"] == "stop"
    assert line["ttft_ms"] is not None and line["duration_ms"] >= line["ttft_ms"]
    assert line["client"] == "10.1.2.3" and line["error"] is None
    assert "T" in line["time"] and "trace_id" not in line  # tracing off here
    raw = " ".join(r.getMessage() for r in caplog.records)
    assert "secret" not in raw and "sk-acme" not in raw


def test_the_access_log_line_of_an_error(stub: StubIngress,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        stub.send(CHAT, chat(stub, temperature=-3), KEY)
        stub.send(CHAT, chat(stub), {"Authorization": "Bearer sk-wrong"})
    bad, unauthorized = access_lines(caplog)
    assert bad["status"] == 400 and bad["error"] == "invalid_request"
    assert bad["tenant"] == "acme" and bad["completion_tokens"] is None
    assert unauthorized["status"] == 401 and unauthorized["tenant"] is None
    assert unauthorized["error"] == "invalid_api_key"
    assert "sk-wrong" not in " ".join(r.getMessage() for r in caplog.records)


def test_the_access_log_line_of_a_stream(stub: StubIngress,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        answer = stub.send(COMP, {"model": stub.model, "prompt": "Hi", "max_tokens": 4,
                                  "stream": True, "stream_options": {"include_usage": True}},
                           KEY)
    (line,) = access_lines(caplog)
    usage = answer.body[-1]["usage"]
    assert line["status"] == 200 and line["path"] == COMP
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert line["prompt_tokens"] == usage["prompt_tokens"] and line["finish_reason"] == "stop"


def test_a_client_that_hangs_up_is_a_499(stub: StubIngress, spans: InMemorySpanExporter,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        stub.send(CHAT, chat(stub, stream=True), KEY, hang_up_after=1)
    (line,) = access_lines(caplog)
    assert line["status"] == 499 and line["error"] == "client_closed"
    server = by_name(spans)[f"POST {CHAT}"]
    assert dict(server.attributes or {})["http.response.status_code"] == 499
    assert server.status.status_code is StatusCode.ERROR
    assert stub.inst.inflight == 0  # its slot was given back


def test_the_access_log_carries_the_trace_id(stub: StubIngress, spans: InMemorySpanExporter,
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        stub.send(CHAT, chat(stub), {**KEY, "traceparent": TRACEPARENT})
    (line,) = access_lines(caplog)
    assert line["trace_id"] == TRACE_ID


# ------------------------------------------------------------------ settings

def test_the_otel_variables() -> None:
    s = tracing.settings({"OTEL_TRACES_EXPORTER": "console"})
    assert s.enabled and s.exporters == ("console",) and s.service_name == "tierserve"
    assert s.endpoint is None and s.sampler == "parentbased_always_on"
    s = tracing.settings({"OTEL_TRACES_EXPORTER": "otlp,console,none",
                          "OTEL_SERVICE_NAME": "edge-7",
                          "OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318/",
                          "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                          "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert s.exporters == ("otlp", "console") and s.service_name == "edge-7"
    assert s.endpoint == "http://jaeger:4318/v1/traces"
    assert s.sampler == "parentbased_traceidratio" and s.sampler_arg == 0.25
    s = tracing.settings({"OTEL_TRACES_EXPORTER": "otlp",
                          "OTEL_EXPORTER_OTLP_ENDPOINT": "http://ignored:4318",
                          "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://collector/traces"})
    assert s.endpoint == "https://collector/traces"  # the traces endpoint, as it is
    assert not tracing.settings({"OTEL_TRACES_EXPORTER": "none"}).enabled


def test_the_provider_follows_the_settings() -> None:
    provider = tracing.make_provider(tracing.settings({
        "OTEL_TRACES_EXPORTER": "console", "OTEL_SERVICE_NAME": "edge-7",
        "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5"}))
    try:
        assert provider.resource.attributes["service.name"] == "edge-7"
        assert "TraceIdRatioBased" in provider.sampler.get_description()
        assert "0.5" in provider.sampler.get_description()
    finally:
        provider.shutdown()
    provider = tracing.make_provider(tracing.settings({"OTEL_TRACES_EXPORTER": "console"}))
    try:
        assert provider.resource.attributes["service.name"] == "tierserve"
        assert provider.sampler.get_description().startswith("ParentBased")
    finally:
        provider.shutdown()


@pytest.mark.parametrize(("env", "says"), [
    ({"OTEL_TRACES_EXPORTER": "jaeger"}, "unknown exporter 'jaeger'"),
    ({"OTEL_TRACES_EXPORTER": "console,zipkin"}, "unknown exporter 'zipkin'"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "jaeger:4318"},
     "http:// or https://"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "sometimes"},
     "unknown sampler 'sometimes'"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "1.5"}, "a ratio from 0 to 1"),
    ({"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "traceidratio",
      "OTEL_TRACES_SAMPLER_ARG": "half"}, "a ratio from 0 to 1"),
])
def test_a_bad_otel_value_is_a_clear_error(env: dict[str, str], says: str) -> None:
    with pytest.raises(tracing.TracingConfigError, match=says):
        tracing.settings(env)


def test_otlp_without_its_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        None)  # not importable, whatever is installed
    with pytest.raises(tracing.TracingConfigError, match=r"tierserve\[tracing\]"):
        tracing.make_provider(tracing.settings({"OTEL_TRACES_EXPORTER": "otlp"}))


def test_otlp_gets_its_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []

    class Exporter:  # stands in for the extra's OTLP exporter
        def __init__(self, **kw: Any) -> None:
            made.append(kw)

        def export(self, spans: Any) -> Any:
            return None

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

    module = types.ModuleType("trace_exporter")
    module.OTLPSpanExporter = Exporter  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                        module)
    for env, want in [({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4318"},
                       {"endpoint": "http://jaeger:4318/v1/traces"}),
                      ({}, {})]:
        provider = tracing.make_provider(tracing.settings({"OTEL_TRACES_EXPORTER": "otlp", **env}))
        provider.shutdown()
        assert made[-1] == want


def test_the_access_log_switch() -> None:
    assert access_log_enabled({}) and access_log_enabled({"TIERSERVE_ACCESS_LOG": "1"})
    assert not access_log_enabled({"TIERSERVE_ACCESS_LOG": "off"})
    with pytest.raises(AccessLogConfigError, match="TIERSERVE_ACCESS_LOG must be 1 or 0"):
        access_log_enabled({"TIERSERVE_ACCESS_LOG": "loud"})


def test_the_launcher_refuses_a_bad_exporter_before_ray(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the launcher started Ray after a failed check")

    monkeypatch.setattr(launch.ray, "init", refuse)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaegr")
    config = Path(__file__).parents[2] / "configs" / "cluster.yaml"
    assert launch.main([str(config)]) == 2
    assert "unknown exporter 'jaegr'" in capsys.readouterr().err


# ------------------------------------------------------------------ under Serve

@pytest.mark.ray
@pytest.mark.slow
def test_under_serve_the_ingress_logs_one_line_per_request(main_app: Any) -> None:
    """The middleware under Serve's proxy: the request is answered (a client's traceparent
    taken), and the ingress's log file gets its one JSON line, without the key."""
    import time

    import httpx
    import ray

    from tests.cluster.helpers import KEYS, MODEL, headers

    rid = f"access-{time.time_ns()}"
    key = next(iter(KEYS.values()))
    r = httpx.post(main_app.url("/v1/chat/completions"), timeout=120,
                   json={"model": MODEL, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "Hi"}]},
                   headers={**headers(key), "X-Request-Id": rid, "traceparent": TRACEPARENT})
    assert r.status_code == 200, r.text
    node = ray._private.worker._global_node
    assert node is not None
    logs = Path(node.get_logs_dir_path())
    found: list[dict[str, Any]] = []
    for _ in range(100):  # the line reaches the file when the ingress's stderr is flushed
        for path in (p for p in logs.rglob("*") if p.is_file()):
            for text in path.read_text(errors="replace").splitlines():
                if rid in text and '{"time"' in text:  # bare, or behind a log prefix
                    found.append(json.loads(text[text.index('{"time"'):]))
        if found:
            break
        time.sleep(0.2)
    assert len(found) == 1, found
    line = found[0]
    assert line["status"] == 200 and line["path"] == "/v1/chat/completions"
    assert line["model"] == MODEL and line["completion_tokens"] >= 1
    assert key not in json.dumps(line)


@pytest.mark.parametrize(("method", "path", "root", "name"), [
    ("GET", "/v1/models/anything-a-client-sends", "", "GET /v1/models/{model_id}"),
    ("GET", "/solo/v1/models/x", "/solo", "GET /solo/v1/models/{model_id}"),
    ("GET", "/v1/models", "", "GET /v1/models"),
    ("POST", "/v1/chat/completions", "", "POST /v1/chat/completions"),
    ("GET", "/v1/responses/resp_anything", "", "GET /v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/resp_x", "", "DELETE /v1/responses/{response_id}"),
    ("GET", "/v1/responses/resp_x/input_items", "", "GET /v1/responses/{response_id}"),
    ("POST", "/v1/responses/resp_x/cancel", "", "POST /v1/responses/{response_id}"),
    ("GET", "/any/path/a/client/makes/up", "", "GET unmatched"),
    ("GET", "/solo/elsewhere", "/solo", "GET unmatched"),
    ("FROBNICATE", "/v1/chat/completions", "", "_OTHER /v1/chat/completions"),
])
def test_span_names_are_bounded(method: str, path: str, root: str, name: str) -> None:
    """A span is named by the route's template: nothing a client puts in a path (a model's or
    a response's id, a path no route has) or an unknown method makes a new name. Before
    routing, from the app's routes (here an app with the ingress's route shapes); after, from
    the route the router chose."""
    from fastapi import APIRouter, FastAPI

    from tierserve.cluster import ingress
    from tierserve.cluster.access import _route_name

    app, router = FastAPI(), APIRouter()
    for template in ("/v1/models", "/v1/models/{model_id:path}", "/v1/chat/completions",
                     "/v1/responses/{response_id:path}"):
        app.add_api_route(template, lambda: None, methods=["GET", "POST", "DELETE"])
        router.add_api_route(template, lambda: None, methods=["GET", "POST", "DELETE"])
    included = FastAPI()
    included.include_router(router)  # as Serve's class-based app holds its routes
    for each in (app, included, ingress.app):
        scope = {"type": "http", "method": method, "path": path, "root_path": root, "app": each}
        assert _route_name(scope) == name
    routed = _route_name({**scope, "app": FastAPI(),
                          "route": types.SimpleNamespace(path="/v1/responses/{response_id:path}")})
    assert routed.endswith(f"{root}/v1/responses/{{response_id}}"), routed


def test_a_routed_requests_span_is_named_by_its_route(stub: StubIngress,
                                                      spans: InMemorySpanExporter) -> None:
    answer = stub.send("/v1/responses", {"model": stub.model, "input": "hi",
                                         "max_output_tokens": 2}, KEY)
    assert answer.status == 200, answer.body
    assert "POST /v1/responses" in by_name(spans)


def test_span_status_never_holds_an_error_message(stub: StubIngress,
                                                  spans: InMemorySpanExporter) -> None:
    """The auth span of a refused header: its status says the error's code, not its message
    (which quotes the header)."""
    answer = stub.send(CHAT, chat(stub), {**KEY, "X-TL-Priority": "secret-priority"})
    assert answer.status == 400 and "secret-priority" in answer.body["error"]["message"]
    auth = by_name(spans)["tierserve.auth"]
    assert auth.status.status_code is StatusCode.ERROR
    assert auth.status.description == "invalid_priority"
    for s in spans.get_finished_spans():
        assert "secret" not in str(s.status.description or "")
        assert all("secret" not in str(dict(e.attributes or {})) for e in s.events)


def test_the_dispatch_span_ends_when_the_send_is_refused(
        stub: StubIngress, spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    """``generate.remote`` raising (the handle refuses the call) still ends the dispatch span,
    as an error."""
    def refuse(request: Any) -> Any:
        raise RuntimeError("secret: the handle is gone")

    monkeypatch.setattr(stub.handle, "remote", refuse)
    answer = stub.send(CHAT, chat(stub), KEY)
    assert answer.status == 500
    dispatch = by_name(spans)["tierserve.dispatch"]  # exported: it ended
    assert dispatch.status.status_code is StatusCode.ERROR
    assert dispatch.status.description == "RuntimeError"


def test_the_access_log_can_be_turned_off(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    from tierserve.cluster.access import setup_access_log

    monkeypatch.setenv("TIERSERVE_ACCESS_LOG", "0")
    try:
        quiet = StubIngress(KEYED)
        with caplog.at_level(logging.INFO, logger="tierserve.access"):
            assert quiet.send(CHAT, chat(quiet), KEY).status == 200
        assert access_lines(caplog) == []
    finally:
        setup_access_log(True, own_handler=False)  # as every other stub has it


def test_a_batched_completions_request_is_one_line(stub: StubIngress,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        answer = stub.send(COMP, {"model": stub.model, "prompt": ["Hi", "Hello there"],
                                  "max_tokens": 4, "n": 2}, KEY)
    assert answer.status == 200, answer.body
    (line,) = access_lines(caplog)
    usage = answer.body["usage"]
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]


def test_a_send_that_fails_is_a_hang_up(stub: StubIngress,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """Under ASGI 2.4 a client that left makes the send fail (Starlette: ``ClientDisconnect``)."""
    from starlette.requests import ClientDisconnect

    with caplog.at_level(logging.INFO, logger="tierserve.access"):
        stub.send(CHAT, chat(stub), KEY, fail=ClientDisconnect())
    (line,) = access_lines(caplog)
    assert line["status"] == 499 and line["error"] == "client_closed"
