"""The mixture-of-experts kernels: the Triton grouped GEMMs (under ``TRITON_INTERPRET=1`` on CPU)
against the torch path, the block-aligned sort, and the native CPU router and weighted sum
against torch at small shapes."""

from __future__ import annotations

import pytest
import torch

from tierserve.kernels import cpu_native, cpu_ops
from tierserve.kernels import moe as tmoe
from tierserve.replica.models.moe import experts_torch, route

needs_native = pytest.mark.skipif(
    not cpu_native.available(),
    reason=f"native kernels unavailable: {cpu_native.unavailable_reason()}",
)


def _weights(
    experts: int, hidden: int, inter: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return gate_up.to(dtype), down.to(dtype)


def _routing(
    t: int, experts: int, top_k: int, seed: int, renorm: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return route(torch.randn(t, experts, generator=gen), top_k, renorm)


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_by_expert_groups_pairs_in_blocks_of_one_expert(block_m: int) -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]])
    sorted_pairs, block_expert = tmoe.align_by_expert(ids, 5, block_m)
    pairs = ids.numel()
    assert sorted_pairs.numel() % block_m == 0
    assert sorted_pairs.numel() >= pairs + 5 * (block_m - 1)
    flat = ids.reshape(-1)
    seen: list[int] = []
    for b, expert in enumerate(block_expert.tolist()):
        block = sorted_pairs[b * block_m : (b + 1) * block_m].tolist()
        real = [p for p in block if p < pairs]
        if expert < 0:
            assert not real
            continue
        assert real and all(int(flat[p]) == expert for p in real)
        seen.extend(real)
    assert sorted(seen) == list(range(pairs))  # every pair once, in its expert's blocks
    # Within an expert, pair ids ascend (a stable sort).
    for expert in range(5):
        mine = [p for p in seen if int(flat[p]) == expert]
        assert mine == sorted(mine)


@pytest.mark.triton
@pytest.mark.parametrize(
    ("t", "experts", "top_k", "hidden", "inter"),
    [(1, 4, 2, 32, 24), (7, 4, 2, 48, 40), (19, 6, 3, 32, 16), (40, 8, 2, 64, 72)],
)
def test_triton_grouped_gemm_matches_the_torch_path(
    t: int, experts: int, top_k: int, hidden: int, inter: int
) -> None:
    """fp32 under the interpreter, both tile configurations (a hidden size and an
    intermediate size that are not multiples of the tiles: masked edges)."""
    gate_up, down = _weights(experts, hidden, inter, seed=t)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(1))
    weights, ids = _routing(t, experts, top_k, seed=2)
    want = experts_torch(x, gate_up, down, weights, ids)
    for cfg in tmoe.CONFIGS:
        got = tmoe.fused_experts(x, gate_up, down, weights, ids, cfg)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.triton
def test_triton_grouped_gemm_rounds_like_the_torch_path_in_bf16() -> None:
    gate_up, down = _weights(4, 32, 32, seed=3, dtype=torch.bfloat16)
    x = torch.randn(9, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights, ids = _routing(9, 4, 2, seed=5)
    want = experts_torch(x, gate_up, down, weights, ids)
    got = tmoe.fused_experts(x, gate_up, down, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_fused_experts_refuses_misshapen_weights() -> None:
    gate_up, down = _weights(4, 32, 16, seed=0)
    x = torch.randn(3, 32)
    weights, ids = _routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"do not fit hidden size 32"):
        tmoe.fused_experts(x, gate_up, down[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match=r"must both be \[3, k\]"):
        tmoe.fused_experts(x, gate_up, down, weights[:, :1], ids)


def test_experts_torch_equals_a_per_token_loop() -> None:
    """The expert-batched torch path against the plain definition, token by token."""
    gate_up, down = _weights(5, 24, 20, seed=6)
    x = torch.randn(13, 24, generator=torch.Generator().manual_seed(7))
    weights, ids = _routing(13, 5, 3, seed=8, renorm=False)
    got = experts_torch(x, gate_up, down, weights, ids)
    for r in range(13):
        want = torch.zeros(24)
        for j in range(3):
            e = int(ids[r, j])
            g, u = (gate_up[e] @ x[r]).chunk(2)
            want += weights[r, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
        torch.testing.assert_close(got[r], want, rtol=1e-5, atol=1e-6)


@needs_native
@pytest.mark.parametrize("renorm", [False, True])
def test_native_route_matches_torch_and_groups_by_expert(renorm: bool) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(37, 8, generator=gen) * 3
    r = cpu_ops.moe_route(logits, 3, renorm)
    weights, ids = route(logits, 3, renorm)
    assert torch.equal(r.ids, ids)
    torch.testing.assert_close(r.weights, weights, rtol=1e-6, atol=1e-7)
    flat = ids.reshape(-1)
    assert r.counts.tolist() == torch.bincount(flat, minlength=8).tolist()
    order = torch.argsort(flat, stable=True)
    assert torch.equal(r.sorted_rows, order // 3)
    assert torch.equal(r.pair_pos[order], torch.arange(flat.numel()))


@needs_native
def test_native_route_refuses_top_k_above_the_experts() -> None:
    with pytest.raises(cpu_ops.NativeKernelError, match=r"top_k must be within 1 \.\. 4 experts"):
        cpu_ops.moe_route(torch.zeros(2, 4), 5, True)


@needs_native
def test_native_combine_sums_by_rank_with_the_shared_expert() -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(11, 6, generator=gen)
    r = cpu_ops.moe_route(logits, 2, False)
    ys = torch.randn(22, 16, generator=gen)
    shared = torch.randn(11, 16, generator=gen)
    gate = torch.randn(11, 1, generator=gen) * 4
    by_pair = ys[r.pair_pos].view(11, 2, 16)
    want = by_pair[:, 0] * r.weights[:, :1] + by_pair[:, 1] * r.weights[:, 1:]
    assert torch.equal(cpu_ops.moe_combine(ys, r), want)  # the same two roundings per element
    got = cpu_ops.moe_combine(ys, r, shared, gate)
    torch.testing.assert_close(got, want + torch.sigmoid(gate) * shared, rtol=1e-6, atol=1e-6)
    with pytest.raises(cpu_ops.NativeKernelError, match="come together"):
        cpu_ops.moe_combine(ys, r, shared, None)
