"""Load generator for a tierserve cluster: ``tierserve-load`` (also ``python -m tierserve.cluster.load``).

Arrivals: ``--rate R`` is an open loop (Poisson arrivals, R requests/s on average, at most
``--max-inflight`` at once: arrivals beyond are dropped and counted); ``--concurrency C`` is a
closed loop (C clients, each sends its next request when its last one has ended; after a 429 it
waits the ``Retry-After``, at most 1 s). Every request streams (SSE) through the HTTP API with
``httpx``: ``/v1/completions``, or ``/v1/chat/completions`` for dataset lines with ``messages``.

Traffic classes mix tiers: ``--class NAME[=WEIGHT][,key=KEY][,priority=P]``, repeatable.

- With a config that gives each tier API keys, one class per tier with its key
  (``--class interactive=1,key=env:KEY_I --class batch=3,key=env:KEY_B``): the server counts
  each request under that tier. ``key=env:VAR`` reads the key from the environment; keys never
  reach the report.
- With the default config (tiers without keys), every request lands in the anonymous tier
  (``standard``, priorities 5 to 9) and the classes differ only by their ``X-TL-Priority``. The
  default mix is ``high=1,priority=9``, ``normal=2,priority=7``, ``low=1,priority=5``. A priority
  outside the caller's tier is refused with 400.

Lengths: ``--prompt-len`` and ``--output-len`` take ``N``, ``uniform:A:B``, ``normal:MEAN:STD``
or ``lognormal:MEDIAN:SIGMA`` (rounded, at least 1). Prompts are token ids by default (exact
lengths under any tokenizer; ``--prompt-format text`` sends text). ``--dataset FILE.jsonl`` takes
one request per line instead: ``prompt`` (text or token ids) or ``messages`` (chat), optional
``max_tokens`` (else ``--output-len``) and ``class``. ``ignore_eos`` is on unless
``--allow-eos``, so outputs have their drawn lengths. ``--abort-fraction F`` makes a fraction of the
clients hang up after their first token (the server aborts those requests).

Bounds: at most ``--num-requests`` requests, none started after ``--duration`` s; requests still
running then get ``--drain-timeout`` s more and are cancelled; each has ``--request-timeout``.
Only loopback targets unless ``--allow-remote``. Without ``--model``, the requests name the model
the server lists first at ``GET /v1/models``; when it lists none or cannot be reached, nothing is
sent and the exit status is 1.

The report (``OUT_DIR/NAME.json``, ``NAME_latency.png``, ``NAME_server.png``): TTFT, TPOT and
end-to-end p50/p90/p99 per class and overall (client-side, from the SSE stream: TTFT is the first
chunk with text, TPOT the time after it over the remaining tokens of ``usage``), throughput
(requests/s, output tokens/s), rejections by status and error code, and the server's own counters
as before/after deltas of the metrics endpoint (preemptions, rejections by reason, aborts,
finished requests). The endpoint is also sampled every ``--sample-interval`` s for the queue
depth, running requests and free KV blocks per replica. Ray exports a replica's metrics about
every 10 s, so those series lag by up to that much, and the final scrape waits (at most
``--settle-timeout`` s) until the server has counted every request the client saw end.

The verdict (in the report as ``verdict``; the exit status is 1 when it fails, after the report
is written): the run fails when no request was answered (a complete answer, or a stream the
client hung up on by ``--abort-fraction``), or when any request got a clear error (an HTTP error
or a stream's error event, by its OpenAI error code) other than a loaded server's refusals
(``queue_full``, ``shed``): ``model_not_found``, ``invalid_api_key``, ``invalid_priority`` and the
like mean the run measured nothing of what it meant to. Transport errors, timeouts and requests
cancelled at the drain are reported, not judged.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import itertools
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tierserve.cluster.measure import (
    RequestsFailed,
    Verdict,
    error_code,
    load_avg_1m,
    machine,
    percentile,
    pyplot,
    rounded_percentile,
    served_model_async,
    verdict,
)
from tierserve.replica.metrics import COUNTERS, GAUGES

# Ray exports every metric with this prefix, and a counter with a ``_total`` suffix.
RAY_PREFIX = "ray_"
SCRAPE_PREFIX = RAY_PREFIX + "tierserve_"


def gauge(name: str) -> str:
    """The scraped name of a gauge of ``tierserve.replica.metrics.GAUGES``."""
    if name not in GAUGES:
        raise KeyError(f"{name} is not a gauge of tierserve.replica.metrics")
    return RAY_PREFIX + name


def counter(name: str) -> str:
    """The scraped name of a counter of ``tierserve.replica.metrics.COUNTERS``."""
    if name not in COUNTERS:
        raise KeyError(f"{name} is not a counter of tierserve.replica.metrics")
    return f"{RAY_PREFIX}{name}_total"


# What this tool reads from a scrape, by the definitions of replica/metrics.py.
WAITING = gauge("tierserve_requests_waiting")
RUNNING = gauge("tierserve_requests_running")
KV_FREE = gauge("tierserve_kv_blocks_free")
KV_TOTAL = gauge("tierserve_kv_blocks_total")
RSS = gauge("tierserve_replica_resident_memory_bytes")
PREEMPTIONS = counter("tierserve_preemptions")
REJECTIONS = counter("tierserve_rejections")
ABORTS = counter("tierserve_aborts")
FINISHED = counter("tierserve_requests_finished")
PROMPT_TOKENS = counter("tierserve_prompt_tokens")
GENERATION_TOKENS = counter("tierserve_generation_tokens")
SCRAPED = (WAITING, RUNNING, KV_FREE, KV_TOTAL, PREEMPTIONS, REJECTIONS, ABORTS, FINISHED,
           PROMPT_TOKENS, GENERATION_TOKENS, RSS)
# A replica's gauges under the keys of its stats (what ReplicaMetrics.refresh exports them from).
GAUGE_KEYS = {WAITING: "waiting", RUNNING: "running", KV_FREE: "free_blocks",
              KV_TOTAL: "total_blocks", RSS: "rss_bytes"}

DEFAULT_CLASSES = ("high=1,priority=9", "normal=2,priority=7", "low=1,priority=5")
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------------------------- workload


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution: ``N``, ``uniform:A:B``, ``normal:MEAN:STD``, ``lognormal:MEDIAN:SIGMA``."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.strip().partition(":")
        try:
            if not rest:
                n = int(kind)
                if n < 1:
                    raise ValueError
                return cls("fixed", n)
            nums = [float(x) for x in rest.split(":")]
        except ValueError:
            raise ValueError(f"bad length {spec!r}: want N >= 1, uniform:A:B, normal:MEAN:STD "
                             "or lognormal:MEDIAN:SIGMA") from None
        if len(nums) != 2 or kind not in ("uniform", "normal", "lognormal"):
            raise ValueError(f"bad length {spec!r}: want uniform:A:B, normal:MEAN:STD or "
                             "lognormal:MEDIAN:SIGMA")
        a, b = nums
        if kind == "uniform" and not 1 <= a <= b:
            raise ValueError(f"bad length {spec!r}: uniform needs 1 <= A <= B")
        if kind == "normal" and (a < 1 or b < 0):
            raise ValueError(f"bad length {spec!r}: normal needs MEAN >= 1 and STD >= 0")
        if kind == "lognormal" and (a < 1 or b < 0):
            raise ValueError(f"bad length {spec!r}: lognormal needs MEDIAN >= 1 and SIGMA >= 0")
        return cls(kind, a, b)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            x = self.a
        elif self.kind == "uniform":
            x = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            x = rng.gauss(self.a, self.b)
        else:
            x = self.a * math.exp(rng.gauss(0.0, self.b))
        return max(1, round(x))

    def __str__(self) -> str:
        return str(int(self.a)) if self.kind == "fixed" else f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True, slots=True)
class TrafficClass:
    """One kind of caller: a share of the requests, an API key and/or an ``X-TL-Priority``."""

    name: str
    weight: float = 1.0
    api_key: str | None = field(default=None, repr=False)
    priority: int | None = None

    @classmethod
    def parse(cls, spec: str, environ: Mapping[str, str] | None = None) -> TrafficClass:
        """``NAME[=WEIGHT][,key=KEY|key=env:VAR][,priority=P]``."""
        environ = os.environ if environ is None else environ
        head, *opts = [p.strip() for p in spec.split(",")]
        name, eq, weight_s = head.partition("=")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"bad class {spec!r}: the name must be letters, digits, _ . -")
        try:
            weight = float(weight_s) if eq else 1.0
        except ValueError:
            raise ValueError(f"bad class {spec!r}: weight {weight_s!r} is not a number") from None
        if not weight > 0 or math.isinf(weight):
            raise ValueError(f"bad class {spec!r}: the weight must be positive")
        key: str | None = None
        priority: int | None = None
        for opt in opts:
            k, _, v = opt.partition("=")
            if k == "key" and v.startswith("env:"):
                if v[4:] not in environ:
                    raise ValueError(f"class {name!r}: environment variable {v[4:]!r} is not set")
                key = environ[v[4:]]
            elif k == "key" and v:
                key = v
            elif k == "priority":
                try:
                    priority = int(v)
                except ValueError:
                    raise ValueError(f"bad class {spec!r}: priority {v!r} is not an integer") from None
            else:
                raise ValueError(f"bad class {spec!r}: unknown option {opt!r} (key=, priority=)")
        return cls(name, weight, key, priority)

    def headers(self) -> dict[str, str]:
        out = {}
        if self.api_key is not None:
            out["Authorization"] = f"Bearer {self.api_key}"
        if self.priority is not None:
            out["X-TL-Priority"] = str(self.priority)
        return out

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, "priority": self.priority,
                "api_key": self.api_key is not None}


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of the run: a completion (``prompt``) or a chat (``messages``)."""

    index: int
    cls: TrafficClass
    max_tokens: int
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    abort_early: bool = False  # hang up after the first token

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.messages is not None else "/v1/completions"


