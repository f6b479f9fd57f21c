"""LoRA adapters in PEFT's format, held in a replica and applied to mixed batches.

Three parts:

- ``load_adapter``: reads a PEFT adapter folder (``adapter_config.json`` and
  ``adapter_model.safetensors``) into a ``LoRAAdapter``: per layer and projection its ``A``
  ``[r, in]`` and ``B`` ``[out, r]`` (``B`` already times the scaling, ``alpha / r`` or
  ``alpha / sqrt(r)`` with rsLoRA). Whatever it cannot apply exactly is refused with a
  ``LoRAError`` (a ``ValueError``) saying what, before anything is kept: nothing half-loaded.
- ``LoRASlots``: the device tensors of one step's adapters, per layer and projection ``A``
  ``[slots, max_rank, in]`` and ``B`` ``[slots, out, max_rank]``, zero-padded to
  ``max_lora_rank`` (a rank below it adds zeros), filled from the CPU-side cache when a step needs
  an adapter that is in no slot.
- ``LoRAManager``: the CPU-side cache (``max_cpu_loras`` adapters, least recently used evicted
  when no request holds it), the slots (``max_loras``), and the hooks on the model's linear
  layers that add ``(x_rows @ A_slot^T) @ B_slot^T`` into each adapter's rows of the output.

Our model fuses q/k/v into ``qkv_proj`` (rows ``[q | k | v]``) and gate/up into
``gate_up_proj`` (rows ``[gate | up]``): a LoRA on ``q_proj`` adds into the q rows of
``qkv_proj``'s output, and so on; an adapter of a checkpoint fused already (Phi-3's
``qkv_proj``, ``gate_up_proj``) adds into the whole module's output. With partial rotary (Phi-3) the q/k rows of each head are in
``layers.rotary_permutation``'s order: the adapter's ``B`` rows are permuted the same way.

A step without adapter rows runs the model's code unchanged: the hooks return at once. With
``enable_lora`` off there are no hooks at all.

In the deterministic mode (``docs/determinism.md``) the adapters run on the native CPU linear
kernel too: each slot's ``A`` and ``B`` are packed for it when the slot is filled, and each
adapter's rows go through it as one matrix. That kernel computes every row alone in a fixed
order, so a row's LoRA output, as the base model's, depends neither on the other rows of the
step nor on how its prompt was cut into chunks.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierserve.records import LoRAError, LoRAInUse, LoRANotFound

# The projections an adapter may target (PEFT's module names) -> (our fused module, part).
# The part indexes the fused module's row blocks: qkv_proj's [q | k | v], gate_up_proj's
# [gate | up]; o_proj and down_proj are one block.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
    # Checkpoints whose projections are fused already (Phi-3): the whole module.
    "qkv_proj": ("self_attn.qkv_proj", 0),
    "gate_up_proj": ("mlp.gate_up_proj", 0),
}
_EMBEDDINGS = ("embed_tokens", "lm_head", "wte", "word_embeddings")
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True, slots=True)
class ProjShape:
    """One projection PEFT names (``q_proj``...): its input width, output rows, and where its
    rows start in the fused module's output."""

    module: str  # our module under the layer: "self_attn.qkv_proj"
    in_features: int
    out_features: int
    offset: int
    # Under partial rotary: the (first, end, heads) row ranges of B (q or k heads) whose rows
    # are permuted within each head as the model's are.
    rotary: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What an adapter must match: per layer, the projections it may target."""

    num_layers: int
    layers: tuple[dict[str, ProjShape], ...]
    rotary_perm: torch.Tensor | None = None  # partial rotary's q/k row order within a head

    @classmethod
    def of(cls, model: nn.Module) -> ModelShapes:
        """The targetable projections of ``model`` (a Llama-family ``LlamaForCausalLM``): the
        fused modules each layer has, split by the config's sizes. A layer without a module
        (a mixture-of-experts MLP) has none of its projections."""
        from tierserve.replica.models.layers import Linear, rotary_permutation

        cfg: Any = model.config
        q, kv = cfg.q_size, cfg.kv_size
        perm = None
        if cfg.rope_dim != cfg.head_dim:
            perm = rotary_permutation(cfg.head_dim, cfg.rope_dim)
        layers: list[dict[str, ProjShape]] = []
        decoder: Any = model.model
        for layer in decoder.layers:
            mods = dict(layer.named_modules())
            shapes: dict[str, ProjShape] = {}
            qkv = mods.get("self_attn.qkv_proj")
            if isinstance(qkv, Linear) and qkv.out_features == q + 2 * kv:
                h = qkv.in_features
                rq = ((0, q, cfg.num_heads),) if perm is not None else ()
                rk = ((0, kv, cfg.num_kv_heads),) if perm is not None else ()
                rqk = ((0, q, cfg.num_heads), (q, q + kv, cfg.num_kv_heads)) if perm is not None \
                    else ()
                shapes["q_proj"] = ProjShape("self_attn.qkv_proj", h, q, 0, rq)
                shapes["k_proj"] = ProjShape("self_attn.qkv_proj", h, kv, q, rk)
                shapes["v_proj"] = ProjShape("self_attn.qkv_proj", h, kv, q + kv)
                shapes["qkv_proj"] = ProjShape("self_attn.qkv_proj", h, q + 2 * kv, 0, rqk)
            o = mods.get("self_attn.o_proj")
            if isinstance(o, Linear):
                shapes["o_proj"] = ProjShape("self_attn.o_proj", o.in_features, o.out_features, 0)
            gu = mods.get("mlp.gate_up_proj")
            if isinstance(gu, Linear):
                inter = gu.out_features // 2
                shapes["gate_proj"] = ProjShape("mlp.gate_up_proj", gu.in_features, inter, 0)
                shapes["up_proj"] = ProjShape("mlp.gate_up_proj", gu.in_features, inter, inter)
                shapes["gate_up_proj"] = ProjShape("mlp.gate_up_proj", gu.in_features,
                                                   gu.out_features, 0)
            d = mods.get("mlp.down_proj")
            if isinstance(d, Linear):
                shapes["down_proj"] = ProjShape("mlp.down_proj", d.in_features, d.out_features, 0)
            layers.append(shapes)
        return cls(len(layers), tuple(layers), perm)


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One adapter in host memory. ``weights[(layer, proj)]``: ``(A [r, in], B [out, r])`` with
    the scaling folded into ``B`` (and partial rotary's row order applied)."""

    name: str
    path: str
    rank: int
    scaling: float
    base_model: str | None
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    int_id: int = 0  # the id its LoRARequest gave (vLLM's lora_int_id)

    @property
    def key(self) -> str:
        """Its identity in a replica: ``LoRARequest.key`` of its name and id."""
        return adapter_key(self.name, self.int_id)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def adapter_key(name: str, int_id: int) -> str:
    """``LoRARequest.key`` of adapter ``name`` of id ``int_id``."""
    return f"{name}#{int_id}"


