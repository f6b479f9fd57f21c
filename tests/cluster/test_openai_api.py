"""The OpenAI API as clients send it, through the ``openai`` SDK and raw HTTP, on the main app
(the embedded model, deterministic mode, API keys): log-probabilities (chat and completions,
streamed too), echo and prompt scoring, ``n`` samples, the penalties and biases, content parts,
``continuous_usage_stats``, and the fields this server refuses by name."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.cluster.helpers import KEYS, MODEL, ServeApp, headers, sse_events

pytestmark = [pytest.mark.ray, pytest.mark.slow]

KEY = KEYS["standard"]
USER = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def http(main_app: ServeApp) -> Any:
    with httpx.Client(base_url=main_app.base_url, timeout=120, headers=headers(KEY)) as client:
        yield client


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_chat_logprobs_have_openais_shape(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    choice = chat.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert chat.usage is not None and len(entries) == chat.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.bytes is not None
        try:
            assert e.token == bytes(e.bytes).decode("utf-8")
        except UnicodeDecodeError:  # part of a character: OpenAI's bytes:\xNN form
            assert e.token == "bytes:" + "".join(f"\\x{b:02x}" for b in e.bytes)
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy: the top token
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True)
    text = b"".join(bytes(e.bytes or []) for e in entries).decode("utf-8", "replace")
    assert choice.message.content is not None and choice.message.content in text


def test_streamed_chat_logprobs_equal_the_whole_answers(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    kwargs: dict[str, Any] = dict(model=MODEL, messages=USER, max_tokens=8, temperature=0,
                                  logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            if c.logprobs is not None and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert whole is not None and whole.content is not None
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole.content]


def test_completion_logprobs_stream_and_not(http: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    out = _post(http, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    n = out["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"])
    # k = 2 alternatives per position (fewer only where two ids decode to the same text); the
    # greedy token is the most likely one, so it is among them with the largest logprob.
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"]) and any(len(t) == 2 for t in lp["top_logprobs"])
    for tok, tok_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert tok in top and max(top.values()) == pytest.approx(tok_lp, abs=1e-6), (tok, tok_lp, top)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    chunks = _stream(http, "/v1/completions", body)
    tokens = [t for c in chunks for ch in c["choices"] if ch["logprobs"]
              for t in ch["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(http: httpx.Client) -> None:
    prompt = "The quick brown fox"
    out = _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                          "logprobs": 1})
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == out["usage"]["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][1:]) == prompt  # the first token is the tokenizer's BOS
    # The same request again (deterministic mode): the same scores.
    again = _post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True,
                                            "logprobs": 1})
    assert again["choices"][0]["logprobs"] == lp
    # Echo with generation, streamed: the prompt comes first.
    chunks = _stream(http, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "echo": True})
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert text.startswith(prompt) and len(text) > len(prompt)


def test_n_samples_each_with_its_own_seed(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    many = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, n=3, seed=21,
                                     temperature=1.0)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    for c in many.choices:
        alone = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6,
                                          seed=21 + c.index, temperature=1.0)
        assert alone.choices[0].text == c.text
    assert many.usage is not None
    assert many.usage.prompt_tokens == client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=1).usage.prompt_tokens  # type: ignore[union-attr]
    assert many.usage.completion_tokens == 18  # 3 x 6 (the embedded model rarely stops early)
    greedy = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, n=2,
                                            temperature=0)
    assert len(greedy.choices) == 2
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_n_samples_stream_by_index(http: httpx.Client) -> None:
    chunks = _stream(http, "/v1/chat/completions", {"messages": USER, "max_tokens": 5, "n": 2,
                                                    "seed": 3, "stream_options": {"include_usage": True}})
    by_index: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for c in chunks[:-1]:
        for ch in c["choices"]:
            by_index[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finished.add(ch["index"])
    assert finished == {0, 1}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_continuous_usage_stats_put_usage_in_every_chunk(http: httpx.Client) -> None:
    chunks = _stream(http, "/v1/completions", {
        "prompt": "Count:", "max_tokens": 6, "temperature": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6
    assert len({u["prompt_tokens"] for u in usages}) == 1


def test_continuous_usage_stats_in_a_chat_stream(http: httpx.Client) -> None:
    chunks = _stream(http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 5,
        "temperature": 0, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), chunks
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 5
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert chunks[-1]["choices"] == []  # the usage-only chunk closes the stream


def test_logit_bias_min_tokens_and_stop_ids_work_together(http: httpx.Client) -> None:
    """Token 65 ('A') biased to be certain, but held back for 5 tokens by min_tokens, then it
    stops the request (a stop token id): 5 other tokens, then 'A' ends it."""
    out = _post(http, "/v1/completions", {
        "prompt": "xyz", "max_tokens": 20, "temperature": 0, "logit_bias": {"65": 100},
        "min_tokens": 5, "stop_token_ids": [65], "logprobs": 0})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and out["usage"]["completion_tokens"] == 6
    assert choice["logprobs"]["tokens"][-1] == "A" and "A" not in choice["logprobs"]["tokens"][:5]
    forced = _post(http, "/v1/completions", {"prompt": "xyz", "max_tokens": 4, "temperature": 0,
                                             "logit_bias": {"65": 100}})
    assert forced["choices"][0]["text"] == "AAAA"


def test_penalties_change_a_greedy_answer(http: httpx.Client) -> None:
    base = {"prompt": "aaaa", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = _post(http, "/v1/completions", base)["choices"][0]["text"]
    penalized = _post(http, "/v1/completions", base | {"frequency_penalty": 2.0,
                                                       "presence_penalty": 2.0,
                                                       "repetition_penalty": 2.0})
    assert penalized["choices"][0]["text"] != plain
    assert len(set(penalized["choices"][0]["text"])) >= len(set(plain))
    min_p = _post(http, "/v1/completions", base | {"temperature": 1.0, "min_p": 1.0, "seed": 1})
    assert min_p["choices"][0]["text"] == plain  # min_p 1 keeps only the most likely token


def test_text_content_parts_equal_a_plain_string(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    kwargs: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=0, user="alice")
    plain = client.chat.completions.create(messages=[
        {"role": "user", "content": "Hello\nthere"}], **kwargs)
    parts = client.chat.completions.create(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}], **kwargs)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    developer = client.chat.completions.create(messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}], **kwargs)
    assert developer.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"messages": USER, "prediction": {"type": "content",
                                                                   "content": "x"}}, "prediction"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         "messages.0.content.0"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ],
)
def test_unsupported_features_are_a_400_that_names_them(http: httpx.Client, path: str,
                                                        body: dict[str, Any], param: str) -> None:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "not supported" in err["message"]
    assert json.dumps(err)  # an OpenAI-shaped error, not FastAPI's 422


def test_the_sdk_with_keys_configured(main_app: ServeApp) -> None:
    """With keys configured the SDK's key is the caller's tier: a known key streams, an unknown
    one is the SDK's AuthenticationError (401), never a silent fall-back to the anonymous tier."""
    client = main_app.client(KEY)
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True)
        if c.choices]
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                      temperature=0)
    assert "".join(pieces) == whole.choices[0].text and whole.usage is not None
    assert whole.usage.completion_tokens == 8
    with pytest.raises(openai.AuthenticationError):
        main_app.client("sk-not-a-configured-key").completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=1)


