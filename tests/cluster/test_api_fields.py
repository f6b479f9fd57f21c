"""The fields OpenAI's API and vLLM's server define, as the ingress takes them (no Ray: the real
ingress class over a stand-in engine, ``stub_ingress``): each accepted, honoured where it means
something here (what reaches the replica, what the answer says), refused with a 400 naming it
where it cannot be honoured yet; a field neither defines keeps its 400."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.stub_ingress import ANSWER, StubIngress

COMP = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress()


def comp(stub: StubIngress, **kw: Any) -> dict[str, Any]:
    return {"model": stub.model, "prompt": "Hello there", "max_tokens": 4, **kw}


def chat(stub: StubIngress, **kw: Any) -> dict[str, Any]:
    return {"model": stub.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, **kw}


def sent(stub: StubIngress, route: str, body: dict[str, Any], **headers: str) -> Any:
    """The request the replica got for ``body`` (the answer must be a 200)."""
    answer = stub.post(route, body, headers)
    assert answer.status == 200, answer.body
    return stub.sent[-1]


def refused(stub: StubIngress, route: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    answer = stub.post(route, body, headers)
    assert answer.status == 400, answer.body
    error: dict[str, Any] = answer.body["error"]
    return error


# ------------------------------------------------------------------ accepted, with no effect

@pytest.mark.parametrize("route", [COMP, CHAT])
@pytest.mark.parametrize("extra", [
    {"spaces_between_special_tokens": False},
    {"use_beam_search": False, "length_penalty": 1.5},
    {"guided_decoding_backend": "xgrammar"},
    {"metadata": {"team": "search", "run": "7"}},
    {"store": False},
    {"user": "u1", "safety_identifier": "hashed-user", "prompt_cache_key": "k1"},
    {"request_id": "abc-123"},
    {"cache_salt": "s" * 43},
    {"bad_words": ["never"], "allowed_token_ids": [1, 2, 3]},
])
def test_every_vllm_and_openai_field_is_accepted(stub: StubIngress, route: str,
                                                 extra: dict[str, Any]) -> None:
    body = (comp if route == COMP else chat)(stub, **extra)
    answer = stub.post(route, body)
    assert answer.status == 200, answer.body


def test_chat_only_fields_are_accepted(stub: StubIngress) -> None:
    body = chat(stub, include_reasoning=False, verbosity="low", echo=False,
                add_generation_prompt=True, documents=[{"title": "t", "text": "x"}])
    assert stub.post(CHAT, body).status == 200


# ------------------------------------------------------------------ honoured

@pytest.mark.parametrize("route", [COMP, CHAT])
def test_detokenizing_fields_reach_the_replica(stub: StubIngress, route: str) -> None:
    make = comp if route == COMP else chat
    plain = sent(stub, route, make(stub)).sampling
    assert plain.skip_special_tokens and not plain.include_stop_str_in_output
    asked = sent(stub, route, make(stub, skip_special_tokens=False, stop=["."],
                                   include_stop_str_in_output=True)).sampling
    assert not asked.skip_special_tokens and asked.include_stop_str_in_output


def test_add_special_tokens_in_completions(stub: StubIngress) -> None:
    tok = stub.inst.tokenizer
    with_special = sent(stub, COMP, comp(stub)).prompt_ids
    without = sent(stub, COMP, comp(stub, add_special_tokens=False)).prompt_ids
    assert list(without) == list(tok.encode("Hello there", add_special_tokens=False))
    assert list(with_special) == list(tok.encode("Hello there", add_special_tokens=True))


def test_truncate_prompt_tokens_keeps_the_last_tokens(stub: StubIngress) -> None:
    whole = sent(stub, COMP, comp(stub, prompt="one two three four five six")).prompt_ids
    cut = sent(stub, COMP, comp(stub, prompt="one two three four five six",
                                truncate_prompt_tokens=3)).prompt_ids
    assert len(whole) > 3 and cut == whole[-3:]
    ids = sent(stub, COMP, comp(stub, prompt=[5, 6, 7, 8], truncate_prompt_tokens=2)).prompt_ids
    assert ids == (7, 8)
    chat_ids = sent(stub, CHAT, chat(stub)).prompt_ids
    assert sent(stub, CHAT, chat(stub, truncate_prompt_tokens=2)).prompt_ids == chat_ids[-2:]


def test_chat_rendering_fields(stub: StubIngress) -> None:
    tok = stub.inst.tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, the"}]
    base = sent(stub, CHAT, chat(stub)).prompt_ids
    bare = sent(stub, CHAT, chat(stub, add_generation_prompt=False)).prompt_ids
    assert len(bare) < len(base) and base[:len(bare)] == bare
    cont = sent(stub, CHAT, chat(stub, messages=messages, add_generation_prompt=False,
                                 continue_final_message=True)).prompt_ids
    assert tok.decode(list(cont)).endswith("Sure, the")
    # A template variable reaches the template (SmolLM2's reads none: the prompt is the same).
    assert sent(stub, CHAT, chat(stub, chat_template_kwargs={"enable_thinking": False})
                ).prompt_ids == base


def test_chat_add_special_tokens_adds_the_tokenizers_own(stub: StubIngress) -> None:
    tok = stub.inst.tokenizer
    base = sent(stub, CHAT, chat(stub)).prompt_ids
    more = sent(stub, CHAT, chat(stub, add_special_tokens=True)).prompt_ids
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert list(more) == list(tok.encode(text, add_special_tokens=True))
    assert len(more) >= len(base)


@pytest.mark.parametrize("route", [COMP, CHAT])
def test_prompt_logprobs_come_back_in_vllm_s_shape(stub: StubIngress, route: str) -> None:
    make = comp if route == COMP else chat
    answer = stub.post(route, make(stub, prompt_logprobs=1))
    assert answer.status == 200, answer.body
    request = stub.sent[-1]
    assert request.sampling.prompt_logprobs == 1
    lps = (answer.body["choices"][0] if route == COMP else answer.body)["prompt_logprobs"]
    assert len(lps) == len(request.prompt_ids) and lps[0] is None
    second = str(request.prompt_ids[1])
    assert lps[1][second] == {"logprob": -1.0, "rank": 1,
                              "decoded_token": stub.inst.token_text.text(int(second))}
    # Not asked: not there.
    plain = stub.post(route, make(stub)).body
    assert "prompt_logprobs" not in (plain["choices"][0] if route == COMP else plain)


def test_a_prompt_token_outside_the_alternatives_keeps_its_rank() -> None:
    """The replica ranks every scored token in the whole distribution, so the prompt's token
    has its rank even when fewer alternatives were asked for than its place."""
    from tierserve.cluster.logprobs import TokenIdNames, prompt_logprobs
    from tierserve.records import TokenLogprob

    (first, entry) = prompt_logprobs([None, TokenLogprob(7, -4.0, ((3, -0.1),), rank=12)],
                                     TokenIdNames())
    assert first is None and entry is not None
    assert entry["7"].rank == 12 and entry["3"].rank == 1


def test_return_tokens_as_token_ids(stub: StubIngress) -> None:
    tok = stub.inst.tokenizer
    first = tok.encode(ANSWER, add_special_tokens=False)[0]
    body = stub.post(CHAT, chat(stub, logprobs=True, return_tokens_as_token_ids=True)).body
    entry = body["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == f"token_id:{first}"
    assert entry["bytes"] == list(f"token_id:{first}".encode())
    body = stub.post(COMP, comp(stub, logprobs=1, return_tokens_as_token_ids=True)).body
    assert body["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{first}"


def test_request_id_names_the_answer(stub: StubIngress) -> None:
    assert stub.post(COMP, comp(stub, request_id="job-7")).body["id"] == "cmpl-job-7"
    assert stub.post(CHAT, chat(stub, request_id="job-8")).body["id"] == "chatcmpl-job-8"


def test_priority_on_vllms_scale_within_the_tier(stub: StubIngress) -> None:
    # vLLM's priority: lower first, 0 the default. The anonymous caller's tier (default config:
    # "standard", 5 to 9) at its own priority; the field moves it within that range, no further.
    caller = stub.inst.tiers.resolve(None, None)
    tier, own = caller.tier, caller.priority
    assert tier.base_priority < own or own < tier.max_priority  # room to move one way at least
    assert sent(stub, COMP, comp(stub, priority=0)).priority == own
    assert sent(stub, CHAT, chat(stub, priority=-1)).priority == min(own + 1, tier.max_priority)
    assert sent(stub, COMP, comp(stub, priority=1)).priority == max(own - 1, tier.base_priority)
    # Never above what the key allows, nor below the tier's base.
    assert sent(stub, COMP, comp(stub, priority=-10**6)).priority == tier.max_priority
    assert sent(stub, CHAT, chat(stub, priority=10**6)).priority == tier.base_priority
    # With X-TL-Priority (this server's absolute scale), the field moves from the header's value.
    header = {"X-TL-Priority": str(tier.base_priority)}
    assert sent(stub, COMP, comp(stub, priority=-1), **header).priority == min(
        tier.base_priority + 1, tier.max_priority)
    assert sent(stub, COMP, comp(stub), **header).priority == tier.base_priority


# ------------------------------------------------------------------ refused

@pytest.mark.parametrize(("route", "extra", "param", "says"), [
    (COMP, {"use_beam_search": True}, "use_beam_search", "beam search is not supported yet"),
    (COMP, {"store": True}, "store", "stored completions are not supported yet"),
    (CHAT, {"store": True}, "store", "stored completions are not supported yet"),
    (COMP, {"logits_processors": ["x.y"]}, "logits_processors", "not supported"),
    (CHAT, {"structural_tag": "{}"}, "structural_tag", "not supported"),
    (COMP, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    (COMP, {"kv_transfer_params": {}}, "kv_transfer_params", "not supported"),
    (COMP, {"vllm_xargs": {"a": 1}}, "vllm_xargs", "not supported"),
    (COMP, {"prompt_embeds": "AAAA"}, "prompt_embeds", "not supported"),
    (CHAT, {"chat_template": "{{ messages }}"}, "chat_template", "not supported"),
    (CHAT, {"mm_processor_kwargs": {}}, "mm_processor_kwargs", "not supported"),
    (CHAT, {"echo": True}, "echo", "echo in a chat request is not supported yet"),
    (CHAT, {"continue_final_message": True}, None,
     "continue_final_message and add_generation_prompt cannot both be true"),
    (COMP, {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "greater than or equal to 1"),
    (COMP, {"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    (COMP, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "not supported with stream yet"),
    (COMP, {"request_id": "has space"}, "request_id", "should match pattern"),
    (COMP, {"request_id": ""}, "request_id", "should match pattern"),
    (COMP, {"metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
    (COMP, {"metadata": {"k": 1}}, "metadata.k", "valid string"),
    (CHAT, {"verbosity": "loud"}, "verbosity", "'low', 'medium' or 'high'"),
    (CHAT, {"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize",
     "an argument of the template's renderer"),
    (CHAT, {"chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt", "an argument of the template's renderer"),
    (COMP, {"skip_special_tokens": "no"}, "skip_special_tokens", "valid boolean"),
    (COMP, {"priority": "high"}, "priority", "valid integer"),
    (COMP, {"not_a_field": 1}, "not_a_field", "unknown field 'not_a_field'"),
    (CHAT, {"frobnicate": True}, "frobnicate", "unknown field 'frobnicate'"),
])
def test_bad_values_are_a_400_naming_the_field(stub: StubIngress, route: str,
                                               extra: dict[str, Any], param: str | None,
                                               says: str) -> None:
    body = (comp if route == COMP else chat)(stub, **extra)
    error = refused(stub, route, body)
    assert error["param"] == param and says in error["message"], error



# ------------------------------------------------------------------ service_tier

KEYED = {"tiers": [
    {"name": "interactive", "base_priority": 10, "max_priority": 15, "api_keys": ["k-int"]},
    {"name": "standard", "base_priority": 5, "max_priority": 9, "api_keys": ["k-std"]},
    {"name": "batch", "base_priority": 0, "max_priority": 4, "queue_share": 0.5,
     "api_keys": ["k-batch"]},
], "anonymous_tier": None}


@pytest.fixture(scope="module")
def keyed() -> StubIngress:
    return StubIngress(KEYED)


@pytest.mark.parametrize(("key", "asked", "tier", "priority", "named"), [
    ("k-int", "flex", "batch", 0, "flex"),
    ("k-std", "flex", "batch", 0, "flex"),
    ("k-batch", "flex", "batch", 0, "flex"),
    ("k-int", "priority", "interactive", 15, "priority"),
    ("k-std", "priority", "standard", 9, "priority"),  # never above the key's tier
    ("k-std", "fast", "standard", 9, "priority"),  # OpenAI's alias: answered as "priority"
    ("k-batch", "priority", "batch", 4, "priority"),
    ("k-std", "auto", "standard", 5, "default"),
    ("k-std", "default", "standard", 5, "default"),
    ("k-batch", "scale", "batch", 0, "default"),
])
def test_service_tier_maps_onto_the_tiers(keyed: StubIngress, key: str, asked: str, tier: str,
                                          priority: int, named: str) -> None:
    for route, make in ((COMP, comp), (CHAT, chat)):
        answer = keyed.post(route, make(keyed, service_tier=asked),
                            {"Authorization": f"Bearer {key}"})
        assert answer.status == 200, answer.body
        assert answer.body["service_tier"] == named
        request = keyed.sent[-1]
        assert (request.tier, request.priority) == (tier, priority)
        assert request.queue_share == {"batch": 0.5}.get(tier, 1.0)


def test_service_tier_in_every_chunk_of_a_stream(keyed: StubIngress) -> None:
    for route, make in ((COMP, comp), (CHAT, chat)):
        body = make(keyed, service_tier="flex", stream=True,
                    stream_options={"include_usage": True})
        answer = keyed.post(route, body, {"Authorization": "Bearer k-int"})
        assert answer.status == 200 and len(answer.body) >= 2
        assert all(event["service_tier"] == "flex" for event in answer.body)
    # Not asked: not named.
    plain = keyed.post(CHAT, chat(keyed, stream=True), {"Authorization": "Bearer k-int"})
    assert all("service_tier" not in event for event in plain.body)
    assert "service_tier" not in keyed.post(COMP, comp(keyed),
                                            {"Authorization": "Bearer k-int"}).body


@pytest.mark.parametrize(("extra", "headers"), [
    ({"service_tier": "flex", "priority": -1}, {}),
    ({"service_tier": "priority"}, {"X-TL-Priority": "12"}),
])
def test_service_tier_that_sets_the_priority_takes_no_other(
        keyed: StubIngress, extra: dict[str, Any], headers: dict[str, str]) -> None:
    answer = keyed.post(COMP, comp(keyed, **extra), {"Authorization": "Bearer k-int", **headers})
    assert answer.status == 400
    assert answer.body["error"]["param"] == "service_tier"
    assert "sets the priority itself" in answer.body["error"]["message"]


def test_an_unknown_service_tier_is_a_400(keyed: StubIngress) -> None:
    answer = keyed.post(CHAT, chat(keyed, service_tier="turbo"), {"Authorization": "Bearer k-int"})
    assert answer.status == 400 and answer.body["error"]["param"] == "service_tier"
    # "ultrafast" is the Responses API's alone (OpenAI's chat does not define it).
    answer = keyed.post(CHAT, chat(keyed, service_tier="ultrafast"),
                        {"Authorization": "Bearer k-int"})
    assert answer.status == 400 and answer.body["error"]["param"] == "service_tier"
    answer = keyed.post(CHAT, chat(keyed, service_tier="fast", priority=1),
                        {"Authorization": "Bearer k-int"})
    assert answer.status == 400 and "'fast' sets the priority itself" in answer.body["error"][
        "message"]
    # Still behind the key: no key, no request.
    assert keyed.post(CHAT, chat(keyed, service_tier="priority")).status == 401


# ------------------------------------------------------------------ batched prompts

@pytest.mark.parametrize("prompts", [["Hello there", "One two three"], [[5, 6, 7], [8, 9]]])
def test_a_list_of_prompts_answers_each_with_openai_s_indexes(stub: StubIngress,
                                                              prompts: list[Any]) -> None:
    before = len(stub.sent)
    answer = stub.post(COMP, comp(stub, prompt=prompts, n=2, echo=True))
    assert answer.status == 200, answer.body
    requests = stub.sent[before:]
    assert len(requests) == 2 and all(r.n == 2 for r in requests)
    choices = answer.body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c in choices:  # prompt j's samples at j * n + i, each after its own prompt's echo
        prompt = prompts[c["index"] // 2]
        text = prompt if isinstance(prompt, str) else stub.inst.tokenizer.decode(prompt)
        assert c["text"] == text + ANSWER
    u = answer.body["usage"]
    assert u["prompt_tokens"] == sum(len(r.prompt_ids) for r in requests)
    assert u["completion_tokens"] == 4 * len(stub.inst.tokenizer.encode(ANSWER))
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_a_list_of_prompts_streams_as_one_stream(stub: StubIngress) -> None:
    before = len(stub.sent)
    answer = stub.post(COMP, comp(stub, prompt=["a b", "c d e"], n=2, stream=True,
                                  stream_options={"include_usage": True}))
    assert answer.status == 200, answer.body
    requests = stub.sent[before:]
    events = answer.body
    assert len({e["id"] for e in events}) == 1
    texts: dict[int, str] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    assert sorted(texts) == [0, 1, 2, 3] and set(texts.values()) == {ANSWER}
    tail = events[-1]  # one usage chunk, the sum, last
    assert tail["choices"] == [] and tail["usage"]["prompt_tokens"] == sum(
        len(r.prompt_ids) for r in requests)
    assert sum(1 for e in events if e.get("usage")) == 1


@pytest.mark.parametrize(("prompt", "param", "says"), [
    (["a"] * 65, "prompt", "at most 64 prompts, got 65"),
    ([], "prompt", None),  # one empty prompt: the replica's "empty" (not checked here)
    (["a", 3], "prompt", "all strings or all lists of token ids"),
    ([[1, 2], "a"], "prompt", "all strings or all lists of token ids"),
    ([[1, "a"]], "prompt", None),
    ([[5, 6], []], None, None),
])
def test_bad_prompt_lists(stub: StubIngress, prompt: list[Any], param: str | None,
                          says: str | None) -> None:
    answer = stub.post(COMP, comp(stub, prompt=prompt))
    if prompt in ([], [[5, 6], []]):
        # An empty prompt is the replica's to refuse; the stand-in engine answers it.
        assert answer.status == 200
        return
    assert answer.status == 400, answer.body
    assert answer.body["error"]["param"] == param
    if says:
        assert says in answer.body["error"]["message"]


def test_a_bad_prompt_in_a_list_is_named_by_its_place(stub: StubIngress) -> None:
    special = sorted(stub.inst.special_ids)[0]
    answer = stub.post(COMP, comp(stub, prompt=[[5, 6], [special]]))
    assert answer.status == 400
    assert answer.body["error"]["code"] == "only_special_tokens"
    assert answer.body["error"]["param"] == "prompt.1"


# ------------------------------------------------------------------ parallel_tool_calls


def test_parallel_tool_calls_null_is_the_default(stub: StubIngress) -> None:
    """OpenAI's SDK types it optional: null is the default (true), a non-boolean a 400."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    sent = []
    for flag in ({}, {"parallel_tool_calls": None}, {"parallel_tool_calls": True}):
        answer = stub.post(CHAT, chat(stub, tools=tools, tool_choice="required", **flag))
        assert answer.status == 200, answer.body
        sent.append(stub.sent[-1])
    assert sent[0].sampling == sent[1].sampling == sent[2].sampling
    answer = stub.post(CHAT, chat(stub, tools=tools, parallel_tool_calls="yes"))
    assert answer.status == 400 and answer.body["error"]["param"] == "parallel_tool_calls"
