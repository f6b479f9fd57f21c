"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE) over one flat batch of rows.

A router (a linear layer, ``gate``, hidden -> experts) scores every expert for each row; the
softmax of the scores is taken in fp32 over all experts, its ``top_k`` largest are kept in rank
order and, where the model says so (``norm_topk_prob``; Mixtral always), divided by their sum:
the order ``transformers`` computes them in, so that greedy tokens match. Each chosen expert is a
SwiGLU MLP; the row's output is the weighted sum of its ``top_k`` experts' outputs, plus, for
Qwen2-MoE, a shared expert scaled by the sigmoid of its own one-output gate.

The experts run as one grouped operation: the (row, rank) pairs are sorted by expert, and each
expert that has rows runs once on all of them (one gate/up and one down product), never once per
token. Where it runs:

- native CPU kernels (fp32 on CPU, after ``pack_for_cpu``; the only path of the deterministic
  mode): the router on ``cpu_ops.linear``, its choice and the pairs' grouping in
  ``cpu_ops.moe_route``, each expert on ``cpu_ops.linear`` / ``cpu_ops.silu_and_mul`` over its
  rows, the weighted sum in ``cpu_ops.moe_combine`` (by rank, in order). Every one of them is
  row-wise with a fixed order, so a row's bits do not depend on the rest of the batch.
