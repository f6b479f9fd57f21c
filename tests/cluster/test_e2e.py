"""End to end: the ``openai`` client against a real local Ray Serve app on CPU.

64 concurrent requests (completions and chat, streaming and not, every tier and no key, several
priorities, four ways to finish) all complete; each answer is exactly what an in-process ``LLM``
of the same model gives (the app runs the engine's deterministic mode, which is batch-invariant),
so no stream was mixed up or cut short; afterwards every replica has all its blocks back.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import openai
import pytest

from tests.cluster.helpers import KEYS, MAIN_ENGINE, MODEL, ServeApp, oa_headers
from tierserve.replica.llm import LLM
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.sampler import SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TIERS = {"interactive": (10, 15), "standard": (5, 9), "batch": (0, 4)}  # configs/cluster.yaml
VARIANTS = ("length", "stop_token", "stop_string", "seeded")


@dataclass
class Spec:
    """One request of the mix and what it should answer."""

    index: int
    chat: bool
    stream: bool
    tier: str | None  # None: no API key (the config's anonymous tier)
    variant: str
    priority: int | None
    sampling: dict[str, Any] = field(default_factory=dict)
    expected: Any = None  # tierserve.replica.llm.RequestOutput

    @property
    def prompt(self) -> str:
        return f"request {self.index}: tell me about tier {self.tier} ({self.variant})"

    @property
    def messages(self) -> list[Any]:
        return [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": self.prompt}]


def mixed_specs() -> list[Spec]:
    specs = []
    combos = itertools.product((False, True), (False, True),
                               ("interactive", "standard", "batch", None), VARIANTS)
    for i, (chat, stream, tier, variant) in enumerate(combos):
        low, high = TIERS[tier or "batch"]
        priority = (None, low, high)[i % 3]
        specs.append(Spec(i, chat, stream, tier, variant, priority))
    return specs


def prompt_ids(llm: LLM, spec: Spec) -> list[int]:
    if spec.chat:
        ids = llm.tokenizer.apply_chat_template(spec.messages, add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        return list(ids)
    return llm.engine.encode(spec.prompt)


def plan(specs: list[Spec]) -> None:
    """Choose each request's sampling and compute its answer with an in-process engine."""
    llm = LLM(EMBEDDED_MODEL, block_size=16, num_kv_blocks=512, max_model_len=2048, deterministic=True,
              device="cpu", attention_backend="torch")
    ids = [prompt_ids(llm, s) for s in specs]
    for s in specs:
        s.sampling = {"max_tokens": 8 + 4 * (s.index % 5), "temperature": 0.0, "ignore_eos": True}
    # A first greedy pass shows what each request will say; stops are picked from it.
    free_run = llm.generate(ids, [SamplingParams(**s.sampling) for s in specs], use_tqdm=False)
    for s, out in zip(specs, free_run, strict=True):
        if s.variant == "stop_token":
            s.sampling = {**s.sampling, "ignore_eos": False,
                          "stop_token_ids": [out.outputs[0].token_ids[4]]}
        elif s.variant == "stop_string":
            text = out.outputs[0].text
            stop = text[min(3, len(text) - 1)]  # may be U+FFFD: the model babbles
            s.sampling = {**s.sampling, "ignore_eos": False, "stop": [stop]}
        elif s.variant == "seeded":
            s.sampling = {**s.sampling, "temperature": 0.8, "top_p": 0.9, "top_k": 40,
                          "seed": 1000 + s.index}
    again = [s for s in specs if s.variant != "length"]  # the free run answered the others
    final = llm.generate([ids[s.index] for s in again],
                         [SamplingParams(**s.sampling) for s in again], use_tqdm=False)
    answers = dict(zip((s.index for s in again), final, strict=True))
    for s, out in zip(specs, free_run, strict=True):
        s.expected = answers.get(s.index, out)
        want = "stop" if s.variant.startswith("stop") else "length"
        assert s.expected.outputs[0].finish_reason == want, (s, s.expected)  # the plan itself is sound


