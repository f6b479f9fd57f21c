"""A request's sampling inputs cannot slow the shared step: its token-id inputs (``logit_bias``,
the ``min_tokens`` stop ids, ``allowed_token_ids``, bad words) are built once, as tensors, and
their lengths are capped, at ``SamplingParams`` and at the API's request models. Bad words and
allowed token ids behave as vLLM's. A token its grammar rejects ends the request in an error
of its own (never a quiet "stop", never taken for a replica failure)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import ValidationError

import tierserve.replica.sampler as sampler_module
from tierserve.cluster.ingress import validation_error
from tierserve.cluster.protocol import ChatCompletionRequest, CompletionRequest
from tierserve.records import (
    GRAMMAR_REJECTED_TOKEN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_IDS,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    GenerateRequest,
    InvalidSamplingParam,
    RequestOutput,
    SamplingParams,
    StructuredOutput,
    failed_before_first_token,
    replica_failed,
)
from tierserve.replica.sampler import SamplerState, sample

VOCAB = 64


def logits(rows: int = 1, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


# ------------------------------------------------------------------ built once, not per step


class CountingIds:
    """A collection of token ids that counts how often it is walked."""

    def __init__(self, ids: range) -> None:
        self.ids = ids
        self.walks = 0

    def __iter__(self) -> Iterator[int]:
        self.walks += 1
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, t: object) -> bool:
        return t in self.ids


class CountingBias(dict[int, float]):
    """A ``logit_bias`` that counts how often its entries are walked."""

    walks = 0

    def items(self) -> Any:
        type(self).walks += 1
        return super().items()


class CountingList(list[int]):
    walks = 0

    def __iter__(self) -> Iterator[int]:
        type(self).walks += 1
        return super().__iter__()


def test_min_tokens_stop_ids_are_walked_once_whatever_the_steps() -> None:
    """A huge stop list costs its request one walk (building its mask), not one per step."""
    vocab = 20_000
    stop = CountingIds(range(10, vocab, 2))  # ~10k ids
    st = SamplerState(SamplingParams(temperature=0.0, min_tokens=40, max_tokens=50),
                      stop_ids=stop)
    x = torch.zeros(1, vocab)
    x[0, 10] = 10.0  # a stop id is the most likely token
    x[0, 11] = 5.0
    toks = [sample(x, [st])[0] for _ in range(30)]
    assert toks == [11] * 30  # still held back
    assert stop.walks == 1
    cached = st.inputs(x)
    assert cached.stop is not None and cached.stop.numel() == len(stop)
    assert st.inputs(x) is cached  # the same tensors every step


def test_the_per_step_path_builds_no_tensor_from_a_requests_ids(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first step, no ``torch.tensor`` the sampler makes is as long as a request's
    ids: every step applies the cached ones."""
    vocab = 5_000
    params = SamplingParams(seed=1, min_tokens=20, max_tokens=30,
                            logit_bias={t: 0.5 for t in range(0, 1000)},
                            allowed_token_ids=list(range(0, 4000)),
                            bad_words_ids=[[7], [8, 9]], repetition_penalty=1.1)
    st = SamplerState(params, prompt=[1, 2, 3], stop_ids=frozenset(range(2000, 2100)))
    x = logits(1, vocab)
    sample(x, [st])  # the first step builds them
    made: list[int] = []
    real = torch.tensor

    def counting(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(data, *args, **kwargs)
        made.append(t.numel())
        return t

    monkeypatch.setattr(sampler_module.torch, "tensor", counting)
    for _ in range(10):
        sample(x, [st])
    assert max(made, default=0) < 10


def test_logit_bias_and_allowed_ids_are_walked_once() -> None:
    CountingBias.walks = 0
    CountingList.walks = 0
    bias = CountingBias({t: 1.0 for t in range(MAX_LOGIT_BIAS_ENTRIES)})
    allowed = CountingList(range(0, 2000, 3))
    st = SamplerState(SamplingParams(temperature=0.0, logit_bias=bias,
                                     allowed_token_ids=allowed))
    after_validation = (CountingBias.walks, CountingList.walks)
    x = logits(1, 3000)
    first = sample(x, [st])
    after_first = (CountingBias.walks, CountingList.walks)
    assert after_first == (after_validation[0] + 1, after_validation[1] + 1)
    for _ in range(20):
        assert sample(x, [st]) == first
    assert (CountingBias.walks, CountingList.walks) == after_first


def test_cached_inputs_give_what_the_definitions_say() -> None:
    """Bias added, stop ids masked below ``min_tokens``, ids outside the vocabulary ignored."""
    x = logits(1, seed=3)
    st = SamplerState(SamplingParams(temperature=0.0, min_tokens=1, max_tokens=4,
                                     logit_bias={3: 2.5, 9: -1.0, VOCAB + 5: 50.0}),
                      stop_ids={4, 7, VOCAB + 1})
    got = x.clone()
    sampler_module._process(got, [st], [0])
    want = x.clone()
    want[0, 3] += 2.5
    want[0, 9] -= 1.0
    want[0, [4, 7]] = float("-inf")
    assert torch.equal(got, want)
    st.record(0)  # min_tokens reached: the stop ids are drawn again
    again = x.clone()
    sampler_module._process(again, [st], [0])
    want[0, [4, 7]] = x[0, [4, 7]]
    assert torch.equal(again, want)


# ------------------------------------------------------------------ allowed ids and bad words


def test_allowed_token_ids_are_the_only_ids_drawn() -> None:
    x = logits(1, seed=4)
    allowed = [5, 17, 40]
    greedy = SamplerState(SamplingParams(temperature=0.0, allowed_token_ids=allowed))
    assert sample(x, [greedy]) == [max(allowed, key=lambda t: float(x[0, t]))]
    hot = SamplerState(SamplingParams(temperature=5.0, seed=2, allowed_token_ids=allowed))
    draws = {sample(x, [hot])[0] for _ in range(300)}
    assert draws == set(allowed)
    # Out-of-vocabulary ids are ignored (the engine refuses them before they get here).
    far = SamplerState(SamplingParams(temperature=0.0, allowed_token_ids=[6, VOCAB + 9]))
    assert sample(x, [far]) == [6]


def test_a_single_token_bad_word_is_never_drawn() -> None:
    x = torch.zeros(1, 10)
    x[0, 3] = 10.0
    x[0, 6] = 5.0
    st = SamplerState(SamplingParams(temperature=0.0, bad_words_ids=[[3]]))
    assert [sample(x, [st])[0] for _ in range(4)] == [6] * 4
    both = SamplerState(SamplingParams(temperature=0.0, bad_words_ids=[[3]],
                                       allowed_token_ids=[3, 2]))
    assert sample(x, [both]) == [2]  # allowed, but a bad word: the other allowed id


def test_a_multi_token_bad_word_bans_its_last_token_after_the_rest() -> None:
    """[1, 2, 3]: 3 is banned only right after the output ends with 1, 2 (vLLM's rule)."""
    def state(prompt: list[int]) -> SamplerState:
        return SamplerState(SamplingParams(temperature=0.0, bad_words_ids=[[1, 2, 3], [4, 5]]),
                            prompt=prompt)

    def prefer(tok: int) -> torch.Tensor:
        x = torch.zeros(1, 10)
        x[0, tok] = 10.0
        x[0, 9] = 1.0  # second choice
        return x

    st = state(prompt=[1, 2])  # the prompt does not count: only the output
    assert sample(prefer(3), [st]) == [3]
    st = state(prompt=[])
    assert [sample(prefer(t), [st])[0] for t in (1, 2, 3)] == [1, 2, 9]
    assert [sample(prefer(t), [st])[0] for t in (1, 7, 2, 3)] == [1, 7, 2, 3]  # tail 7, 2
    assert [sample(prefer(t), [st])[0] for t in (4, 5, 5)] == [4, 9, 5]  # 5 after 4 only


def test_bad_words_and_allowed_ids_keep_seeded_rows_independent_of_the_batch() -> None:
    x = logits(2, seed=8) * 0.3

    def params() -> SamplingParams:
        return SamplingParams(seed=5, allowed_token_ids=list(range(0, VOCAB, 2)),
                              bad_words_ids=[[0], [2, 4]], logit_bias={6: 1.0})

    alone = SamplerState(params())
    a = [sample(x[:1], [alone])[0] for _ in range(15)]
    mine = SamplerState(params())
    other = SamplerState(SamplingParams(seed=1, bad_words_ids=[[1, 2]]))
    b = []
    for i in range(15):
        rows = torch.cat([x[1:], x[:1]]) if i % 2 else x
        out = sample(rows, [other, mine] if i % 2 else [mine, other])
        b.append(out[1] if i % 2 else out[0])
    assert a == b
    assert all(t % 2 == 0 and t != 0 for t in a)
    assert all(not (p == 2 and t == 4) for p, t in itertools.pairwise(a))


# ------------------------------------------------------------------ caps at SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
        ({"logit_bias": {t: 1.0 for t in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": ["ok", "y" * (MAX_STOP_STRING_CHARS + 1)]}, "stop.1"),
        ({"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop.0"),
        ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, 2, -3]}, "allowed_token_ids.2"),
        ({"bad_words_ids": [[1]] * (MAX_BAD_WORDS_IDS + 1)}, "bad_words_ids"),
        ({"bad_words_ids": [list(range(MAX_BAD_WORD_TOKENS + 1))]}, "bad_words_ids.0"),
        ({"bad_words_ids": [[1], []]}, "bad_words_ids.1"),
        ({"bad_words_ids": [[1, True]]}, "bad_words_ids.0.1"),
        ({"bad_words_ids": [3]}, "bad_words_ids.0"),
    ],
)
def test_sampling_params_refuse_over_the_caps(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSamplingParam) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert param.split(".")[0] in str(e.value)


