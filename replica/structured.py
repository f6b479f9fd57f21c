"""Structured outputs in the replica: grammars compiled in a worker process, kept in a cache
bounded in bytes, a matcher per sample, and the token masks the sampler applies
(docs/structured.md).

The grammar library is xgrammar (token bitmasks over the vocabulary, an Earley-style matcher
per sequence; ``benchmarks/structured.py`` measured it against llguidance on this model's
tokenizer).

Compiling. ``Grammars`` compiles a request's ``StructuredOutput`` in a process of its own
(``tierserve.replica.grammar_worker``, started on the first structured request and again after
it dies), never on the step loop or in the replica's process: the worker sends the compiled
grammar back serialized. Each compile has a budget (``EngineConfig.grammar_compile_timeout_s``):
past it the worker is killed (and started again for the next job) and the request refused,
400 ``grammar_too_complex``; a grammar larger than the cache's budget is refused the same way,
and a compile that crashes the worker is a 400 ``grammar_compile_failed``. One compile runs at
a time; the queue is ordered by the request's priority (higher first, then in arrival order),
and a tenant has at most ``EngineConfig.grammar_compiles_per_tenant`` compiles queued or
running: one more is refused, 429 ``too_many_compiles``. A request that waits for a compile
counts as waiting (``Grammars.waiting``, in the engine's ``num_waiting``).

Caching. Compiled grammars are cached by a key that ignores what does not change which
outputs are valid (``plan``: a JSON schema without its annotations, canonical JSON), in an LRU
bounded by ``EngineConfig.grammar_cache_bytes`` (each grammar's ``memory_size_bytes`` and its
key's text). Requests that ask for a spec while it compiles wait for that one compile. A
request that leaves while it waits takes nothing with it; a compile no one waits for any more
is dropped from the queue, and nothing that failed is cached.

``Constraint`` is one sample's matcher (a ``tierserve.replica.constraint.TokenConstraint``):
the sampler asks it for the mask of the next token (``apply_constraints``, one bitmask for the
batch's constrained rows) and tells it the token drawn. It lives with the request's sampler
state, so it survives preemption by recompute (the kept tokens were accepted already) and is
never shared by two samples.

xgrammar is imported on first use: a replica that never sees a structured request does not
load it, nor start the worker.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tierserve
from tierserve.records import BadRequest, StructuredOutput
from tierserve.replica.grammar_worker import (
    Timeout,
    read_frame,
    reason,
    release_freed_memory,
    write_frame,
)

if TYPE_CHECKING:
    import torch
    import xgrammar

log = logging.getLogger(__name__)


class GrammarError(BadRequest, ValueError):
    """A structured output the replica refuses: a schema, regex or grammar xgrammar refuses
    (``code`` ``invalid_structured_output``), one too complex to compile within the budget
    (``grammar_too_complex``), one that crashed the compiler (``grammar_compile_failed``), or
    one over its tenant's compiles (``too_many_compiles``). ``param`` names the request field it
    came from; ``status`` is the HTTP status a server answers with (400; 429 for the tenant
    cap; 503 when the replica cannot compile at all)."""

    code = "invalid_structured_output"

    def __init__(self, message: str, param: str, code: str = "invalid_structured_output",
                 status: int = 400) -> None:
        super().__init__(message, code, param, status=status)


# Whitespace characters JSON may put between two of its tokens: enough for any indentation a
# model writes, and a bound on a small model that would otherwise fill its answer with blanks.
MAX_WHITESPACE = 16

# ``EngineConfig``'s defaults (``grammar_cache_bytes``, ``grammar_compile_timeout_s``,
# ``grammar_compiles_per_tenant``).
DEFAULT_CACHE_BYTES = 64 * 2**20
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_COMPILES_PER_TENANT = 4

# Called after each compilation (its kind and seconds), each lookup (hit or not) and each
# change of the cache (entries, bytes, evictions so far).
CompileObserver = Callable[[str, float], None]
CacheObserver = Callable[[bool], None]
CacheSizeObserver = Callable[[int, int, int], None]


# Where a JSON schema holds subschemas: by name, in a list, or one (a list too: the old array
# form of ``items``).
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_ONE = ("items", "additionalProperties", "propertyNames", "contains", "additionalItems",
            "unevaluatedProperties")

def subschemas(schema: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Each direct subschema of ``schema`` with its path from it (``properties/a``,
    ``anyOf/0``, ``items``)."""
    for key in _SUB_MAPS:
        subs = schema.get(key)
        if isinstance(subs, dict):
            for name, sub in subs.items():
                yield f"{key}/{name}", sub
    for key in _SUB_LISTS + _SUB_ONE:
        sub = schema.get(key)
        if isinstance(sub, list) and (key in _SUB_LISTS or key == "items"):
            for i, s in enumerate(sub):
                yield f"{key}/{i}", s
        elif key in _SUB_ONE and sub is not None:
            yield key, sub