async def send(client: openai.AsyncOpenAI, spec: Spec) -> tuple[str, str | None, Any]:
    """(text, finish_reason, usage) of one request, streamed or not."""
    sp = spec.sampling
    common: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": sp["max_tokens"],
        "temperature": sp["temperature"],
        "top_p": sp.get("top_p", 1.0),
        "seed": sp.get("seed"),
        "stop": sp.get("stop"),
        "extra_body": {"top_k": sp.get("top_k", 0), "ignore_eos": sp["ignore_eos"],
                       "stop_token_ids": sp.get("stop_token_ids")},
        "extra_headers": oa_headers(spec.tier and KEYS[spec.tier], spec.priority),
    }
    usage_too: Any = {"include_usage": True}
    text, reason, usage = "", None, None
    if spec.chat:
        if not spec.stream:
            r = await client.chat.completions.create(messages=spec.messages, **common)
            return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage
        stream = await client.chat.completions.create(messages=spec.messages, stream=True,
                                                      stream_options=usage_too, **common)
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        return text, reason, usage
    if not spec.stream:
        c = await client.completions.create(prompt=spec.prompt, **common)
        return c.choices[0].text, c.choices[0].finish_reason, c.usage
    cstream = await client.completions.create(prompt=spec.prompt, stream=True,
                                              stream_options=usage_too, **common)
    async for cchunk in cstream:
        for cchoice in cchunk.choices:
            text += cchoice.text
            reason = cchoice.finish_reason or reason
        usage = cchunk.usage or usage
    return text, reason, usage


async def send_all(app: ServeApp, specs: list[Spec]) -> list[tuple[str, str | None, Any]]:
    clients = {tier: app.async_client(KEYS[tier] if tier else None)
               for tier in ("interactive", "standard", "batch", None)}
    try:
        return await asyncio.gather(*(send(clients[s.tier], s) for s in specs))
    finally:
        for c in clients.values():
            await c.close()


def test_64_concurrent_mixed_requests_complete_exactly(main_app: ServeApp) -> None:
    assert MAIN_ENGINE["deterministic"] is True  # the exact comparison relies on it
    specs = mixed_specs()
    assert len(specs) == 64
    plan(specs)
    results = asyncio.run(send_all(main_app, specs))

    for spec, (text, reason, usage) in zip(specs, results, strict=True):
        want = spec.expected
        label = (spec.index, spec.chat, spec.stream, spec.tier, spec.variant)
        assert reason == want.outputs[0].finish_reason, label
        assert usage is not None, label
        assert usage.completion_tokens == len(want.outputs[0].token_ids), label
        assert usage.prompt_tokens == len(want.prompt_token_ids), label
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, label
        assert text == want.outputs[0].text, label
    reasons = [r for _, r, _ in results]
    assert reasons.count("stop") == 32 and reasons.count("length") == 32

    stats = main_app.wait_idle()
    assert {n: s["free_blocks"] for n, s in stats.items()} == main_app.baseline
    assert len(main_app.baseline) == 2


# ---------------------------------------------------------------------- tiers through HTTP


def complete(app: ServeApp, key: str | None, priority: int | None) -> str | None:
    # ignore_eos: the random model may sample its end of text within two tokens ("stop").
    r = app.client(key).completions.create(model=MODEL, prompt="tiers", max_tokens=2,
                                           extra_headers=oa_headers(key, priority),
                                           extra_body={"ignore_eos": True})
    return r.choices[0].finish_reason


@pytest.mark.parametrize("priority", [5, 10, 15])
def test_a_batch_key_cannot_ask_for_interactive_priority(main_app: ServeApp,
                                                         priority: int) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        complete(main_app, KEYS["batch"], priority)
    assert e.value.status_code == 400
    assert e.value.code == "invalid_priority"
    assert "outside what tier 'batch' allows (0 to 4)" in e.value.message


def test_each_key_may_ask_for_its_own_range(main_app: ServeApp) -> None:
    for tier, (low, high) in TIERS.items():
        for p in (low, high, None):
            assert complete(main_app, KEYS[tier], p) == "length"
    assert complete(main_app, KEYS["interactive"], 15) == "length"


def test_without_a_key_the_anonymous_tier_applies(main_app: ServeApp) -> None:
    """Every tier has a key and the anonymous tier is the lowest: dropping a key never raises
    a caller above what a batch key gets."""
    assert complete(main_app, None, None) == "length"
    assert complete(main_app, None, 4) == "length"  # batch's highest
    for p in (5, 10):
        with pytest.raises(openai.BadRequestError) as e:
            complete(main_app, None, p)
        assert "outside what tier 'batch' allows (0 to 4)" in e.value.message


def test_a_wrong_key_is_401_even_with_an_anonymous_tier(main_app: ServeApp) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        complete(main_app, "not-a-key", None)
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"


def test_without_an_anonymous_tier_a_key_is_required(solo_app: ServeApp) -> None:
    with pytest.raises(openai.AuthenticationError) as e:
        complete(solo_app, None, None)
    assert "needs an API key" in e.value.message
    assert complete(solo_app, KEYS["batch"], None) == "length"
