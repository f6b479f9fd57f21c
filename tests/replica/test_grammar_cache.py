"""The replica's grammar cache: keyed by what changes which outputs are valid (a schema without
its annotations, canonical JSON), bounded in bytes (least recently used dropped first), and
seen in the replica's metrics.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import threading
from typing import Any

from tierserve.records import StructuredOutput
from tierserve.replica.metrics import EXPORTED, GAUGES, MEMORY_GAUGES, ReplicaMetrics
from tierserve.replica.models.embedded_spec import EOS_ID, build_tokenizer, embedded_config
from tierserve.replica.structured import Grammars, plan, strip_annotations

LONG = "x" * (600 * 1024)


@functools.cache
def _tokenizer() -> Any:
    return build_tokenizer()


def make(**kw: Any) -> Grammars:
    return Grammars(_tokenizer(), embedded_config().vocab_size, [EOS_ID], **kw)


def schema(description: str = "", **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "title": "Record",
        "description": description,
        "properties": {
            "id": {"type": "integer", "description": description, "examples": [1, 2]},
            "tags": {"type": "array", "items": {"enum": ["a", "b"], "$comment": description}},
        },
        "required": ["id"],
        **extra,
    }


def test_annotations_are_stripped_everywhere_but_a_property_named_like_one_is_kept() -> None:
    s = {
        "type": "object",
        "description": "drop me",
        "properties": {
            "description": {"type": "string", "description": "drop me too", "default": "x"},
            "title": {"const": {"description": "data, kept"}},
            "list": {"type": "array", "items": [{"title": "t", "type": "integer"}]},
        },
        "required": ["description", "title"],
        "$defs": {"examples": {"type": "null", "examples": [None]}},
        "anyOf": [{"title": "one", "type": "object"}],
    }
    assert strip_annotations(s) == {
        "type": "object",
        "properties": {
            "description": {"type": "string"},
            "title": {"const": {"description": "data, kept"}},
            "list": {"type": "array", "items": [{"type": "integer"}]},
        },
        "required": ["description", "title"],
        "$defs": {"examples": {"type": "null"}},
        "anyOf": [{"type": "object"}],
    }


def test_the_key_ignores_annotations_and_blanks_and_keeps_what_matters() -> None:
    a = StructuredOutput("json", json.dumps(schema("short")))
    b = StructuredOutput("json", json.dumps(schema(LONG), indent=4))
    assert plan(a).key == plan(b).key
    assert len(plan(b).key[1]) < 300  # the description is not in it
    # What changes the language changes the key: a keyword, a property's name, the options.
    assert plan(a).key != plan(StructuredOutput("json", json.dumps(schema(maxProperties=1)))).key
    named = {"type": "object", "properties": {"description": {"type": "string"}}}
    other = {"type": "object", "properties": {"summary": {"type": "string"}}}
    assert (plan(StructuredOutput("json", json.dumps(named))).key
            != plan(StructuredOutput("json", json.dumps(other))).key)
    assert plan(a).key != plan(StructuredOutput("json", a.spec, any_whitespace=False)).key


def test_property_order_is_kept_in_the_key_and_in_what_is_compiled() -> None:
    """The grammar writes an object's properties in its schema's order: a tool call's ``name``
    before its ``arguments`` (sorted, the model would have to write its arguments before
    knowing which function it calls). Two orders are two grammars."""
    call = {"type": "object", "properties": {"name": {"const": "f"},
                                             "arguments": {"type": "object"}},
            "required": ["name", "arguments"]}
    swapped = {**call, "properties": dict(reversed(list(call["properties"].items())))}
    first = plan(StructuredOutput("json", json.dumps(call)))
    assert list(json.loads(first.body)["properties"]) == ["name", "arguments"]
    assert first.key != plan(StructuredOutput("json", json.dumps(swapped))).key


def test_schemas_that_differ_only_in_annotations_share_one_small_entry() -> None:
    g = make()
    sizes = []
    for i in range(5):
        spec = StructuredOutput("json", json.dumps(schema(LONG + str(i))))
        g.compile(spec)
        sizes.append(g.cache_used_bytes)
    assert g.compiled == 1 and g.cache_entries == 1
    assert sizes == [sizes[0]] * 5 and sizes[0] < 256 * 1024
    # The grammar enforces the schema (the byte-level tokenizer: token id = byte).
    c = g.constraint(StructuredOutput("json", json.dumps(schema("other"))))
    assert all(c.accept(b) for b in b'{"id": 7}')
    assert c.accept(EOS_ID) and c.terminated
    bad = g.constraint(StructuredOutput("json", json.dumps(schema())))
    assert all(bad.accept(b) for b in b'{"id"') and not bad.accept(ord("x"))


def regex(i: int) -> StructuredOutput:
    return StructuredOutput("regex", f"[a-c]{{1,5}}-{i}")


def test_the_cache_keeps_to_its_bytes_dropping_the_least_recently_used() -> None:
    probe = make()
    probe.compile(regex(0))
    one = probe.cache_used_bytes  # every regex(i) costs the same
    seen: list[tuple[int, int, int]] = []
    g = make(cache_bytes=int(2.5 * one), on_cache=lambda *a: seen.append(a))
    g.compile(regex(1))
    g.compile(regex(2))
    assert (g.cache_entries, g.evictions) == (2, 0)
    g.compile(regex(1))  # a hit: regex(2) is now the least recently used
    g.compile(regex(3))
    assert (g.cache_entries, g.cache_used_bytes, g.evictions) == (2, 2 * one, 1)
    assert g.compiled == 3
    g.compile(regex(1))  # kept
    assert g.compiled == 3
    g.compile(regex(2))  # dropped: compiled again
    assert g.compiled == 4 and g.evictions == 2
    assert seen[-1] == (2, 2 * one, 2)
    assert all(used <= g.cache_bytes for _, used, _ in seen)


def test_a_grammar_dropped_from_the_cache_still_serves_the_request_that_holds_it() -> None:
    probe = make()
    probe.compile(regex(0))
    g = make(cache_bytes=int(1.5 * probe.cache_used_bytes))

    async def prepare() -> Any:
        return await g.prepare(regex(1))

    held = asyncio.run(prepare())
    g.compile(regex(2))  # evicts regex(1)
    assert g.cache_entries == 1 and g.evictions == 1
    c = g.constraint(regex(1))  # no compile: the request's own grammar, cached again
    assert g.compiled == 2 and c.accept(ord("a"))
    assert g.cache_entries == 1 and g.evictions == 2
    del held, c
    gc.collect()
    g.constraint(regex(2))  # dropped, and held by no one: compiled again
    assert g.compiled == 3


class FakeGauge:
    def __init__(self) -> None:
        self.values: list[float] = []

    def set(self, value: float) -> None:
        self.values.append(value)


class FakeCounter:
    def __init__(self) -> None:
        self.total = 0.0

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        self.total += value


def test_the_replica_exports_the_caches_entries_bytes_and_evictions() -> None:
    names = {"tierserve_grammar_cache_entries", "tierserve_grammar_cache_bytes"}
    assert {f"ray_{n}" for n in names} | {"ray_tierserve_grammar_cache_evictions_total"} <= EXPORTED
    assert not names & set(GAUGES | MEMORY_GAUGES)  # not among the dashboard's gauges
    m = object.__new__(ReplicaMetrics)
    m.gauges = {name: FakeGauge() for name in names}  # type: ignore[misc]
    counter = FakeCounter()
    m.grammar_counters = {"tierserve_grammar_cache_evictions": counter}  # type: ignore[dict-item]
    m._grammar_lock = threading.Lock()
    m.grammar_cache(3, 4096, 0)
    m.grammar_cache(2, 3000, 2)
    m.grammar_cache(2, 3100, 2)
    gauges: dict[str, Any] = m.gauges
    assert gauges["tierserve_grammar_cache_entries"].values == [3, 2, 2]
    assert gauges["tierserve_grammar_cache_bytes"].values == [4096, 3000, 3100]
    assert counter.total == 2
    m._set_grammar_gauges()  # what the refresher does every period, so they never expire
    assert gauges["tierserve_grammar_cache_bytes"].values[-1] == 3100


def test_a_large_grammar_s_frame_is_handed_back_to_the_system(monkeypatch: Any) -> None:
    """Reading, parsing and dropping a large serialized grammar leaves the allocator holding
    several times its size: the replica hands it back (``release_freed_memory``) once the
    grammar is built; a small one costs no trim."""
    import tierserve.replica.structured as structured

    trims: list[int] = []
    monkeypatch.setattr(structured, "release_freed_memory", lambda: trims.append(1))
    g = make()
    g.compile(StructuredOutput("json", json.dumps(schema("small"))))
    assert trims == []
    monkeypatch.setattr(structured, "TRIM_AFTER_BYTES", 1)
    g.compile(StructuredOutput("json", json.dumps(schema("small", maxProperties=2))))
    assert trims == [1]


def test_release_freed_memory_runs_where_there_is_no_malloc_trim() -> None:
    from tierserve.replica.grammar_worker import release_freed_memory

    release_freed_memory()  # glibc: trims; elsewhere: nothing, and no error