_QUANT = re.compile(r"[-._](?:i?q\d+(?:_[a-z0-9]+)*|f16|f32|bf16|fp16|fp32|gguf)$")


def model_identity(name: str) -> str:
    """A model's name as an adapter's ``base_model_name_or_path`` and the engine's model are
    compared: lowercase, the last path component (no org prefix), without ``.gguf``/``-gguf``
    and quantisation suffixes (``-q8_0``, ``.Q4_1``, ``-q4_k_m``, ``-f16``). So
    ``HuggingFaceTB/SmolLM2-135M-Instruct`` and ``SmolLM2-135M-Instruct.Q4_1.gguf`` agree."""
    s = name.strip().replace("\\", "/").rstrip("/").rsplit("/", 1)[-1].lower()
    while True:
        t = _QUANT.sub("", s)
        if t == s or not t:
            return s
        s = t


def _config_error(path: str, what: str) -> LoRAError:
    return LoRAError(f"LoRA adapter at {path!r}: {what}")


def read_adapter_config(path: str, max_rank: int) -> dict[str, Any]:
    """``adapter_config.json`` of the adapter folder ``path``, checked: a PEFT LoRA (not DoRA,
    no bias, no ``modules_to_save``, no per-module ranks or alphas, no embedding targets), a
    rank up to ``max_rank``. Raises ``LoRAError`` naming what is wrong."""
    if not os.path.isdir(path):
        raise _config_error(path, "no such directory")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise _config_error(path, f"not a PEFT adapter: no {CONFIG_FILE}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise _config_error(path, f"{CONFIG_FILE} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _config_error(path, f"{CONFIG_FILE} is not a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise _config_error(path, f"peft_type {kind!r} is not supported (LORA only)")
    if cfg.get("use_dora"):
        raise _config_error(path, "DoRA (use_dora) is not supported")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _config_error(path, f"r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _config_error(path, f"rank {r} is above max_lora_rank {max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _config_error(path, f"lora_alpha must be a number, got {alpha!r}")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise _config_error(path, f"bias {bias!r} is not supported (only 'none')")
    if cfg.get("modules_to_save"):
        raise _config_error(
            path, f"modules_to_save {cfg['modules_to_save']!r} is not supported (full copies of "
                  "modules, e.g. a new head or embedding, are not applied per request)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _config_error(path, f"{key} (per-module ranks or alphas) is not supported")
    for key in ("layers_to_transform", "layer_replication", "target_parameters", "lora_bias",
                "trainable_token_indices", "alora_invocation_tokens", "use_qalora"):
        if cfg.get(key):
            raise _config_error(path, f"{key} is not supported")
    targets = cfg.get("target_modules")
    names: list[str] = []
    if isinstance(targets, str):
        names = [targets]
    elif isinstance(targets, list):
        names = [str(t) for t in targets]
    elif targets is not None:
        raise _config_error(path, f"target_modules must be a list or a string, got {targets!r}")
    for t in names:
        short = t.rsplit(".", 1)[-1]
        if any(e in t for e in _EMBEDDINGS):
            raise _config_error(path, f"target module {t!r}: LoRA on embeddings or the output "
                                      "head is not supported")
        if isinstance(targets, list) and short not in TARGETS:
            raise _config_error(path, f"target module {t!r} is not one this model has (supported: "
                                      f"{', '.join(TARGETS)})")
    return cfg


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise _config_error(path, "adapter_model.bin (a pickle) is not loaded: save the "
                                      "adapter as adapter_model.safetensors (PEFT's default)")
        raise _config_error(path, f"not a PEFT adapter: no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(weights, device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise _config_error(path, f"{WEIGHTS_FILE} is not readable ({e})") from None


def load_adapter(name: str, path: str, shapes: ModelShapes, max_rank: int,
                 dtype: torch.dtype = torch.float32, int_id: int = 0) -> LoRAAdapter:
    """Read and check the PEFT adapter at ``path`` against a model of ``shapes``: every tensor a
    ``lora_A``/``lora_B`` of a projection the layer has, of its input width and output rows, of
    the config's rank. Raises ``LoRAError`` for the first thing wrong; returns a whole adapter
    or nothing."""
    cfg = read_adapter_config(path, max_rank)
    r = int(cfg["r"])
    alpha = float(cfg.get("lora_alpha", r))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    tensors = _read_weights(path)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        if "lora_magnitude_vector" in key:
            raise _config_error(path, "DoRA weights (lora_magnitude_vector) are not supported")
        if "lora_embedding" in key or any(f".{e}." in key for e in _EMBEDDINGS):
            raise _config_error(path, f"tensor {key!r}: LoRA on embeddings or the output head is "
                                      "not supported")
        m = _KEY.search(key)
        if m is None:
            raise _config_error(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder "
                                      "layer's projection (modules_to_save and biases are not "
                                      "supported)")
        layer, proj, half = int(m.group(1)), m.group(2), m.group(3)
        if layer >= shapes.num_layers:
            raise _config_error(path, f"tensor {key!r}: layer {layer} is beyond the model's "
                                      f"{shapes.num_layers} layers")
        if proj not in shapes.layers[layer]:
            raise _config_error(path, f"tensor {key!r}: layer {layer} has no {proj} this server "
                                      "applies LoRA to")
        halves.setdefault((layer, proj), {})[half] = t
    if not halves:
        raise _config_error(path, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, proj), pair in sorted(halves.items()):
        where = f"layer {layer} {proj}"
        if set(pair) != {"A", "B"}:
            raise _config_error(path, f"{where} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        shape = shapes.layers[layer][proj]
        if a.dim() != 2 or b.dim() != 2:
            raise _config_error(path, f"{where}: A and B must be matrices")
        if a.shape[0] != r or b.shape[1] != r:
            raise _config_error(path, f"{where}: rank {a.shape[0]}/{b.shape[1]} is not the "
                                      f"config's r {r}")
        if a.shape[1] != shape.in_features or b.shape[0] != shape.out_features:
            raise _config_error(
                path, f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                      f"model's {shape.in_features} -> {shape.out_features} projection (an "
                      "adapter of another base model?)")
        b = b.to(torch.float32) * scaling
        if shape.rotary and shapes.rotary_perm is not None:
            from tierserve.replica.models.layers import permute_rotary_rows_

            b = b.contiguous()
            for first, end, heads in shape.rotary:
                permute_rotary_rows_(b[first:end], heads, shapes.rotary_perm)
        weights[(layer, proj)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    base = cfg.get("base_model_name_or_path")
    return LoRAAdapter(name, path, r, scaling, None if base is None else str(base), weights,
                       int_id)


# ---------------------------------------------------------------------- the step's adapters


@dataclass(slots=True)
class LoRABatch:
    """One step's rows by adapter slot: ``row_slots`` ``[T]`` int (-1: the base model);
    ``segments``: per slot present, the indices ``[n]`` of its rows (int64; on the device for
    the torch path, on the host for the kernels').
    Built by ``LoRAManager.batch`` beside the runner's ``ForwardBatch``; None there when no row
    has an adapter."""

    row_slots: torch.Tensor
    segments: list[tuple[int, torch.Tensor]]
    names: dict[int, str] = field(default_factory=dict)  # slot -> adapter name
    # The same segments as the Triton kernels take them (``tierserve.kernels.lora``): every
    # segment's rows in one int32 tensor, where each starts (``[S + 1]``), each one's slot.
    rows: torch.Tensor | None = None
    seg_start: torch.Tensor | None = None
    seg_slot: torch.Tensor | None = None
    triton: bool = False  # the Triton kernels apply it (else torch ops)
    native: bool = False  # the native CPU kernel applies it, segment by segment (deterministic)
    # The torch path on the CPU where the adapter rows form few contiguous runs (prefill
    # chunks): ``(start, end, slot)`` per run, applied in place on row ranges (no gather, no
    # scatter); None: the padded layout below.
    runs: list[tuple[int, int, int]] | None = None
    # The torch path's layout: segments padded to the longest (``length`` rows each, padding
    # repeats a segment's first row), ``padded`` ``[S * length]`` their rows; ``valid`` the
    # positions in it that are real rows (None: all are) and ``valid_rows`` those rows;
    # ``slot_index`` the slots to gather ``A``/``B`` of, in segment order (None: every slot in
    # order, no gather needed).
    length: int = 0
    padded: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    valid_rows: torch.Tensor | None = None
    slot_index: torch.Tensor | None = None


@dataclass(slots=True)
class _Part:
    """One projection's slots in one fused module: A ``[slots, R, in]``, B ``[slots, out, R]``."""

    offset: int
    out_features: int
    a: torch.Tensor
    b: torch.Tensor
    used: list[bool]  # per slot: whether the slot's adapter targets this projection
    # The deterministic mode's per slot ``A`` and ``B`` packed for the native linear kernel
    # (``cpu_packing.pack_linear``); None where the slot's adapter does not target it.
    packed: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    # On the CPU's torch path: the A of every part of the module side by side, ``[slots,
    # parts * R, in]`` (``a`` is this part's view of it, columns ``index * R`` on), so that one
    # matmul shrinks a run of rows for all the module's parts.
    group: torch.Tensor | None = None
    index: int = 0


class _ModuleLoRA:
    """The forward hook of one fused linear module: adds each slot's rows' LoRA output."""

    def __init__(self, manager: LoRAManager, parts: list[_Part]) -> None:
        self.manager = manager
        self.parts = parts

    def __call__(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
        batch = self.manager.active
        if batch is None:
            return
        x = args[0]
        apply_lora(x, out, self.parts, batch)


def apply_lora(x: torch.Tensor, out: torch.Tensor, parts: Sequence[_Part],
               batch: LoRABatch) -> None:
    """``out[rows, part] += (x[rows] @ A_slot^T) @ B_slot^T`` for every slot's rows and every
    part its adapter targets: on CUDA by the Triton kernels (``tierserve.kernels.lora``: one
    shrink and one expand per part over every segment); elsewhere by torch ops over the segments
    padded to one length, one batched matmul pair and one ``index_add_`` per part whatever the
    number of adapters (a part no adapter of the step targets is skipped)."""
    if batch.native:
        _apply_native(x, out, parts, batch)
        return
    if batch.triton and batch.rows is not None:
        from tierserve.kernels import lora as tlora  # Triton: the GPU path only

        assert batch.seg_start is not None and batch.seg_slot is not None
        for p in parts:
            tlora.lora_add(x, out, p.a, p.b, p.offset, batch.rows, batch.seg_start,
                           batch.seg_slot)
        return
    if batch.runs is not None:
        group = parts[0].group
        for start, end, slot in batch.runs:
            xr = x[start:end]
            # One shrink for the module's parts where they share a group (their A side by
            # side), else one per part.
            both = torch.mm(xr, group[slot].t()) if group is not None else None
            for p in parts:
                if not p.used[slot]:
                    continue
                rank = p.a.shape[1]
                h = (both[:, p.index * rank : (p.index + 1) * rank] if both is not None
                     else torch.mm(xr, p.a[slot].t()))
                out[start:end, p.offset : p.offset + p.out_features].addmm_(h, p.b[slot].t())
        return
    if batch.padded is None:
        raise ValueError("a LoRABatch for the torch path has its padded layout "
                         "(LoRAManager.batch builds it)")
    slots = [slot for slot, _ in batch.segments]
    segs, length = len(slots), batch.length
    xs = x.index_select(0, batch.padded).view(segs, length, x.shape[1])
    rows = batch.padded if batch.valid_rows is None else batch.valid_rows
    for p in parts:
        if not any(p.used[s] for s in slots):
            continue
        a, b = p.a, p.b
        if batch.slot_index is not None:
            a, b = a.index_select(0, batch.slot_index), b.index_select(0, batch.slot_index)
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))
        delta = delta.view(segs * length, p.out_features)
        if batch.valid is not None:
            delta = delta.index_select(0, batch.valid)
        out[:, p.offset : p.offset + p.out_features].index_add_(0, rows, delta)


def _apply_native(x: torch.Tensor, out: torch.Tensor, parts: Sequence[_Part],
                  batch: LoRABatch) -> None:
    """The deterministic mode's ``apply_lora``: per segment and part, the segment's rows through
    the native linear kernel twice (``A`` then ``B``, packed at ``_fill``), added into their
    rows. The kernel's result for a row does not depend on the other rows it is given, and each
    row gets exactly one add: a row's bits are the same in any batch."""
    from tierserve.kernels import cpu_ops

    for slot, rows in batch.segments:
        xs = x.index_select(0, rows)
        for p in parts:
            packed = p.packed[slot]
            if packed is None:
                continue
            h = cpu_ops.linear(xs, packed[0], p.a.shape[1])
            delta = cpu_ops.linear(h, packed[1], p.out_features)
            out[:, p.offset : p.offset + p.out_features].index_add_(0, rows, delta)


# The CPU's torch path applies adapters run by run (contiguous rows of one adapter: the runner
# puts each adapter's decodes side by side, and its chunks) while a step has at most this many
# runs, or two per adapter; beyond (rows in another order), over the segments padded to one
# length, which costs a gather and a scatter but few ops.
RUNS_MAX = 8


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """The maximal ranges of consecutive rows under one adapter slot (-1, the base: none)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                runs.append((start, i, slots[start]))
            start = i
    return runs


class LoRAManager:
    """The adapters of one replica: a CPU-side cache of ``max_cpu_loras`` adapters keyed by
    ``name#id`` (``LoRARequest.key``; least recently used evicted, never a pinned one),
    ``max_loras`` device slots, and hooks on the model's fused projections. Thread-safe: the
    engine's loop, its loader thread and its callers share it.

    The cache keeps no count of users: the engine passes the keys ``pinned`` (those of its
    running requests) to ``install`` and ``unload``, under its own lock, so a waiting request
    holds nothing. ``read`` (disk, no lock) and ``install`` are a load's two halves.
    ``batch(rows)`` puts the step's adapters in slots (copying any not there yet) and returns
    the step's ``LoRABatch``; ``active`` is that batch while the model runs (``running``)."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 use_triton: bool | None = None, deterministic: bool = False,
                 base_names: Collection[str] = (), base_check: bool = True) -> None:
        """``use_triton``: apply the adapters by the Triton kernels; None: on CUDA.
        ``deterministic``: by the native CPU linear kernel, batch-invariant (fp32 on the CPU
        only; the engine's deterministic mode). ``base_names``: the engine model's names (each
        a ``model_identity``) an adapter's ``base_model_name_or_path`` must be one of, where
        ``base_check`` and the adapter names one."""
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras "
                             f"({max_loras})")
        self.shapes = ModelShapes.of(model)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = torch.device(device)
        self.dtype = dtype
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton
        self.deterministic = deterministic
        self.base_names = frozenset(model_identity(n) for n in base_names if n)
        self.base_check = base_check
        if deterministic and (self.device.type != "cpu" or dtype != torch.float32
                              or self.use_triton):
            raise LoRAError("the deterministic mode applies adapters on the native CPU kernel: "
                            f"fp32 on the CPU only (here {dtype} on {self.device})")
        self._lock = threading.RLock()
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slots: list[str | None] = [None] * max_loras
        self._slot_of: dict[str, int] = {}
        self._parts: dict[tuple[int, str], _Part] = {}
        self.active: LoRABatch | None = None
        self._hooks: list[Any] = []
        decoder: Any = model.model
        for i, (layer, shapes) in enumerate(zip(decoder.layers, self.shapes.layers, strict=True)):
            by_module: dict[str, list[_Part]] = {}
            mods = dict(layer.named_modules())
            grouped = self.device.type == "cpu" and not self.use_triton and not deterministic
            for proj, shape in shapes.items():
                part = _Part(
                    shape.offset, shape.out_features,
                    torch.zeros(max_loras, max_rank, shape.in_features, device=self.device,
                                dtype=dtype),
                    torch.zeros(max_loras, shape.out_features, max_rank, device=self.device,
                                dtype=dtype),
                    [False] * max_loras, [None] * max_loras)
                self._parts[(i, proj)] = part
                by_module.setdefault(shape.module, []).append(part)
            for module, parts in by_module.items():
                if grouped and len(parts) > 1:
                    group = torch.zeros(max_loras, len(parts) * max_rank,
                                        parts[0].a.shape[2], device=self.device, dtype=dtype)
                    for j, part in enumerate(parts):
                        part.group, part.index = group, j
                        part.a = group[:, j * max_rank : (j + 1) * max_rank]
                hook = mods[module].register_forward_hook(_ModuleLoRA(self, parts))
                self._hooks.append(hook)

    # ------------------------------------------------------------------ the CPU-side cache

    def read(self, name: str, path: str, int_id: int = 0) -> LoRAAdapter:
        """The adapter at ``path`` read from disk and checked for this model (shapes, rank, and
        the base model it names, ``check_base``), held by nothing: the slow part of a load,
        which takes no lock (a loader thread runs it). ``LoRAError``: what is wrong."""
        if not path:
            raise LoRANotFound(f"LoRA adapter {name!r} is not loaded and the request gives no "
                               "path")
        adapter = load_adapter(name, path, self.shapes, self.max_rank, self.dtype, int_id)
        self.check_base(adapter)
        return adapter

    def check_base(self, adapter: LoRAAdapter) -> None:
        """``LoRAError`` ``lora_base_mismatch`` when ``adapter`` names a base model
        (``base_model_name_or_path``) that is not this engine's (``base_names``, compared by
        ``model_identity``); an adapter naming none, or an engine without ``base_names`` or with
        ``lora_base_check`` off, passes."""
        base = adapter.base_model
        if not self.base_check or not self.base_names or not base:
            return
        if model_identity(base) not in self.base_names:
            raise LoRAError(
                f"LoRA adapter at {adapter.path!r}: it was trained for base model {base!r}, not "
                f"this server's model ({', '.join(sorted(self.base_names))}); same shapes would "
                "give wrong outputs (lora_base_check: false skips this check)",
                "lora_base_mismatch")

    def install(self, adapter: LoRAAdapter, pinned: Collection[str] = ()) -> bool:
        """Keep ``adapter`` (read by ``read``) in the cache, under its key; False, and nothing
        changed, when that needs an entry in ``pinned`` (the keys of the running requests'
        adapters) dropped: another copy of its name (an older id), or the only candidates
        for eviction when ``max_cpu_loras`` are loaded. An unpinned copy of the same name is
        replaced; else the least recently used unpinned entry is evicted."""
        key = adapter.key
        with self._lock:
            if key in self._cpu:
                self._cpu.move_to_end(key)
                return True
            others = [k for k, a in self._cpu.items() if a.name == adapter.name]
            if any(k in pinned for k in others):
                return False
            if not others and len(self._cpu) >= self.max_cpu_loras:
                victim = next((k for k in self._cpu if k not in pinned), None)
                if victim is None:
                    return False
                others = [victim]
            for k in others:
                self._drop(k)
            self._cpu[key] = adapter
            return True

    def load(self, name: str, path: str, int_id: int = 0, pinned: Collection[str] = ()) -> bool:
        """``read`` then ``install`` (the start's static adapters, an admin's load): whether it
        is kept in the cache (False: valid, but every entry it could replace is pinned; a
        request of it loads it again). ``LoRAError``: the adapter is bad."""
        with self._lock:
            have = self._cpu.get(adapter_key(name, int_id))
            if have is not None and (not path or have.path == path):
                self._cpu.move_to_end(have.key)
                return True
        return self.install(self.read(name, path, int_id), pinned)

    def unload(self, name: str, pinned: Collection[str] = ()) -> list[str]:
        """Forget adapter ``name``: the entry of that key (``name#id``) where there is one, else
        every entry of that name (each id). Returns the keys dropped. ``LoRANotFound`` when
        none is loaded; ``LoRAInUse`` when one is in ``pinned`` (running requests use it;
        nothing is dropped): refused, not deferred, so that the caller knows when it is gone."""
        with self._lock:
            keys = [name] if name in self._cpu else [k for k, a in self._cpu.items()
                                                     if a.name == name]
            if not keys:
                raise LoRANotFound(f"LoRA adapter {name!r} is not loaded")
            busy = [k for k in keys if k in pinned]
            if busy:
                raise LoRAInUse(f"LoRA adapter {name!r} is in use by running requests: unload "
                                "it once they finish")
            for k in keys:
                self._drop(k)
            return keys

    def _drop(self, key: str) -> None:
        del self._cpu[key]
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._slots[slot] = None

    def names(self) -> list[str]:
        """The loaded adapters' keys (``name#id``), least recently used first."""
        with self._lock:
            return list(self._cpu)

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._cpu.values())

    def get(self, key: str) -> LoRAAdapter | None:
        with self._lock:
            return self._cpu.get(key)

    def has(self, key: str) -> bool:
        """Whether the adapter of ``key`` is loaded (a request of it may be admitted)."""
        with self._lock:
            return key in self._cpu

    # ------------------------------------------------------------------ the step

    def batch(self, row_adapters: Sequence[str | None]) -> LoRABatch | None:
        """The slots of one step whose row ``i`` runs under adapter ``row_adapters[i]`` (None:
        the base). None when no row has one (the model runs unchanged). Puts each adapter in a
        slot, evicting only adapters absent from this step; ``LoRAError`` when the step has more
        distinct adapters than ``max_loras`` (the scheduler never plans one) or one is not
        loaded."""
        present = list(dict.fromkeys(n for n in row_adapters if n is not None))
        if not present:
            return None
        if len(present) > self.max_loras:
            raise LoRAError(f"a step holds {len(present)} adapters, above max_loras "
                            f"{self.max_loras}")
        with self._lock:
            for name in present:
                if name not in self._slot_of:
                    self._fill(name, keep=present)
            slot_of = dict(self._slot_of)
        slots = [-1 if n is None else slot_of[n] for n in row_adapters]
        row_slots = torch.tensor(slots, dtype=torch.int64)
        host = [(slot_of[n], torch.nonzero(row_slots == slot_of[n]).flatten()) for n in present]
        # The kernels read ``rows``/``seg_start``/``seg_slot``: the segments stay on the host.
        segments = (host if self.use_triton or self.deterministic
                    else [(slot, r.to(self.device)) for slot, r in host])
        flat = torch.cat([rows for _, rows in host]).to(torch.int32)
        start = torch.tensor([0, *itertools.accumulate(r.numel() for _, r in host)],
                             dtype=torch.int32)
        seg_slot = torch.tensor([slot for slot, _ in host], dtype=torch.int32)
        batch = LoRABatch(row_slots.to(self.device), segments, {slot_of[n]: n for n in present},
                          flat.to(self.device), start.to(self.device), seg_slot.to(self.device),
                          self.use_triton, native=self.deterministic)
        if not self.use_triton and not self.deterministic:
            runs = _runs(slots)
            if self.device.type == "cpu" and len(runs) <= max(RUNS_MAX, 2 * len(present)):
                batch.runs = runs
            else:
                self._pad(batch, host)
        return batch

    def _pad(self, batch: LoRABatch, host: list[tuple[int, torch.Tensor]]) -> None:
        """The torch path's padded layout of ``batch``'s segments (see ``LoRABatch``)."""
        length = max(rows.numel() for _, rows in host)
        padded = torch.stack([torch.cat([rows, rows[:1].expand(length - rows.numel())])
                              for _, rows in host])
        dev = self.device
        batch.length = length
        batch.padded = padded.flatten().to(dev)
        if any(rows.numel() < length for _, rows in host):
            valid = torch.cat([torch.arange(rows.numel()) + i * length
                               for i, (_, rows) in enumerate(host)])
            batch.valid = valid.to(dev)
            batch.valid_rows = torch.cat([rows for _, rows in host]).to(dev)
        slots = [slot for slot, _ in host]
        if slots != list(range(self.max_loras)):
            batch.slot_index = torch.tensor(slots, dtype=torch.int64, device=dev)

    def _fill(self, name: str, keep: Sequence[str]) -> None:
        adapter = self._cpu.get(name)
        if adapter is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        slot = next((i for i, n in enumerate(self._slots) if n is None), None)
        if slot is None:
            slot = next(i for i, n in enumerate(self._slots) if n not in keep)
            old = self._slots[slot]
            if old is not None:
                del self._slot_of[old]
        r = adapter.rank
        for key, part in self._parts.items():
            w = adapter.weights.get(key)
            part.a[slot].zero_()
            part.b[slot].zero_()
            part.used[slot] = w is not None
            if w is not None:
                part.a[slot, :r].copy_(w[0])
                part.b[slot, :, :r].copy_(w[1])
            part.packed[slot] = self._pack(part, slot) if w is not None else None
        self._slots[slot] = name
        self._slot_of[name] = slot
        self._cpu.move_to_end(name)

    def _pack(self, part: _Part, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The deterministic mode's ``A`` and ``B`` of ``slot`` packed for the native kernel
        (the zero padding to ``max_lora_rank`` included: it adds exact zeros)."""
        if not self.deterministic:
            return None
        from tierserve.kernels.cpu_packing import pack_linear

        return pack_linear(part.a[slot]), pack_linear(part.b[slot])

    def warm_up(self) -> int:
        """Run the Triton kernels once on one row of every distinct projection part (input
        width, output rows, fused module width), so that no serving step compiles them;
        the output is discarded. Returns the launches made (0 on the torch path)."""
        if not self.use_triton:
            return 0
        from tierserve.kernels import lora as tlora

        dev = self.device
        rows = torch.zeros(1, dtype=torch.int32, device=dev)
        start = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        slot = torch.zeros(1, dtype=torch.int32, device=dev)
        seen: set[tuple[int, int, int]] = set()
        for part in self._parts.values():
            k = part.a.shape[2]
            width = part.offset + part.out_features
            key = (k, part.out_features, width)
            if key in seen:
                continue
            seen.add(key)
            x = torch.zeros(1, k, device=dev, dtype=self.dtype)
            out = torch.zeros(1, width, device=dev, dtype=self.dtype)
            tlora.lora_add(x, out, part.a, part.b, part.offset, rows, start, slot)
        return len(seen)

    def slot_names(self) -> list[str | None]:
        """Which adapter each slot holds (None: empty)."""
        with self._lock:
            return list(self._slots)

    @contextmanager
    def running(self, batch: LoRABatch | None) -> Iterator[None]:
        """``batch`` is the active one while the model runs within."""
        self.active = batch
        try:
            yield
        finally:
            self.active = None

    def close(self) -> None:
        """Remove the hooks (the model runs as it did before)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()



__all__ = [
    "LoRABatch", "LoRAError", "LoRAInUse", "LoRAManager", "LoRANotFound", "ModelShapes",
    "adapter_key", "apply_lora", "load_adapter", "model_identity", "read_adapter_config",
]
