"""Sampling: greedy, filters, per-request generators, batch independence, validation."""

from __future__ import annotations

import pytest
import torch

from tierserve.replica.sampler import (
    SamplerState,
    SamplingParams,
    logit_bias_from_json,
    sample,
    token_logprobs,
)


def logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax() -> None:
    x = logits(4)
    got = sample(x, [SamplerState(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert got == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    x = logits(6, seed=1)
    def params(i: int) -> SamplingParams:
        return SamplingParams(seed=100 + i, top_p=0.9, top_k=20)
    alone = [sample(x[i : i + 1], [SamplerState(params(i))])[0] for i in range(6)]
    # The same rows interleaved with greedy and other random rows, in reverse order.
    other = logits(6, seed=9)
    rows, states = [], []
    for i in reversed(range(6)):
        rows += [x[i], other[i]]
        states += [SamplerState(params(i)), SamplerState(SamplingParams(temperature=0.0 if i % 2 else 0.7))]
    batched = sample(torch.stack(rows), states)[::2]
    assert batched[::-1] == alone


def test_seeded_stream_repeats_and_different_seeds_differ() -> None:
    x = logits(1, vocab=1000, seed=2) * 0.1  # nearly flat: draws vary
    def stream(seed: int) -> list[int]:
        st = SamplerState(SamplingParams(seed=seed))
        return [sample(x, [st])[0] for _ in range(20)]
    assert stream(7) == stream(7)
    assert stream(7) != stream(8)


def test_top_k_one_is_greedy() -> None:
    x = logits(3, seed=3)
    got = sample(x, [SamplerState(SamplingParams(top_k=1, seed=i)) for i in range(3)])
    assert got == x.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    x = torch.full((1, 10), -10.0)
    x[0, 3] = 10.0  # ~all the mass
    x[0, 5] = 0.0
    st = SamplerState(SamplingParams(top_p=0.5, seed=0))
    assert {sample(x, [st])[0] for _ in range(50)} == {3}


def test_top_k_restricts_the_support() -> None:
    x = torch.zeros(1, 10)
    x[0, :3] = 1.0
    st = SamplerState(SamplingParams(top_k=3, seed=0, temperature=5.0))
    assert {sample(x, [st])[0] for _ in range(200)} <= {0, 1, 2}


def test_temperature_sampling_follows_the_distribution() -> None:
    p = torch.tensor([[0.7, 0.2, 0.1]])
    st = SamplerState(SamplingParams(seed=1))
    draws = [sample(p.log(), [st])[0] for _ in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.04)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_row_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="rows"):
        sample(logits(2), [SamplerState(SamplingParams())])


def test_huge_top_k_and_tiny_temperature_are_safe() -> None:
    x = logits(2, seed=4)
    huge = sample(x, [SamplerState(SamplingParams(top_k=10**30, seed=1)) for _ in range(2)])
    assert all(0 <= t < x.shape[1] for t in huge)
    tiny = sample(x, [SamplerState(SamplingParams(temperature=1e-300, seed=1)) for _ in range(2)])
    assert tiny == x.argmax(-1).tolist()


def test_logit_bias_forces_and_bans_tokens() -> None:
    x = logits(2, seed=5)
    forced = SamplerState(SamplingParams(temperature=0.0, logit_bias={7: 100.0}))
    banned_top = int(x[1].argmax())
    banned = SamplerState(SamplingParams(temperature=0.0, logit_bias={banned_top: -100.0}))
    got = sample(x, [forced, banned])
    assert got[0] == 7
    assert got[1] == int(x[1].clone().index_fill_(0, torch.tensor([banned_top]), -1e9).argmax())
    assert torch.equal(x, logits(2, seed=5))  # the caller's logits are not modified
    assert logit_bias_from_json({"7": 5, "12": -3.5}) == {7: 5.0, 12: -3.5}
    with pytest.raises(ValueError, match="token ids"):
        logit_bias_from_json({"seven": 1})


def test_min_tokens_holds_the_stop_tokens_back() -> None:
    x = torch.zeros(1, 10)
    x[0, 2] = 10.0  # the stop token is by far the most likely
    x[0, 4] = 5.0
    st = SamplerState(SamplingParams(temperature=0.0, min_tokens=3), stop_ids={2})
    assert [sample(x, [st])[0] for _ in range(5)] == [4, 4, 4, 2, 2]


def test_penalties_follow_vllms_definitions() -> None:
    vocab = 6
    x = torch.tensor([[2.0, -1.0, 1.5, 0.5, -0.5, 0.0]])
    st = SamplerState(
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.3,
                       presence_penalty=0.2),
        prompt=[1],
    )
    for tok in (0, 0, 3):  # as if these had been generated
        st._history(vocab)
        st.record(tok)
    got = x.clone()
    from tierserve.replica.sampler import _process

    _process(got, [st], [0])
    want = torch.tensor([[
        2.0 / 2 - 0.3 * 2 - 0.2,  # generated twice, positive: divided, then both penalties
        -1.0 * 2,  # in the prompt only, negative: multiplied; no count
        1.5,  # never seen
        0.5 / 2 - 0.3 - 0.2,
        -0.5,
        0.0,
    ]])
    torch.testing.assert_close(got, want)


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    x = torch.tensor([[3.0, 2.9, 0.0]])
    plain = SamplerState(SamplingParams(temperature=0.0))
    penalized = SamplerState(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[0])
    assert sample(x, [plain, penalized][:1]) == [0]
    assert sample(x, [penalized]) == [1]


def test_min_p_drops_the_unlikely_tail() -> None:
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    st = SamplerState(SamplingParams(seed=3, min_p=0.5))  # keep p >= 0.25
    assert {sample(p.log(), [st])[0] for _ in range(300)} == {0, 1}


def test_seeded_penalized_rows_do_not_depend_on_the_batch_or_a_pause() -> None:
    """Penalties, bias and min-p per row: a request's stream alone equals its stream in a
    batch, and pausing it (as a preemption does) between tokens changes nothing."""
    x = logits(2, vocab=40, seed=6) * 0.3

    def params() -> SamplingParams:
        return SamplingParams(seed=11, presence_penalty=0.5, frequency_penalty=0.4,
                              repetition_penalty=1.3, min_p=0.05, logit_bias={3: 2.0},
                              min_tokens=2)

    alone = SamplerState(params(), prompt=[1, 2, 3], stop_ids={5})
    a = [sample(x[:1], [alone])[0] for _ in range(12)]
    mine = SamplerState(params(), prompt=[1, 2, 3], stop_ids={5})
    other = SamplerState(SamplingParams(seed=1, frequency_penalty=1.0))
    b = []
    for i in range(12):
        rows = torch.cat([x[1:], x[:1]]) if i % 2 else torch.cat([x[:1], x[1:]])
        states = [other, mine] if i % 2 else [mine, other]
        out = sample(rows, states)
        b.append(out[1] if i % 2 else out[0])
    assert a == b


def test_token_logprobs_are_the_models_log_softmax() -> None:
    x = logits(3, vocab=30, seed=7)
    tokens = [4, 0, 29]
    got = token_logprobs(x, tokens, [0, 3, 5])
    want = torch.log_softmax(x, -1)
    for r, lp in enumerate(got):
        assert lp.token == tokens[r]
        assert lp.logprob == pytest.approx(float(want[r, tokens[r]]), abs=1e-6)
        assert len(lp.top) == [0, 3, 5][r]
        ids = [i for i, _ in lp.top]
        assert ids == want[r].argsort(descending=True)[: len(ids)].tolist()
        assert [v for _, v in lp.top] == pytest.approx([float(want[r, i]) for i in ids], abs=1e-6)
