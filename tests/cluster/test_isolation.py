"""One client cannot learn about, or hold on to, what is another's (docs/security.md), on the
live cluster:

- the prefix cache is partitioned by tenant: a prompt another tenant just sent is not found
  cached (``cached_tokens`` 0), the caller's own repeat is; ``cache_salt`` splits further;
- a client that hangs up is aborted and its blocks return even when it sent Ray's headers that
  ask the proxy not to notice (``x-request-disconnect-disabled``, ``x-request-timeout-seconds``);
- with a key on every tier, a request without one gets the lowest tier, never more.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.cluster.helpers import KEYS, MODEL, ServeApp, headers, sse_events
from tests.cluster.test_disconnect import LONG, long_body

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# 60 words: about 4 full blocks of 16 before the question.
SYSTEM = " ".join(f"isolation{i}" for i in range(60))


def cached(app: ServeApp, key: str, prompt: str, salt: str | None = None) -> tuple[int, int]:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(app.url("/v1/completions"), json=body, headers=headers(key), timeout=60)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_finds_another_tenant_s_prompt_cached(solo_app: ServeApp) -> None:
    """One replica, so a miss is the partition's doing, not the router's."""
    a, b = KEYS["standard"], KEYS["batch"]  # a key per tier: each is a tenant of its own
    prompt = f"{SYSTEM} | question one"
    tokens, first = cached(solo_app, a, prompt)
    assert tokens > 48 and first == 0
    assert cached(solo_app, b, prompt)[1] == 0  # b cannot tell that a sent it
    again = cached(solo_app, a, f"{SYSTEM} | question two")[1]
    assert again >= 48 and again % 16 == 0  # a finds its own
    assert cached(solo_app, b, f"{SYSTEM} | question three")[1] >= 48  # and b now its own
    # A salt is a partition inside the tenant's.
    assert cached(solo_app, a, prompt, salt="s1")[1] == 0
    assert cached(solo_app, a, f"{SYSTEM} | question four", salt="s1")[1] >= 48
    assert cached(solo_app, a, f"{SYSTEM} | question five", salt="s2")[1] == 0


def test_a_bad_cache_salt_is_a_400(solo_app: ServeApp) -> None:
    for salt in ("", "x" * 257, 7):
        r = httpx.post(solo_app.url("/v1/completions"), headers=headers(KEYS["batch"]),
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": salt},
                       timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


@pytest.mark.parametrize("opt_out", [
    {"x-request-disconnect-disabled": "?1"},
    {"x-request-timeout-seconds": "3600"},
    {"x-request-disconnect-disabled": "?1", "x-request-timeout-seconds": "0"},
], ids=["disconnect-disabled", "timeout", "both"])
def test_hanging_up_aborts_whatever_headers_the_client_sent(solo_app: ServeApp,
                                                            opt_out: dict[str, str]) -> None:
    before = solo_app.engine_stats().steps
    path, body = long_body(chat=False, stream=True)
    seen = 0
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", solo_app.url(path), json=body,
            headers={**headers(KEYS["standard"]), **opt_out}) as response:
        assert response.status_code == 200
        for event in sse_events(response.iter_lines()):
            assert event != "[DONE]"
            if event["choices"][0].get("text"):
                seen += 1
            if seen == 2:
                break
    stats = solo_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == solo_app.baseline
    steps = solo_app.engine_stats().steps - before
    assert 2 <= steps < LONG, steps


def test_without_a_key_a_caller_gets_the_lowest_tier_only(main_app: ServeApp) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    r = httpx.post(main_app.url("/v1/completions"), json=body,
                   headers={"X-TL-Priority": "9"}, timeout=60)
    assert r.status_code == 400 and "tier 'batch'" in r.json()["error"]["message"], r.text
    r = httpx.post(main_app.url("/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
