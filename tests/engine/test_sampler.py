"""Sampling: greedy, filters, per-request generators, batch independence, validation."""

from __future__ import annotations

import pytest
import torch

from replica.sampler import SamplerState, SamplingParams, sample


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
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
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
