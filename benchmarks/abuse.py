"""Isolation as a measured property: ``python -m benchmarks.abuse``.

A well-behaved client (the victim) streams completions while, one at a time, probes do what a
careless or hostile client of the lowest tier can do to a shared cluster: hang up on slow grammar
compiles, send schemas that are huge, or huge only in their annotations, flood the compiler,
send every stop token id it can, leave streams unread, trickle a body a byte a second, nest JSON
1,200 deep, ask another tenant's prompt back from the prefix cache. Each probe is judged by what
the victim saw and by what it left behind, against four targets:

- the victim's stream never pauses longer than ``max(0.5 s, 3 x its worst gap alone)`` during a
  probe (its worst gap in the quiet window just before; the probe's window is at least 2 s);
- a replica's resident memory grows by at most 48 MiB under 100 schemas that differ only in
  their annotations (``annotation_schemas``);
- no probe leaves a schema, a block or a replica broken: afterwards a request with each schema
  the probe used, from another well-behaved client, answers 200; the replicas' free KV blocks
  come back to their quiet value (``tierserve_kv_blocks_free``, at most 60 s); ``/ready`` is 200;
- nothing a client sends yields a 5xx.

Each probe also states what it expects of its own answers (a fast 400, a 408, a 401, ...); an
answer other than that fails it too.

Run: ``python -m benchmarks.abuse [--config CONFIG | --url URL] [--keys per-tier|none]
[--probes a,b,...] [--json out.json] [--plot out.png]``.

- ``--config`` (default ``configs/cluster.yaml``): the bench starts the cluster itself
  (``python -m tierserve.cluster.launch CONFIG``, what ``tierserve serve`` runs), on the
  config as it is, then, with ``--keys per-tier`` (the default), again on a config derived from
  it with a fresh key on every tier (standard with two tenants, as ``benchmarks.tiers``
  derives it) and ``anonymous_tier: null`` (a request without a key is a 401). The keys live in the environment of the cluster
  and of this process only (``env:VAR`` references in the written config); the report never
  shows one. Ray's metrics are exported every ``--metrics-interval-ms`` (2000) so that the
  replicas' gauges can be read a few seconds after a probe.
- ``--url``: a cluster that is already running (nothing started or stopped); with ``--keys
  per-tier`` its keys come from ``benchmarks.tiers.KEY_VARS``' environment variables.

Who is who: the victim is the interactive tier's key (no key where none is configured: the
anonymous tier), streaming completions back to back (about 40 words in, ``max_tokens`` 48,
``temperature`` 0, ``ignore_eos`` so that every answer has 48 tokens), in a process of its own
so that this process's work never delays what it measures; it records every token's arrival.
The attacker is the lowest tier: the batch key, or no key. The well-behaved client of the
checks afterwards is tenant-a of the standard tier (no key without keys). Probes
``no_key`` and ``cache_probe`` need keys and are skipped without them.

Per probe: a quiet window (``--quiet``, 8 s, the victim alone), the probe while the victim
keeps streaming, then the checks above (which also let the cluster settle). The table: the
probe's answers by status and error code, the victim's TTFT p99, TPOT p99 and worst gap in the
quiet window and during the probe, the replicas' resident memory from before to after (Ray's
metrics), and the verdict; the reasons of every failure below it; then the machine.
``--json`` writes everything (every victim request with its token times, every answer,
every check), ``--plot`` the victim's gaps over time with the probes' windows shaded. Exit
status 1 when any probe fails a target or a run could not be made, 2 for bad arguments.
About 5-10 minutes per config on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import secrets
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import yaml

from benchmarks.serving import DEFAULT_CONFIG, answers, completion_ready, stop, wait_for
from benchmarks.tiers import (
    KEY_VARS,
    app_args,
    derive_config,
    http_target,
    new_keys,
    redact,
    validate,
)
from benchmarks.tools import ROOT
from tierserve.cluster.load import Scrape, parse_metrics
from tierserve.cluster.measure import (
    error_code,
    load_avg_1m,
    machine,
    pyplot,
    rounded_percentile,
    served_model,
    served_model_async,
)
from tierserve.records import MAX_STOP_TOKEN_IDS

TOOL = "benchmarks.abuse"
QUIET_S = 8.0
MIN_WINDOW_S = 2.0  # a probe's window for the victim's figures lasts at least this long
GAP_FLOOR_S = 0.5
GAP_FACTOR = 3.0
MEMORY_LIMIT_BYTES = 48 * 2**20  # per replica, under annotation_schemas
FAST_S = 2.0  # what a "fast" refusal takes at most
BLOCKS_TIMEOUT_S = 60.0
VICTIM_WORDS = 40
VICTIM_MAX_TOKENS = 48
REQUEST_TIMEOUT_S = 120.0
PRIORITY_HEADER = "X-TL-Priority"
KEY_MODES = ("per-tier", "none")

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
         "wise", "owls", "count", "stars", "above", "quiet", "hills", "near", "an", "old",
         "river", "where", "children", "once", "built", "small", "wooden", "boats")


def now() -> float:
    """The clock of every time here, the victim's process included (``CLOCK_MONOTONIC``)."""
    return time.monotonic()


def encode(obj: Any) -> bytes:
    """A request body as this bench sends it (``json.dumps``' default separators: the sizes
    below are what goes on the wire)."""
    return json.dumps(obj).encode()


# ---------------------------------------------------------------------------------- the victim


@dataclass(slots=True)
class VictimRequest:
    """One of the victim's streamed completions; times are run seconds (monotonic in the
    victim's process until collected)."""

    index: int
    start: float
    end: float = 0.0
    status: int = 0  # 0: no answer (transport error, timeout)
    code: str | None = None
    error: str | None = None
    tokens: list[float] = field(default_factory=list)  # each event that carried text

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def ttft(self) -> float | None:
        return self.tokens[0] - self.start if self.tokens else None

    @property
    def tpot(self) -> float | None:
        """The mean gap after the first token."""
        if len(self.tokens) < 2:
            return None
        return (self.tokens[-1] - self.tokens[0]) / (len(self.tokens) - 1)

    def gaps(self) -> list[tuple[float, float]]:
        """Each pause between two tokens, as (from, to)."""
        return list(zip(self.tokens, self.tokens[1:], strict=False))

    def shifted(self, t0: float) -> VictimRequest:
        return VictimRequest(self.index, self.start - t0, self.end - t0, self.status, self.code,
                             self.error, [t - t0 for t in self.tokens])


def victim_prompt(seed: int, index: int, words: int = VICTIM_WORDS) -> str:
    """The victim's ``index``-th prompt: ``words`` words drawn afresh each time (no two share
    their cached prefix beyond chance)."""
    import random

    rng = random.Random(f"{seed}:{index}")
    return " ".join(rng.choice(WORDS) for _ in range(words))


def victim_body(model: str, prompt: str) -> bytes:
    return encode({"model": model, "prompt": prompt, "max_tokens": VICTIM_MAX_TOKENS,
                   "temperature": 0, "ignore_eos": True, "stream": True})


DONE = "[DONE]"


