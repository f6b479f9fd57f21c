"""Two models in one application, on a live cluster: two configurations of the embedded
``tierserve-tiny`` (``tiny-a`` on ``LLMServer``, ``tiny-b`` on ``LLMServer-tiny-b``), one CPU
replica each, behind one ingress. A burst of mixed completions and chat requests to both at once:
every answer names its model, and came from that model's deployment (the replica that served a
prompt holds its blocks in its prefix cache: the same prompt sent again to its model finds them
cached, sent to the other model finds none). ``/v1/models`` lists both, ``/ready`` names both,
an unknown model is a 404, and no KV block is left held. ``tiny-b`` takes LoRA adapters (PEFT
adapters made by ``peft`` for ``tierserve-tiny``'s shapes, ``tests/replica/lora_helpers.py``): its
static adapter answers as itself, and an admin key loads, uses and unloads another through the
HTTP routes (the application's adapter store actor and the replica's methods, live). Then both
models and three adapters (more than ``max_cpu_loras``: 2) take bursts at once, and each answer
is its own model's or adapter's (both models run in the deterministic mode, so an answer in a
burst is bit for bit the answer alone), and each adapter's answer alone is the offline ``LLM``'s
under that adapter, computed in the test process.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
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


def tiny_adapters(root: Path) -> dict[str, Path]:
    """Three PEFT adapters for ``tierserve-tiny``'s shapes (a random Llama of its config: only
    the shapes matter; seeds 1, 2, 3) and a folder that is not one."""
    import transformers

    from tests.replica.lora_helpers import make_adapter
    from tierserve.replica.models.embedded_spec import embedded_config

    c = embedded_config()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size,
        tie_word_embeddings=True))
    targets = ["q_proj", "v_proj", "down_proj"]
    out = {name: make_adapter(hf, root / name, seed=i + 1, r=4, lora_alpha=8,
                              target_modules=targets)
           for i, name in enumerate(("b-sql", "b-chat", "b-sum"))}
    (root / "empty").mkdir()
    out["empty"] = root / "empty"
    return out


def multi_config(adapters: dict[str, Path] | None = None) -> dict[str, Any]:
    """configs/cluster.yaml's application with two models instead of one: the second's
    deployment a copy of ``LLMServer``'s, renamed; with ``adapters``, the second takes LoRA
    adapters (``b-sql`` static), the interactive key is an admin's."""
    app = copy.deepcopy(cluster_yaml()["applications"][0])
    app["name"], app["route_prefix"] = "multi", "/multi"
    del app["args"]["engine"]
    app["args"]["models"] = [{"name": A, "engine": ENGINE},
                             {"name": B, "engine": {**ENGINE, "max_num_seqs": 4}}]
    app["args"]["flow"]["starting_per_replica"] = 4
    for tier in app["args"]["tiers"]:
        tier["api_keys"] = [f"env:{KEY_VARS[tier['name']]}"]
    app["args"]["anonymous_tier"] = "batch"
    if adapters is not None:
        app["args"]["models"][1]["engine"].update(
            enable_lora=True, max_loras=2, max_cpu_loras=2,
            lora_modules=[{"name": "b-sql", "path": str(adapters["b-sql"])}])
        app["args"]["admin_keys"] = [f"env:{KEY_VARS['interactive']}"]
        app["args"]["lora_path_roots"] = [str(adapters["b-sql"].parent)]
    llm = next(d for d in app["deployments"] if d["name"] == "LLMServer")
    llm["num_replicas"] = 1
    app["deployments"].append({**copy.deepcopy(llm), "name": f"LLMServer-{B}"})
    return app


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tiny_adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def multi_app(local_serve: LocalServe, adapters: dict[str, Path]) -> Iterator[ServeApp]:
    with local_serve.app("multi", multi_config(adapters)) as app:
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
    assert [m["id"] for m in listed.json()["data"]] == [A, B, "b-sql"]
    ready = httpx.get(multi_app.url("/ready"), timeout=30)
    assert ready.status_code == 200, ready.text
    assert set(ready.json()["models"]) == {A, B}
    assert all(s["ready"] for s in ready.json()["models"].values())
    r = httpx.post(multi_app.url("/v1/completions"), timeout=30,
                   json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_adapters_are_served_loaded_and_unloaded_over_http(
        multi_app: ServeApp, adapters: dict[str, Path]) -> None:
    admin = {"Authorization": f"Bearer {KEYS['interactive']}"}
    key = {"Authorization": f"Bearer {KEYS['standard']}"}

    def post(path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
        return httpx.post(multi_app.url(path), json=body, headers=headers, timeout=120)

    def complete(model: str) -> httpx.Response:
        return post("/v1/completions", {"model": model, "prompt": PROMPTS[B][0],
                                        "max_tokens": 4, "temperature": 0}, key)

    r = complete("b-sql")  # the static adapter, on tiny-b's replica
    assert r.status_code == 200 and r.json()["model"] == "b-sql", r.text
    body = {"lora_name": "b-chat", "lora_path": str(adapters["b-chat"])}
    refused = post("/v1/load_lora_adapter", body, key)
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "permission_denied"
    assert complete("b-chat").status_code == 404  # not loaded yet
    loaded = post("/v1/load_lora_adapter", body, admin)
    assert loaded.status_code == 200 and loaded.json()["status"] == "loaded", loaded.text
    bad = post("/v1/load_lora_adapter", {"lora_name": "b-bad",
                                          "lora_path": str(adapters["empty"])}, admin)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora_adapter"
    r = complete("b-chat")
    assert r.status_code == 200 and r.json()["model"] == "b-chat", r.text
    cards = {m["id"]: m for m in httpx.get(multi_app.url("/v1/models"), headers=key,
                                           timeout=30).json()["data"]}
    assert cards["b-chat"]["parent"] == B and "b-bad" not in cards
    gone = post("/v1/unload_lora_adapter", {"lora_name": "b-chat"}, admin)
    assert gone.status_code == 200 and gone.json()["status"] == "unloaded", gone.text
    assert complete("b-chat").status_code == 404


def offline_answers(adapters: dict[str, Path], prompts: list[str], max_tokens: int
                    ) -> dict[tuple[str, str], list[int]]:
    """What ``tiny-b``'s engine answers, offline in this process, to each prompt under each
    adapter and the base (``B``): ``LLM`` with tiny-b's engine settings, greedy, each prompt's
    ids made as ``/v1/completions`` makes them (the served tokenizer, special tokens added, no
    template)."""
    from tierserve import LLM, LoRARequest, SamplingParams
    from tierserve.replica.models.meta import load_tokenizer

    tok = load_tokenizer(MODEL, False)
    ids = [{"prompt_token_ids": list(tok.encode(p, add_special_tokens=True))} for p in prompts]
    llm = LLM(**{**ENGINE, "max_num_seqs": 4, "enable_lora": True, "max_loras": 2,
                 "max_cpu_loras": 2})
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    out: dict[tuple[str, str], list[int]] = {}
    for i, target in enumerate((B, "b-sql", "b-chat", "b-sum")):
        lora = None if target == B else LoRARequest(target, i, str(adapters[target]))
        for p, o in zip(prompts, llm.generate(ids, params, use_tqdm=False, lora_request=lora),
                        strict=True):
            out[(target, p)] = list(o.outputs[0].token_ids)
    return out


def test_two_models_and_three_adapters_under_load_each_answer_as_itself(
        multi_app: ServeApp, adapters: dict[str, Path]) -> None:
    """Both models and three adapters (``b-sql`` static, ``b-chat`` and ``b-sum`` loaded over
    HTTP; more than ``max_cpu_loras``, 2, so an adapter's request meets a cache full of
    adapters in use, and waits) at once, three rounds of a burst: every request is answered,
    and each answer is, token for token, what its own model or adapter answers to that prompt
    alone (both engines are deterministic, so a batch changes no bit). Alone, each adapter's
    answers and the base's are the offline engine's in this process (so no adapter ran under
    another's weights, which answers measured only through the cluster could not show), and
    they differ between the adapters and from the base somewhere (each was applied)."""
    admin = {"Authorization": f"Bearer {KEYS['interactive']}"}
    key = {"Authorization": f"Bearer {KEYS['standard']}"}
    for name in ("b-chat", "b-sum"):
        body = {"lora_name": name, "lora_path": str(adapters[name])}
        loaded = httpx.post(multi_app.url("/v1/load_lora_adapter"), json=body, headers=admin,
                            timeout=120)
        assert loaded.status_code == 200, loaded.text
    adapter_names = ("b-sql", "b-chat", "b-sum")
    targets = (A, B, *adapter_names)
    prompts = {t: PROMPTS[A if t == A else B][:3] for t in targets}
    max_tokens = 8

    def body_of(target: str, prompt: str) -> dict[str, Any]:
        return {"model": target, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}

    async def burst() -> list[tuple[str, str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=multi_app.base_url, timeout=180,
                                     limits=httpx.Limits(max_connections=None)) as client:
            sends = [(t, p) for _ in range(3) for t in targets for p in prompts[t]]
            answers = await asyncio.gather(*(
                client.post("/v1/completions", json=body_of(t, p), headers=key)
                for t, p in sends))
            return [(t, p, r) for (t, p), r in zip(sends, answers, strict=True)]

    answers = asyncio.run(burst())
    alone: dict[tuple[str, str], str] = {}
    alone_ids: dict[tuple[str, str], list[int]] = {}
    for t in targets:
        for p in prompts[t]:
            # Its tokens' ids too (logprobs' tokens as ids), for the offline comparison.
            r = httpx.post(multi_app.url("/v1/completions"), headers=key, timeout=120, json={
                **body_of(t, p), "logprobs": 1, "return_tokens_as_token_ids": True})
            assert r.status_code == 200 and r.json()["model"] == t, r.text
            choice = r.json()["choices"][0]
            alone[(t, p)] = choice["text"]
            alone_ids[(t, p)] = [int(s.removeprefix("token_id:"))
                                 for s in choice["logprobs"]["tokens"]]
    assert len(answers) == 45
    for t, p, r in answers:
        assert r.status_code == 200, r.text
        assert r.json()["model"] == t
        assert r.json()["choices"][0]["text"] == alone[(t, p)], (t, p)
    offline = offline_answers(adapters, prompts[B], max_tokens)
    for t in (B, *adapter_names):
        for p in prompts[B]:
            assert alone_ids[(t, p)] == offline[(t, p)], (t, p)
    for i, adapter in enumerate(adapter_names):
        assert any(alone[(adapter, p)] != alone[(B, p)] for p in prompts[B]), adapter
        for other in adapter_names[i + 1:]:
            assert any(alone[(adapter, p)] != alone[(other, p)] for p in prompts[B]), (
                adapter, other)


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