def map_subschemas(schema: dict[str, Any], fn: Callable[[Any], Any]) -> dict[str, Any]:
    """A copy of ``schema`` with ``fn`` applied to each direct subschema (``subschemas``)."""
    out = dict(schema)
    for key in _SUB_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: fn(v) for k, v in out[key].items()}
    for key in _SUB_LISTS + _SUB_ONE:
        sub = out.get(key)
        if isinstance(sub, list) and (key in _SUB_LISTS or key == "items"):
            out[key] = [fn(v) for v in sub]
        elif key in _SUB_ONE and sub is not None:
            out[key] = fn(sub)
    return out


def enforceable(schema: Any) -> Any:
    """``schema`` as the grammar is compiled from it: every output still validates against the
    original.

    - An object schema that lists its ``properties`` and says nothing of others
      (``additionalProperties``, ``patternProperties``, ``unevaluatedProperties``) gets only
      those: a model given room for extra keys (a tool's arguments, a record) may fill its
      answer with them instead of ending it.

    A string bounded by ``minLength``/``maxLength`` stays as it is: the compile worker makes its
    characters plain (``tierserve.replica.grammar_worker.plain_bounded_strings``).
    """
    if not isinstance(schema, dict):
        return schema
    out = map_subschemas(schema, enforceable)
    if ("properties" in out and not {"additionalProperties", "patternProperties",
                                     "unevaluatedProperties"} & out.keys()):
        out["additionalProperties"] = False
    return out


