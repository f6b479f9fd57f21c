"""What the load generator (``tierserve.cluster.load``, ``tierserve-load``) and the benchmarks of the
repository's ``benchmarks/`` share: the machine record, the one percentile, plotting, and the
checks of the HTTP tools.

- ``machine(**extra)``: the machine a figure was measured on (CPU model, cores, memory, Python,
  platform, the load average at the start and, where torch imports, its version, its thread
  count and the CPU capability its kernels dispatch to). A benchmark adds its own keys through
  ``extra``; ``load_avg_1m()`` reads the load again at the end.
- ``percentile(values, q)``: one definition of a percentile for every figure (linear
  interpolation between the closest ranks, numpy's default), so that a p99 of one tool compares
  with a p99 of another; ``rounded_percentile`` is the same for a JSON report (``None`` values
  left out, rounded to the microsecond, ``None`` when nothing is left).
- ``pyplot()``: matplotlib on its file-only backend (a benchmark runs without a display).

What the HTTP tools (load, and the benchmarks soak, serving, startup, tiers) share, so that none
of them can pass on nothing:

- ``served_model(url)`` (``served_model_async`` on an ``httpx.AsyncClient``): the model the
  server names at ``GET /v1/models``, for a tool given no ``--model``; ``RequestsFailed`` naming
  the URL and what came back when it names none (``NotServing`` when nothing answered it);
- ``answered(response)``: whether a request was answered, is not answered yet (a server still
  starting), or was refused for a reason that asking again cannot change (``RequestsFailed``);
- ``verdict(...)``: pass or fail from the counts of a run: no request succeeded, or clear errors
  (by their OpenAI error code) beyond what the tool's mix asks for, fail it;
  ``Verdict.conclude`` prints why and gives the exit status.

Installed because ``tierserve-load`` needs it; nothing on the serving path imports it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from types import ModuleType
from typing import Any, TextIO

import httpx


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    model = platform.processor() or platform.machine() or "unknown"
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo", encoding="utf-8") as f:
        model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return model


def load_avg_1m() -> float:
    """The 1-minute load average (NaN where the OS has none): other work on the machine adds
    noise to every timing, so each run records it before and after."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; a container may allow fewer than the
    machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def torch_record() -> dict[str, Any]:
    """torch's version, threads and CPU capability; empty where torch does not import."""
    try:
        import torch
    except ImportError:
        return {}
    return {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def machine(*, torch_info: bool = True, **extra: Any) -> dict[str, Any]:
    """The machine record of a run, with the benchmark's own keys (``extra``) last.

    ``torch_info=False`` leaves torch out: the HTTP tools (load, soak) have no use for it and
    should not pay its import.
    """
    record: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable_cores(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m_before": load_avg_1m(),
    }
    if torch_info:
        record.update(torch_record())
    record.update(extra)
    return record


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0 to 100) of ``values``, NaNs left out; NaN when none is left.

    Linear interpolation between the closest ranks (numpy's default method).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    xs = sorted(v for v in values if not math.isnan(v))
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    frac = k - lo
    if frac == 0 or xs[lo] == xs[hi]:  # keeps an inf (never served) from turning into NaN
        return xs[lo]
    return xs[lo] + (xs[hi] - xs[lo]) * frac


def rounded_percentile(values: Iterable[float | None], q: float) -> float | None:
    """``percentile`` for a JSON report: ``None`` values left out, the result rounded to the
    microsecond; ``None`` when no value is left."""
    xs = [v for v in values if v is not None]
    return round(percentile(xs, q), 6) if xs else None


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (PNG files, no display); ``ImportError`` when
    matplotlib is not installed (it comes with the ``dev`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---------------------------------------------------------------------------------- HTTP tools

MODELS_PATH = "/v1/models"
# A server's refusals under load (429 ``queue_full``; ``shed`` by flow control, 429 or 503): a
# tool that loads the server asks for them, in any number.
OVERLOAD_CODES = frozenset({"queue_full", "shed"})


class RequestsFailed(RuntimeError):
    """A tool's requests cannot measure what it is meant to: the server names no model to send
    them to, or refuses them for a reason that asking again does not change."""


class NotServing(RequestsFailed):
    """Nothing answered ``GET /v1/models`` with a model list: the server is unreachable or
    answered an HTTP error (one still starting does both)."""


def _excerpt(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def models_url(base_url: str) -> str:
    """``GET /v1/models`` of the API at ``base_url``."""
    return base_url.rstrip("/") + MODELS_PATH


def model_from_listing(url: str, response: httpx.Response) -> str:
    """The first model a ``GET /v1/models`` answer names (the cluster serves one).
    ``NotServing`` for an HTTP error, ``RequestsFailed`` for an answer that is not a model list
    or lists none; either names ``url`` and what came back."""
    answer = f"{response.status_code} {_excerpt(response.text) or '(empty)'}"
    if response.status_code != 200:
        raise NotServing(f"{url} answered {answer}, not a model list")
    try:
        data = response.json()["data"]
        ids = [str(m["id"]) for m in data]
    except (ValueError, KeyError, TypeError):
        raise RequestsFailed(f"{url} answered {answer}: not a model list "
                             '({"data": [{"id": ...}]})') from None
    if not ids or not ids[0]:
        raise RequestsFailed(f"{url} serves no model: it answered {answer}")
    return ids[0]


def _unreachable(url: str, e: httpx.HTTPError) -> NotServing:
    return NotServing(f"could not reach {url} ({type(e).__name__}: {_excerpt(str(e)) or 'no detail'});"
                      " is the server up?")


def served_model(base_url: str, *, timeout_s: float = 30.0,
                 client: httpx.Client | None = None) -> str:
    """The model the server at ``base_url`` names at ``GET /v1/models`` (``model_from_listing``);
    ``NotServing`` when it cannot be reached."""
    url = models_url(base_url)
    try:
        response = (client.get(url, timeout=timeout_s) if client is not None
                    else httpx.get(url, timeout=timeout_s))
    except httpx.HTTPError as e:
        raise _unreachable(url, e) from None
    return model_from_listing(url, response)


async def served_model_async(client: httpx.AsyncClient, base_url: str,
                             timeout_s: float = 30.0) -> str:
    """``served_model`` on an ``httpx.AsyncClient``."""
    url = models_url(base_url)
    try:
        response = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise _unreachable(url, e) from None
    return model_from_listing(url, response)


def error_code(body: bytes | str) -> str | None:
    """The ``code`` of an OpenAI error body (``{"error": {"code": ...}}``); None for any other."""
    try:
        err = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    code = err.get("code") if isinstance(err, dict) else None
    return str(code) if code else None


def answered(response: httpx.Response) -> bool:
    """Whether a request was answered (a 2xx). False, not answered yet: a 5xx, a 429, or an error
    without an OpenAI error body (a proxy whose route is not up yet). A clear refusal of any
    other kind (400 ``model_not_found``, 401 ``invalid_api_key``, ...) raises
    ``RequestsFailed`` naming it: asking again cannot change it."""
    if 200 <= response.status_code < 300:
        return True
    code = error_code(response.content)
    if response.status_code >= 500 or response.status_code in (408, 429) or code is None:
        return False
    try:
        what = f"{response.request.method} {response.request.url}"
    except RuntimeError:  # a response made without its request
        what = "the request"
    raise RequestsFailed(f"{what} was refused: {response.status_code} {code}: "
                         f"{_excerpt(response.text)}")


@dataclass(frozen=True, slots=True)
class Verdict:
    """Whether a run's requests measured the server: ``reasons`` says why not (none: passed).

    ``errors``: the clear errors (an HTTP error or a stream's error event with an OpenAI error
    code) by code; ``unexpected``: those beyond what the tool's mix asks for (``expected``) and
    the refusals of a loaded server (``tolerated``), by how many each code is over."""

    sent: int
    succeeded: int
    errors: dict[str, int] = field(default_factory=dict)
    expected: dict[str, int] = field(default_factory=dict)
    unexpected: dict[str, int] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.reasons

    @property
    def exit_status(self) -> int:
        """0 when the run passed, else 1."""
        return 0 if self.passed else 1

    def record(self) -> dict[str, Any]:
        """The verdict for a JSON report."""
        return {"passed": self.passed, **asdict(self), "reasons": list(self.reasons)}

    def conclude(self, tool: str, file: TextIO | None = None) -> int:
        """Print why the run failed (nothing when it passed) to ``file`` (stderr), each line
        led by ``tool``; the exit status."""
        out = sys.stderr if file is None else file
        for reason in self.reasons:
            print(f"{tool}: FAILED: {reason}", file=out)
        return self.exit_status


def verdict(*, sent: int, succeeded: int, errors: Mapping[str, int],
            expected: Mapping[str, int] | None = None,
            tolerated: Collection[str] = OVERLOAD_CODES) -> Verdict:
    """Pass or fail from the counts of a run. It fails when no request succeeded, or when
    clear errors of some code outnumber what the tool's mix asks for: ``expected`` (requests
    that must end with that code, e.g. a soak's invalid ones), except codes in ``tolerated`` (a
    loaded server's refusals), which any number may have. A code no request asks for, such as
    ``model_not_found``, fails the run at its first occurrence."""
    expected = {k: v for k, v in (expected or {}).items() if v}
    errors = {k: v for k, v in errors.items() if v}
    unexpected = {code: n - expected.get(code, 0) for code, n in sorted(errors.items())
                  if code not in tolerated and n > expected.get(code, 0)}
    reasons: list[str] = []
    if succeeded <= 0:
        why = f"; clear errors by code: {dict(Counter(errors).most_common())}" if errors else ""
        reasons.append(f"no request succeeded ({sent} sent{why})")
    if unexpected:
        asked = f"; the mix asks for {expected}" if expected else ""
        reasons.append(f"{sum(unexpected.values())} clear errors the mix does not ask for, by "
                       f"code: {unexpected} (all clear errors: {errors}{asked})")
    return Verdict(sent, succeeded, dict(errors), expected, unexpected, tuple(reasons))