def load_dataset(path: str | Path, class_names: set[str]) -> list[dict[str, Any]]:
    """The lines of a JSONL request file, each checked (``prompt`` or ``messages``, ...)."""
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from None
            if not isinstance(item, dict):
                raise ValueError(f"{where}: each line must be a JSON object")
            unknown = set(item) - {"prompt", "messages", "max_tokens", "class"}
            if unknown:
                raise ValueError(f"{where}: unknown fields {sorted(unknown)}")
            prompt, messages = item.get("prompt"), item.get("messages")
            if (prompt is None) == (messages is None):
                raise ValueError(f"{where}: give exactly one of 'prompt' and 'messages'")
            if prompt is not None and not (
                (isinstance(prompt, str) and prompt)
                or (isinstance(prompt, list) and prompt
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt))
            ):
                raise ValueError(f"{where}: 'prompt' must be non-empty text or token ids")
            if messages is not None and not (
                isinstance(messages, list) and messages
                and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                        and isinstance(m.get("content"), str) for m in messages)
            ):
                raise ValueError(f"{where}: 'messages' must be a list of {{role, content}}")
            mt = item.get("max_tokens")
            if mt is not None and not (isinstance(mt, int) and not isinstance(mt, bool) and mt >= 1):
                raise ValueError(f"{where}: 'max_tokens' must be a positive integer")
            cls = item.get("class")
            if cls is not None and cls not in class_names:
                raise ValueError(f"{where}: class {cls!r} is not one of {sorted(class_names)}")
            out.append(item)
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