def test_the_caps_themselves_are_allowed() -> None:
    p = SamplingParams(
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS_ENTRIES)},
        stop=["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS)),
        bad_words_ids=[list(range(MAX_BAD_WORD_TOKENS))] * MAX_BAD_WORDS_IDS,
    )
    assert p.bad_words_ids is not None and len(p.bad_words_ids) == 2 * MAX_BAD_WORDS


# ------------------------------------------------------------------ caps at the API

COMPLETION: dict[str, Any] = {"model": "m", "prompt": "p"}
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids",
         f"at most {MAX_STOP_TOKEN_IDS} items"),
        ({"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias",
         f"at most {MAX_LOGIT_BIAS_ENTRIES} items"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop",
         f"at most {MAX_STOP_STRINGS} stop strings"),
        ({"stop": ["x", "y" * (MAX_STOP_STRING_CHARS + 1)]}, "stop",
         f"at most {MAX_STOP_STRING_CHARS} characters, stop 1"),
        ({"stop": "y" * (MAX_STOP_STRING_CHARS + 1)}, "stop",
         f"at most {MAX_STOP_STRING_CHARS} characters"),
        ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids",
         f"at most {MAX_ALLOWED_TOKEN_IDS} items"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids.1", "greater than or equal to 0"),
        ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words",
         f"at most {MAX_BAD_WORDS} items"),
        ({"bad_words": ["ok", "w" * (MAX_BAD_WORD_CHARS + 1)]}, "bad_words.1",
         f"at most {MAX_BAD_WORD_CHARS} characters"),
        ({"bad_words": ["ok", ""]}, "bad_words.1", "at least 1 character"),
    ],
)
def test_the_request_models_refuse_over_the_caps_naming_the_field(
        model: Any, fields: dict[str, Any], param: str, says: str) -> None:
    body = (COMPLETION if model is CompletionRequest else CHAT) | fields
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    msg, got = validation_error(e.value.errors())
    assert got == param
    assert msg.startswith(f"{param}: ") and says in msg


