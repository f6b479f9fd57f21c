"""``benchmarks.abuse`` without a cluster: the victim's figures, the verdicts, the payloads
the probes send, the report's table and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import abuse
from benchmarks.abuse import (
    Answer,
    Check,
    Limits,
    ProbeReport,
    RunReport,
    VictimRequest,
    WindowStats,
)
from benchmarks.tools import ROOT

MODEL = "m"


def stream(index: int, start: float, first: float, gap: float, n: int = 48) -> VictimRequest:
    return VictimRequest(index, start, first + gap * (n - 1), 200, None, None,
                         [first + gap * k for k in range(n)])


def test_a_victim_request_has_its_ttft_tpot_and_gaps() -> None:
    r = VictimRequest(0, 1.0, 2.0, 200, tokens=[1.5, 1.6, 1.8])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.15)
    assert r.gaps() == [(1.5, 1.6), (1.6, 1.8)]
    assert VictimRequest(1, 0.0, tokens=[0.2]).tpot is None
    assert VictimRequest(2, 0.0).ttft is None
    shifted = r.shifted(1.0)
    assert (shifted.start, shifted.tokens[0]) == (0.0, 0.5)


def test_window_stats_count_requests_started_and_gaps_overlapping() -> None:
    quiet = [stream(i, start=2.0 * i, first=2.0 * i + 0.1, gap=0.02, n=10) for i in range(3)]
    paused = VictimRequest(3, 6.0, 9.0, 200, tokens=[6.1, 6.12, 8.9])  # a 2.78 s pause
    failed = VictimRequest(4, 9.0, 9.5, 503, "no_replica")
    reqs = [*quiet, paused, failed]
    w = abuse.window_stats(reqs, 0.0, 6.0)
    assert (w.requests, w.errors) == (3, 0)
    assert w.worst_gap_s == pytest.approx(0.02)
    assert w.ttft_p99_s == pytest.approx(0.1)
    during = abuse.window_stats(reqs, 7.0, 10.0)  # the pause began before, ends inside
    assert during.worst_gap_s == pytest.approx(2.78)
    assert (during.requests, during.errors) == (1, 1)
    assert abuse.window_stats([], 0.0, 1.0).worst_gap_s is None


def test_the_gap_limit_is_three_times_the_quiet_worst_or_half_a_second() -> None:
    assert abuse.gap_limit(0.05) == 0.5
    assert abuse.gap_limit(0.3) == pytest.approx(0.9)
    assert abuse.gap_limit(None) == 0.5


def passing_report(**kw: object) -> ProbeReport:
    r = ProbeReport("deep_json", "a body nested deep", quiet=(0.0, 8.0), window=(8.0, 8.1),
                    answers=[Answer(400, "invalid_json", 0.01)], checks=[Check("a 400", True)],
                    ready_status=200, free_blocks_quiet=1450.0, free_blocks_after=1456.0,
                    blocks_returned=True)
    r.quiet_stats = WindowStats(0.0, 8.0, 4, 0, 0.2, 0.3, 0.025, 0.03, 180, 0.08)
    r.probe_stats = WindowStats(8.0, 10.0, 1, 0, 0.2, 0.2, 0.025, 0.025, 48, 0.2)
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_judge_passes_a_probe_that_met_every_target() -> None:
    assert abuse.judge(passing_report()) == []
    assert abuse.judge(ProbeReport("no_key", "", skipped="needs keys")) == []


@pytest.mark.parametrize(("change", "says"), [
    ({"probe_stats": WindowStats(8.0, 10.0, 1, 0, worst_gap_s=0.6)}, "paused 0.600 s"),
    ({"probe_stats": WindowStats(8.0, 10.0, 1, 2, worst_gap_s=0.1)}, "2 of the victim's"),
    ({"quiet_stats": WindowStats(0.0, 8.0)}, "no tokens in the quiet window"),
    ({"answers": [Answer(503, "no_replica")]}, "5xx"),
    ({"checks": [Check("a 400", False, "wanted 400, got 1x 200")]}, "a 400: wanted 400"),
    ({"rechecks": [Answer(200), Answer(400, "grammar_compile_failed")]},
     "1 of 2 requests with the probe's schemas"),
    ({"ready_status": 503}, "/ready answered 503"),
    ({"ready_status": None}, "/ready answered nothing"),
    ({"blocks_returned": False}, "did not come back"),
    ({"blocks_returned": None}, "could not be read"),
    ({"memory_limit_bytes": 48 * 2**20, "memory_before": {"r1": 1e9, "r2": 1e9},
      "memory_after": {"r1": 1e9 + 49 * 2**20, "r2": 1e9}}, "replica r1's memory grew 49.0"),
    ({"memory_limit_bytes": 48 * 2**20}, "resident memory could not be read"),
])
def test_judge_names_what_failed(change: dict[str, object], says: str) -> None:
    reasons = abuse.judge(passing_report(**change))
    assert len(reasons) == 1 and says in reasons[0], reasons


def test_a_long_quiet_gap_raises_the_limit() -> None:
    r = passing_report(quiet_stats=WindowStats(0.0, 8.0, 4, 0, worst_gap_s=0.3),
                       probe_stats=WindowStats(8.0, 10.0, 1, 0, worst_gap_s=0.85))
    assert abuse.judge(r) == []


def test_memory_within_the_limit_passes() -> None:
    r = passing_report(memory_limit_bytes=48 * 2**20, memory_before={"r1": 1e9},
                       memory_after={"r1": 1e9 + 47 * 2**20, "gone": 5.0})
    assert abuse.judge(r) == []
    assert abuse.memory_growth({"a": 1.0, "b": 2.0}, {"a": 3.0}) == {"a": 2.0}


def test_expect_checks_statuses_codes_and_speed() -> None:
    fast = [Answer(400, "too_long", 0.1)] * 4
    assert abuse.expect("x", fast, {400}, "too_long", 2.0).ok
    assert not abuse.expect("x", fast, {400}, "invalid_json").ok
    slow = abuse.expect("x", [Answer(400, "too_long", 3.5)], {400}, within_s=2.0)
    assert not slow.ok and "3.50 s" in slow.detail
    assert not abuse.expect("x", [], {200}).ok
    mixed = abuse.expect("x", [Answer(200), Answer(0, note="hung up")], {200})
    assert not mixed.ok and "1x hung up" in mixed.detail


def test_answers_are_counted_by_status_and_code() -> None:
    got = [Answer(200)] * 3 + [Answer(429, "too_many_compiles"), Answer(0, note="hung up")]
    assert abuse.answers_text(got) == "3x 200, 1x 429 too_many_compiles, 1x hung up"
    assert abuse.status_counts(got)["200"] == 3
    assert abuse.answers_text([]) == "-"


def test_no_key_expectations_follow_the_anonymous_tier() -> None:
    assert abuse.no_key_expectations(None, True)["no key"] == {401}
    batch = abuse.no_key_expectations("batch", True)
    assert batch == {"no key": {200}, "no key, priority 15": {400}, "a wrong key": {401}}
    assert abuse.no_key_expectations(None, False)["a wrong key"] == {401}


# ---------------------------------------------------------------------------------- payloads


def chat_schema(body: bytes) -> dict[str, Any]:
    data = json.loads(body)
    assert data["model"] == MODEL and data["messages"][0]["role"] == "user"
    schema: dict[str, Any] = data["response_format"]["json_schema"]["schema"]
    return schema


def test_hangup_schemas_are_fresh_per_client_with_24_bounded_strings() -> None:
    schemas = abuse.hangup_schemas("n1")
    assert len(schemas) == 6
    texts = {json.dumps(s) for s in schemas}
    assert len(texts) == 6 and not texts & {json.dumps(s) for s in abuse.hangup_schemas("n2")}
    props = schemas[0]["properties"]
    assert sorted(p["maxLength"] for p in props.values()) == list(range(60, 84))
    leader = abuse.leader_schema("n1", 0)
    assert all(p["pattern"] == abuse.SLOW_PATTERN for p in leader["properties"].values())


def test_huge_schema_is_about_900_kib_and_fits_the_body_limit() -> None:
    body = abuse.schema_request(MODEL, abuse.huge_schema())
    assert 850 * 1024 < len(body) < Limits().max_request_bytes
    assert len(chat_schema(body)["properties"]) == 20_000


def test_annotation_schemas_differ_only_in_their_description() -> None:
    a, b = abuse.annotation_schema(0), abuse.annotation_schema(1)
    assert a["description"] != b["description"]
    assert {k: v for k, v in a.items() if k != "description"} == \
        {k: v for k, v in b.items() if k != "description"}
    body = abuse.schema_request(MODEL, a)
    assert 590 * 1024 < len(body) < Limits().max_request_bytes


def test_flood_schemas_are_distinct() -> None:
    texts = {json.dumps(abuse.flood_schema("n", i)) for i in range(32)}
    assert len(texts) == 32


def test_the_unenforceable_schema_has_pattern_and_max_length_together() -> None:
    prop = abuse.unenforceable_schema()["properties"]["code"]
    assert {"pattern", "maxLength"} <= prop.keys()


def test_deep_json_nests_1200_deep_and_is_json_a_deeper_parser_reads() -> None:
    body = abuse.deep_json_body(MODEL)
    assert abuse.json_depth(body) == 1201  # the body's object, then 1,200 lists
    assert body.startswith(b'{"model": "m"') and body.endswith(b"]}")
    with pytest.raises(RecursionError):
        json.loads(body)


def test_stop_token_ids_requests_carry_the_count_within_the_vocabulary() -> None:
    many = json.loads(abuse.stop_ids_request(MODEL, 100_000, 49152))
    assert len(many["stop_token_ids"]) == 100_000
    assert min(many["stop_token_ids"]) >= 0 and max(many["stop_token_ids"]) < 49152
    assert (many["min_tokens"], many["max_tokens"]) == (32, 48)
    most = json.loads(abuse.stop_ids_request(MODEL, 128, 49152))
    assert len(set(most["stop_token_ids"])) == 128


def test_the_huge_prompt_is_just_under_the_body_limit() -> None:
    body = abuse.huge_prompt_body(MODEL, 1 << 20)
    assert (1 << 20) - 512 < len(body) <= 1 << 20
    assert len(json.loads(body)["prompt"]) > 1_040_000


def test_victim_body_and_prompt() -> None:
    body = json.loads(abuse.victim_body(MODEL, abuse.victim_prompt(0, 3)))
    assert body["stream"] is True and body["temperature"] == 0 and body["max_tokens"] == 48
    assert len(body["prompt"].split()) == 40
    assert abuse.victim_prompt(0, 3) == abuse.victim_prompt(0, 3) != abuse.victim_prompt(0, 4)


def test_sse_lines_and_chunk_text() -> None:
    assert abuse.sse_payload("data: [DONE]") == abuse.DONE
    assert abuse.sse_payload(": keep-alive") is None and abuse.sse_payload("") is None
    chunk = abuse.sse_payload('data: {"choices": [{"text": "hi", "index": 0}]}')
    assert abuse.chunk_text(chunk) == "hi"
    assert abuse.chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert abuse.chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert abuse.chunk_text({"choices": []}) == ""


def test_raw_requests_and_statuses() -> None:
    raw = abuse.raw_request("127.0.0.1", 8000, "/v1/completions", {"Authorization": "Bearer k"},
                            b"", content_length=1000)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"Content-Length: 1000" in head and b"Authorization: Bearer k" in head
    assert body == b""
    assert abuse.status_of(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n") == 408
    assert abuse.status_of(b"HTTP/1.1 200 OK") is None  # the line is not all there yet
    assert abuse.status_of(b"garbage\r\n") is None
    assert abuse.host_port("http://127.0.0.1:8000") == ("127.0.0.1", 8000)


def test_cached_tokens_from_usage() -> None:
    usage = {"usage": {"prompt_tokens": 700, "prompt_tokens_details": {"cached_tokens": 688}}}
    assert abuse.cached_tokens(usage) == 688
    assert abuse.cached_tokens({"usage": {"prompt_tokens": 3}}) is None
    assert abuse.cached_tokens(None) is None


def test_ray_processes_are_named_by_their_command_line() -> None:
    assert abuse.ray_label(["ray::ProxyActor"]) == "ProxyActor"
    assert abuse.ray_label(["ray::ServeReplica:tierserve:LLMServer"]) == \
        "ServeReplica:tierserve:LLMServer"
    assert abuse.ray_label(["ray::IDLE", "", ""]) == "IDLE"
    assert abuse.ray_label(["/usr/bin/python", "-m", "benchmarks.abuse"]) is None
    assert abuse.ray_label([]) is None
    mem = abuse.ray_memory()  # none here, or whatever Ray runs on this machine
    assert mem["total_bytes"] >= 0 and mem["processes"] >= 0


# ---------------------------------------------------------------------------------- limits, configs


def test_limits_from_the_servers_openapi_document() -> None:
    doc = {
        "components": {"schemas": {"CompletionRequest": {"properties": {
            "max_tokens": {"anyOf": [{"type": "integer", "maximum": 1024}, {"type": "null"}]},
            "n": {"type": "integer", "maximum": 8},
            "stop_token_ids": {"anyOf": [{"type": "array", "maxItems": 128,
                                          "items": {"type": "integer", "maximum": 49151}},
                                         {"type": "null"}]},
        }}}},
        "paths": {"/v1/completions": {"post": {"requestBody": {
            "description": "An OpenAI-style request. At most 1048576 bytes."}}}},
    }
    got = abuse.limits_from_openapi(doc, Limits(body_timeout_s=12.0))
    assert got == Limits(max_tokens=1024, max_n=8, max_stop_token_ids=128, vocab_size=49152,
                         max_request_bytes=1048576, body_timeout_s=12.0)
    assert abuse.limits_from_openapi({}) == Limits()


def test_the_keyed_config_puts_a_key_on_every_tier_and_requires_one() -> None:
    base = yaml.safe_load((ROOT / "configs" / "cluster.yaml").read_text())
    config = abuse.keyed_config(base)
    args = abuse.app_args(config)
    assert args["anonymous_tier"] is None  # a request without a key is a 401
    tiers = {t["name"]: t for t in args["tiers"]}
    assert tiers["interactive"]["api_keys"] and tiers["batch"]["api_keys"]
    assert {t["name"] for t in tiers["standard"]["tenants"]} >= {"tenant-a", "tenant-b"}
    keys = json.dumps(args["tiers"])
    assert "env:" in keys
    assert abuse.app_args(base).get("anonymous_tier") == "standard"  # the base is left alone
    limits = abuse.limits_from_config(abuse.app_args(base))
    assert limits.max_tokens == 1024 and limits.max_request_bytes == 1 << 20


def test_probes_are_selected_by_name_in_the_bench_order() -> None:
    assert [p.name for p in abuse.select_probes("huge_prompt,deep_json")] == \
        ["deep_json", "huge_prompt"]
    assert len(abuse.select_probes(None)) == 15
    with pytest.raises(ValueError, match="unknown probe 'nope'"):
        abuse.select_probes("deep_json,nope")
    assert {p.name for p in abuse.PROBES if p.needs_keys} == {"no_key", "cache_probe"}


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert abuse.main(["--probes", "nope"]) == 2
    assert "unknown probe" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- output


def finished_run() -> RunReport:
    victim = [stream(i, 2.0 * i, 2.0 * i + 0.2, 0.025, 48) for i in range(12)]
    victim.append(VictimRequest(12, 18.0, 21.0, 200, tokens=[18.2, 18.22, 20.9]))
    ok = ProbeReport("deep_json", "", quiet=(0.0, 8.0), window=(8.0, 8.05),
                     answers=[Answer(400, "invalid_json", 0.01)], checks=[Check("a 400", True)],
                     ready_status=200, free_blocks_quiet=10.0, free_blocks_after=10.0,
                     blocks_returned=True, memory_before={"r": 100.0 * 2**20},
                     memory_after={"r": 101.5 * 2**20})
    bad = ProbeReport("huge_prompt", "", quiet=(10.0, 18.0), window=(18.0, 21.0),
                      answers=[Answer(400, "too_long", 0.2)] * 4, checks=[Check("x", True)],
                      ready_status=200, free_blocks_quiet=10.0, free_blocks_after=10.0,
                      blocks_returned=True)
    skipped = ProbeReport("cache_probe", "", skipped="needs keys")
    run = RunReport("as configured", "http://127.0.0.1:8000", "smollm2", replicas=2,
                    probes=[ok, bad, skipped], victim=victim,
                    who=abuse.who({}, "standard"))
    abuse.finish(run.probes, run.victim)
    return run


def test_finish_judges_every_probe_and_the_table_shows_it() -> None:
    run = finished_run()
    ok, bad, skipped = run.probes
    assert ok.passed and not bad.passed and skipped.passed
    assert "paused 2.680 s" in bad.reasons[0]
    assert not run.passed
    text = abuse.table_text(run)
    lines = text.splitlines()
    assert lines[1].split()[0] == "probe"
    assert "1x 400 invalid_json" in text and "+1.5 MiB" in text
    assert "4x 400 too_long" in text and "FAIL" in text
    assert "huge_prompt: FAILED: the victim's stream paused" in text
    assert "skipped (needs keys)" in text
    assert "victim: no key (the anonymous tier, standard)" in lines[0]
    record = abuse.run_record(run)
    assert record["passed"] is False and record["probes"][0]["passed"] is True
    assert record["probes"][0]["gap_limit_s"] == 0.5
    json.dumps(record)  # all of it is JSON


def test_the_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "gaps.png"
    abuse.plot([finished_run()], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_machine_line() -> None:
    line = abuse.machine_line({"cpu": "Xeon", "cores": 2, "cores_usable": 2, "memory_gib": 23.5,
                               "python": "3.11.7", "platform": "Linux",
                               "load_avg_1m_before": 0.5, "load_avg_1m_after": 1.25})
    assert line.startswith("machine: Xeon, 2 cores (2 usable), 23.5 GiB") and "1.25 after" in line


# ---------------------------------------------------------------------------------- clients


def test_the_victim_records_each_token_of_a_stream() -> None:
    import httpx

    from tests.fake_api import MODEL as FAKE
    from tests.fake_api import Behaviour, FakeApi

    with FakeApi(Behaviour(tokens=5)) as api, httpx.Client(timeout=10) as client:
        r = abuse.victim_request(client, api.url, {}, FAKE, 0, 0)
        sent = api.completions[-1]
    assert r.ok and len(r.tokens) == 5 and r.start <= r.tokens[0] <= r.end
    assert sent["stream"] is True and sent["max_tokens"] == 48
    with FakeApi(Behaviour(refuse=(429, "shed"))) as api, httpx.Client(timeout=10) as client:
        r = abuse.victim_request(client, api.url, {}, FAKE, 1, 0)
    assert (r.ok, r.status, r.code, r.tokens) == (False, 429, "shed", [])


def test_the_metrics_give_free_blocks_and_memory_per_replica() -> None:
    import asyncio

    import httpx

    from tests.fake_api import FakeApi

    async def read(url: str) -> abuse.Scrape | None:
        async with httpx.AsyncClient() as client:
            return await abuse.scrape(client, f"{url}/metrics")

    with FakeApi() as api:
        s = asyncio.run(read(api.url))
    assert abuse.free_blocks(s) == 16
    assert abuse.rss(s) == {"r1": 100 * 2**20}
    assert abuse.free_blocks(None) is None and abuse.rss(None) == {}


def test_socket_clients_trickle_and_hold_unread_on_threads_of_their_own() -> None:
    import asyncio
    import socket
    import threading
    import time

    def serve(listener: socket.socket, answer: bytes, after_bytes: int) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                got = b""
                while b"\r\n\r\n" not in got:
                    got += conn.recv(1024)
                body = got.partition(b"\r\n\r\n")[2]
                while len(body) < after_bytes:
                    body += conn.recv(1)
                conn.sendall(answer)
                time.sleep(0.3)

    def listener(answer: bytes, after_bytes: int) -> tuple[socket.socket, int]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        for _ in range(4):
            threading.Thread(target=serve, args=(sock, answer, after_bytes), daemon=True).start()
        return sock, sock.getsockname()[1]

    sock, port = listener(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n\r\n", 2)
    head = abuse.raw_request("127.0.0.1", port, "/v1/completions", {}, b"", content_length=1000)
    got = abuse.trickle("127.0.0.1", port, head, 1000, 10.0)
    sock.close()
    assert got.status == 408 and got.note == "after 2 bytes"

    sock, port = listener(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" +
                          b"data: {}\n\n" * 1000, 0)
    request = abuse.raw_request("127.0.0.1", port, "/v1/chat/completions", {}, b"{}")

    async def hold_with(fn: Any) -> list[Answer]:
        return list(await asyncio.gather(*abuse.in_threads(
            fn, [("127.0.0.1", port, request, 0.5)] * 4)))

    threads: set[str] = set()
    real = abuse.hold_unread

    def hold_unread(*args: Any) -> Answer:
        threads.add(threading.current_thread().name)
        return real(*args)

    held = asyncio.run(hold_with(hold_unread))
    read = asyncio.run(hold_with(abuse.read_all))
    sock.close()
    assert [a.status for a in held] == [200] * 4 and {a.note for a in held} == {"held unread"}
    assert len(threads) == 4  # each socket on a thread of its own, at once
    assert [a.status for a in read] == [200] * 4 and {a.note for a in read} == {"read"}
