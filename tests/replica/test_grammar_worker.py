"""The grammar compile worker (``tierserve.replica.grammar_worker``): compiles run in a process of
their own, with a time budget and a size limit; a compile past its budget, one too large and a
worker that dies are each that request's refusal (400), and the next compile works.

The slow schema here is many integer properties with wide ranges: xgrammar turns each range
into a large automaton, so compiling it takes far longer than the 0.05 s budget it is given.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tierserve.records import ErrorRecord, GenerateRequest, SamplingParams, StructuredOutput
from tierserve.replica import deployment, grammar_worker
from tierserve.replica.deployment import LLMServer
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.models.embedded_spec import EOS_ID, build_tokenizer, embedded_config
from tierserve.replica.structured import GrammarError, Grammars

SMALL = StructuredOutput("regex", "[ab]{1,4}", "guided_regex")
SLOW = StructuredOutput("json", json.dumps({
    "type": "object",
    "properties": {f"n{i}": {"type": "integer", "minimum": -123456789 + i,
                             "maximum": 987654321 - i} for i in range(200)},
}), "response_format.json_schema.schema")


@functools.cache
def _tokenizer() -> Any:
    return build_tokenizer()


def make(**kw: Any) -> Grammars:
    return Grammars(_tokenizer(), embedded_config().vocab_size, [EOS_ID], **kw)


def wait_until(condition: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.001)


def test_a_grammar_compiles_in_a_worker_process_and_works_here() -> None:
    g = make()
    g.compile(SMALL)
    pid = g.worker_pid
    assert pid is not None and pid != os.getpid()
    c = g.constraint(SMALL)  # the byte-level tokenizer: token id = byte
    assert c.accept(ord("a")) and c.accept(ord("b")) and not c.accept(ord("c"))
    assert c.accept(EOS_ID) and c.terminated


def test_a_compile_past_its_budget_is_refused_the_worker_replaced_and_the_next_works() -> None:
    g = make(compile_timeout_s=0.05)
    g.compile(SMALL)  # the worker is up: its start is never part of a budget
    before = g.worker_pid
    with pytest.raises(GrammarError) as e:
        g.compile(SLOW)
    assert (e.value.status, e.value.code) == (400, "grammar_too_complex")
    assert e.value.param == SLOW.param
    assert str(e.value) == (f"{SLOW.param}: the json is too complex to compile within 0.05 s "
                            "(this replica's grammar compile budget)")
    assert g.worker_pid != before  # killed
    assert g.cache_entries == 1 and g.compiled == 1  # nothing of it kept
    other = StructuredOutput("regex", "[cd]{1,4}")
    g.compile(other)
    assert g.compiled == 2 and g.worker_pid not in (None, before)


def test_a_worker_that_dies_mid_compile_fails_that_request_and_the_next_compile_works() -> None:
    g = make(compile_timeout_s=120)
    g.compile(SMALL)
    errors: list[BaseException] = []

    def compile_slow() -> None:
        try:
            g.compile(SLOW)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=compile_slow)
    t.start()
    wait_until(lambda: g.compiling is not None)
    pid = g.worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)  # a crash in native code, as the replica sees it
    t.join(60)
    (e,) = errors
    assert isinstance(e, GrammarError)
    assert (e.status, e.code, e.param) == (400, "grammar_compile_failed", SLOW.param)
    assert "signal 9" in str(e)
    g.compile(StructuredOutput("regex", "[ef]{1,4}"))
    assert g.worker_pid not in (None, pid)


def test_a_worker_that_died_idle_is_started_again_for_the_next_compile() -> None:
    g = make()
    g.compile(SMALL)
    pid = g.worker_pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: g.worker_pid is None)
    g.compile(StructuredOutput("regex", "[gh]{1,4}"))  # not its failure: it was idle
    assert g.worker_pid not in (None, pid)


def test_a_worker_that_cannot_start_is_a_503_and_a_later_compile_starts_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from tierserve.replica import structured

    g = make()
    structured._SLOT.close()
    monkeypatch.setattr(sys, "executable", "/bin/false")  # exits at once
    with pytest.raises(GrammarError) as e:
        g.compile(SMALL)
    assert (e.value.status, e.value.code) == (503, "replica_unavailable")
    assert "could not start" in str(e.value) and g.cache_entries == 0
    monkeypatch.undo()
    g.compile(SMALL)
    assert g.worker_pid is not None


def test_a_grammar_larger_than_the_cache_is_refused_as_too_complex() -> None:
    g = make(cache_bytes=50_000)
    rules = "\n".join(f'r{i} ::= "k{i}" [a-z]*' for i in range(2000))
    big = StructuredOutput("grammar", "root ::= " + " | ".join(f"r{i}" for i in range(2000))
                           + "\n" + rules, "guided_grammar")
    with pytest.raises(GrammarError) as e:
        g.compile(big)
    assert (e.value.status, e.value.code, e.value.param) == (400, "grammar_too_complex",
                                                             "guided_grammar")
    assert "MiB" in str(e.value) and g.cache_entries == 0
    g.compile(SMALL)
    assert g.cache_entries == 1


def test_the_worker_answers_a_compile_that_runs_out_of_memory_and_retires() -> None:
    class OutOfMemory:
        def compile_regex(self, text: str) -> Any:
            raise RuntimeError("std::bad_alloc")

    head = {"op": "regex", "max_bytes": 1 << 20}
    assert grammar_worker.run_job(OutOfMemory(), head, "a") == (
        {"ok": False, "too_large": 0, "retire": True}, b"")

    class Refuses:
        def compile_regex(self, text: str) -> Any:
            raise RuntimeError("[12:00:00] /src/regex.cc:42: the parenthesis is not closed")

    assert grammar_worker.run_job(Refuses(), head, "(") == (
        {"ok": False, "error": "the parenthesis is not closed"}, b"")


def test_a_frame_read_honours_its_deadline_and_sees_the_writer_leave() -> None:
    r, w = os.pipe()
    try:
        grammar_worker.write_frame(w, {"op": "regex"}, b"[a-z]+")
        assert grammar_worker.read_frame(r, time.monotonic() + 5) == ({"op": "regex"}, b"[a-z]+")
        with pytest.raises(grammar_worker.Timeout):
            grammar_worker.read_frame(r, time.monotonic() + 0.01)
    finally:
        os.close(w)
    with pytest.raises(EOFError):
        grammar_worker.read_frame(r, time.monotonic() + 5)
    os.close(r)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LLMServer]:
    monkeypatch.setattr(deployment, "_replica_id", lambda: "replica-3")
    s = LLMServer(engine={"model": EMBEDDED_MODEL, "device": "cpu", "num_kv_blocks": 32,
                          "max_num_seqs": 4, "num_threads": 1,
                          "grammar_compile_timeout_s": 0.05})
    try:
        yield s
    finally:
        s.engine.shutdown()


def test_the_replica_answers_a_schema_past_the_budget_with_a_400_saying_so(
        server: LLMServer) -> None:
    async def go(spec: StructuredOutput) -> list[Any]:
        request = GenerateRequest((1, 2, 3), SamplingParams(max_tokens=8, structured=spec))
        return [item async for item in server.generate(request)]

    server.engine.grammars.compile(SMALL)  # the worker is up
    (first,) = asyncio.run(asyncio.wait_for(go(SLOW), timeout=120))
    assert isinstance(first, ErrorRecord)
    assert (first.status, first.code, first.param) == (400, "grammar_too_complex", SLOW.param)
    assert "too complex to compile within 0.05 s" in first.message
    items = asyncio.run(asyncio.wait_for(go(SMALL), timeout=120))  # the next one is served
    assert items and not isinstance(items[0], ErrorRecord)
    stats = server.engine.stats()
    assert (stats.running, stats.waiting) == (0, 0)


def test_bounded_strings_compile_fast_and_take_only_plain_characters() -> None:
    """A string bounded by ``maxLength``: xgrammar's own repetition (cheap to build), its
    characters made plain: no raw control character, which no JSON parser takes (xgrammar lets
    all but CR and LF through). If xgrammar changes how it writes that character, the marker is
    gone and this test says so."""
    import xgrammar as xgr

    from tierserve.replica.grammar_worker import BOUNDED_CHAR, plain_bounded_strings

    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "string", "maxLength": 5},
                             "b": {"type": "string", "minLength": 2, "maxLength": 3}}}
    raw = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    assert str(raw).count(BOUNDED_CHAR) == 2
    plain = plain_bounded_strings(raw)
    assert BOUNDED_CHAR not in str(plain)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(
        plain)

    def takes(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return bool(m.accept_string(text)) and bool(m.is_terminated())

    assert takes('{"a": "hello", "b": "ok"}')
    for bad in ('{"a": "he\tlo", "b": "ok"}', '{"a": "h\x01", "b": "ok"}',
                '{"a": "toolong", "b": "ok"}', '{"a": "x", "b": "o"}'):
        assert not takes(bad), bad
    assert plain_bounded_strings(xgr.Grammar.from_json_schema('{"type": "integer"}')) is not None