_WORDS = ("the", "cluster", "serves", "tokens", "from", "a", "paged", "cache", "with", "tiers",
          "and", "priority", "under", "load", "every", "replica", "step")


class Workload:
    """Request ``i`` of the run, the same for the same seed (independent of arrival order)."""

    def __init__(
        self,
        classes: Sequence[TrafficClass],
        prompt_len: LengthDist,
        output_len: LengthDist,
        *,
        seed: int = 0,
        prompt_format: str = "ids",
        token_range: tuple[int, int] = (33, 127),
        abort_fraction: float = 0.0,
        dataset: list[dict[str, Any]] | None = None,
    ) -> None:
        if not classes:
            raise ValueError("at least one traffic class is needed")
        if prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt format must be 'ids' or 'text', got {prompt_format!r}")
        if not 0.0 <= abort_fraction <= 1.0:
            raise ValueError(f"abort fraction must be in [0, 1], got {abort_fraction}")
        self.classes = list(classes)
        self.by_name = {c.name: c for c in self.classes}
        if len(self.by_name) != len(self.classes):
            raise ValueError("traffic class names must be distinct")
        self.prompt_len, self.output_len = prompt_len, output_len
        self.seed, self.prompt_format, self.token_range = seed, prompt_format, token_range
        self.abort_fraction = abort_fraction
        self.dataset = dataset

    def spec(self, index: int) -> RequestSpec:
        rng = random.Random(f"{self.seed}:{index}")
        cls = rng.choices(self.classes, weights=[c.weight for c in self.classes])[0]
        abort = rng.random() < self.abort_fraction
        if self.dataset is not None:
            item = self.dataset[index % len(self.dataset)]
            if item.get("class") is not None:
                cls = self.by_name[item["class"]]
            max_tokens = item.get("max_tokens") or self.output_len.sample(rng)
            return RequestSpec(index, cls, max_tokens, prompt=item.get("prompt"),
                               messages=item.get("messages"), abort_early=abort)
        n = self.prompt_len.sample(rng)
        prompt: str | list[int]
        if self.prompt_format == "ids":
            lo, hi = self.token_range
            prompt = [rng.randrange(lo, hi) for _ in range(n)]
        else:
            text = f"{index} "
            while len(text) < n:
                text += rng.choice(_WORDS) + " "
            prompt = text[:n]
        return RequestSpec(index, cls, self.output_len.sample(rng), prompt=prompt,
                           abort_early=abort)


# ---------------------------------------------------------------------------------- metrics

