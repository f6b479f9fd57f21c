"""Two models in one application, on a live cluster: two configurations of the embedded
``tierserve-tiny`` (``tiny-a`` on ``LLMServer``, ``tiny-b`` on ``LLMServer-tiny-b``), one CPU
replica each, behind one ingress. A burst of mixed completions and chat requests to both at once:
every answer names its model, and came from that model's deployment (the replica that served a
prompt holds its blocks in its prefix cache: the same prompt sent again to its model finds them
cached, sent to the other model finds none). ``/v1/models`` lists both, ``/ready`` names both,
an unknown model is a 404, and no KV block is left held.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.helpers import KEY_VARS, KEYS, MODEL, LocalServe, ServeApp, cluster_yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]

A, B = "tiny-a", "tiny-b"
ENGINE = {"model": MODEL, "num_kv_blocks": 64, "kv_cache_memory_bytes": None, "max_num_seqs": 8,
          "max_waiting": 64, "deterministic": True, "device": "cpu"}
# Prompts of three full blocks (the tiny tokenizer: a token a byte), distinct per model.
PROMPTS = {m: [f"{m} prompt {i}: " + "lorem ipsum dolor sit amet " * 2 for i in range(4)]
           for m in (A, B)}


def multi_config() -> dict[str, Any]:
    """configs/cluster.yaml's application with two models instead of one: the second's
    deployment a copy of ``LLMServer``'s, renamed."""
    app = copy.deepcopy(cluster_yaml()["applications"][0])
    app["name"], app["route_prefix"] = "multi", "/multi"
    del app["args"]["engine"]
    app["args"]["models"] = [{"name": A, "engine": ENGINE},
                             {"name": B, "engine": {**ENGINE, "max_num_seqs": 4}}]
    app["args"]["flow"]["starting_per_replica"] = 4
    for tier in app["args"]["tiers"]:
        tier["api_keys"] = [f"env:{KEY_VARS[tier['name']]}"]
    app["args"]["anonymous_tier"] = "batch"
    llm = next(d for d in app["deployments"] if d["name"] == "LLMServer")
    llm["num_replicas"] = 1
    app["deployments"].append({**copy.deepcopy(llm), "name": f"LLMServer-{B}"})
    return app


@pytest.fixture(scope="module")
def multi_app(local_serve: LocalServe) -> Iterator[ServeApp]:
    with local_serve.app("multi", multi_config()) as app:
        yield app


def request(model: str, prompt: str, chat: bool) -> tuple[str, dict[str, Any]]:
    if chat:
        return "/v1/chat/completions", {"model": model, "max_tokens": 4, "temperature": 0,
                                        "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4,
                               "temperature": 0}


def cached(answer: httpx.Response) -> int:
    assert answer.status_code == 200, answer.text
    details = answer.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_a_burst_to_both_models_is_answered_by_each_model_s_deployment(
        multi_app: ServeApp) -> None:
    key = {"Authorization": f"Bearer {KEYS['standard']}"}

    async def burst() -> list[tuple[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=multi_app.base_url, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as client:
            # A, B, A, B, ...: each model's prompts 0 and 2 as completions, 1 and 3 as chats.
            mixed = [(m, i, p) for i, ps in enumerate(zip(PROMPTS[A], PROMPTS[B], strict=True))
                     for m, p in zip((A, B), ps, strict=True)]
            sends = [(m, request(m, p, chat=i % 2 == 1)) for m, i, p in mixed]
            answers = await asyncio.gather(*(client.post(path, json=body, headers=key)
                                             for _, (path, body) in sends))
            return [(m, r) for (m, _), r in zip(sends, answers, strict=True)]

    answers = asyncio.run(burst())
    assert {m for m, _ in answers} == {A, B} and len(answers) == 8
    for model, r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["usage"]["completion_tokens"] >= 1
    # Came from its model's deployment: that replica alone holds the prompt's blocks.
    for model, other in ((A, B), (B, A)):
        path, body = request(model, PROMPTS[model][0], chat=False)
        assert cached(httpx.post(multi_app.url(path), json=body, headers=key)) >= 16
        path, body = request(other, PROMPTS[model][0], chat=False)
        assert cached(httpx.post(multi_app.url(path), json=body, headers=key)) == 0


def test_models_ready_and_an_unknown_model(multi_app: ServeApp) -> None:
    listed = httpx.get(multi_app.url("/v1/models"), timeout=30)
    assert [m["id"] for m in listed.json()["data"]] == [A, B]
    ready = httpx.get(multi_app.url("/ready"), timeout=30)
    assert ready.status_code == 200, ready.text
    assert set(ready.json()["models"]) == {A, B}
    assert all(s["ready"] for s in ready.json()["models"].values())
    r = httpx.post(multi_app.url("/v1/completions"), timeout=30,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_no_block_is_left_held(multi_app: ServeApp) -> None:
    """Every replica of both deployments idle, its blocks free (cached ones count as free)."""
    import ray

    prefix = f"SERVE_REPLICA::{multi_app.name}#LLMServer"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(prefix)]
    assert len(names) == 2, names  # LLMServer and LLMServer-tiny-b, one replica each

    def idle() -> bool:
        for name in names:
            s = ray.get(ray.get_actor(name, namespace="serve").record_routing_stats.remote(),
                        timeout=30)
            if s["waiting"] or s["running"] or s["free_blocks"] != s["total_blocks"]:
                return False
        return True

    from tests.cluster.helpers import wait_for

    wait_for("both deployments idle with all blocks free", idle, timeout_s=120, every_s=0.5)
