"""The sampler keeps every tensor on the logits' device: checked on CPU with a simulated CUDA
device (``tests.replica.simulated_cuda``), which refuses what a real one refuses (a CPU bias row added
to CUDA logits, penalties from CPU counts, noise drawn from a CPU generator)."""

from __future__ import annotations

import pytest
import torch

from tests.replica.simulated_cuda import DeviceMismatch, cuda_tensor, on_cuda, simulated_cuda
from tierserve.replica.sampler import SamplerState, SamplingParams, sample, token_logprobs

VOCAB = 64

EVERY_PATH = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, seed=3, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.0, logit_bias={1: 5.0, 7: -100.0}),
    SamplingParams(temperature=1.0, seed=4, repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2),
    SamplingParams(temperature=0.0, min_tokens=3),
    SamplingParams(temperature=0.0, allowed_token_ids=[2, 4, 6, 8, 10], bad_words_ids=[[4], [6, 8]]),
    SamplingParams(temperature=1.0, seed=5, bad_words_ids=[[3], [1, 2, 7], [9, 9]], min_tokens=2),
]


def states(params: list[SamplingParams]) -> list[SamplerState]:
    return [SamplerState(p, prompt=[1, 2, 3, 9], stop_ids=(0, 5)) for p in params]


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g)


def test_the_simulated_device_refuses_what_cuda_refuses() -> None:
    with simulated_cuda():
        x = cuda_tensor(torch.zeros(4, 8))
        assert on_cuda(x + 1) and x.device.type == "cuda"
        with pytest.raises(DeviceMismatch):
            x[0][[1, 2]] += torch.tensor([1.0, 2.0])  # a CPU bias row into CUDA logits
        with pytest.raises(DeviceMismatch):
            _ = x - torch.ones(8)
        with pytest.raises(DeviceMismatch):
            x[0].exponential_(generator=torch.Generator(device="cpu"))
        x[0][[1, 2]] += torch.tensor([1.0, 2.0], device=x.device)  # on the device: fine
        x[0].exponential_(generator=torch.Generator(device=x.device))
        assert x[0][1].item() > 0 and len(x.argmax(dim=-1).tolist()) == 4
        assert on_cuda(torch.zeros(3, device=x.device)) and not on_cuda(x.cpu())


@pytest.mark.parametrize("p", EVERY_PATH, ids=lambda p: repr(p)[14:60])
def test_every_sampling_path_stays_on_the_logits_device(p: SamplingParams) -> None:
    st = states([p, SamplingParams(temperature=1.0, seed=1)])
    with simulated_cuda():
        x = cuda_tensor(logits(2))
        for _ in range(4):  # penalties and min_tokens change state over steps
            toks = sample(x, st)
            assert all(0 <= t < VOCAB for t in toks)
        lps = token_logprobs(x, toks, [2, 0])
        assert len(lps[0].top) == 2


def test_a_batch_of_every_path_on_the_device_samples_as_on_cpu() -> None:
    """Seeded and greedy rows give the same tokens on the (simulated) device as on the CPU:
    the device path computes the same thing."""
    params = [p for p in EVERY_PATH if p.greedy or p.seed is not None]
    cpu = states(params)
    dev = states(params)
    want = [sample(logits(len(params), s), cpu) for s in range(5)]
    with simulated_cuda():
        got = [sample(cuda_tensor(logits(len(params), s)), dev) for s in range(5)]
    assert got == want


@pytest.mark.parametrize("processed", [False, True])
def test_sampling_moves_only_its_parameters_to_the_device(processed: bool) -> None:
    """The noise is drawn on the device: what crosses to it is per row (temperatures, biases,
    ids), never a vocabulary-wide row per request."""
    rows = 8
    extra = dict(logit_bias={3: 1.0}, repetition_penalty=1.1) if processed else {}
    st = states([SamplingParams(temperature=1.0, seed=i, top_p=0.9, min_p=0.01,
                                **extra)  # type: ignore[arg-type]
                 for i in range(rows)])
    x = cuda_tensor(logits(rows))
    with simulated_cuda() as traffic:
        for _ in range(3):
            sample(x, st)
    per_step = traffic.elements / 3
    assert traffic.copies > 0 and per_step < VOCAB  # the prompts' ids once, a few per row


def test_a_requests_ids_cross_to_the_device_once_not_every_step() -> None:
    """Its stop ids, bias and allowed ids are shipped at its first step; the next steps ship a
    few numbers per row, however long those inputs are."""
    vocab = 4096
    params = SamplingParams(temperature=1.0, seed=2, min_tokens=20, max_tokens=30,
                            logit_bias={t: 0.5 for t in range(0, 1000, 2)},
                            allowed_token_ids=list(range(0, 3000)), bad_words_ids=[[5], [6, 7]])
    st = [SamplerState(params, stop_ids=frozenset(range(1000, 2000)))]
    g = torch.Generator().manual_seed(0)
    x = cuda_tensor(torch.randn(1, vocab, generator=g))
    with simulated_cuda() as first:
        sample(x, st)
    assert first.elements >= 1000 + 500 + 500  # the stop ids, the bias ids and values
    with simulated_cuda() as later:
        for _ in range(10):
            sample(x, st)
    assert later.elements / 10 < 16