def _literal(text: str) -> str:
    """An EBNF string literal matching ``text`` exactly (JSON's escapes are EBNF's)."""
    return json.dumps(text, ensure_ascii=False)


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF of one of ``choices``, verbatim."""
    return "root ::= " + " | ".join(_literal(c) for c in choices)


# Keywords that say nothing of which outputs are valid: a schema is cached, and compiled,
# without them (JSON Schema's annotations, and ``$comment``).
ANNOTATIONS = frozenset({"title", "description", "examples", "$comment", "default", "deprecated",
                         "readOnly", "writeOnly"})

# What names a compiled grammar in a replica's cache: kind, the spec in canonical form,
# any_whitespace, prefix, suffix.
CacheKey = tuple[str, str, bool, str, str]

# A grammar whose serialized form is this large leaves that much (several times over: the
# frame, its text, the parse) freed but kept by the allocator: it is handed back to the system.
TRIM_AFTER_BYTES = 4 * 2**20

# Seconds a new compile worker may take to import xgrammar and say it is ready.
WORKER_START_TIMEOUT_S = 120.0
# Memory the worker may take beyond what it holds once ready, besides 8 times the largest
# grammar it may send (the serialized form is built twice over, and compiling takes more).
WORKER_MEMORY_HEADROOM = 2**30


def strip_annotations(schema: Any) -> Any:
    """``schema`` without its ``ANNOTATIONS``, in itself and every subschema
    (``subschemas``): a property *named* ``description`` stays, it is a name, not a keyword;
    so do ``enum`` and ``const`` values, which are data. A subschema under a keyword this module
    does not know keeps its annotations (two such schemas are then cached apart, never one
    grammar for two different languages)."""
    if not isinstance(schema, dict):
        return schema
    return map_subschemas({k: v for k, v in schema.items() if k not in ANNOTATIONS},
                          strip_annotations)


@dataclass(frozen=True, slots=True)
class CompilePlan:
    """What a spec is cached under (``key``) and what the worker compiles (``head``: the job,
    ``body``: its text)."""

    key: CacheKey
    head: dict[str, Any]
    body: str


def _key_bytes(key: CacheKey) -> int:
    """What a key costs the cache (its text; the grammar's own size comes apart)."""
    return len(key[1]) + len(key[3]) + len(key[4])


def plan(spec: StructuredOutput) -> CompilePlan:
    """The cache key and the compile job of ``spec``; ``GrammarError`` where the spec cannot be
    read (a schema that is not JSON, a choice that is not a list of strings).

    A JSON schema's key is the schema without its annotations (``strip_annotations``), as JSON
    without blanks: two schemas that differ in a ``description`` (or in whitespace) share one
    grammar, and a long description costs the cache nothing. Key order is kept, in the key and
    in what is compiled: the grammar writes an object's properties in its schema's order (a
    tool call's ``name`` before its ``arguments``), so two orders are two grammars. The grammar
    is compiled from that same schema (``enforceable``'s form of it)."""
    ws = MAX_WHITESPACE if spec.any_whitespace else None
    try:
        if spec.kind == "json":
            stripped = strip_annotations(json.loads(spec.spec))
            canonical = json.dumps(stripped, separators=(",", ":"), ensure_ascii=False)
            body = json.dumps(enforceable(stripped), ensure_ascii=False)
            head: dict[str, Any] = {"op": "json", "any_whitespace": spec.any_whitespace,
                                    "max_whitespace": ws, "prefix": spec.prefix,
                                    "suffix": spec.suffix}
            key: CacheKey = ("json", canonical, spec.any_whitespace, spec.prefix, spec.suffix)
            return CompilePlan(key, head, body)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not isinstance(choices, list) or not choices or not all(
                    isinstance(c, str) for c in choices):
                raise ValueError("choice must be a non-empty list of strings")
            text = json.dumps(choices, ensure_ascii=False)
            return CompilePlan(("choice", text, False, "", ""), {"op": "ebnf"},
                               choice_grammar(choices))
    except (ValueError, TypeError, RecursionError) as e:
        raise GrammarError(f"{spec.param}: the {spec.kind} does not compile: {reason(e)}",
                           spec.param) from None
    if spec.kind == "json_object":
        return CompilePlan(("json_object", "", spec.any_whitespace, "", ""),
                           {"op": "json_object", "any_whitespace": spec.any_whitespace,
                            "max_whitespace": ws}, "")
    if spec.kind == "regex":
        return CompilePlan(("regex", spec.spec, False, "", ""), {"op": "regex"}, spec.spec)
    # grammar (StructuredOutput checked the kind)
    return CompilePlan(("grammar", spec.spec, False, "", ""), {"op": "ebnf"}, spec.spec)


class _Failure(Exception):
    """Why a compile job gave no grammar; each request that waited for it gets a
    ``GrammarError`` of its own (``error``: its field named)."""

    def __init__(self, detail: str, code: str = "invalid_structured_output", status: int = 400,
                 about_spec: bool = True) -> None:
        super().__init__(detail)
        self.detail, self.code, self.status, self.about_spec = detail, code, status, about_spec

    def error(self, spec: StructuredOutput) -> GrammarError:
        text = f"{spec.param}: the {spec.kind} {self.detail}" if self.about_spec else self.detail
        return GrammarError(text, spec.param, self.code, self.status)


def _shutting_down() -> _Failure:
    return _Failure("the replica is shutting down: its grammar compiler has stopped",
                    "replica_unavailable", 503, about_spec=False)


@dataclass(eq=False, slots=True)
class _Job:
    """One compile: queued, then running on the worker; every request that asks for its key
    meanwhile waits for it."""

    plan: CompilePlan
    kind: str
    priority: int
    order: int
    tenant: str | None  # charged for it while it is queued or running (None: no one)
    future: Future[Any] = field(default_factory=Future)
    waiters: int = 0
    state: str = "queued"  # queued, running, done, dropped

    def __lt__(self, other: _Job) -> bool:  # the queue's order: higher priority, then older
        return (-self.priority, self.order) < (-other.priority, other.order)


@dataclass(slots=True)
class _Built:
    compiled: Any
    nbytes: int
    seconds: float


class _Worker:
    """A compile worker process (``tierserve.replica.grammar_worker``) and its channel."""

    def __init__(self, start_timeout_s: float, headroom: int) -> None:
        to_child_r, self._out = os.pipe()
        self._in, from_child_w = os.pipe()
        root = str(Path(tierserve.__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        try:
            # Not a fork: the replica is a process with threads (Ray's, the step loop's).
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierserve.replica.grammar_worker", str(to_child_r),
                 str(from_child_w), str(headroom)],
                pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            for fd in (self._out, self._in):
                os.close(fd)
            raise
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        self.tokenizers: set[str] = set()  # the ids of the tokenizers it was sent
        self.start_timeout_s = start_timeout_s
        try:
            read_frame(self._in, time.monotonic() + start_timeout_s)  # xgrammar is imported
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def know(self, tokenizer_id: str, tokenizer_info: Callable[[], str]) -> None:
        """Send the tokenizer (``tokenizer_info()``: its serialized ``TokenizerInfo``) unless
        it was sent before."""
        if tokenizer_id not in self.tokenizers:
            write_frame(self._out, {"op": "tokenizer", "id": tokenizer_id},
                        tokenizer_info().encode())
            read_frame(self._in, time.monotonic() + self.start_timeout_s)
            self.tokenizers.add(tokenizer_id)

    def run(self, head: dict[str, Any], body: str,
            timeout_s: float) -> tuple[dict[str, Any], bytes]:
        """Send a job and read the answer: ``Timeout`` past ``timeout_s``, ``EOFError`` or
        ``OSError`` when the process is gone."""
        deadline = time.monotonic() + timeout_s
        write_frame(self._out, head, body.encode())
        return read_frame(self._in, deadline)

    def signal(self) -> None:
        """Kill the process (any thread: the channel is left to ``close``)."""
        with contextlib.suppress(OSError):
            self.proc.kill()

    def close(self) -> str:
        """Kill the process, reap it and close the channel; how it ended."""
        self.signal()
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        for fd in (self._out, self._in):
            with contextlib.suppress(OSError):
                os.close(fd)
        if code is None:
            return "it did not end"
        return f"signal {-code}" if code < 0 else f"exit status {code}"


class _WorkerSlot:
    """The process's compile worker, shared by its engines (a replica has one; an offline
    process may have several ``LLM``s): one job at a time, whoever holds ``lock``."""

    def __init__(self) -> None:
        self.worker: _Worker | None = None
        self.lock = threading.Lock()  # held to start the worker or run a job on it
        self.user: object | None = None  # the ``Grammars`` whose job runs now

    def ready(self, tokenizer_id: str, tokenizer_info: Callable[[], str],
              headroom: int) -> _Worker:
        """The worker, started now (its memory capped at ``headroom`` past its start) if there
        is none or it died, knowing the tokenizer. Under ``lock``."""
        if self.worker is not None and not self.worker.alive():
            self.close_locked()
        if self.worker is None:
            self.worker = _Worker(WORKER_START_TIMEOUT_S, headroom)
        try:
            self.worker.know(tokenizer_id, tokenizer_info)
        except BaseException:
            self.close_locked()
            raise
        return self.worker

    def close_locked(self) -> str:
        """End the worker (the next job starts another); how it ended. Under ``lock``."""
        worker, self.worker = self.worker, None
        return worker.close() if worker is not None else ""

    def close(self) -> None:
        with self.lock:
            self.close_locked()


_SLOT = _WorkerSlot()


@atexit.register
def _end_worker() -> None:  # a compile left running must not outlive the replica
    worker = _SLOT.worker
    if worker is not None:
        worker.signal()


class Grammars:
    """One replica's compiled grammars (a cache bounded in bytes) and their compile queue, run
    by a worker process of its own (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Sequence[int],
        on_compile: CompileObserver | None = None,
        on_lookup: CacheObserver | None = None,
        on_cache: CacheSizeObserver | None = None,
        *,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        compiles_per_tenant: int = DEFAULT_COMPILES_PER_TENANT,
    ) -> None:
        if cache_bytes <= 0 or compile_timeout_s <= 0 or compiles_per_tenant <= 0:
            raise ValueError("cache_bytes, compile_timeout_s and compiles_per_tenant must be "
                             "positive")
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self.on_compile = on_compile
        self.on_lookup = on_lookup
        self.on_cache = on_cache
        self.cache_bytes = cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.compiles_per_tenant = compiles_per_tenant
        self._info: xgrammar.TokenizerInfo | None = None
        self._lock = threading.Lock()
        # The cache, least recently used first, and what its entries cost.
        self._cache: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()
        self._cache_used = 0
        # Every compiled grammar something still holds (a request that has not made its
        # matchers yet), cached or not: ``constraint`` finds it here after an eviction.
        self._held: weakref.WeakValueDictionary[CacheKey, Any] = weakref.WeakValueDictionary()
        self._jobs: dict[CacheKey, _Job] = {}  # queued or running, by key
        self._queue: list[_Job] = []  # a heap: higher priority first, then older
        self._per_tenant: dict[str, int] = {}
        self._order = itertools.count()
        self._dispatching = False
        self._closing = False
        self._running: _Job | None = None
        self._revived = False  # a lookup cached a held grammar again (the gauges to update)
        # The last specs planned, by identity: ``prepare`` then ``constraint`` for each of n
        # samples read one schema once.
        self._plans: OrderedDict[int, tuple[StructuredOutput, CompilePlan]] = OrderedDict()
        self._info_id: str | None = None
        self.compiled = 0  # compilations run (not lookups)
        self.evictions = 0  # cached grammars dropped for room
        self.waiting = 0  # requests in ``prepare`` waiting for a compile (queued or running)

    # ------------------------------------------------------------------ the cache

    @property
    def cache_entries(self) -> int:
        return len(self._cache)

    @property
    def cache_used_bytes(self) -> int:
        """The cache's bytes: each grammar's ``memory_size_bytes`` and its key's text."""
        return self._cache_used

    @property
    def worker_pid(self) -> int | None:
        """The compile worker's process id (None before the first compile or after it died)."""
        worker = _SLOT.worker
        return worker.pid if worker is not None and worker.alive() else None

    @property
    def compiling(self) -> CacheKey | None:
        """The key of this engine's job on the worker now (sent, not answered), if any."""
        job = self._running
        return job.plan.key if job is not None and _SLOT.user is self else None

    def _plan(self, spec: StructuredOutput) -> CompilePlan:
        with self._lock:
            known = self._plans.get(id(spec))
            if known is not None and known[0] is spec:
                return known[1]
        made = plan(spec)
        with self._lock:
            self._plans[id(spec)] = (spec, made)
            while len(self._plans) > 8:
                self._plans.popitem(last=False)
        return made

    def _lookup(self, key: CacheKey) -> Any:
        """The compiled grammar of ``key``, cached or still held by someone (then cached
        again), or None. Under ``_lock``."""
        entry = self._cache.get(key)
        if entry is not None:
            self._cache.move_to_end(key)
            return entry[0]
        compiled = self._held.get(key)
        if compiled is not None:  # dropped for room, and in use again
            self._remember(key, compiled, int(compiled.memory_size_bytes) + _key_bytes(key))
            self._revived = True
        return compiled

    def _remember(self, key: CacheKey, compiled: Any, cost: int) -> None:
        """Cache ``compiled``, dropping the least recently used for room. Under ``_lock``."""
        self._held[key] = compiled
        if cost > self.cache_bytes or key in self._cache:
            return
        while self._cache and self._cache_used + cost > self.cache_bytes:
            _, (_, freed) = self._cache.popitem(last=False)
            self._cache_used -= freed
            self.evictions += 1
        self._cache[key] = (compiled, cost)
        self._cache_used += cost

    def _report_cache(self) -> None:
        if self.on_cache is not None:
            self.on_cache(len(self._cache), self._cache_used, self.evictions)

    # ------------------------------------------------------------------ the queue

    def _join(self, spec: StructuredOutput, made: CompilePlan, priority: int,
              tenant: str | None, count: bool = True) -> tuple[Any, _Job | None]:
        """The cached grammar of ``made``, or the job that compiles it (this request one of its
        waiters): under way, or queued now. ``GrammarError`` (429) when ``tenant`` has its
        share of compiles under way, 503 after ``shutdown``. ``count``: report the lookup
        (once per request)."""
        key = made.key
        with self._lock:
            compiled = self._lookup(key)
            job = None if compiled is not None else self._jobs.get(key)
            hit = compiled is not None or job is not None
            if compiled is None:
                if job is None:
                    if self._closing:
                        raise _shutting_down().error(spec)
                    if (tenant is not None
                            and self._per_tenant.get(tenant, 0) >= self.compiles_per_tenant):
                        raise GrammarError(
                            f"{spec.param}: too many grammar compiles in progress for this "
                            f"tenant (at most {self.compiles_per_tenant} at once); retry when "
                            "they have finished", spec.param, "too_many_compiles", 429)
                    job = _Job(made, spec.kind, priority, next(self._order), tenant)
                    self._jobs[key] = job
                    if tenant is not None:
                        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
                    heapq.heappush(self._queue, job)
                    self._dispatch()
                elif job.state == "queued" and priority > job.priority:
                    job.priority = priority  # it waits for the highest of its requests
                    heapq.heapify(self._queue)
                job.waiters += 1
            revived, self._revived = self._revived, False
        if count and self.on_lookup is not None:
            self.on_lookup(hit)
        if revived:
            self._report_cache()
        return compiled, job

    def _leave(self, job: _Job) -> None:
        """A waiter is done with ``job``; the last one to leave a queued job drops it (nothing
        is kept of it: the next request with its spec queues it again). Under ``_lock``."""
        job.waiters -= 1
        if job.waiters == 0 and job.state == "queued":
            self._queue.remove(job)
            heapq.heapify(self._queue)
            self._forget(job, "dropped")
            job.future.set_exception(_Failure("was not compiled: every request for it left"))

    def _forget(self, job: _Job, state: str) -> None:
        """``job`` leaves the books. Under ``_lock``."""
        job.state = state
        if self._jobs.get(job.plan.key) is job:
            del self._jobs[job.plan.key]
        if job.tenant is not None:
            left = self._per_tenant[job.tenant] - 1
            if left:
                self._per_tenant[job.tenant] = left
            else:
                del self._per_tenant[job.tenant]

    def _dispatch(self) -> None:
        """Start the dispatcher thread unless one runs. Under ``_lock``."""
        if not self._dispatching:
            self._dispatching = True
            threading.Thread(target=self._drain, name="tierserve-grammar", daemon=True).start()

    def _drain(self) -> None:
        """The dispatcher: the queue's jobs one at a time, best first, until it is empty."""
        while True:
            with self._lock:
                if not self._queue:
                    self._dispatching = False
                    return
                job = heapq.heappop(self._queue)
                job.state = "running"
                self._running = job
            try:
                outcome: _Built | _Failure = self._compile_job(job)
            except _Failure as f:
                outcome = f
                if f.status == 503:  # no worker: the jobs behind it would wait for nothing
                    self._fail_queue(f)
            except Exception as e:  # the dispatcher must outlive any job
                log.exception("grammar compile failed")
                outcome = _Failure(f"failed to compile: {reason(e)}", "grammar_compile_failed")
            self._finish(job, outcome)

    def _fail_queue(self, failure: _Failure) -> None:
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
            for job in jobs:
                self._forget(job, "done")
        for job in jobs:
            job.future.set_exception(failure)

    def _finish(self, job: _Job, outcome: _Built | _Failure) -> None:
        with self._lock:
            self._running = None
            if self._closing and isinstance(outcome, _Failure):
                outcome = _shutting_down()
            self._forget(job, "done")
            if isinstance(outcome, _Built):  # cached before anyone hears of it
                self._remember(job.plan.key, outcome.compiled,
                               outcome.nbytes + _key_bytes(job.plan.key))
                self.compiled += 1
        if isinstance(outcome, _Built):
            if self.on_compile is not None:
                self.on_compile(job.kind, outcome.seconds)
            self._report_cache()
            job.future.set_result(outcome.compiled)
        else:
            job.future.set_exception(outcome)

    # ------------------------------------------------------------------ the worker

    def _tokenizer_info(self) -> xgrammar.TokenizerInfo:
        if self._info is None:
            import xgrammar as xgr

            self._info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
        return self._info

    def _tokenizer_id(self) -> str:
        """The tokenizer's name in the worker: the hash of its serialized ``TokenizerInfo``
        (engines of one tokenizer share its compiler there)."""
        if self._info_id is None:
            self._info_id = hashlib.sha256(self._info_json().encode()).hexdigest()[:16]
        return self._info_id

    def _info_json(self) -> str:
        return str(self._tokenizer_info().serialize_json())

    def _worker(self) -> _Worker:
        """The process's worker, started if it is not running, knowing this tokenizer. Under
        ``_SLOT.lock``."""
        if self._closing:
            raise _shutting_down()
        try:
            return _SLOT.ready(self._tokenizer_id(), self._info_json,
                               WORKER_MEMORY_HEADROOM + 8 * self.cache_bytes)
        except (OSError, EOFError, ValueError, Timeout) as e:
            log.error("the grammar compile worker did not start: %r", e)
            raise _Failure(f"this replica's grammar compiler could not start: "
                           f"{reason(e) if str(e) else type(e).__name__}",
                           "replica_unavailable", 503, about_spec=False) from None

    def _compile_job(self, job: _Job) -> _Built:
        """Run ``job`` on the worker within the budget; raises the ``_Failure`` it ends in. The
        budget starts when the job is sent (a worker that starts first does not use it)."""
        task = job.plan.head | {"tokenizer": self._tokenizer_id(), "max_bytes": self.cache_bytes}
        with _SLOT.lock:
            worker = self._worker()
            t0 = time.perf_counter()
            _SLOT.user = self
            try:
                head, body = worker.run(task, job.plan.body, self.compile_timeout_s)
            except Timeout:
                _SLOT.close_locked()
                raise _Failure(f"is too complex to compile within {self.compile_timeout_s:g} s "
                               "(this replica's grammar compile budget)",
                               "grammar_too_complex") from None
            except (EOFError, OSError, ValueError):
                how = _SLOT.close_locked()
                raise _Failure(f"made the grammar compiler fail (its process ended: {how})",
                               "grammar_compile_failed") from None
            finally:
                _SLOT.user = None
            if head.get("retire"):  # it grew: the next job gets a fresh one
                _SLOT.close_locked()
        if not head.get("ok"):
            size = head.get("too_large")
            if size == 0:
                raise _Failure("needs more memory to compile than this replica's grammar "
                               "compiler may use", "grammar_too_complex")
            if size is not None:
                raise _Failure(f"compiles to a grammar of {int(size) / 2**20:.1f} MiB, more than "
                               f"the {self.cache_bytes / 2**20:g} MiB this replica keeps for "
                               "grammars", "grammar_too_complex")
            raise _Failure(f"does not compile: {head.get('error', 'no reason given')}")
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(body.decode(), self._tokenizer_info())
        if len(body) >= TRIM_AFTER_BYTES:
            del body
            release_freed_memory()
        return _Built(compiled, int(head.get("bytes", 0)), time.perf_counter() - t0)

    def _compiler_of(self) -> xgrammar.TokenizerInfo:
        """The tokenizer's ``TokenizerInfo`` and a running compile worker that knows it (what
        the first compile makes; the bench times them apart). Returns the ``TokenizerInfo``."""
        try:
            with _SLOT.lock:
                self._worker()
        except _Failure as f:
            raise RuntimeError(f.detail) from None
        return self._tokenizer_info()

    # ------------------------------------------------------------------ the API

    async def prepare(self, spec: StructuredOutput, *, priority: int = 0,
                      tenant: str | None = "") -> Any:
        """Wait, without blocking the event loop or the step loop, until ``spec`` is compiled,
        and return its compiled grammar (hold it until the request's matchers are made:
        ``constraint`` finds it then even if the cache dropped it). Raises ``GrammarError``:
        the spec does not compile, runs past the budget or crashes the compiler (400), its
        ``tenant`` has ``compiles_per_tenant`` compiles under way (429; None: no cap).

        A new compile is queued by ``priority`` (higher first, then in arrival order). A caller
        that leaves (its task cancelled) takes nothing with it: the others waiting for that
        compile still get it, and a compile that no one waits for any more is dropped from
        the queue (or, already running, finishes and is cached)."""
        made = self._plan(spec)
        compiled, job = self._join(spec, made, priority, tenant)
        if job is None:
            return compiled
        loop = asyncio.get_running_loop()
        mine: asyncio.Future[Any] = loop.create_future()

        def settle(done: Future[Any]) -> None:  # on the thread that finished the job
            with contextlib.suppress(RuntimeError):  # the loop is closed: no one is waiting
                loop.call_soon_threadsafe(_copy_outcome, done, mine, spec)

        with self._lock:
            self.waiting += 1
        try:
            job.future.add_done_callback(settle)
            return await mine
        finally:
            with self._lock:
                self.waiting -= 1
                self._leave(job)

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec``, compiled on the worker when it is new while the
        caller waits (the offline path; no tenant cap, priority 0)."""
        return self._compile(spec, count=True)

    def _compile(self, spec: StructuredOutput, count: bool) -> Any:
        compiled, job = self._join(spec, self._plan(spec), 0, None, count)
        if job is None:
            return compiled
        try:
            return job.future.result()
        except _Failure as f:
            raise f.error(spec) from None
        finally:
            with self._lock:
                self._leave(job)

    def constraint(self, spec: StructuredOutput) -> Constraint:
        """A fresh matcher for one sample (compiling ``spec`` first if no one has: the lookup
        is not counted, ``prepare`` or ``compile`` counts it once per request)."""
        import xgrammar as xgr

        compiled = self._compile(spec, count=False)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=self.stop_ids)
        return Constraint(matcher)

    def shutdown(self) -> None:
        """Stop compiling: queued compiles fail (503), and a compile of this engine's running
        on the worker is killed with it (the next compile in the process starts another; an
        idle worker ends with the process). Grammars already compiled still serve."""
        with self._lock:
            self._closing = True
        self._fail_queue(_shutting_down())
        worker = _SLOT.worker
        if _SLOT.user is self and worker is not None:
            worker.signal()


def _copy_outcome(done: Future[Any], mine: asyncio.Future[Any], spec: StructuredOutput) -> None:
    """Give one waiter (``mine``, on its loop) its job's outcome, unless it left."""
    if mine.done():
        return
    error = done.exception()
    if error is None:
        mine.set_result(done.result())
    elif isinstance(error, _Failure):
        mine.set_exception(error.error(spec))
    else:
        mine.set_exception(error)


class Constraint:
    """One sample's position in its grammar."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it (nothing changes)."""
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the output ends here."""
        return bool(self.matcher.is_terminated())