- Triton (the model's fused kernels on the triton backend): ``tierserve.kernels.moe``'s grouped
  GEMMs over the pairs sorted by expert (a block-aligned sort on the device, no host sync).
- torch otherwise: the same grouping with ``torch`` ops (a host sync for the group sizes).

Weights are stacked per layer as ``transformers`` 5 holds them: ``experts.gate_up_proj``
``[E, 2 * I, hidden]`` (rows ``[gate | up]`` per expert) and ``experts.down_proj``
``[E, hidden, I]``; the loaders fill them from per-expert checkpoints too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tierserve.kernels import cpu_native, cpu_ops, cpu_packing
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.models.layers import Linear, SwiGLU, silu_and_mul


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from ``logits`` ``[T, E]``: weights ``[T, top_k]`` (fp32) and expert
    ids ``[T, top_k]`` (int64), in rank order: softmax over the experts in fp32, the ``top_k``
    largest, divided by their sum when ``renormalize``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_torch(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """The chosen experts of each row of ``x`` ``[T, hidden]``, weighted and summed, in torch:
    the pairs sorted by expert, one gate/up and one down product per expert that has rows, the
    ``top_k`` outputs of a row summed by rank in order. ``gate_up`` ``[E, 2 * I, hidden]``,
    ``down`` ``[E, hidden, I]``; ``weights``/``ids`` from ``route``. Returns ``x``'s dtype."""
    t, hidden = x.shape
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    xs = x.index_select(0, order // top_k)
    ys = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        act = silu_and_mul(F.linear(xs[rows], gate_up[e]))
        ys[rows] = F.linear(act, down[e])
        start += n
    by_pair = torch.empty_like(ys)
    by_pair[order] = ys
    return weighted_sum(by_pair.view(t, top_k, hidden), weights).to(x.dtype)


def weighted_sum(ys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_j ys[:, j] * weights[:, j]`` for ``ys`` ``[T, k, hidden]``, by rank in order (each
    product rounded before it is added), in the wider of the two dtypes."""
    out = ys[:, 0] * weights[:, :1]
    for j in range(1, ys.shape[1]):
        out = out + ys[:, j] * weights[:, j : j + 1]
    return out


class MoEExperts(nn.Module):
    """The stacked experts of one layer: ``gate_up_proj`` ``[E, 2 * I, hidden]`` and
    ``down_proj`` ``[E, hidden, I]`` (no biases).

    ``pack_for_cpu`` repacks every expert's two matrices into the native linear kernel's panels
    (``cpu_packing.pack_linear``, stacked: ``[E, 2I / 16, hidden, 16]`` and
    ``[E, hidden / 16, I, 16]``), replacing the originals; the experts then run on the native
    kernels at every row count (they see few rows each: the calibration against the library GEMM
    that ``Linear`` does is not done here, nor the quantized panels).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        deterministic: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.deterministic = deterministic
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, device=device, dtype=dtype),
            requires_grad=False,
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype),
            requires_grad=False,
        )
        self.packed = False

    def pack_for_cpu(self) -> bool:
        """Repack the experts for the native kernels where they take them (fp32 on CPU, kernels
        built); returns whether it did. A deterministic layer they cannot take raises
        ``DeterministicModeUnavailable``. Load weights first."""
        if self.packed:
            return False
        if self.deterministic:
            cpu_native.require_fused(self.gate_up_proj, "mixture of experts")
        elif not cpu_native.fused_ok(self.gate_up_proj):
            return False
        gate_up = torch.stack([cpu_packing.pack_linear(w) for w in self.gate_up_proj.data])
        down = torch.stack([cpu_packing.pack_linear(w) for w in self.down_proj.data])
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self.packed = True
        return True

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E, 2I, hidden], down [E, hidden, I])``, unpacked copies when packed."""
        if not self.packed:
            return self.gate_up_proj.data, self.down_proj.data
        inter, hidden = self.intermediate_size, self.hidden_size
        gate_up = torch.stack(
            [cpu_packing.unpack_linear(p, 2 * inter) for p in self.gate_up_proj.data]
        )
        down = torch.stack([cpu_packing.unpack_linear(p, hidden) for p in self.down_proj.data])
        return gate_up, down

    def forward_native(self, x: torch.Tensor, routing: cpu_ops.MoeRouting) -> torch.Tensor:
        """The experts' outputs ``[T * k, hidden]`` in ``routing``'s sorted-pair order: each
        expert with rows runs once, on the native kernels, over its rows of ``x``."""
        inter, hidden = self.intermediate_size, self.hidden_size
        xs = x.index_select(0, routing.sorted_rows)
        ys = torch.empty((xs.shape[0], hidden), dtype=torch.float32)
        start = 0
        for e, n in enumerate(routing.counts.tolist()):
            if n == 0:
                continue
            end = start + n
            gate_up = cpu_ops.linear(xs[start:end], self.gate_up_proj[e], 2 * inter)
            act = cpu_ops.silu_and_mul(gate_up)
            ys[start:end].copy_(cpu_ops.linear(act, self.down_proj[e], hidden))
            start = end
        return ys

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, packed={self.packed}"
        )


class MoEMLP(nn.Module):
    """A mixture-of-experts MLP: router ``gate``, stacked ``experts``, and for Qwen2-MoE a
    ``shared_expert`` (SwiGLU) with its one-output ``shared_expert_gate``. See the module."""

    def __init__(
        self,
        cfg: ModelConfig,
        deterministic: bool = False,
        fused: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.deterministic = deterministic
        self.fused = fused
        self.gate = Linear(hidden, cfg.num_experts, False, deterministic, device, dtype)
        self.experts = MoEExperts(
            cfg.num_experts, hidden, cfg.moe_intermediate_size, deterministic, device, dtype
        )
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size > 0:
            self.shared_expert = SwiGLU(
                hidden, cfg.shared_expert_intermediate_size, deterministic, device, dtype
            )
            self.shared_expert_gate = Linear(hidden, 1, False, deterministic, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts.packed:
            return self._forward_native(x)
        if self.deterministic:
            raise cpu_native.DeterministicModeUnavailable(
                "a deterministic mixture of experts runs on the native kernel's packed weights: "
                "call pack_for_cpu() once its weights are loaded (the model loaders do)"
            )
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if self.fused:
            from tierserve.kernels import moe  # imported late: Triton reads TRITON_INTERPRET

            out = moe.fused_experts(x, gate_up, down, weights, ids)
        else:
            out = experts_torch(x, gate_up, down, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def _forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if self.deterministic:
            cpu_native.require_fused(x, "mixture of experts")
        routing = cpu_ops.moe_route(self.gate(x), self.top_k, self.renormalize)
        ys = self.experts.forward_native(x, routing)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x)
            return cpu_ops.moe_combine(ys, routing, shared, self.shared_expert_gate(x))
        return cpu_ops.moe_combine(ys, routing)