def test_the_request_models_take_the_caps_and_document_them() -> None:
    body = COMPLETION | {
        "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)),
        "stop": ["s" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        "allowed_token_ids": [1, 2],
        "bad_words": ["w" * MAX_BAD_WORD_CHARS] * MAX_BAD_WORDS,
    }
    parsed = CompletionRequest.model_validate(body)
    assert parsed.bad_words is not None and parsed.allowed_token_ids == [1, 2]
    assert CompletionRequest.model_validate(COMPLETION | {"stop": "one"}).stop_list() == ["one"]
    props = CompletionRequest.model_json_schema()["properties"]
    array = next(o for o in props["stop"]["anyOf"] if o.get("type") == "array")
    assert array["maxItems"] == MAX_STOP_STRINGS
    assert array["items"]["maxLength"] == MAX_STOP_STRING_CHARS
    ids = next(o for o in props["stop_token_ids"]["anyOf"] if o.get("type") == "array")
    assert ids["maxItems"] == MAX_STOP_TOKEN_IDS
    words = next(o for o in props["bad_words"]["anyOf"] if o.get("type") == "array")
    assert words["maxItems"] == MAX_BAD_WORDS


# ------------------------------------------------------------------ a rejected token is an error


class RefusingConstraint:
    """A grammar whose mask allows every token but whose matcher refuses its ``after``-th
    token (0: the first): the mask and the matcher disagree, as a bug would make them."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.accepted = 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1  # every bit set: every token allowed

    def accept(self, token: int) -> bool:
        if self.accepted == self.after:
            return False
        self.accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        return False


def test_the_sampler_records_the_rejected_token() -> None:
    st = SamplerState(SamplingParams(temperature=0.0), constraint=RefusingConstraint(1))
    x = logits(1, seed=2)
    first = sample(x, [st])[0]
    assert not st.rejected and st.rejected_token is None
    second = sample(x, [st])[0]
    assert st.rejected and st.rejected_token == second == first


@pytest.mark.parametrize("after", [0, 3])
def test_a_token_the_grammar_rejects_ends_the_request_in_an_error(
        after: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from tierserve.replica.config import EngineConfig
    from tierserve.replica.engine import Engine
    from tierserve.replica.models.embedded import EMBEDDED_MODEL

    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=32, max_model_len=256))
    # The spec compiles for real; each sample's matcher is one that disagrees with its mask.
    monkeypatch.setattr(engine.grammars, "constraint",
                        lambda spec: RefusingConstraint(after))
    outs: list[RequestOutput] = []
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                            structured=StructuredOutput("regex", "[a-z]+"))
    free = engine.stats().free_blocks
    engine.add_request(GenerateRequest.of([5, 6, 7], params), sink=outs.append)
    for _ in range(50):
        if not engine.has_unfinished():
            break
        engine.step()
    assert not engine.has_unfinished()
    last = outs[-1]
    assert last.finished and last.finish_reason == "error"
    assert last.error_code == GRAMMAR_REJECTED_TOKEN
    assert re.search(r"grammar rejected token \d+", last.failure or "")
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == after == last.completion_tokens  # the rejected token is not output
    # The request's own error: not a replica failure, never resent.
    assert not replica_failed(last) and not failed_before_first_token(outs[0])
    assert engine.stats().free_blocks == free
    assert engine.error is None  # the engine serves on
    engine.shutdown()


def test_an_engine_failure_is_still_a_replica_failure() -> None:
    failed = RequestOutput(1, "", [], finished=True, finish_reason="error", failure="boom")
    assert replica_failed(failed) and failed_before_first_token(failed)
    rejected = RequestOutput(1, "", [], finished=True, finish_reason="error", failure="x",
                             error_code=GRAMMAR_REJECTED_TOKEN)
    assert not replica_failed(rejected) and not failed_before_first_token(rejected)