@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _ours(line: str, prefixes: tuple[str, ...]) -> bool:
    """A sample line, or a ``# HELP`` / ``# TYPE`` line, of a metric named with ``prefixes``."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return len(parts) >= 3 and parts[1] in ("HELP", "TYPE") and parts[2].startswith(prefixes)
    return line.startswith(prefixes)


def parse_metrics(text: str, prefixes: Sequence[str] = (SCRAPE_PREFIX,)) -> list[Sample]:
    """The samples of a Prometheus text exposition whose names start with one of ``prefixes``.

    Only those lines reach the parser: Ray's endpoint carries many more metrics, and one it
    cannot parse must not cost this tool its own. ``ValueError`` when a line of ours is malformed.
    """
    keep = tuple(prefixes)
    ours = "\n".join(line for line in text.splitlines() if _ours(line, keep)) + "\n"
    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(ours)
            for s in family.samples if s.name.startswith(keep)]


@dataclass(slots=True)
class Scrape:
    """One scrape of the metrics endpoint (tierserve's samples only)."""

    t: float  # seconds since the run started
    samples: list[Sample]

    def select(self, name: str, app: str | None = None) -> list[Sample]:
        return [s for s in self.samples if s.name == name
                and (app is None or s.labels.get("application") == app)]

    def total(self, name: str, app: str | None = None) -> float:
        return sum(s.value for s in self.select(name, app))

    def by(self, name: str, label: str, app: str | None = None) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.select(name, app):
            k = s.labels.get(label, "")
            out[k] = out.get(k, 0.0) + s.value
        return out

    def replicas(self, app: str | None = None) -> dict[str, dict[str, float]]:
        """Each replica's gauges: waiting, running, free_blocks, total_blocks."""
        out: dict[str, dict[str, float]] = {}
        for name, key in GAUGE_KEYS.items():
            for s in self.select(name, app):
                out.setdefault(s.labels.get("replica", "?"), {})[key] = s.value
        return out


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """Counter increase per key (a key absent before counts from 0); zero increases left out."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: v for k, v in sorted(out.items()) if v}


# ---------------------------------------------------------------------------------- one request


@dataclass(slots=True)
class Result:
    """One request as the client saw it. Times in seconds since the run started."""

    index: int
    cls: str
    start: float
    end: float = 0.0
    status: int = 0  # the HTTP status; 0: no response (transport error, timeout, cancelled)
    code: str | None = None  # the error body's code (queue_full, shed, never_fits, ...)
    first_token: float | None = None
    last_token: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    aborted: bool = False  # the client hung up after the first token, on purpose
    error: str | None = None  # transport error, timeout, cancelled or an error inside the stream
    retry_after: float | None = None

    @property
    def outcome(self) -> str:
        if self.aborted:
            return "aborted"
        if self.status == 200 and self.error is None and self.finish_reason is not None:
            return "ok"
        if self.status >= 400:
            return "rejected"
        return "error"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens or 0
        if self.first_token is None or self.last_token is None or n < 2:
            return None
        return (self.last_token - self.first_token) / (n - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start


STREAM_ERROR = "stream error: "  # how ``Result.error`` starts for a stream's error event


async def send(client: httpx.AsyncClient, base_url: str, model: str, spec: RequestSpec,
               clock: Callable[[], float], ignore_eos: bool = True) -> Result:
    """Stream one request; errors are in the result (a cancellation propagates)."""
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if spec.messages is not None:
        body["messages"] = spec.messages
    else:
        body["prompt"] = spec.prompt
    r = Result(spec.index, spec.cls.name, clock())
    try:
        async with client.stream("POST", base_url + spec.path, json=body,
                                 headers=spec.cls.headers()) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.code = error_code(await resp.aread())
                ra = resp.headers.get("retry-after", "")
                r.retry_after = float(ra) if ra.replace(".", "", 1).isdigit() else None
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = chunk["error"]
                    r.error = STREAM_ERROR + str(err.get("code") if isinstance(err, dict) else err)
                    break
                if chunk.get("usage"):
                    r.prompt_tokens = chunk["usage"].get("prompt_tokens")
                    r.completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    text = choice.get("text") if "text" in choice else (
                        (choice.get("delta") or {}).get("content"))
                    now = clock()
                    if text or choice.get("finish_reason"):
                        if r.first_token is None:
                            r.first_token = now
                        r.last_token = now
                    if choice.get("finish_reason"):
                        r.finish_reason = choice["finish_reason"]
                if spec.abort_early and r.first_token is not None and r.finish_reason is None:
                    r.aborted = True  # leaving the block closes the connection: the server aborts
                    break
            if r.finish_reason is None and r.error is None and not r.aborted:
                r.error = "stream ended without a finish_reason"
    except httpx.TimeoutException:
        r.error = "timeout"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        r.end = clock()
    return r


# ---------------------------------------------------------------------------------- the run


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(slots=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    metrics_url: str | None = "http://127.0.0.1:8080/metrics"
    model: str | None = None
    rate: float | None = None
    concurrency: int | None = None
    num_requests: int = 1000
    duration_s: float = 60.0
    max_inflight: int = 256
    drain_timeout_s: float = 60.0
    request_timeout_s: float = 300.0
    sample_interval_s: float = 2.0
    settle_timeout_s: float = 30.0
    ignore_eos: bool = True
    app: str | None = None
    progress: bool = True

    def check(self) -> None:
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("give exactly one of --rate (open loop) and --concurrency (closed loop)")
        if self.rate is not None and not 0 < self.rate <= 10_000:
            raise ValueError(f"--rate must be in (0, 10000], got {self.rate}")
        if self.concurrency is not None and not 1 <= self.concurrency <= 4096:
            raise ValueError(f"--concurrency must be in [1, 4096], got {self.concurrency}")
        if not 1 <= self.num_requests <= 10_000_000:
            raise ValueError(f"--num-requests must be in [1, 1e7], got {self.num_requests}")
        if not 0 < self.duration_s <= 7 * 86400:
            raise ValueError(f"--duration must be in (0, 1 week], got {self.duration_s}")
        for name in ("drain_timeout_s", "request_timeout_s", "sample_interval_s", "settle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if self.max_inflight < 1:
            raise ValueError("--max-inflight must be at least 1")


@dataclass(slots=True)
class RunData:
    """Everything the report is made of."""

    model: str
    started_at: str
    wall_s: float
    results: list[Result]
    dropped: int
    before: Scrape | None
    after: Scrape | None
    settled: bool  # the server counted every request the client saw end
    idle_after: bool  # the final scrape shows every replica idle
    samples: list[dict[str, Any]]
    metrics_error: str | None
    machine: dict[str, Any] = field(default_factory=dict)  # the client's, at the start


class LoadRunner:
    def __init__(self, cfg: LoadConfig, workload: Workload) -> None:
        cfg.check()
        self.cfg, self.workload = cfg, workload
        self.results: list[Result] = []
        self.inflight = 0
        self.dropped = 0
        self.samples: list[dict[str, Any]] = []
        self.metrics_error: str | None = None
        self._t0 = time.perf_counter()
        self._bar: Any = None

    def clock(self) -> float:
        return time.perf_counter() - self._t0

    # ------------------------------------------------------------------ metrics

    async def scrape(self, client: httpx.AsyncClient) -> Scrape | None:
        if not self.cfg.metrics_url:
            return None
        try:
            resp = await client.get(self.cfg.metrics_url, timeout=10.0)
            resp.raise_for_status()
        except httpx.HTTPError as e:
            self.metrics_error = f"{self.cfg.metrics_url}: {type(e).__name__}: {e}"[:300]
            return None
        t = self.clock()  # parsed off the event loop: the streams' timings stay honest
        try:
            return Scrape(t, await asyncio.to_thread(parse_metrics, resp.text))
        except ValueError as e:
            self.metrics_error = f"{self.cfg.metrics_url}: unparsable exposition: {e}"[:300]
            return None

    def _record(self, s: Scrape, before: Scrape | None) -> None:
        """One point of the server's time series (counters since ``before``)."""
        app = self.cfg.app
        base = {n: before.total(n, app) if before else 0.0 for n in (PREEMPTIONS, REJECTIONS)}
        self.samples.append({
            "t": round(s.t, 3), "inflight": self.inflight, "replicas": s.replicas(app),
            "preemptions": s.total(PREEMPTIONS, app) - base[PREEMPTIONS],
            "rejections": s.total(REJECTIONS, app) - base[REJECTIONS],
        })

    async def _sample_loop(self, client: httpx.AsyncClient, before: Scrape | None,
                           stop: asyncio.Event) -> None:
        while not stop.is_set():
            s = await self.scrape(client)
            if s is not None and not stop.is_set():
                self._record(s, before)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.cfg.sample_interval_s)

    async def _settle(self, client: httpx.AsyncClient, before: Scrape | None
                      ) -> tuple[Scrape | None, bool, bool]:
        """The final scrape: (scrape, counted, idle). Waits (at most ``settle_timeout_s``) until
        the server has counted every request the client saw end, then until the gauges show
        every replica idle (they lag too); either may stay false, e.g. with other traffic."""
        target = sum(r.outcome in ("ok", "aborted") for r in self.results)
        base = before.total(FINISHED, self.cfg.app) if before else 0.0
        deadline = time.perf_counter() + self.cfg.settle_timeout_s
        last: Scrape | None = None
        counted = idle = False
        while self.cfg.metrics_url:
            s = await self.scrape(client)
            if s is not None:
                last = s
                counted = counted or s.total(FINISHED, self.cfg.app) - base >= target
                reps = s.replicas(self.cfg.app).values()
                idle = bool(reps) and all(r.get("waiting") == 0 and r.get("running") == 0
                                          for r in reps)
                if counted and idle:
                    break
            if time.perf_counter() >= deadline:
                break
            await asyncio.sleep(0.5)
        return last, counted, idle

    # ------------------------------------------------------------------ requests

    async def _one(self, client: httpx.AsyncClient, model: str, index: int) -> Result:
        spec = self.workload.spec(index)
        self.inflight += 1
        try:
            r = await send(client, self.cfg.url, model, spec, self.clock, self.cfg.ignore_eos)
        except asyncio.CancelledError:
            self.results.append(Result(index, spec.cls.name, self.clock(), self.clock(),
                                       error="cancelled"))
            raise
        finally:
            self.inflight -= 1
            if self._bar is not None:
                self._bar.update(1)
        self.results.append(r)
        if self._bar is not None:
            c = Counter(x.outcome for x in self.results)
            self._bar.set_postfix(ok=c["ok"], rejected=c["rejected"], errors=c["error"],
                                  inflight=self.inflight, refresh=False)
        return r

    async def _open_loop(self, client: httpx.AsyncClient, model: str) -> None:
        assert self.cfg.rate is not None
        rng = random.Random(f"arrivals:{self.workload.seed}")
        tasks: set[asyncio.Task[Result]] = set()
        t = 0.0
        for i in range(self.cfg.num_requests):
            t += rng.expovariate(self.cfg.rate)
            if t >= self.cfg.duration_s:
                break
            wait = t - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)
            if len(tasks) >= self.cfg.max_inflight:
                self.dropped += 1
                continue
            task = asyncio.create_task(self._one(client, model, i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await self._drain(set(tasks))

    async def _closed_loop(self, client: httpx.AsyncClient, model: str) -> None:
        assert self.cfg.concurrency is not None
        counter = itertools.count()

        async def worker() -> None:
            while True:
                i = next(counter)
                if i >= self.cfg.num_requests or self.clock() >= self.cfg.duration_s:
                    return
                r = await self._one(client, model, i)
                if r.status == 429:
                    await asyncio.sleep(min(r.retry_after or 0.1, 1.0))

        workers = {asyncio.create_task(worker()) for _ in range(self.cfg.concurrency)}
        done, pending = await asyncio.wait(workers, timeout=self.cfg.duration_s + 1.0)
        await self._drain(pending)
        for task in done:
            task.result()

    async def _drain(self, tasks: set[asyncio.Task[Any]]) -> None:
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=self.cfg.drain_timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def run(self) -> RunData:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=cfg.max_inflight + (cfg.concurrency or 0) + 4,
                              max_keepalive_connections=64)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            model = cfg.model or await served_model_async(client, cfg.url)
            host = machine(torch_info=False)
            before = await self.scrape(client)
            started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            stop = asyncio.Event()
            self._t0 = time.perf_counter()
            sampler = asyncio.create_task(self._sample_loop(client, before, stop))
            if cfg.progress:
                from tqdm import tqdm

                expected = cfg.num_requests if cfg.rate is None else min(
                    cfg.num_requests, max(1, round(cfg.rate * cfg.duration_s)))
                self._bar = tqdm(total=expected, unit="req", desc="tierserve-load",
                                 file=sys.stderr, dynamic_ncols=True)
            try:
                if cfg.rate is not None:
                    await self._open_loop(client, model)
                else:
                    await self._closed_loop(client, model)
            finally:
                wall = self.clock()
                if self._bar is not None:
                    self._bar.close()
                    self._bar = None
                try:  # the sampler goes on while the server drains: the plots show it
                    after, settled, idle = await self._settle(client, before)
                finally:
                    stop.set()
                    await sampler
                if after is not None:  # the final scrape is a point too
                    self._record(after, before)
                    self.samples.sort(key=lambda x: float(x["t"]))
        return RunData(model, started_at, wall, sorted(self.results, key=lambda r: r.index),
                       self.dropped, before, after, settled, idle, self.samples, self.metrics_error,
                       host | {"load_avg_1m_after": load_avg_1m()})


def error_codes(results: Sequence[Result]) -> dict[str, int]:
    """The clear errors among ``results`` by code: refusals (their error body's code, else
    ``HTTP <status>``) and streams that ended in an error event."""
    out: Counter[str] = Counter()
    for r in results:
        if r.outcome == "rejected":
            out[r.code or f"HTTP {r.status}"] += 1
        elif r.outcome == "error" and r.error is not None and r.error.startswith(STREAM_ERROR):
            out[r.error[len(STREAM_ERROR):]] += 1
    return dict(sorted(out.items()))


def run_verdict(results: Sequence[Result]) -> Verdict:
    """A run's verdict (``tierserve.cluster.measure.verdict``): a request succeeded when it was
    answered, or streamed until the client hung up on purpose; the mix asks for no clear error,
    and a loaded server's refusals are tolerated."""
    succeeded = sum(r.outcome in ("ok", "aborted") for r in results)
    return verdict(sent=len(results), succeeded=succeeded, errors=error_codes(results))


# ---------------------------------------------------------------------------------- report


def stats(values: Sequence[float | None]) -> dict[str, float | int | None]:
    xs = sorted(v for v in values if v is not None)
    out: dict[str, float | int | None] = {"n": len(xs)}
    for q in PERCENTILES:
        out[f"p{q}"] = rounded_percentile(xs, q)
    out["mean"] = round(sum(xs) / len(xs), 6) if xs else None
    out["max"] = round(xs[-1], 6) if xs else None
    return out


def latency(results: Sequence[Result]) -> dict[str, Any]:
    ok = [r for r in results if r.outcome == "ok"]
    return {"ttft": stats([r.ttft for r in ok]), "tpot": stats([r.tpot for r in ok]),
            "e2e": stats([r.e2e for r in ok])}


def build_report(run: RunData, cfg: LoadConfig, workload: Workload) -> dict[str, Any]:
    rs = run.results
    ok = [r for r in rs if r.outcome == "ok"]
    outcomes = Counter(r.outcome for r in rs)
    span = max((r.end for r in rs), default=0.0) or run.wall_s
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    classes = [c.name for c in workload.classes]

    def rejections(sel: Sequence[Result]) -> dict[str, int]:
        c = Counter(f"{r.status} {r.code or 'unknown'}" for r in sel if r.outcome == "rejected")
        return dict(sorted(c.items()))

    server: dict[str, Any] | None = None
    if run.before is not None and run.after is not None:
        b, a, app = run.before, run.after, cfg.app
        server = {
            "settled": run.settled,
            "idle_after": run.idle_after,
            "preemptions": a.total(PREEMPTIONS, app) - b.total(PREEMPTIONS, app),
            "rejections_by_reason": delta(a.by(REJECTIONS, "reason", app), b.by(REJECTIONS, "reason", app)),
            "rejections_by_tier": delta(a.by(REJECTIONS, "tier", app), b.by(REJECTIONS, "tier", app)),
            "aborts": a.total(ABORTS, app) - b.total(ABORTS, app),
            "finished_by_reason": delta(a.by(FINISHED, "reason", app), b.by(FINISHED, "reason", app)),
            "finished_by_tier": delta(a.by(FINISHED, "tier", app), b.by(FINISHED, "tier", app)),
            "prompt_tokens": a.total(PROMPT_TOKENS, app) - b.total(PROMPT_TOKENS, app),
            "generation_tokens": a.total(GENERATION_TOKENS, app) - b.total(GENERATION_TOKENS, app),
            "replicas_after": a.replicas(app),
        }
    config = {k: v for k, v in asdict(cfg).items() if k != "progress"}
    config.update(prompt_len=str(workload.prompt_len), output_len=str(workload.output_len),
                  prompt_format=workload.prompt_format, seed=workload.seed,
                  abort_fraction=workload.abort_fraction,
                  dataset_lines=None if workload.dataset is None else len(workload.dataset))
    return {
        "tool": "tierserve-load",
        "model": run.model,
        "started_at": run.started_at,
        "mode": "open loop (Poisson)" if cfg.rate is not None else "closed loop",
        "machine": run.machine,
        "config": config,
        "classes": [c.describe() for c in workload.classes],
        "wall_s": round(run.wall_s, 3),
        "requests": {"sent": len(rs), "ok": outcomes["ok"], "aborted_by_client": outcomes["aborted"],
                     "rejected": outcomes["rejected"], "errors": outcomes["error"],
                     "dropped_over_max_inflight": run.dropped},
        "throughput": {
            "requests_per_s": round(len(ok) / span, 4) if span else None,
            "output_tokens_per_s": round(out_tokens / span, 2) if span else None,
            "prompt_tokens_per_s": round(in_tokens / span, 2) if span else None,
            "output_tokens": out_tokens, "prompt_tokens": in_tokens, "span_s": round(span, 3),
        },
        "latency_s": {"all": latency(rs),
                      "per_class": {c: latency([r for r in rs if r.cls == c]) for c in classes}},
        "rejections": {"total": outcomes["rejected"], "by_status_code": rejections(rs),
                       "per_class": {c: rejections([r for r in rs if r.cls == c]) for c in classes}},
        "errors": dict(sorted(Counter((r.error or f"status {r.status}").split(":")[0]
                                      for r in rs if r.outcome == "error").items())),
        "server": server,
        "metrics_error": run.metrics_error,
        "samples": run.samples,
        "requests_detail": [
            {"i": r.index, "class": r.cls, "outcome": r.outcome, "status": r.status, "code": r.code,
             "start": round(r.start, 4), "end": round(r.end, 4),
             "ttft": None if r.ttft is None else round(r.ttft, 5),
             "tpot": None if r.tpot is None else round(r.tpot, 6),
             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "error": r.error}
            for r in rs
        ],
    }


def windowed(points: Sequence[tuple[float, float]], window_s: float
             ) -> tuple[list[float], dict[int, list[float]]]:
    """Percentiles of ``(t, value)`` points per time window: window mid-times, {q: values}."""
    if not points:
        return [], {q: [] for q in PERCENTILES}
    end = max(t for t, _ in points)
    ts: list[float] = []
    out: dict[int, list[float]] = {q: [] for q in PERCENTILES}
    for w in range(int(end // window_s) + 1):
        xs = sorted(v for t, v in points if w * window_s <= t < (w + 1) * window_s)
        if xs:
            ts.append((w + 0.5) * window_s)
            for q in PERCENTILES:
                out[q].append(percentile(xs, q))
    return ts, out


def plot(report: dict[str, Any], out_dir: Path, name: str, window_s: float | None = None) -> dict[str, str]:
    """Two PNGs: latency percentiles per class over time; the server's gauges over time."""
    plt = pyplot()
    rows = [r for r in report["requests_detail"] if r["outcome"] == "ok"]
    classes = [c["name"] for c in report["classes"]]
    span = max((r["end"] for r in report["requests_detail"]), default=1.0)
    window = window_s or max(2.0, span / 15.0)
    paths: dict[str, str] = {}

    metrics = (("TTFT (s)", lambda r: r["ttft"], 1.0), ("TPOT (ms)", lambda r: r["tpot"], 1e3),
               ("end-to-end (s)", lambda r: r["end"] - r["start"], 1.0))
    fig, axes = plt.subplots(3, len(classes), figsize=(4.2 * len(classes) + 0.6, 8.5),
                             sharex=True, squeeze=False)
    for col, cls in enumerate(classes):
        for row, (label, get, scale) in enumerate(metrics):
            ax = axes[row][col]
            pts = [(r["end"], get(r) * scale) for r in rows if r["class"] == cls and get(r) is not None]
            ts, qs = windowed(pts, window)
            for q, style in zip(PERCENTILES, ("-o", "--s", ":^"), strict=True):
                ax.plot(ts, qs[q], style, markersize=3, label=f"p{q}")
            ax.set_title(f"{cls}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == 2:
                ax.set_xlabel(f"time (s), {window:.3g} s windows by completion")
            if not pts:
                ax.text(0.5, 0.5, "no completed requests", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"tierserve-load: latency percentiles per class ({report['mode']})")
    fig.tight_layout()
    paths["latency"] = str(out_dir / f"{name}_latency.png")
    fig.savefig(paths["latency"], dpi=110)
    plt.close(fig)

    samples = report["samples"]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True, squeeze=False)
    replicas = sorted({rep for s in samples for rep in s["replicas"]})
    panels = ((axes[0][0], "waiting", "queue depth (waiting requests)"),
              (axes[0][1], "running", "running requests"),
              (axes[1][0], "free_blocks", "free KV blocks"))
    for ax, key, title in panels:
        for rep in replicas:
            pts = [(s["t"], s["replicas"][rep][key]) for s in samples
                   if key in s["replicas"].get(rep, {})]
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], drawstyle="steps-post",
                           label=f"replica {rep}")
            if key == "free_blocks":
                tot = [(s["t"], s["replicas"][rep]["total_blocks"]) for s in samples
                       if "total_blocks" in s["replicas"].get(rep, {})]
                ax.plot([p[0] for p in tot], [p[1] for p in tot], "--", drawstyle="steps-post",
                        color=line[0].get_color(), alpha=0.5, label=f"{rep} total")
        if key == "running":
            ax.plot([s["t"] for s in samples], [s["inflight"] for s in samples], "k:",
                    drawstyle="steps-post", label="client in flight")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if replicas or key == "running":
            ax.legend(fontsize=7)
    ax = axes[1][1]
    for key in ("preemptions", "rejections"):
        ax.plot([s["t"] for s in samples], [s[key] for s in samples], drawstyle="steps-post",
                label=key)
    ax.set_title("server counters since the start (cumulative)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for a in axes[1]:
        a.set_xlabel("time (s); Ray exports replica metrics every ~10 s, so these lag")
    if not samples:
        fig.text(0.5, 0.5, f"no metrics samples ({report['metrics_error']})", ha="center")
    fig.suptitle("tierserve-load: the server's gauges, sampled from the metrics endpoint")
    fig.tight_layout()
    paths["server"] = str(out_dir / f"{name}_server.png")
    fig.savefig(paths["server"], dpi=110)
    plt.close(fig)
    return paths


def summary_text(report: dict[str, Any]) -> str:
    def fmt(s: dict[str, Any], scale: float = 1.0) -> str:
        if not s["n"]:
            return "-"
        return " / ".join(f"{s[f'p{q}'] * scale:.3g}" for q in PERCENTILES)

    req, thr = report["requests"], report["throughput"]
    lines = [
        f"tierserve-load: {report['mode']}, model {report['model']}, {report['wall_s']:.1f} s",
        f"  requests: {req['sent']} sent, {req['ok']} ok, {req['rejected']} rejected, "
        f"{req['aborted_by_client']} aborted by the client, {req['errors']} errors, "
        f"{req['dropped_over_max_inflight']} dropped",
        f"  throughput: {thr['requests_per_s']} req/s, {thr['output_tokens_per_s']} output tok/s, "
        f"{thr['prompt_tokens_per_s']} prompt tok/s",
    ]
    groups = [("all", report["latency_s"]["all"]), *report["latency_s"]["per_class"].items()]
    table = [["p50 / p90 / p99", "TTFT (s)", "TPOT (ms)", "E2E (s)"]] + [
        [f"{name} (n={lat['e2e']['n']})", fmt(lat["ttft"]), fmt(lat["tpot"], 1e3), fmt(lat["e2e"])]
        for name, lat in groups]
    widths = [max(len(row[i]) for row in table) + 3 for i in range(4)]
    lines += ["    " + "".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in table]
    lines.append(f"  rejections (client): {report['rejections']['by_status_code'] or 'none'}")
    if report["errors"]:
        lines.append(f"  errors: {report['errors']}")
    srv = report["server"]
    if srv is None:
        lines.append(f"  server metrics: unavailable ({report['metrics_error']})")
    else:
        lines.append(f"  server (metrics delta{'' if srv['settled'] else ', NOT settled'}): "
                     f"{srv['preemptions']:g} preemptions, {srv['aborts']:g} aborts, rejections "
                     f"{srv['rejections_by_reason'] or 'none'}, finished {srv['finished_by_reason']}")
        for rep, g in sorted(srv["replicas_after"].items()):
            w, r, f, t = (f"{g[k]:g}" if k in g else "?"
                          for k in ("waiting", "running", "free_blocks", "total_blocks"))
            lines.append(f"  replica {rep} after{'' if srv['idle_after'] else ' (not idle yet)'}: "
                         f"waiting {w}, running {r}, free KV blocks {f} of {t}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tierserve-load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("target")
    g.add_argument("--url", default="http://127.0.0.1:8000", help="the cluster's HTTP API")
    g.add_argument("--metrics-url", default="http://127.0.0.1:8080/metrics",
                   help="Ray's metrics endpoint ('' to skip the server's side)")
    g.add_argument("--app", default=None, help="only this Serve application's metrics")
    g.add_argument("--model", default=None, help="default: the first of /v1/models")
    g.add_argument("--allow-remote", action="store_true", help="allow targets off this machine")
    g = p.add_argument_group("arrivals (one of)")
    m = g.add_mutually_exclusive_group(required=True)
    m.add_argument("--rate", type=float, help="open loop: Poisson arrivals, requests/s")
    m.add_argument("--concurrency", type=int, help="closed loop: this many clients")
    g = p.add_argument_group("bounds")
    g.add_argument("-n", "--num-requests", type=int, default=1000)
    g.add_argument("-d", "--duration", type=float, default=60.0, help="seconds of arrivals")
    g.add_argument("--max-inflight", type=int, default=256, help="open loop: more are dropped")
    g.add_argument("--drain-timeout", type=float, default=60.0)
    g.add_argument("--request-timeout", type=float, default=300.0)
    g = p.add_argument_group("requests")
    g.add_argument("--class", dest="classes", action="append", metavar="SPEC",
                   help="NAME[=WEIGHT][,key=KEY|key=env:VAR][,priority=P]; repeatable "
                        f"(default: {' '.join(DEFAULT_CLASSES)})")
    g.add_argument("--prompt-len", default="lognormal:128:0.6")
    g.add_argument("--output-len", default="uniform:16:128")
    g.add_argument("--prompt-format", choices=("ids", "text"), default="ids")
    g.add_argument("--token-range", default="33:127", help="LO:HI of random prompt token ids")
    g.add_argument("--dataset", default=None, help="JSONL of requests (see above)")
    g.add_argument("--abort-fraction", type=float, default=0.0)
    g.add_argument("--allow-eos", action="store_true", help="don't send ignore_eos")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default="benchmarks/out")
    g.add_argument("--name", default="load", help="file names: NAME.json, NAME_*.png")
    g.add_argument("--sample-interval", type=float, default=2.0)
    g.add_argument("--settle-timeout", type=float, default=30.0)
    g.add_argument("--window", type=float, default=None, help="plot window, seconds")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[LoadConfig, Workload]:
    for url in (args.url, args.metrics_url):
        if url and not args.allow_remote and not is_loopback(url):
            raise ValueError(f"{url} is not on this machine; pass --allow-remote to load it")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.name):
        raise ValueError(f"--name {args.name!r}: letters, digits, _ . - only")
    classes = [TrafficClass.parse(s) for s in (args.classes or DEFAULT_CLASSES)]
    lo_s, _, hi_s = args.token_range.partition(":")
    try:
        token_range = (int(lo_s), int(hi_s))
    except ValueError:
        raise ValueError(f"--token-range {args.token_range!r}: want LO:HI") from None
    if not 0 <= token_range[0] < token_range[1]:
        raise ValueError(f"--token-range {args.token_range!r}: want 0 <= LO < HI")
    dataset = load_dataset(args.dataset, {c.name for c in classes}) if args.dataset else None
    workload = Workload(classes, LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len),
                        seed=args.seed, prompt_format=args.prompt_format, token_range=token_range,
                        abort_fraction=args.abort_fraction, dataset=dataset)
    cfg = LoadConfig(
        url=args.url.rstrip("/"), metrics_url=args.metrics_url or None, model=args.model,
        rate=args.rate, concurrency=args.concurrency, num_requests=args.num_requests,
        duration_s=args.duration, max_inflight=args.max_inflight,
        drain_timeout_s=args.drain_timeout, request_timeout_s=args.request_timeout,
        sample_interval_s=args.sample_interval, settle_timeout_s=args.settle_timeout,
        ignore_eos=not args.allow_eos, app=args.app, progress=not args.no_progress,
    )
    cfg.check()
    return cfg, workload


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg, workload = build(args)
    except (ValueError, OSError) as e:
        print(f"tierserve-load: {e}", file=sys.stderr)
        return 2
    try:
        run = asyncio.run(LoadRunner(cfg, workload).run())
    except RequestsFailed as e:
        print(f"tierserve-load: {e} (or pass --model)", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"tierserve-load: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tierserve-load: interrupted", file=sys.stderr)
        return 130
    report = build_report(run, cfg, workload)
    judged = run_verdict(run.results)
    report["verdict"] = judged.record()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not args.no_plots:
        try:
            report["plots"] = plot(report, out_dir, args.name, args.window)
        except ImportError:
            print("tierserve-load: matplotlib is not installed: no plots", file=sys.stderr)
    path = out_dir / f"{args.name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(summary_text(report))
    print(f"  report: {path}" + "".join(f"\n  plot: {p}" for p in report.get("plots", {}).values()))
    return judged.conclude("tierserve-load")


if __name__ == "__main__":
    sys.exit(main())
