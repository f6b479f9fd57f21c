"""The ingress's smaller endpoints (no Ray: the real ingress class over a stand-in engine,
``stub_ingress``): vLLM's ``/tokenize`` and ``/detokenize``, ``/version`` and one model's object
at ``/v1/models/{id}``; every bad input a clear error naming what was wrong."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.stub_ingress import StubIngress
from tierserve import __version__
from tierserve.cluster import ingress


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress()


def error(answer: Any, status: int) -> dict[str, Any]:
    assert answer.status == status, answer.body
    out: dict[str, Any] = answer.body["error"]
    return out


def test_tokenize_a_prompt_as_the_completions_route_does(stub: StubIngress) -> None:
    tok = stub.inst.tokenizer
    answer = stub.post("/tokenize", {"model": stub.model, "prompt": "Hello there"})
    assert answer.status == 200, answer.body
    ids = list(tok.encode("Hello there", add_special_tokens=True))
    assert answer.body["tokens"] == ids and answer.body["count"] == len(ids)
    assert answer.body["max_model_len"] == stub.inst.prompt_bound.context
    assert answer.body.get("token_strs") is None
    # What /v1/completions would send for the same prompt.
    assert stub.post("/v1/completions", {"model": stub.model, "prompt": "Hello there",
                                         "max_tokens": 1}).status == 200
    assert list(stub.sent[-1].prompt_ids) == ids


def test_tokenize_without_special_tokens_and_with_token_strings(stub: StubIngress) -> None:
    tok = stub.inst.tokenizer
    answer = stub.post("/tokenize", {"model": stub.model, "prompt": "Hello there",
                                     "add_special_tokens": False, "return_token_strs": True})
    assert answer.status == 200, answer.body
    ids = list(tok.encode("Hello there", add_special_tokens=False))
    assert answer.body["tokens"] == ids
    assert answer.body["token_strs"] == tok.convert_ids_to_tokens(ids)


def test_tokenize_messages_as_the_chat_route_renders_them(stub: StubIngress) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    answer = stub.post("/tokenize", {"model": stub.model, "messages": messages})
    assert answer.status == 200, answer.body
    assert stub.post("/v1/chat/completions", {"model": stub.model, "messages": messages,
                                              "max_tokens": 1}).status == 200
    assert answer.body["tokens"] == list(stub.sent[-1].prompt_ids)
    bare = stub.post("/tokenize", {"model": stub.model, "messages": messages,
                                   "add_generation_prompt": False})
    assert bare.status == 200 and bare.body["count"] < answer.body["count"]


def test_a_large_prompt_is_tokenized_through_the_pool(stub: StubIngress,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The work goes through ``Tokenizing.run`` of the routes' own pool (``utility_tokenizing``,
    not the generation routes' ``tokenizing``) with the input's size (past ``OFF_LOOP_CHARS``
    it runs on the pool), and the same ids come back."""
    sizes: list[int] = []
    run = stub.inst.utility_tokenizing.run

    async def counted(size: int, fn: Any) -> Any:
        sizes.append(size)
        return await run(size, fn)

    async def generation_pool(size: int, fn: Any) -> Any:
        raise AssertionError("/tokenize's work queued on the generation routes' pool")

    monkeypatch.setattr(stub.inst.utility_tokenizing, "run", counted)
    monkeypatch.setattr(stub.inst.tokenizing, "run", generation_pool)
    text = "word " * 1000
    answer = stub.post("/tokenize", {"model": stub.model, "prompt": text})
    assert answer.status == 200, answer.body
    ids = list(stub.inst.tokenizer.encode(text))
    assert answer.body["tokens"] == ids
    assert sizes == [len(text)]
    answer = stub.post("/detokenize", {"model": stub.model, "tokens": answer.body["tokens"]})
    assert answer.status == 200 and sizes[-1] == len(ids)
    answer = stub.post("/tokenize", {"model": stub.model,
                                     "messages": [{"role": "user", "content": text}]})
    assert answer.status == 200, answer.body
    assert sizes[-2:] == [len(text), answer.body["count"]]  # the render, then the answer


