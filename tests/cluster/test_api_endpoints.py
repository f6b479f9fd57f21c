"""The ingress's smaller endpoints (no Ray: the real ingress class over a stand-in engine,
``stub_ingress``): vLLM's ``/tokenize`` and ``/detokenize``, ``/version`` and one model's object
at ``/v1/models/{id}``; every bad input a clear error naming what was wrong."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.stub_ingress import StubIngress
from tierserve import __version__


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
    """The work goes through ``Tokenizing.run`` with the input's size (past ``OFF_LOOP_CHARS``
    it runs on the pool), and the same ids come back."""
    sizes: list[int] = []
    run = stub.inst.tokenizing.run

    async def counted(size: int, fn: Any) -> Any:
        sizes.append(size)
        return await run(size, fn)

    monkeypatch.setattr(stub.inst.tokenizing, "run", counted)
    text = "word " * 1000
    answer = stub.post("/tokenize", {"model": stub.model, "prompt": text})
    assert answer.status == 200, answer.body
    assert answer.body["tokens"] == list(stub.inst.tokenizer.encode(text))
    assert sizes == [len(text)]
    answer = stub.post("/detokenize", {"model": stub.model, "tokens": answer.body["tokens"]})
    assert answer.status == 200 and sizes[-1] == len(stub.inst.tokenizer.encode(text))
    stub.post("/tokenize", {"model": stub.model, "messages": [{"role": "user", "content": text}]})
    assert sizes[-1] == len(text)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": None, "prompt": "x"}, "model"),
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