def test_shared_prefixes_go_where_they_are_cached_and_usage_says_so(http: httpx.Client) -> None:
    """Three long system prompts, each asked four times in turn: every repeat finds the prompt's
    shared blocks cached (the router sent it where its prefix went; with two replicas and no
    affinity about half the second visits would miss), and usage reports the cached positions
    as OpenAI does (``prompt_tokens_details.cached_tokens``), streamed usage too."""
    systems = [" ".join(f"{word}{i}" for i in range(60)) for word in ("alpha", "beta", "gamma")]
    seen: dict[int, list[tuple[int, int]]] = {}
    for k in range(12):
        s = k % 3
        out = _post(http, "/v1/completions", {
            "prompt": f"{systems[s]} | question {k}:", "max_tokens": 2, "temperature": 0})
        u = out["usage"]
        seen.setdefault(s, []).append((u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]))
    for s, visits in seen.items():
        prompt0, cached0 = visits[0]
        assert cached0 < prompt0 - 16, (s, visits)  # the first visit computes its system prompt
        for prompt, cached in visits[1:]:
            assert cached % 16 == 0 and prompt - 48 <= cached < prompt, (s, visits)
    events = _stream(http, "/v1/completions", {
        "prompt": f"{systems[0]} | question streamed:", "max_tokens": 2, "temperature": 0,
        "stream_options": {"include_usage": True}})
    final = events[-1]["usage"]
    assert final["prompt_tokens"] - 48 <= final["prompt_tokens_details"]["cached_tokens"]


def test_vllm_and_openai_fields_through_the_sdk(main_app: ServeApp) -> None:
    """vLLM's fields in ``extra_body`` and OpenAI's own, as the SDK sends them: accepted, and
    honoured where they mean something (a stop string kept, the tier a flex request ran in)."""
    client = main_app.client(KEY)
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0, service_tier="flex",
        metadata={"run": "1"}, store=False,
        extra_body={"skip_special_tokens": True, "add_generation_prompt": True,
                    "chat_template_kwargs": {}, "truncate_prompt_tokens": 64,
                    "request_id": "sdk-1", "cache_salt": "salt-1"})
    assert chat.id == "chatcmpl-sdk-1" and chat.service_tier == "flex"
    # vLLM's priority (lower first), moved within the key's tier: any integer is taken, a value
    # past the tier's range runs at its edge (tests/cluster/test_api_fields.py checks where).
    for priority in (-1, 0, 10**6):
        ranked = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=2,
                                                extra_body={"priority": priority})
        assert ranked.choices[0].message.content is not None
    plain = client.completions.create(model=MODEL, prompt="The lighthouse", max_tokens=6,
                                      temperature=0)
    text = plain.choices[0].text
    stop = text.strip().split()[0] if text.strip() else text
    kept = client.completions.create(model=MODEL, prompt="The lighthouse", max_tokens=6,
                                     temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"no_such_field": 1})
    assert "unknown field 'no_such_field'" in str(caught.value)


def test_a_list_of_prompts_through_the_sdk(main_app: ServeApp) -> None:
    client = main_app.client(KEY)
    prompts = ["The lighthouse", "A ship"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0)
             for p in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0,
                                     n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for c in both.choices:
        assert c.text == alone[c.index // 2].choices[0].text
    assert both.usage is not None
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    chunks = list(client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}
    assert chunks[-1].usage is not None and chunks[-1].choices == []
