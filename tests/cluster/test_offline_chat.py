"""The offline ``LLM.chat`` (``tierserve.cluster.offline``) on the embedded tiny model (CPU, no
download): a conversation becomes the very prompt the HTTP chat route sends a replica (checked
against the real ingress class over a stand-in engine, ``stub_ingress``), one ``RequestOutput``
per conversation; bad messages a ``ValueError`` naming them, before any work, the engine usable
after."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.stub_ingress import StubIngress
from tests.cluster.test_tool_calls_formats import MISTRAL_TEMPLATE, with_template
from tierserve import LLM, SamplingParams
from tierserve.replica.models.embedded import EMBEDDED_MODEL

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
TALK: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Another?"}]}]
USER: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EMBEDDED_MODEL, num_kv_blocks=256, block_size=16, max_num_seqs=8,
               max_model_len=2048)


@pytest.fixture(scope="module")
def stub() -> StubIngress:
    return StubIngress({"engine": {"model": EMBEDDED_MODEL}})


def served_prompt(stub: StubIngress, **body: Any) -> list[int]:
    answer = stub.post("/v1/chat/completions", {"model": stub.model, "max_tokens": 3, **body})
    assert answer.status == 200, answer.body
    return list(stub.sent[-1].prompt_ids)


@pytest.mark.parametrize("options, body", [
    ({}, {}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"tools": [TOOL]}, {"tools": [TOOL]}),
])
def test_a_conversation_is_the_prompt_the_chat_route_sends(
        llm: LLM, stub: StubIngress, options: dict[str, Any], body: dict[str, Any]) -> None:
    (r,) = llm.chat(TALK, GREEDY, use_tqdm=False, **options)
    assert r.prompt_token_ids == served_prompt(stub, messages=TALK, **body)
    assert r.prompt == llm.tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False)
    assert r.finished and len(r.outputs[0].token_ids) == 3
    if "tools" in options:
        assert "get_weather" in (r.prompt or "")


# A history with a call (its id OpenAI's ``call_...``, not 9 characters) and its result.
CALLED: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0123456789abcdef01234567", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": "sunny"},
    {"role": "user", "content": "And tomorrow?"}]


def test_a_mistral_template_renders_as_the_chat_route_renders_it(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a Mistral template, the history's ``call_...`` id is mapped to 9 characters (the
    template refuses others) the same way offline as over HTTP: the same prompt."""
    with_template(monkeypatch, MISTRAL_TEMPLATE)
    served = StubIngress({"engine": {"model": EMBEDDED_MODEL}})
    monkeypatch.setattr(llm.tokenizer, "chat_template", MISTRAL_TEMPLATE)
    assert llm.tool_format == "mistral"
    (r,) = llm.chat(CALLED, GREEDY, use_tqdm=False, tools=[TOOL])
    assert r.prompt_token_ids == served_prompt(served, messages=CALLED, tools=[TOOL])
    assert "call_0123" not in (r.prompt or "") and "[TOOL_CALLS]" in (r.prompt or "")


@pytest.mark.parametrize("parser", ["llama3_json", "mistral", "hermes"])
def test_the_tool_call_parser_option_is_the_config_field(parser: str) -> None:
    """``tool_call_parser=`` writes the tools and earlier calls in that format over a plain
    template, as the server configured with the same ``tool_call_parser`` does."""
    llm = LLM(EMBEDDED_MODEL, num_kv_blocks=64, block_size=16, max_num_seqs=2,
              max_model_len=2048, tool_call_parser=parser)
    assert llm.tool_format == parser
    served = StubIngress({"engine": {"model": EMBEDDED_MODEL}, "tool_call_parser": parser})
    (r,) = llm.chat(CALLED, GREEDY, use_tqdm=False, tools=[TOOL])
    assert r.prompt_token_ids == served_prompt(served, messages=CALLED, tools=[TOOL])


def test_an_unknown_tool_call_parser_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown tool_call_parser 'pythonic'.*hermes"):
        LLM(EMBEDDED_MODEL, tool_call_parser="pythonic")


def test_several_conversations_and_n_samples(llm: LLM) -> None:
    other: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    a, b = llm.chat([TALK, other], SamplingParams(n=2, max_tokens=3, seed=3, ignore_eos=True),
                    use_tqdm=False)
    assert [len(a.outputs), len(b.outputs)] == [2, 2]
    (alone,) = llm.chat(other, SamplingParams(n=2, max_tokens=3, seed=3, ignore_eos=True),
                        use_tqdm=False)
    assert alone.prompt_token_ids == b.prompt_token_ids
    assert [o.token_ids for o in alone.outputs] == [o.token_ids for o in b.outputs]


@pytest.mark.parametrize("messages, options, match", [
    ([], {}, "no messages"),
    ("hello", {}, "messages must be a list"),
    ([{"content": "hi"}], {}, "conversation 0, message 0 has no 'role'"),
    ([TALK, [{"role": "user", "content": "a"}, {"content": "b"}]], {},
     "conversation 1, message 1 has no 'role'"),
    ([["user", "hi"]], {}, "conversation 0, message 0 must be a dict"),
    ([{"role": "robot", "content": "hi"}], {}, "conversation 0: message.0"),
    ([{"role": "user", "content": "hi", "colour": "red"}], {}, "colour"),
    ([{"role": "user"}], {}, "conversation 0: message.0.user.content"),
    ([[]], {}, "conversation 0 has no messages"),
    ([{"role": "user", "content": "hi"}], {"tools": [{"type": "web_search"}]}, "tools.0"),
    ([{"role": "user", "content": "hi"}], {"chat_template_kwargs": {"tokenize": True}},
     "'tokenize' is an argument of the template's renderer"),
    ([{"role": "user", "content": "hi"}], {"continue_final_message": True},
     "cannot both be true"),
])
def test_bad_messages_are_a_value_error_before_any_work(
        llm: LLM, messages: Any, options: dict[str, Any], match: str) -> None:
    before = llm.stats()
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False, **options)
    after = llm.stats()
    assert after.waiting == after.running == 0 and after.free_blocks == before.free_blocks
    (ok,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert ok.finished


def test_a_template_that_fails_is_a_value_error_naming_the_conversation(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    real = llm.tokenizer.apply_chat_template

    def refuses_systems(messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        if any(m["role"] == "system" for m in messages):
            raise RuntimeError("no system messages here")
        return real(messages, *args, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "apply_chat_template", refuses_systems)
    with pytest.raises(ValueError, match="conversation 1: the chat template could not render "
                                         "these messages: no system messages here"):
        llm.chat([USER, TALK], GREEDY, use_tqdm=False)
    assert llm.stats().waiting == llm.stats().running == 0


def test_a_model_without_a_chat_template_says_to_use_generate(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match=r"no chat template .* use generate"):
        llm.chat(USER, GREEDY, use_tqdm=False)
