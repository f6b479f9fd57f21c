"""``benchmarks.burst`` against the fake API (no Ray, no model): what a round counts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from benchmarks.burst import Round, burst, first_model, fmt
from tests.fake_api import MODEL, Behaviour, FakeApi

ROOT = Path(__file__).resolve().parents[2]


def test_a_burst_counts_answers_attempts_and_refusals() -> None:
    with FakeApi() as api:
        r = Round("here", "warm", "health", 2)
        asyncio.run(burst(api.url, MODEL, 2, 0, r))  # a completion, then a streamed one
    assert (r.answered, r.refused, r.failed, r.attempts) == (2, {}, {}, 2)
    assert sorted(bool(b.get("stream")) for b in api.completions) == [False, True]
    with FakeApi(Behaviour(refuse=(429, "shed"))) as api:
        r = Round("here", "warm", "health", 1)
        asyncio.run(burst(api.url, MODEL, 1, 0, r))
    # the SDK tries three times (its two retries), each a 429 counted with its Retry-After
    assert (r.answered, r.refused, r.attempts, len(r.retry_after)) == (0, {"429": 1}, 3, 3)
    line = fmt(r)
    assert "answered 0/1" in line and "first tries refused: 3" in line
    assert Path(r.code).name in line


def test_the_first_model_is_read_from_either_config_shape() -> None:
    # One engine (with and without a served name) and a models list (the multi-model config).
    assert first_model({"engine": {"model": "smollm2-135m-instruct"}}) == \
        "smollm2-135m-instruct"
    assert first_model({"served_model_name": "m", "engine": {"model": "x"}}) == "m"
    multi = yaml.safe_load((ROOT / "configs" / "cluster-multi.yaml").read_text())
    args = multi["applications"][0]["args"]
    assert first_model(args) == args["models"][0]["name"]