def test_token_strings_and_the_answer_are_made_in_the_pools_job(
        stub: StubIngress, monkeypatch: pytest.MonkeyPatch) -> None:
    """``return_token_strs``'s names and the answer's JSON are made inside the job
    ``Tokenizing.run`` is given (on the pool for a large input), not on the event loop."""
    inside = False
    run = stub.inst.utility_tokenizing.run
    names = stub.inst.tokenizer.convert_ids_to_tokens
    calls: list[bool] = []

    async def marked(size: int, fn: Any) -> Any:
        def job() -> Any:
            nonlocal inside
            inside = True
            try:
                return fn()
            finally:
                inside = False
        return await run(size, job)

    def named(ids: Any) -> Any:
        calls.append(inside)
        return names(ids)

    monkeypatch.setattr(stub.inst.utility_tokenizing, "run", marked)
    monkeypatch.setattr(stub.inst.tokenizer, "convert_ids_to_tokens", named)
    monkeypatch.setattr(ingress, "_json_bytes", _only_inside(lambda: inside, ingress._json_bytes))
    for body in ({"prompt": "word " * 1000, "return_token_strs": True},
                 {"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}):
        answer = stub.post("/tokenize", body)
        assert answer.status == 200 and answer.body["token_strs"], answer.body
    assert stub.post("/detokenize", {"tokens": [1, 2, 3]}).status == 200
    assert calls == [True, True]


def _only_inside(inside: Any, fn: Any) -> Any:
    def checked(content: Any) -> Any:
        assert inside(), "the answer's JSON was made outside the pool's job"
        return fn(content)
    return checked


def test_tokenize_is_admitted_against_the_tier_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both routes count in flight as a generation request does: past the tier's share of
    ``max_inflight_requests``, a 429 at once; a request answered (or refused) is released."""
    small = StubIngress({"max_inflight_requests": 4})
    # What the deployment sets at its start (the stub's instance sets it on another copy of app).
    monkeypatch.setattr(ingress.app.state, "retry_after", 1, raising=False)
    body = {"prompt": "Hello"}
    assert small.post("/tokenize", body).status == 200
    assert small.post("/tokenize", {"prompt": 3}).status == 400
    assert small.post("/detokenize", {"tokens": [1]}).status == 200
    assert small.inst.inflight == 0
    small.inst.inflight = 4
    for route, b in (("/tokenize", body), ("/detokenize", {"tokens": [1]}),
                     ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})):
        e = error(small.post(route, b), 429)
        assert e["code"] in ("queue_full", "shed") and "in flight" in e["message"]
    assert small.inst.inflight == 4


@pytest.mark.parametrize(("body", "param"), [
    ({"model": 3, "prompt": "x"}, "model"),
    ({"model": None, "prompt": 3}, None),
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, None),
])
def test_bad_tokenize_requests_are_a_400(stub: StubIngress, body: dict[str, Any],
                                         param: str | None) -> None:
    body = {"model": stub.model, **body}
    if body["model"] is None:
        del body["model"]
    e = error(stub.post("/tokenize", body), 400)
    assert e["message"]
    if param is not None:
        assert e["param"] == param, e


def test_model_is_optional_on_tokenize_and_detokenize(stub: StubIngress) -> None:
    """vLLM's shape: left out or null, ``model`` is the served model."""
    want = list(stub.inst.tokenizer.encode("Hello"))
    for extra in ({}, {"model": None}):
        answer = stub.post("/tokenize", {"prompt": "Hello", **extra})
        assert answer.status == 200 and answer.body["tokens"] == want, answer.body
        answer = stub.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                         **extra})
        assert answer.status == 200, answer.body
        answer = stub.post("/detokenize", {"tokens": want, **extra})
        assert answer.status == 200 and answer.body == {"prompt": "Hello"}, answer.body
    e = error(stub.post("/detokenize", {"model": "other", "tokens": want}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"


def test_tokenize_is_bounded_by_max_tokenize_chars() -> None:
    small = StubIngress({"max_tokenize_chars": 100})
    assert small.post("/tokenize", {"prompt": "x" * 100}).status == 200
    e = error(small.post("/tokenize", {"prompt": "x" * 101}), 400)
    assert e["code"] == "too_long" and e["param"] == "prompt" and "101" in e["message"]
    messages = [{"role": "user", "content": "x" * 60},
                {"role": "user", "content": [{"type": "text", "text": "y" * 41}]}]
    e = error(small.post("/tokenize", {"messages": messages}), 400)
    assert e["code"] == "too_long" and e["param"] == "messages"
    assert small.post("/tokenize", {"messages": messages[:1]}).status == 200


def test_tokenize_is_behind_the_body_limit() -> None:
    small = StubIngress({"max_request_bytes": 1024})
    e = error(small.post("/tokenize", {"model": small.model, "prompt": "x" * 2000}), 413)
    assert e["code"] == "too_large"
    e = error(small.post("/detokenize", {"model": small.model, "tokens": [1] * 1000}), 413)
    assert e["code"] == "too_large"


def test_tokenize_is_behind_the_key_check() -> None:
    keyed = StubIngress({"tiers": [{"name": "paid", "base_priority": 0, "max_priority": 4,
                                    "api_keys": ["sk-1"]}], "anonymous_tier": None})
    body = {"model": keyed.model, "prompt": "x"}
    assert error(keyed.post("/tokenize", body), 401)["code"] == "invalid_api_key"
    assert error(keyed.post("/detokenize", {"model": keyed.model, "tokens": [1]}),
                 401)["code"] == "invalid_api_key"
    ok = keyed.post("/tokenize", body, {"Authorization": "Bearer sk-1"})
    assert ok.status == 200, ok.body


def test_detokenize_is_the_inverse_of_tokenize(stub: StubIngress) -> None:
    ids = stub.post("/tokenize", {"model": stub.model, "prompt": "Hello there",
                                  "add_special_tokens": False}).body["tokens"]
    answer = stub.post("/detokenize", {"model": stub.model, "tokens": ids})
    assert answer.status == 200, answer.body
    assert answer.body == {"prompt": "Hello there"}
    assert stub.post("/detokenize", {"model": stub.model, "tokens": []}).body == {"prompt": ""}


@pytest.mark.parametrize(("tokens", "param"), [
    ("1 2", "tokens"),
    ([1, -1], "tokens.1"),
    ([1, 2.5], "tokens.1"),
    ([1, True], "tokens.1"),
])
def test_bad_detokenize_requests_are_a_400(stub: StubIngress, tokens: Any, param: str) -> None:
    e = error(stub.post("/detokenize", {"model": stub.model, "tokens": tokens}), 400)
    assert e["param"] == param, e


def test_detokenize_refuses_ids_outside_the_vocabulary(stub: StubIngress) -> None:
    size = stub.inst.tokenizer_size
    e = error(stub.post("/detokenize", {"model": stub.model, "tokens": [1, size]}), 400)
    assert e["code"] == "invalid_token" and e["param"] == "tokens.1"
    assert str(size) in e["message"]
    e = error(stub.post("/detokenize", {"model": "other", "tokens": [1]}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    e = error(stub.post("/tokenize", {"model": "other", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"


def test_version(stub: StubIngress) -> None:
    answer = stub.get("/version")
    assert answer.status == 200 and answer.body == {"version": __version__}


def test_one_model_and_an_unknown_one(stub: StubIngress) -> None:
    answer = stub.get(f"/v1/models/{stub.model}")
    assert answer.status == 200, answer.body
    assert answer.body["id"] == stub.model and answer.body["object"] == "model"
    e = error(stub.get("/v1/models/no-such-model"), 404)
    assert e["code"] == "model_not_found" and e["type"] == "not_found_error"
    assert "no-such-model" in e["message"]


def test_the_new_routes_are_in_the_openapi_document(stub: StubIngress) -> None:
    paths = stub.inst.openapi_doc["paths"]
    for path, method in [("/tokenize", "post"), ("/detokenize", "post"), ("/version", "get"),
                         ("/v1/models/{model_id}", "get")]:
        assert method in paths[path], path
    tok = paths["/tokenize"]["post"]
    assert "requestBody" in tok and "400" in tok["responses"] and "413" in tok["responses"]
    assert "404" in paths["/v1/models/{model_id}"]["get"]["responses"]