def sse_payload(line: str) -> Any:
    """A server-sent event line's payload: the parsed JSON of ``data: {...}``, ``DONE`` for
    ``data: [DONE]``, None for any other line (blank, comment, another field)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == DONE:
        return DONE
    try:
        return json.loads(data)
    except ValueError:
        return None


def chunk_text(chunk: Any) -> str:
    """The text a completion or chat chunk carries (its first choice's)."""
    if not isinstance(chunk, dict):
        return ""
    choices = chunk.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    c = choices[0]
    delta = c.get("delta")
    text = c.get("text") if delta is None else (delta or {}).get("content")
    return text if isinstance(text, str) else ""


def victim_request(client: httpx.Client, url: str, headers: Mapping[str, str], model: str,
                   index: int, seed: int) -> VictimRequest:
    rec = VictimRequest(index, now())
    body = victim_body(model, victim_prompt(seed, index))
    try:
        with client.stream("POST", f"{url}/v1/completions", content=body,
                           headers={**headers, "Content-Type": "application/json"}) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.code = error_code(r.read())
            else:
                for line in r.iter_lines():
                    payload = sse_payload(line)
                    if payload is None:
                        continue
                    if payload == DONE:
                        break
                    if isinstance(payload, dict) and "error" in payload:
                        rec.error = error_code(json.dumps(payload)) or "stream error"
                        break
                    if chunk_text(payload):
                        rec.tokens.append(now())
    except httpx.HTTPError as e:
        rec.error = type(e).__name__
    rec.end = now()
    return rec


def victim_loop(url: str, headers: dict[str, str], model: str, seed: int, out: Any,
                halt: Any) -> None:
    """The victim's process: streams completions one after another until ``halt`` (an event)
    is set, putting each record (a dict) on ``out`` (a queue), then None."""
    try:
        with httpx.Client(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
            index = 0
            while not halt.is_set():
                rec = victim_request(client, url, headers, model, index, seed)
                out.put(asdict(rec))
                if not rec.ok:
                    time.sleep(0.5)
                index += 1
    finally:
        out.put(None)


class Victim:
    """The victim's process and the thread here that collects its records."""

    def __init__(self, url: str, headers: Mapping[str, str], model: str, seed: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self._queue = ctx.Queue()
        self._halt = ctx.Event()
        self.records: list[VictimRequest] = []
        self._proc = ctx.Process(target=victim_loop, daemon=True, name="tierserve-victim",
                                 args=(url, dict(headers), model, seed, self._queue, self._halt))
        self._thread = threading.Thread(target=self._collect, daemon=True)

    def start(self) -> None:
        self._proc.start()
        self._thread.start()

    def _collect(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self.records.append(VictimRequest(**item))

    def stop(self, timeout_s: float = 90.0) -> None:
        self._halt.set()
        self._thread.join(timeout_s)
        self._proc.join(10.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)


# ---------------------------------------------------------------------------------- figures


@dataclass(slots=True)
class WindowStats:
    """The victim in one window (run seconds): its requests that started there (TTFT, TPOT),
    those that failed there, and every gap between two tokens that overlaps it."""

    start: float
    end: float
    requests: int = 0
    errors: int = 0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_p50_s: float | None = None
    tpot_p99_s: float | None = None
    gaps: int = 0
    worst_gap_s: float | None = None


def window_stats(reqs: Iterable[VictimRequest], t0: float, t1: float) -> WindowStats:
    reqs = list(reqs)
    started = [r for r in reqs if t0 <= r.start < t1]
    failed = [r for r in reqs if not r.ok and t0 <= r.end <= t1]
    ttfts = [x for x in (r.ttft for r in started if r.ok) if x is not None]
    tpots = [x for x in (r.tpot for r in started if r.ok) if x is not None]
    gaps = [b - a for r in reqs for a, b in r.gaps() if b > t0 and a < t1]
    return WindowStats(round(t0, 3), round(t1, 3), len(started), len(failed),
                       rounded_percentile(ttfts, 50), rounded_percentile(ttfts, 99),
                       rounded_percentile(tpots, 50), rounded_percentile(tpots, 99), len(gaps),
                       round(max(gaps), 6) if gaps else None)


def gap_limit(quiet_worst_s: float | None) -> float:
    """The longest pause the victim may see during a probe: ``max(0.5 s, 3 x`` its worst gap
    alone)."""
    return max(GAP_FLOOR_S, GAP_FACTOR * (quiet_worst_s or 0.0))


# ---------------------------------------------------------------------------------- answers


@dataclass(slots=True)
class Answer:
    """One answer to a probe's request: ``status`` 0 is none (``note`` says why: hung up on
    purpose, a timeout, the connection reset)."""

    status: int
    code: str | None = None
    seconds: float = 0.0
    note: str | None = None
    message: str | None = None


def answer_key(a: Answer) -> str:
    if a.status == 0:
        return a.note or "no answer"
    return f"{a.status} {a.code}" if a.code else str(a.status)


def answers_text(answers: Iterable[Answer]) -> str:
    """``"12x 200, 6x hung up"``: the answers by status and code, most first."""
    counts = Counter(answer_key(a) for a in answers)
    return ", ".join(f"{n}x {k}" for k, n in counts.most_common()) or "-"


def status_counts(answers: Iterable[Answer]) -> dict[str, int]:
    return dict(Counter(answer_key(a) for a in answers).most_common())


def from_response(r: httpx.Response, seconds: float) -> Answer:
    code, message = None, None
    if r.status_code != 200:
        code = error_code(r.content)
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            message = str(r.json()["error"]["message"])[:300]
    return Answer(r.status_code, code, round(seconds, 4), None, message)


@dataclass(slots=True)
class Check:
    """One expectation of a probe about its own answers."""

    name: str
    ok: bool
    detail: str = ""


def expect(name: str, answers: Sequence[Answer], statuses: Iterable[int],
           code: str | None = None, within_s: float | None = None) -> Check:
    """Every answer is one of ``statuses`` (with ``code``, when given) and came within
    ``within_s``."""
    allowed = set(statuses)
    bad = [a for a in answers if a.status not in allowed or (code is not None and a.code != code)]
    slow = [a for a in answers if within_s is not None and a.seconds > within_s]
    want = "/".join(map(str, sorted(allowed))) + (f" {code}" if code else "")
    if not answers:
        return Check(name, False, "no answer")
    if bad:
        return Check(name, False, f"wanted {want}, got {answers_text(answers)}")
    if slow:
        return Check(name, False, f"{len(slow)} of {len(answers)} took more than {within_s:g} s "
                                  f"(slowest {max(a.seconds for a in slow):.2f} s)")
    took = max(a.seconds for a in answers)
    return Check(name, True, f"{len(answers)}x {want} (slowest {took:.2f} s)")


# ---------------------------------------------------------------------------------- payloads


def chat(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def schema_request(model: str, schema: dict[str, Any], max_tokens: int = 8) -> bytes:
    """A chat request whose answer must follow ``schema`` (``response_format`` json_schema)."""
    return encode(chat(model, "Fill in the JSON object.", max_tokens=max_tokens, temperature=0,
                       response_format={"type": "json_schema",
                                        "json_schema": {"name": "probe", "schema": schema}}))


def string_object(prefix: str, lengths: Sequence[int]) -> dict[str, Any]:
    """An object of string properties ``{prefix}_{k}``, each with ``maxLength`` from
    ``lengths``, all required."""
    names = [f"{prefix}_{k}" for k in range(len(lengths))]
    return {"type": "object", "additionalProperties": False, "required": names,
            "properties": {n: {"type": "string", "maxLength": m}
                           for n, m in zip(names, lengths, strict=True)}}


def hangup_schemas(nonce: str, clients: int = 6) -> list[dict[str, Any]]:
    """A fresh schema per client: 24 strings with ``maxLength`` 60..83, named per client."""
    return [string_object(f"h{nonce}c{i}", range(60, 84)) for i in range(clients)]


# Nested bounded repetitions: the grammar's construction takes seconds (about 2.5 s for two of
# these on one core of a 2-core Xeon), within the compile budget.
SLOW_PATTERN = "^([a-z]{1,30}[0-9]{1,30}){1,30}$"


def leader_schema(nonce: str, i: int, properties: int = 2) -> dict[str, Any]:
    """A schema that compiles slowly, to queue the hung-up ones behind it."""
    names = [f"l{nonce}x{i}_{k}" for k in range(properties)]
    return {"type": "object", "required": names,
            "properties": {n: {"type": "string", "pattern": SLOW_PATTERN} for n in names}}


def huge_schema(properties: int = 20_000) -> dict[str, Any]:
    """An object of ``properties`` bounded strings: about 900 KiB of JSON at 20,000."""
    return {"type": "object",
            "properties": {f"p{k:05d}": {"type": "string", "maxLength": 8}
                           for k in range(properties)}}


def annotation_schema(i: int, description_bytes: int = 600 * 1024) -> dict[str, Any]:
    """The same small schema each time, with a different ``description`` of about
    ``description_bytes``: what it accepts never changes, only its annotation."""
    head = f"variant {i:04d}: "
    filler = ("this annotation changes nothing about what the schema accepts " *
              (description_bytes // 60 + 1))
    return {"type": "object", "description": (head + filler)[:description_bytes],
            "properties": {"answer": {"type": "string", "maxLength": 16}},
            "required": ["answer"], "additionalProperties": False}


def flood_schema(nonce: str, i: int) -> dict[str, Any]:
    """A moderately complex schema, distinct per ``i``: bounded integers and numbers, an enum,
    an array and a nested object with a pattern."""
    p = f"f{nonce}n{i}"
    return {
        "type": "object", "additionalProperties": False,
        "required": [f"{p}_id", f"{p}_kind", f"{p}_address"],
        "properties": {
            f"{p}_id": {"type": "integer", "minimum": i, "maximum": 1_000_000 + i},
            f"{p}_score": {"type": "number", "minimum": -10.5 - i, "maximum": 99.25 + i},
            f"{p}_name": {"type": "string", "maxLength": 40 + i},
            f"{p}_kind": {"enum": [f"{p}_{k}" for k in ("a", "b", "c", "d", "e")]},
            f"{p}_tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                          "maxItems": 4},
            f"{p}_address": {
                "type": "object", "required": ["street", "zip"],
                "properties": {"street": {"type": "string", "maxLength": 60},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                               "floor": {"type": "integer", "minimum": -3, "maximum": 200}}},
        },
    }


def unenforceable_schema() -> dict[str, Any]:
    """``pattern`` with ``maxLength`` on one string: a grammar follows one or the other."""
    return {"type": "object", "required": ["code"],
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$",
                                    "maxLength": 3}}}


def deep_json_body(model: str, depth: int = 1200) -> bytes:
    """A completion whose ``user`` field is a list nested ``depth`` deep (written by hand:
    ``json`` itself cannot nest that deep)."""
    head = encode({"model": model, "prompt": "hi", "max_tokens": 1})[:-1]
    return head + b', "user": ' + b"[" * depth + b"]" * depth + b"}"


def json_depth(text: bytes) -> int:
    """How deep the brackets of ``text`` nest (strings are not looked into)."""
    depth = deepest = 0
    for ch in text:
        if ch in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in b"]}":
            depth -= 1
    return deepest


def stop_ids_request(model: str, count: int, vocab: int, min_tokens: int = 32,
                     max_tokens: int = 48) -> bytes:
    """A completion with ``count`` stop token ids (from the top of the vocabulary down,
    repeating past its size)."""
    ids = [vocab - 1 - (k % vocab) for k in range(count)]
    return encode({"model": model, "prompt": "Count from one to fifty:", "max_tokens": max_tokens,
                   "min_tokens": min_tokens, "temperature": 0, "stop_token_ids": ids})


def huge_prompt_body(model: str, max_request_bytes: int, margin: int = 256) -> bytes:
    """A completion whose prompt makes the body ``margin`` bytes short of ``max_request_bytes``."""
    empty = encode({"model": model, "prompt": "", "max_tokens": 1})
    room = max_request_bytes - margin - len(empty)
    filler = ("abuse " * (room // 6 + 1))[:max(room, 0)]
    return encode({"model": model, "prompt": filler, "max_tokens": 1})


def long_prompt(nonce: str, words: int = 600) -> str:
    """The cache probe's prompt: long enough for many full KV blocks, fresh per run."""
    import random

    rng = random.Random(nonce)
    return f"[{nonce}] " + " ".join(rng.choice(WORDS) for _ in range(words))


def raw_request(host: str, port: int, path: str, headers: Mapping[str, str], body: bytes,
                content_length: int | None = None) -> bytes:
    """An HTTP/1.1 POST as bytes; ``content_length`` declares another length than ``body``'s
    (the slow body declares what it will never send)."""
    length = len(body) if content_length is None else content_length
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
             f"Content-Length: {length}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode() + body


def status_of(head: bytes) -> int | None:
    """The status of an HTTP response's first line; None before it is all there."""
    line, sep, _ = head.partition(b"\r\n")
    if not sep:
        return None
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return int(parts[1])
    return None


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


# ---------------------------------------------------------------------------------- limits


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server takes at most (its ``/openapi.json``, else its config, else defaults)."""

    max_tokens: int = 4096
    max_n: int = 8
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    vocab_size: int = 49152
    max_request_bytes: int = 1 << 20
    body_timeout_s: float = 30.0


def _array_option(prop: Mapping[str, Any], type_: str) -> Mapping[str, Any]:
    for option in prop.get("anyOf", [prop]):
        if isinstance(option, dict) and option.get("type") == type_:
            return option
    return {}


def limits_from_openapi(doc: Mapping[str, Any], base: Limits | None = None) -> Limits:
    """``base`` with what the server's OpenAPI document says: ``max_tokens``' and ``n``'s
    maximum, ``stop_token_ids``' most items and their largest id, the body's size."""
    import re

    base = base or Limits()
    values = asdict(base)
    try:
        props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    except (KeyError, TypeError):
        return base
    mt = _array_option(props.get("max_tokens", {}), "integer").get("maximum")
    if isinstance(mt, int):
        values["max_tokens"] = mt
    n = _array_option(props.get("n", {}), "integer").get("maximum")
    if isinstance(n, int):
        values["max_n"] = n
    stops = _array_option(props.get("stop_token_ids", {}), "array")
    if isinstance(stops.get("maxItems"), int):
        values["max_stop_token_ids"] = stops["maxItems"]
    top = (stops.get("items") or {}).get("maximum")
    if isinstance(top, int):
        values["vocab_size"] = top + 1
    with contextlib.suppress(KeyError, TypeError):
        note = doc["paths"]["/v1/completions"]["post"]["requestBody"]["description"]
        m = re.search(r"At most (\d+) bytes", str(note))
        if m:
            values["max_request_bytes"] = int(m.group(1))
    return Limits(**values)


def limits_from_config(args: Mapping[str, Any]) -> Limits:
    """The limits an application's args set (validated as the cluster reads them)."""
    cfg = validate(args)
    return Limits(max_tokens=cfg.max_tokens_limit, max_n=cfg.max_n,
                  max_request_bytes=cfg.max_request_bytes, body_timeout_s=cfg.body_timeout_s)


# ---------------------------------------------------------------------------------- configs


def keyed_config(base: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with a key on every tier (``benchmarks.tiers``' keys: interactive, the
    standard tier's tenant-a and tenant-b, batch) and no anonymous tier: a request without a
    key is refused (401)."""
    config = derive_config(base, "tiers")
    args = app_args(config)
    args["anonymous_tier"] = None
    validate(args)
    return config


# ---------------------------------------------------------------------------------- Ray memory


def ray_label(cmdline: Sequence[str]) -> str | None:
    """What a Ray process is, from its command line (``ray::ServeReplica:app:Deployment``,
    ``ray::ProxyActor``, ...); None for a process that is not Ray's worker."""
    for word in " ".join(cmdline).split():
        if "ray::" in word or "ProxyActor" in word or "ServeReplica" in word:
            return word.split("ray::", 1)[-1][:80] or word[:80]
    return None


def ray_memory() -> dict[str, Any]:
    """The resident memory of every Ray worker process on this machine (the proxy's too), by
    what each is, and in all."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with ray
        return {"total_bytes": None, "by_label": {}, "processes": 0}
    by_label: dict[str, int] = {}
    n = 0
    for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        label = ray_label(p.info.get("cmdline") or [])
        mem = p.info.get("memory_info")
        if label is None or mem is None or p.info["pid"] == os.getpid():
            continue
        by_label[label] = by_label.get(label, 0) + int(mem.rss)
        n += 1
    proxy = sum(v for k, v in by_label.items() if "ProxyActor" in k)
    return {"total_bytes": sum(by_label.values()), "proxy_bytes": proxy,
            "by_label": dict(sorted(by_label.items())), "processes": n}


# ---------------------------------------------------------------------------------- probes


@dataclass(slots=True)
class Context:
    """What every probe may use."""

    url: str
    model: str
    limits: Limits
    attacker: dict[str, str]
    checker: dict[str, str]
    keys: dict[str, str]  # role (KEY_VARS') -> key; empty: the cluster has no keys
    anonymous_tier: str | None
    anonymous_known: bool  # False: a cluster given by --url (its config is not read)
    nonce: str
    replicas: int
    client: httpx.AsyncClient

    def auth(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[role]}"} if role in self.keys else {}


@dataclass(slots=True)
class Outcome:
    """What a probe did: its answers, its own checks, the schemas to send again afterwards
    (request bodies), and anything else it recorded."""

    answers: list[Answer] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    reuse: list[bytes] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    memory_limit_bytes: int | None = None


async def post(ctx: Context, path: str, body: bytes, headers: Mapping[str, str],
               timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[Answer, Any]:
    """One request; its answer and, for a 200, its JSON."""
    t0 = now()
    try:
        r = await ctx.client.post(f"{ctx.url}{path}", content=body, timeout=timeout_s,
                                  headers={**headers, "Content-Type": "application/json"})
    except httpx.HTTPError as e:
        return Answer(0, None, round(now() - t0, 4), type(e).__name__), None
    a = from_response(r, now() - t0)
    data = None
    if r.status_code == 200:
        with contextlib.suppress(ValueError):
            data = r.json()
    return a, data


async def post_all(ctx: Context, path: str, bodies: Sequence[bytes], headers: Mapping[str, str],
                   concurrency: int | None = None) -> list[Answer]:
    """``bodies`` at most ``concurrency`` at a time (all at once by default); in order."""
    gate = asyncio.Semaphore(concurrency or max(1, len(bodies)))

    async def one(body: bytes) -> Answer:
        async with gate:
            return (await post(ctx, path, body, headers))[0]

    return list(await asyncio.gather(*(one(b) for b in bodies)))


async def hang_up_after(ctx: Context, path: str, body: bytes, headers: Mapping[str, str],
                        after_s: float) -> Answer:
    """A request whose client leaves after ``after_s`` (its connection closed) unless it was
    answered first."""
    t0 = now()
    try:
        a, _ = await asyncio.wait_for(post(ctx, path, body, headers), after_s)
        return a
    except TimeoutError:
        return Answer(0, None, round(now() - t0, 4), "hung up")


async def stream_then_leave(ctx: Context, body: bytes, headers: Mapping[str, str],
                            events: int) -> Answer:
    """A streamed completion whose client leaves after ``events`` data events."""
    t0 = now()
    seen = 0
    try:
        async with ctx.client.stream("POST", f"{ctx.url}/v1/completions", content=body,
                                     headers={**headers, "Content-Type": "application/json"},
                                     timeout=REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                await r.aread()
                return from_response(r, now() - t0)
            async for line in r.aiter_lines():
                if sse_payload(line) is not None:
                    seen += 1
                if seen >= events:
                    break
    except httpx.HTTPError as e:
        return Answer(0, None, round(now() - t0, 4), type(e).__name__)
    return Answer(200, None, round(now() - t0, 4), f"left after {seen} events")


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def probe_hangup_compile(ctx: Context) -> Outcome:
    out = Outcome()
    leaders = [schema_request(ctx.model, leader_schema(ctx.nonce, j))
               for j in range(max(1, ctx.replicas))]
    bodies = [schema_request(ctx.model, s) for s in hangup_schemas(ctx.nonce)]
    # One slow compile per replica first (from another client, not hung up on), then the six
    # fresh ones that queue behind it, each client leaving after 0.3 s.
    lead = asyncio.ensure_future(post_all(ctx, CHAT, leaders, ctx.checker))
    await asyncio.sleep(0.2)
    hung = await asyncio.gather(*(hang_up_after(ctx, CHAT, b, ctx.attacker, 0.3)
                                  for b in bodies))
    led = await lead
    # Then the same schemas again, 12 requests (two each), 4 at a time: all must be answered.
    again = await post_all(ctx, CHAT, [b for b in bodies for _ in range(2)], ctx.attacker, 4)
    out.answers = [*hung, *again]
    out.details = {"leaders": status_counts(led), "hung_up": status_counts(hung),
                   "again": status_counts(again)}
    out.checks = [expect("the 12 requests after the hang-ups", again, {200})]
    out.reuse = bodies
    return out


async def probe_huge_schema(ctx: Context) -> Outcome:
    body = schema_request(ctx.model, huge_schema())
    a, _ = await post(ctx, CHAT, body, ctx.attacker)
    return Outcome([a], [expect("a fast 400", [a], {400}, within_s=FAST_S)],
                   details={"body_bytes": len(body)})


async def probe_annotation_schemas(ctx: Context) -> Outcome:
    bodies = [schema_request(ctx.model, annotation_schema(i)) for i in range(100)]
    got = await post_all(ctx, CHAT, bodies, ctx.attacker, 4)
    accepted = [i for i, a in enumerate(got) if a.status == 200]
    out = Outcome(got, [expect("each answered (200, or a clear 400)", got, {200, 400})],
                  memory_limit_bytes=MEMORY_LIMIT_BYTES)
    out.details = {"body_bytes": len(bodies[0]), "accepted": len(accepted),
                   "refused": len(got) - len(accepted), "answers": status_counts(got)}
    picks = sorted({accepted[0], accepted[len(accepted) // 2], accepted[-1]}) if accepted else []
    out.reuse = [bodies[i] for i in picks]
    return out


async def probe_compile_flood(ctx: Context) -> Outcome:
    bodies = [schema_request(ctx.model, flood_schema(ctx.nonce, i)) for i in range(32)]
    got = await post_all(ctx, CHAT, bodies, ctx.attacker)
    out = Outcome(got, [expect("each answered (200, or a 429 under the tenant's compile cap)",
                               got, {200, 429})])
    out.reuse = bodies
    return out


async def probe_stop_token_ids(ctx: Context) -> Outcome:
    lim = ctx.limits
    many = [stop_ids_request(ctx.model, 100_000, lim.vocab_size) for _ in range(8)]
    most = [stop_ids_request(ctx.model, lim.max_stop_token_ids, lim.vocab_size)
            for _ in range(8)]
    refused = await post_all(ctx, COMPLETIONS, many, ctx.attacker)
    served = await post_all(ctx, COMPLETIONS, most, ctx.attacker)
    return Outcome([*refused, *served], [
        expect("100,000 stop_token_ids: 400", refused, {400}),
        expect(f"{lim.max_stop_token_ids} stop_token_ids (the most allowed): 200", served, {200}),
    ], details={"most_allowed": lim.max_stop_token_ids, "body_bytes_many": len(many[0])})


def no_key_expectations(anonymous_tier: str | None, known: bool) -> dict[str, set[int]]:
    """What each request of ``no_key`` may be answered: without a key, a server with no
    anonymous tier answers 401, one with an anonymous tier (the lowest, with keys on every tier)
    serves it there, and refuses a priority above that tier's (400); a wrong key is 401."""
    if not known:
        return {"no key": {200, 401}, "no key, priority 15": {400, 401}, "a wrong key": {401}}
    if anonymous_tier is None:
        return {"no key": {401}, "no key, priority 15": {401}, "a wrong key": {401}}
    return {"no key": {200}, "no key, priority 15": {400}, "a wrong key": {401}}


async def probe_no_key(ctx: Context) -> Outcome:
    body = encode({"model": ctx.model, "prompt": "Hello", "max_tokens": 4})
    cases = {"no key": {}, "no key, priority 15": {PRIORITY_HEADER: "15"},
             "a wrong key": {"Authorization": "Bearer tsb-not-a-key-" + ctx.nonce}}
    wanted = no_key_expectations(ctx.anonymous_tier, ctx.anonymous_known)
    out = Outcome()
    for name, headers in cases.items():
        a, _ = await post(ctx, COMPLETIONS, body, headers)
        out.answers.append(a)
        out.checks.append(expect(name, [a], wanted[name]))
    out.details = {"anonymous_tier": ctx.anonymous_tier if ctx.anonymous_known else "unknown"}
    return out


async def probe_disconnect_headers(ctx: Context) -> Outcome:
    max_tokens = min(1500, ctx.limits.max_tokens)
    body = encode({"model": ctx.model, "prompt": "Write a very long story about the sea.",
                   "max_tokens": max_tokens, "ignore_eos": True, "stream": True})
    headers = {**ctx.attacker, "x-request-disconnect-disabled": "?1",
               "x-request-timeout-seconds": "3600"}
    got = await asyncio.gather(*(stream_then_leave(ctx, body, headers, 2) for _ in range(8)))
    return Outcome(list(got), [expect("8 streams answered (then left)", list(got), {200})],
                   details={"max_tokens": max_tokens})


def in_threads(fn: Callable[..., Answer],
               calls: Sequence[tuple[Any, ...]]) -> list[asyncio.Future[Answer]]:
    """``fn(*args)`` for each of ``calls``, all at once, each on a thread of its own (the
    default executor has fewer threads than the probes hold sockets)."""
    from concurrent.futures import ThreadPoolExecutor

    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=max(1, len(calls)), thread_name_prefix="abuse-socket")
    futures = [loop.run_in_executor(pool, fn, *args) for args in calls]
    pool.shutdown(wait=False)  # its threads end with their calls
    return futures


def hold_unread(host: str, port: int, request: bytes, hold_s: float) -> Answer:
    """Send ``request``, read no more than its response's head, hold the connection ``hold_s``
    from the send without reading, then close it."""
    t0 = now()
    deadline = t0 + hold_s
    head = b""
    note = None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.settimeout(10.0)
        try:
            s.connect((host, port))
            s.sendall(request)
            while b"\r\n\r\n" not in head and len(head) < 65536:
                left = deadline - now()
                if left <= 0:
                    note = f"no head within {hold_s:g} s"
                    break
                s.settimeout(left)
                chunk = s.recv(512)
                if not chunk:
                    note = "closed by the server"
                    break
                head += chunk
        except TimeoutError:
            note = f"no head within {hold_s:g} s"
        except OSError as e:
            note = type(e).__name__
        status = status_of(head) or 0
        seconds = now() - t0
        time.sleep(max(0.0, deadline - now()))
    return Answer(status, None, round(seconds, 4), note if status == 0 else "held unread")


def read_all(host: str, port: int, request: bytes, hold_s: float) -> Answer:
    """Send ``request`` and read its response as it comes, for at most ``hold_s``, then close:
    ``hold_unread``'s load from a client that reads."""
    t0 = now()
    deadline = t0 + hold_s
    got = b""
    note = None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(10.0)
        try:
            s.connect((host, port))
            s.sendall(request)
            while now() < deadline:
                s.settimeout(max(0.05, deadline - now()))
                chunk = s.recv(65536)
                if not chunk:
                    break
                if len(got) < 65536:
                    got += chunk
        except TimeoutError:
            pass
        except OSError as e:
            note = type(e).__name__
    status = status_of(got) or 0
    return Answer(status, None, round(now() - t0, 4), note if status == 0 else "read")


def heavy_stream_request(ctx: Context) -> tuple[str, int, bytes]:
    """``non_reader``'s request (and ``heavy_reader``'s): the most a chat stream can make."""
    host, port = host_port(ctx.url)
    body = encode(chat(ctx.model, "Write a very long story about the sea.",
                       max_tokens=ctx.limits.max_tokens, n=min(4, ctx.limits.max_n),
                       logprobs=True, top_logprobs=20, ignore_eos=True, stream=True))
    return host, port, raw_request(host, port, CHAT, ctx.attacker, body)


async def probe_heavy_reader(ctx: Context, hold_s: float = 20.0) -> Outcome:
    """The control of ``non_reader``: the same 16 streams, read as they come. What the victim
    sees here is the load's compute; what it sees more under ``non_reader`` is the unread
    output's."""
    host, port, request = heavy_stream_request(ctx)
    got = list(await asyncio.gather(*in_threads(read_all, [(host, port, request, hold_s)] * 16)))
    return Outcome(got, [expect("16 streams started (and read)", got, {200})])


async def probe_non_reader(ctx: Context, hold_s: float = 20.0) -> Outcome:
    host, port, request = heavy_stream_request(ctx)
    before = await asyncio.to_thread(ray_memory)
    t0 = now()
    holders = asyncio.gather(*in_threads(hold_unread, [(host, port, request, hold_s)] * 16))
    during: list[dict[str, Any]] = []
    peak: dict[str, Any] | None = None
    while not holders.done():
        await asyncio.sleep(2.0)
        sample = await asyncio.to_thread(ray_memory)
        during.append({"s": round(now() - t0, 2), "total_bytes": sample["total_bytes"],
                       "proxy_bytes": sample["proxy_bytes"]})
        if peak is None or (sample["total_bytes"] or 0) > (peak["total_bytes"] or 0):
            peak = sample
    got = list(await holders)
    out = Outcome(got, [expect("16 streams started (then left unread)", got, {200})])
    out.details = {"ray_memory_before": before, "ray_memory_during": during,
                   "ray_memory_peak": peak,
                   "max_tokens": ctx.limits.max_tokens, "n": min(4, ctx.limits.max_n),
                   "hold_s": hold_s}
    return out


async def probe_deep_json(ctx: Context) -> Outcome:
    a, _ = await post(ctx, COMPLETIONS, deep_json_body(ctx.model), ctx.attacker)
    return Outcome([a], [expect("a 400", [a], {400}, within_s=FAST_S)])


async def probe_unenforceable(ctx: Context) -> Outcome:
    a, _ = await post(ctx, CHAT, schema_request(ctx.model, unenforceable_schema()), ctx.attacker)
    check = expect("a 400", [a], {400})
    if check.ok and not any(k in (a.message or "") for k in ("maxLength", "pattern")):
        check = Check("a 400 naming the keyword", False,
                      f"the message names neither 'pattern' nor 'maxLength': {a.message!r}")
    return Outcome([a], [check], details={"message": a.message})


def trickle(host: str, port: int, head: bytes, length: int, deadline_s: float) -> Answer:
    """Send ``head`` (declaring ``length`` bytes of body), then a byte a second until the
    server answers, closes, or ``deadline_s`` passes."""
    t0 = now()
    sent = 0
    got = b""
    note = None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(10.0)
        try:
            s.connect((host, port))
            s.sendall(head)
            while sent < length and now() - t0 < deadline_s:
                readable, _, _ = select.select([s], [], [], 1.0)
                if readable:
                    while b"\r\n" not in got:
                        chunk = s.recv(4096)
                        if not chunk:
                            break
                        got += chunk
                    break
                s.sendall(b" ")
                sent += 1
            else:
                note = f"no answer within {deadline_s:g} s"
        except OSError as e:  # the server may have answered and closed while a byte went out
            note = type(e).__name__
            with contextlib.suppress(OSError):
                s.settimeout(1.0)
                got += s.recv(4096)
    status = status_of(got) or 0
    if status == 0 and note is None:
        note = "closed without an answer"
    return Answer(status, None, round(now() - t0, 3), note or f"after {sent} bytes")


async def probe_slow_body(ctx: Context) -> Outcome:
    host, port = host_port(ctx.url)
    head = raw_request(host, port, COMPLETIONS, ctx.attacker, b"", content_length=1000)
    within = ctx.limits.body_timeout_s + 5.0
    got = await asyncio.gather(*in_threads(trickle, [(host, port, head, 1000, within + 10)] * 8))
    return Outcome(list(got), [expect(f"a 408 within {within:g} s", list(got), {408},
                                      within_s=within)],
                   details={"body_timeout_s": ctx.limits.body_timeout_s})


async def probe_huge_prompt(ctx: Context) -> Outcome:
    body = huge_prompt_body(ctx.model, ctx.limits.max_request_bytes)
    got = await post_all(ctx, COMPLETIONS, [body] * 4, ctx.attacker)
    return Outcome(got, [expect("a fast 400 too_long", got, {400}, "too_long", FAST_S)],
                   details={"body_bytes": len(body)})


async def probe_tokenize_flood(ctx: Context) -> Outcome:
    """``/tokenize`` is not bounded by the context: 16 prompts of 200,000 characters at once, each
    asking for its token strings (work and a large answer, on the ingress), then 4 past
    ``max_tokenize_chars``: admitted against the tier's share (200 or 429), refused fast (400)."""
    text = " ".join(f"w{i % 997}" for i in range(40_000))[:200_000]
    body = encode({"model": ctx.model, "prompt": text, "return_token_strs": True})
    over = encode({"model": ctx.model, "prompt": "x" * 1_000_000})
    got = await post_all(ctx, "/tokenize", [body] * 16, ctx.attacker)
    past = await post_all(ctx, "/tokenize", [over] * 4, ctx.attacker)
    return Outcome([*got, *past], [
        expect("200,000 characters: answered, or 429 past the tier's share", got, {200, 429}),
        expect("1,000,000 characters: a fast 400 too_long", past, {400}, "too_long", FAST_S),
    ], details={"body_bytes": len(body), "answers": status_counts(got)})


def cached_tokens(data: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an answer (None: not reported)."""
    try:
        details = data["usage"].get("prompt_tokens_details") or {}
    except (KeyError, TypeError, AttributeError):
        return None
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) else None


async def probe_cache_probe(ctx: Context) -> Outcome:
    body = encode({"model": ctx.model, "prompt": long_prompt(ctx.nonce), "max_tokens": 1,
                   "temperature": 0})
    a1, d1 = await post(ctx, COMPLETIONS, body, ctx.auth("tenant-a"))
    b, db = await post(ctx, COMPLETIONS, body, ctx.auth("tenant-b"))
    a2, d2 = await post(ctx, COMPLETIONS, body, ctx.auth("tenant-a"))
    seen = cached_tokens(db)
    check = expect("tenant B answered", [b], {200})
    if check.ok:
        check = Check("tenant B's cached_tokens is 0", not seen, f"cached_tokens {seen}")
    return Outcome([a1, b, a2], [check], details={
        "prompt_tokens": (d1 or {}).get("usage", {}).get("prompt_tokens"),
        "cached_tokens": {"tenant_a": cached_tokens(d1), "tenant_b": seen,
                          "tenant_a_again (the cache at work)": cached_tokens(d2)}})


@dataclass(frozen=True, slots=True)
class ProbeDef:
    name: str
    description: str
    run: Callable[[Context], Awaitable[Outcome]]
    needs_keys: bool = False


PROBES: tuple[ProbeDef, ...] = (
    ProbeDef("hangup_compile", "6 clients hang up on fresh schemas queued behind slow compiles; "
             "then 12 requests with them", probe_hangup_compile),
    ProbeDef("huge_schema", "a schema of 20,000 properties (about 900 KiB)", probe_huge_schema),
    ProbeDef("annotation_schemas", "100 schemas that differ only in a 600 KiB description, "
             "4 at a time", probe_annotation_schemas),
    ProbeDef("compile_flood", "32 distinct schemas at once from one tenant", probe_compile_flood),
    ProbeDef("stop_token_ids", "8 requests with 100,000 stop_token_ids, then 8 with the most "
             "allowed (min_tokens 32)", probe_stop_token_ids),
    ProbeDef("no_key", "no key, no key with priority 15, a wrong key", probe_no_key,
             needs_keys=True),
    ProbeDef("disconnect_headers", "8 long streams asking not to be cancelled, left after 2 "
             "events", probe_disconnect_headers),
    ProbeDef("heavy_reader", "16 streams (n 4, top_logprobs 20, max_tokens the most) read as "
             "they come for 20 s: non_reader's control", probe_heavy_reader),
    ProbeDef("non_reader", "16 streams (n 4, top_logprobs 20, max_tokens the most) never read "
             "for 20 s", probe_non_reader),
    ProbeDef("deep_json", "a body nested 1,200 deep", probe_deep_json),
    ProbeDef("unenforceable", "a string with pattern and maxLength", probe_unenforceable),
    ProbeDef("slow_body", "8 bodies trickled a byte a second", probe_slow_body),
    ProbeDef("huge_prompt", "4 prompts of 1 MiB at once", probe_huge_prompt),
    ProbeDef("cache_probe", "tenant B sends tenant A's long prompt", probe_cache_probe,
             needs_keys=True),
    ProbeDef("tokenize_flood", "16 /tokenize of 200,000 characters with their token strings "
             "at once, then 4 of 1,000,000", probe_tokenize_flood),
)
BY_NAME = {p.name: p for p in PROBES}


def select_probes(text: str | None) -> list[ProbeDef]:
    """The probes named in ``text`` (a comma list; None or empty: all), in the bench's order;
    ``ValueError`` for an unknown name."""
    if not text:
        return list(PROBES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown probe {unknown[0]!r}: one of {', '.join(BY_NAME)}")
    return [p for p in PROBES if p.name in names]


# ---------------------------------------------------------------------------------- one probe


@dataclass(slots=True)
class ProbeReport:
    name: str
    description: str
    skipped: str | None = None
    quiet: tuple[float, float] = (0.0, 0.0)  # run seconds
    window: tuple[float, float] = (0.0, 0.0)
    answers: list[Answer] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    rechecks: list[Answer] = field(default_factory=list)
    ready_status: int | None = None
    free_blocks_quiet: float | None = None
    free_blocks_after: float | None = None
    blocks_returned: bool | None = None
    blocks_return_s: float | None = None  # after the probe ended
    memory_before: dict[str, float] = field(default_factory=dict)  # replica -> RSS bytes
    memory_after: dict[str, float] = field(default_factory=dict)
    memory_limit_bytes: int | None = None
    ray_memory_before: int | None = None
    ray_memory_after: int | None = None
    quiet_stats: WindowStats | None = None
    probe_stats: WindowStats | None = None
    reasons: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.reasons


def memory_growth(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Each replica's resident memory after minus before (replicas seen both times)."""
    return {k: after[k] - before[k] for k in sorted(before) if k in after}


def probe_window(report: ProbeReport) -> tuple[float, float]:
    """The window of the victim's figures during a probe: the probe's, at least
    ``MIN_WINDOW_S`` long (a refusal takes milliseconds, what it disturbs may come after)."""
    p0, p1 = report.window
    return p0, max(p1, p0 + MIN_WINDOW_S)


def judge(r: ProbeReport) -> list[str]:
    """Why a probe failed its targets (none: it passed). ``quiet_stats`` and ``probe_stats``
    must be filled in."""
    if r.skipped:
        return []
    reasons: list[str] = []
    q, d = r.quiet_stats, r.probe_stats
    if q is None or q.worst_gap_s is None:
        reasons.append("the victim streamed no tokens in the quiet window")
    elif d is not None and d.worst_gap_s is not None and d.worst_gap_s > gap_limit(q.worst_gap_s):
        reasons.append(f"the victim's stream paused {d.worst_gap_s:.3f} s during the probe, more "
                       f"than {gap_limit(q.worst_gap_s):.3f} s (3x its worst gap alone, "
                       f"{q.worst_gap_s:.3f} s, or 0.5 s)")
    if d is not None and d.errors:
        reasons.append(f"{d.errors} of the victim's requests failed during the probe")
    five = [a for a in (*r.answers, *r.rechecks) if a.status >= 500]
    if five:
        reasons.append(f"{len(five)} answers were 5xx ({answers_text(five)})")
    reasons += [f"{c.name}: {c.detail}" for c in r.checks if not c.ok]
    bad = [a for a in r.rechecks if a.status != 200]
    if bad:
        reasons.append(f"{len(bad)} of {len(r.rechecks)} requests with the probe's schemas, from "
                       f"another client, were not answered 200 ({answers_text(bad)})")
    if r.ready_status != 200:
        reasons.append(f"/ready answered {r.ready_status or 'nothing'} after the probe")
    if r.blocks_returned is None:
        reasons.append("the replicas' free KV blocks could not be read from the metrics")
    elif not r.blocks_returned:
        reasons.append(f"the free KV blocks did not come back within {BLOCKS_TIMEOUT_S:g} s "
                       f"({r.free_blocks_after} after, {r.free_blocks_quiet} quiet)")
    if r.memory_limit_bytes is not None:
        growth = memory_growth(r.memory_before, r.memory_after)
        if not growth:
            reasons.append("the replicas' resident memory could not be read from the metrics")
        elif max(growth.values()) > r.memory_limit_bytes:
            worst = max(growth, key=lambda k: growth[k])
            reasons.append(f"replica {worst}'s memory grew {growth[worst] / 2**20:.1f} MiB, more "
                           f"than {r.memory_limit_bytes / 2**20:g} MiB")
    return reasons


def finish(reports: Sequence[ProbeReport], victim: Sequence[VictimRequest]) -> None:
    """Fill in the victim's figures and the verdict of every probe (once the victim stopped)."""
    for r in reports:
        if r.skipped:
            continue
        r.quiet_stats = window_stats(victim, *r.quiet)
        r.probe_stats = window_stats(victim, *probe_window(r))
        r.reasons = judge(r)


# ---------------------------------------------------------------------------------- the run


async def scrape(client: httpx.AsyncClient, metrics_url: str | None) -> Scrape | None:
    if not metrics_url:
        return None
    try:
        r = await client.get(metrics_url, timeout=10.0)
        r.raise_for_status()
        return Scrape(now(), parse_metrics(r.text))
    except (httpx.HTTPError, ValueError):
        return None


def free_blocks(s: Scrape | None) -> float | None:
    reps = s.replicas() if s is not None else {}
    vals = [r["free_blocks"] for r in reps.values() if "free_blocks" in r]
    return sum(vals) if vals else None


def rss(s: Scrape | None) -> dict[str, float]:
    reps = s.replicas() if s is not None else {}
    return {k: r["rss_bytes"] for k, r in reps.items() if "rss_bytes" in r}


@dataclass(slots=True)
class Timing:
    quiet_s: float = QUIET_S
    metrics_lag_s: float = 5.0  # the metrics show a change this long after it at most
    blocks_timeout_s: float = BLOCKS_TIMEOUT_S


async def run_probe(ctx: Context, probe: ProbeDef, metrics_url: str | None, t_zero: float,
                    timing: Timing) -> ProbeReport:
    rep = ProbeReport(probe.name, probe.description)

    def rel(t: float) -> float:
        return round(t - t_zero, 3)

    q0 = now()
    frees: list[float] = []
    last: Scrape | None = None
    for _ in range(4):  # the quiet window, scraping as it goes
        await asyncio.sleep(timing.quiet_s / 4)
        s = await scrape(ctx.client, metrics_url)
        if s is not None:
            last = s
            f = free_blocks(s)
            if f is not None:
                frees.append(f)
    rep.free_blocks_quiet = min(frees) if frees else None
    rep.memory_before = rss(last)
    rep.ray_memory_before = (await asyncio.to_thread(ray_memory))["total_bytes"]
    p0 = now()
    rep.quiet = (rel(q0), rel(p0))
    try:
        outcome = await probe.run(ctx)
    except Exception as e:  # a probe that breaks is reported, the run goes on
        outcome = Outcome(checks=[Check("the probe ran", False, f"{type(e).__name__}: {e}")])
    p1 = now()
    rep.window = (rel(p0), rel(p1))
    rep.answers, rep.checks, rep.details = outcome.answers, outcome.checks, outcome.details
    rep.memory_limit_bytes = outcome.memory_limit_bytes
    print(f"  {probe.name}: {answers_text(rep.answers)} ({p1 - p0:.1f} s)", flush=True)
    # Afterwards: the probe's schemas from another client, /ready, the blocks, the memory.
    rep.rechecks = await post_all(ctx, CHAT, outcome.reuse, ctx.checker, 4)
    try:
        rep.ready_status = (await ctx.client.get(f"{ctx.url}/ready", timeout=10.0)).status_code
    except httpx.HTTPError:
        rep.ready_status = None
    # The metrics show the state after the probe from metrics_lag_s on; then until the blocks
    # are back (or the time is up).
    await asyncio.sleep(max(0.0, p1 + timing.metrics_lag_s - now()))
    after: Scrape | None = None
    while True:
        s = await scrape(ctx.client, metrics_url)
        if s is None:  # not read this time: again, until the time is up
            if now() >= p1 + timing.blocks_timeout_s:
                break
            await asyncio.sleep(1.0)
            continue
        after = s
        rep.free_blocks_after = f = free_blocks(s)
        if rep.free_blocks_quiet is None or f is None:
            rep.blocks_returned = None
            break
        rep.blocks_returned = f >= rep.free_blocks_quiet
        if rep.blocks_returned:
            rep.blocks_return_s = round(now() - p1, 2)
            break
        if now() >= p1 + timing.blocks_timeout_s:
            break
        await asyncio.sleep(1.0)
    rep.memory_after = rss(after)
    rep.ray_memory_after = (await asyncio.to_thread(ray_memory))["total_bytes"]
    if probe.name == "non_reader":
        rep.details["ray_memory_after"] = await asyncio.to_thread(ray_memory)
    return rep


async def replica_count(client: httpx.AsyncClient, metrics_url: str | None,
                        timeout_s: float = 60.0, url: str | None = None) -> int:
    """The replicas ``/ready`` says can take work (at ``url``), else those the metrics show
    (waiting up to ``timeout_s`` for the first export: right after a start it may show only
    some); 1 when neither says."""
    if url is not None:
        try:
            r = await client.get(f"{url}/ready", timeout=10.0)
            ready = r.json().get("replicas_ready") if r.status_code == 200 else None
            if isinstance(ready, int) and ready > 0:
                return ready
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
    deadline = now() + timeout_s
    while now() < deadline:
        s = await scrape(client, metrics_url)
        reps = s.replicas() if s is not None else {}
        n = sum(1 for r in reps.values() if "free_blocks" in r)
        if n:
            return n
        if not metrics_url:
            break
        await asyncio.sleep(1.0)
    return 1


async def server_limits(client: httpx.AsyncClient, url: str, base: Limits) -> Limits:
    try:
        r = await client.get(f"{url}/openapi.json", timeout=10.0)
        if r.status_code == 200:
            return limits_from_openapi(r.json(), base)
    except (httpx.HTTPError, ValueError):
        pass
    return base


@dataclass(slots=True)
class Setup:
    """One run: which cluster, who is who."""

    label: str
    url: str
    metrics_url: str | None
    keys: dict[str, str]  # role -> key
    anonymous_tier: str | None
    anonymous_known: bool
    limits: Limits
    config: dict[str, Any] | None = None  # redacted
    startup_s: float | None = None


@dataclass(slots=True)
class RunReport:
    label: str
    url: str
    model: str | None = None
    config: dict[str, Any] | None = None
    startup_s: float | None = None
    limits: dict[str, Any] = field(default_factory=dict)
    who: dict[str, str] = field(default_factory=dict)
    replicas: int | None = None
    probes: list[ProbeReport] = field(default_factory=list)
    victim: list[VictimRequest] = field(default_factory=list)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(p.passed for p in self.probes)


def who(keys: Mapping[str, str], anonymous_tier: str | None) -> dict[str, str]:
    anon = f"no key (the anonymous tier, {anonymous_tier or 'unknown'})"
    return {"victim": "the interactive key" if "interactive" in keys else anon,
            "attacker": "the batch key" if "batch" in keys else anon,
            "checker": "tenant-a's key (standard)" if "tenant-a" in keys else anon}


async def exercise(setup: Setup, probes: Sequence[ProbeDef], timing: Timing,
                   report: RunReport) -> None:
    limits_http = httpx.Limits(max_connections=256, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits_http, timeout=REQUEST_TIMEOUT_S) as client:
        model = await served_model_async(client, setup.url)
        limits = await server_limits(client, setup.url, setup.limits)
        replicas = await replica_count(client, setup.metrics_url, url=setup.url)
        report.model, report.limits, report.replicas = model, asdict(limits), replicas
        keys = setup.keys
        ctx = Context(setup.url, model, limits, {}, {}, dict(keys), setup.anonymous_tier,
                      setup.anonymous_known, secrets.token_hex(4), replicas, client)
        ctx.attacker, ctx.checker = ctx.auth("batch"), ctx.auth("tenant-a")
        victim = Victim(setup.url, ctx.auth("interactive"), model)
        t_zero = now()
        victim.start()
        try:
            await asyncio.sleep(4.0)  # its first requests (a fresh process) are not judged
            for probe in probes:
                if probe.needs_keys and not keys:
                    report.probes.append(ProbeReport(probe.name, probe.description,
                                                     skipped="needs keys"))
                    continue
                report.probes.append(await run_probe(ctx, probe, setup.metrics_url, t_zero,
                                                     timing))
        finally:
            await asyncio.to_thread(victim.stop)
        report.victim = sorted((r.shifted(t_zero) for r in victim.records), key=lambda r: r.start)
        finish(report.probes, report.victim)


def start_cluster(config_path: Path, env: Mapping[str, str], url: str, metrics_port: int,
                  headers: Mapping[str, str], log: Path,
                  timeout_s: float) -> tuple[subprocess.Popen[bytes], float]:
    """``python -m tierserve.cluster.launch CONFIG`` in its own process group, until ``/ready``
    says ready and a one-token completion with ``headers`` is answered; its start-up time."""
    with log.open("wb") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierserve.cluster.launch", str(config_path),
             "--metrics-port", str(metrics_port)],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True)
    try:
        wait_for(proc, lambda: answers(lambda: httpx.get(f"{url}/ready", timeout=5)), log, t0,
                 timeout_s, "the cluster", poll_s=1.0)
        model = served_model(url)
        wait_for(proc, lambda: completion_ready(url, model, dict(headers)), log, t0, timeout_s,
                 "the cluster", poll_s=1.0)
    except BaseException:
        stop(proc)
        raise
    return proc, time.perf_counter() - t0


# ---------------------------------------------------------------------------------- output


def _s(x: float | None, scale: float = 1.0, unit: str = "") -> str:
    if x is None:
        return "-"
    v = x * scale
    return (f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}") + unit


def _arrow(q: WindowStats | None, d: WindowStats | None, key: str, scale: float,
           unit: str) -> str:
    def get(w: WindowStats | None) -> float | None:
        return None if w is None else getattr(w, key)

    return f"{_s(get(q), scale)}→{_s(get(d), scale)} {unit}"


def memory_text(r: ProbeReport) -> str:
    growth = memory_growth(r.memory_before, r.memory_after)
    if not growth:
        return "-"
    total = sum(growth.values()) / 2**20
    return f"{total:+.1f} MiB"


def row(r: ProbeReport) -> list[str]:
    if r.skipped:
        return [r.name, f"skipped ({r.skipped})", "", "", "", "", "-"]
    q, d = r.quiet_stats, r.probe_stats
    text = answers_text(r.answers)
    return [r.name, text if len(text) <= 44 else text[:41] + "...",
            _arrow(q, d, "ttft_p99_s", 1.0, "s"), _arrow(q, d, "tpot_p99_s", 1e3, "ms"),
            _arrow(q, d, "worst_gap_s", 1e3, "ms"),
            memory_text(r), "pass" if r.passed else "FAIL"]


HEAD = ["probe", "attack answers", "victim TTFT p99 quiet→probe", "TPOT p99 quiet→probe",
        "worst gap quiet→probe", "memory delta", "verdict"]


def table_text(run: RunReport) -> str:
    rows = [HEAD, *(row(r) for r in run.probes)]
    widths = [max(len(x[i]) for x in rows) for i in range(len(HEAD))]
    lines = [f"{run.label}: {run.url}, model {run.model}, {run.replicas} replicas; "
             + "; ".join(f"{k}: {v}" for k, v in run.who.items())]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip()
              for x in rows]
    for r in run.probes:
        lines += [f"  {r.name}: FAILED: {why}" for why in r.reasons]
        nr = r.details.get("ray_memory_peak") if r.name == "non_reader" else None
        if nr:
            before = r.details["ray_memory_before"]["total_bytes"] or 0
            after = (r.details.get("ray_memory_after") or {}).get("total_bytes") or 0
            lines.append(f"  non_reader: Ray processes {before / 2**20:.0f} MiB before, "
                         f"{(nr['total_bytes'] or 0) / 2**20:.0f} at the peak (the proxy "
                         f"{(nr['proxy_bytes'] or 0) / 2**20:.0f}), {after / 2**20:.0f} after")
    if run.error:
        lines.append(f"  the run failed: {run.error}")
    return "\n".join(lines)


def machine_line(m: Mapping[str, Any]) -> str:
    return (f"machine: {m.get('cpu')}, {m.get('cores')} cores ({m.get('cores_usable')} usable), "
            f"{m.get('memory_gib')} GiB, Python {m.get('python')}, {m.get('platform')}; load "
            f"{m.get('load_avg_1m_before', math.nan):.2f} before, "
            f"{m.get('load_avg_1m_after', math.nan):.2f} after")


def run_record(run: RunReport) -> dict[str, Any]:
    out = asdict(run)
    out["passed"] = run.passed
    for p, r in zip(out["probes"], run.probes, strict=True):
        p["passed"] = r.passed
        if r.quiet_stats is not None:
            p["gap_limit_s"] = gap_limit(r.quiet_stats.worst_gap_s)
    return out


def plot(runs: Sequence[RunReport], path: str) -> None:
    """The victim's gaps over time, one panel per run, each probe's window shaded."""
    plt = pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        xs = [b for r in run.victim for _, b in r.gaps()]
        ys = [(b - a) * 1e3 for r in run.victim for a, b in r.gaps()]
        ax.plot(xs, ys, ".", markersize=2, color="tab:blue", label="victim's gaps")
        top = max(ys, default=1.0)
        for i, p in enumerate(x for x in run.probes if not x.skipped):
            p0, p1 = probe_window(p)
            ax.axvspan(p0, p1, color="tab:red" if not p.passed else "tab:orange", alpha=0.2)
            ax.text(p0, top * (0.95 - 0.08 * (i % 3)), p.name, fontsize=7, rotation=0)
            if p.quiet_stats is not None:
                ax.hlines(gap_limit(p.quiet_stats.worst_gap_s) * 1e3, p0, p1, colors="k",
                          linestyles="--", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("run seconds")
        ax.set_ylabel("gap between tokens (ms)")
        ax.set_title(f"{TOOL}: {run.label} (shaded: probes, red failed; dashed: the gap limit)",
                     fontsize=9)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {TOOL}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running cluster (nothing is started)")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="the config of the cluster the bench starts (default %(default)s)")
    p.add_argument("--keys", default="per-tier", choices=KEY_MODES,
                   help="per-tier: also a run with a key on every tier (with --url: the keys "
                   "of the environment); none: the config as it is")
    p.add_argument("--probes", default=None, help=f"a comma list of {', '.join(BY_NAME)}")
    p.add_argument("--json", default=None, help="write everything here")
    p.add_argument("--plot", default=None, help="a PNG of the victim's gaps over time")
    p.add_argument("--quiet", type=float, default=QUIET_S, help="seconds of the quiet window")
    p.add_argument("--metrics-port", type=int, default=8080)
    p.add_argument("--metrics-url", default=None,
                   help="with --url: its metrics (default http://127.0.0.1:8080/metrics)")
    p.add_argument("--metrics-interval-ms", type=int, default=2000,
                   help="how often the started cluster exports its metrics (0: Ray's default)")
    p.add_argument("--metrics-lag", type=float, default=None,
                   help="seconds the metrics may lag (default: from the interval; 12 with --url)")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="keep each cluster's log here")
    return p.parse_args(argv)


def env_keys() -> dict[str, str]:
    """The keys of a cluster given by --url, from ``KEY_VARS``' variables (role -> key)."""
    missing = [v for v in KEY_VARS.values() if not os.environ.get(v)]
    if missing:
        raise ValueError(f"--keys per-tier with --url needs the keys in {', '.join(missing)}")
    return {role: os.environ[var] for role, var in KEY_VARS.items()}


def run_url(args: argparse.Namespace, probes: Sequence[ProbeDef], timing: Timing) -> RunReport:
    keys = env_keys() if args.keys == "per-tier" else {}
    label = "keys per tier" if keys else "no keys"
    setup = Setup(label, args.url.rstrip("/"),
                  args.metrics_url or "http://127.0.0.1:8080/metrics", keys, None, False, Limits())
    report = RunReport(label, setup.url, who=who(keys, None))
    try:
        asyncio.run(exercise(setup, probes, timing, report))
    except Exception as e:
        report.error = f"{type(e).__name__}: {e}"
    return report


def run_config(label: str, config: dict[str, Any], keyed: bool, args: argparse.Namespace,
               probes: Sequence[ProbeDef], timing: Timing, logs: Path) -> RunReport:
    url = http_target(config)
    cargs = app_args(config)
    cfg = validate(cargs)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    keys: dict[str, str] = {}
    if keyed:
        fresh = new_keys()
        env |= fresh
        keys = {role: fresh[var] for role, var in KEY_VARS.items()}
    if args.metrics_interval_ms > 0:
        env["RAY_metrics_report_interval_ms"] = str(args.metrics_interval_ms)
    anonymous = cfg.anonymous_tier
    report = RunReport(label, url, config=redact(config), who=who(keys, anonymous))
    if answers(lambda: httpx.get(f"{url}/v1/models", timeout=5)):
        report.error = f"something already serves on {url}; stop it first"
        return report
    setup = Setup(label, url, f"http://127.0.0.1:{args.metrics_port}/metrics", keys, anonymous,
                  True, limits_from_config(cargs))
    victim_headers = {"Authorization": f"Bearer {keys['interactive']}"} if keys else {}
    with tempfile.TemporaryDirectory(prefix="bench-abuse-") as tmp:
        path = Path(tmp) / f"{label.replace(' ', '-')}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        log = logs / f"abuse-{label.replace(' ', '-')}-cluster.log"
        print(f"{label}: starting the cluster ({args.config}), log {log}", flush=True)
        try:
            proc, report.startup_s = start_cluster(path, env, url, args.metrics_port,
                                                   victim_headers, log, args.start_timeout)
        except Exception as e:
            report.error = f"the cluster did not start: {type(e).__name__}: {e}"[:2000]
            return report
        try:
            asyncio.run(exercise(setup, probes, timing, report))
        except Exception as e:
            report.error = f"{type(e).__name__}: {e}"
        finally:
            stop(proc)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        probes = select_probes(args.probes)
        if args.quiet <= 0:
            raise ValueError("--quiet must be positive")
        runs_plan: list[tuple[str, dict[str, Any], bool]] = []
        if args.url is None:
            base = yaml.safe_load(Path(args.config).read_text())
            validate(app_args(base))
            http_target(base)
            runs_plan.append(("as configured", base, False))
            if args.keys == "per-tier":
                runs_plan.append(("keys per tier", keyed_config(base), True))
        elif args.keys == "per-tier":
            env_keys()
    except (ValueError, OSError, yaml.YAMLError, TypeError, AttributeError) as e:
        print(f"{TOOL}: {e}", file=sys.stderr)
        return 2
    lag = args.metrics_lag
    if lag is None:
        lag = 12.0 if args.url or args.metrics_interval_ms <= 0 else \
            max(3.0, 2.0 * args.metrics_interval_ms / 1000 + 1.0)
    timing = Timing(args.quiet, lag)
    m = machine(torch_info=False)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="tierserve-abuse-"))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[RunReport] = []
    try:
        if args.url is not None:
            runs.append(run_url(args, probes, timing))
            print(table_text(runs[-1]), flush=True)
        for label, config, keyed in runs_plan:
            runs.append(run_config(label, config, keyed, args, probes, timing, logs))
            print(table_text(runs[-1]), flush=True)
    except KeyboardInterrupt:
        print(f"{TOOL}: interrupted", file=sys.stderr)
        return 130
    m["load_avg_1m_after"] = load_avg_1m()
    print(machine_line(m))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"tool": TOOL, "machine": m, "settings": vars(args),
             "targets": {"gap_floor_s": GAP_FLOOR_S, "gap_factor": GAP_FACTOR,
                         "memory_limit_bytes": MEMORY_LIMIT_BYTES, "fast_s": FAST_S,
                         "blocks_timeout_s": BLOCKS_TIMEOUT_S},
             "runs": [run_record(r) for r in runs]}, indent=1))
    if args.plot:
        try:
            plot(runs, args.plot)
        except ImportError:
            print(f"{TOOL}: matplotlib is not installed: no plot", file=sys.stderr)
    return 0 if runs and all(r.passed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
