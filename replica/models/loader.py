"""Load a model (the Llama family, Gemma 2/3: ``causal_lm``) and its tokenizer: the embedded default, a packaged model
(``tierserve.replica.models.catalog``: its GGUF installed from the package registry), a GGUF file or a
folder holding one (``tierserve.replica.models.gguf_loader``), a local checkpoint directory, or a Hugging
Face hub id.

A checkpoint directory holds ``config.json``, weights (``model.safetensors``, sharded
``*.safetensors`` with ``model.safetensors.index.json``, or ``pytorch_model.bin`` / its sharded
index) and tokenizer files. Hugging Face tensor names map onto ours with q/k/v fused into
``qkv_proj`` and gate/up into ``gate_up_proj``; a checkpoint that holds them fused already
(Phi-3's ``self_attn.qkv_proj`` rows ``[q | k | v]`` and ``mlp.gate_up_proj`` rows
``[gate | up]``, our order) is read as it is; a Gemma checkpoint's norm weights (offsets from
one) get their one added (``gemma.fold_norm_offsets``). Every failure is a ``ModelLoadError`` (a
``ValueError``) that names what was wrong.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Container, Iterator
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from tierserve.replica.models import embedded, gemma, gguf_loader
from tierserve.replica.models.config import GEMMA_ARCHITECTURES, ModelConfig, ModelLoadError
from tierserve.replica.models.layers import (
    Linear,
    SwiGLU,
    permute_rotary_rows_,
    rotary_permutation,
)
from tierserve.replica.models.llama import LlamaDecoderLayer, LlamaForCausalLM, ModelOptions
from tierserve.replica.models.meta import (
    _tokenizer_from,
    gguf_file,
    load_model_config,
    load_tokenizer,
    read_config,
    resolve_checkpoint,
)
from tierserve.replica.models.moe import MoEMLP

# The weight-free half (config, tokenizer) lives in tierserve.replica.models.meta; re-exported here.
__all__ = [
    "CausalLM",
    "ModelLoadError",
    "ModelOptions",
    "causal_lm",
    "default_dtype",
    "fill_weights",
    "gguf_file",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "load_weights",
    "read_config",
    "resolve_checkpoint",
    "weight_files",
]


# The model classes ``load_model`` builds.
CausalLM = LlamaForCausalLM | gemma.GemmaForCausalLM


def causal_lm(
    cfg: ModelConfig,
    options: ModelOptions | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> CausalLM:
    """The (unloaded) model of ``cfg.architecture``: ``GemmaForCausalLM`` for Gemma 2/3,
    ``LlamaForCausalLM`` for the rest."""
    if cfg.architecture in GEMMA_ARCHITECTURES:
        return gemma.GemmaForCausalLM(cfg, options, device, dtype)
    return LlamaForCausalLM(cfg, options, device, dtype)


def default_dtype(device: torch.device | str) -> torch.dtype:
    """fp32 on CPU, bf16 on CUDA and other accelerators."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def load_model(
    model: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    options: ModelOptions | None = None,
    trust_remote_code: bool = False,
) -> tuple[CausalLM, PreTrainedTokenizerBase, ModelConfig]:
    """Build the model, its tokenizer (a ``transformers`` fast tokenizer) and its config.

    ``model``: ``embedded.EMBEDDED_MODEL``, a packaged model's name, a GGUF file (or a folder
    holding one), a checkpoint directory or a hub id. ``dtype`` None means
    ``default_dtype(device)``. Raises ``ModelLoadError``.
    """
    dev = torch.device(device)
    dtype = dtype or default_dtype(dev)
    if model == embedded.EMBEDDED_MODEL:
        cfg = embedded.embedded_config()
        return embedded.build_model(options, dev, dtype), embedded.build_tokenizer(), cfg
    gguf = gguf_file(model)
    if gguf is not None:
        cfg = gguf_loader.gguf_model_config(gguf)
        net = causal_lm(cfg, options, dev, dtype)
        fill_weights(
            net,
            gguf_loader.gguf_weights(gguf, cfg),
            str(gguf),
            gguf_loader.gguf_tensor_namer(cfg.architecture),
        )
        tokenizer = gguf_loader.gguf_tokenizer(gguf)
    else:
        path = resolve_checkpoint(model)
        cfg = read_config(path, trust_remote_code)
        net = causal_lm(cfg, options, dev, dtype)
        load_weights(net, path)
        tokenizer = _tokenizer_from(path, trust_remote_code)
    if net.options.deterministic:
        net.pack_for_cpu()  # its layers run on the native kernel's packed weights
    return net.eval(), tokenizer, cfg


def weight_files(path: Path) -> list[Path]:
    """The weight files of a checkpoint, safetensors preferred. Raises ``ModelLoadError``."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = path / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (ValueError, KeyError, AttributeError) as e:
                raise ModelLoadError(f"{index} is not a valid weight index: {e}") from e
            files = [path / s for s in shards]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelLoadError(f"{index} names shard(s) that are missing: {missing}")
            return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    if (path / "pytorch_model.bin").is_file():
        return [path / "pytorch_model.bin"]
    raise ModelLoadError(
        f"no weight files in {path}: expected model.safetensors, sharded *.safetensors with "
        "model.safetensors.index.json, or pytorch_model.bin"
    )


def load_weights(model: CausalLM, path: Path) -> None:
    """Copy a checkpoint's tensors into ``model`` (casting to its dtype, moving to its device).

    Raises ``ModelLoadError`` naming missing tensors or a tensor whose shape does not match,
    or when the model's layers are already packed for the CPU kernel (load before packing).
    """
    _check_unpacked(model)
    wanted = set(_targets(model)) | set(_fused_targets(model)) | set(_aliases(model))
    files = weight_files(path)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            yield from _read_tensors(file, wanted)

    source = tensors()
    if isinstance(model, gemma.GemmaForCausalLM):
        source = gemma.fold_norm_offsets(source)
    fill_weights(model, source, f"checkpoint {path}")


def _check_unpacked(model: CausalLM) -> None:
    if any(getattr(m, "packed", False) for m in model.modules()):
        raise ModelLoadError(
            "the model's linear layers are packed for the native CPU kernel (pack_for_cpu); "
            "load weights into a model before packing it"
        )


def fill_weights(
    model: CausalLM,
    tensors: Iterator[tuple[str, torch.Tensor]],
    source: str,
    file_name: Callable[[str], str | None] | None = None,
) -> None:
    """Copy ``(Hugging Face name, tensor)`` pairs into ``model`` one at a time (cast to its dtype,
    moved to its device); names the model does not have are skipped. Raises ``ModelLoadError``
    for a misshapen tensor, for tensors the model needs that never came, and for a model whose
    layers are already packed. ``file_name`` gives a tensor's name in the source where it differs
    (a GGUF file's ``blk.1.ffn_up.weight``): errors name both.

    A fused tensor (``self_attn.qkv_proj.weight``, ``mlp.gate_up_proj.weight``, in our row order)
    stands for the split ones it holds. With partial rotary (``config.rotary_dim``) the q/k rows
    of every head are permuted once all came (``_permute_rotary``). A mixture-of-experts layer's
    experts come either one tensor per expert and matrix (``experts.3.w1.weight``,
    ``experts.3.gate_proj.weight``) or stacked as ``transformers`` 5 holds them
    (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``); Mixtral's may sit under
    ``block_sparse_moe`` or ``mlp`` (``_aliases``)."""
    _check_unpacked(model)
    targets = _targets(model)
    fused = _fused_targets(model)
    aliases = _aliases(model)
    covers = _covers(model)
    filled: set[str] = set()

    def named(name: str) -> str:
        other = file_name(name) if file_name is not None else None
        return name if other is None or other == name else f"{name} ({other} in the file)"

    with torch.no_grad():
        for name, tensor in tensors:
            name = aliases.get(name, name)
            target = targets.get(name)
            parts: tuple[str, ...] = (name,)
            if target is None and name in fused:
                target, parts = fused[name]
            if target is None:
                continue
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelLoadError(
                    f"{source}: tensor {named(name)} has shape {tuple(tensor.shape)}; "
                    f"the config implies {tuple(target.shape)}"
                )
            target.copy_(tensor)
            filled.update(parts)
    for _ in range(2):  # stacked experts: filled whole, in halves, or expert by expert
        for whole, held in covers.items():
            if whole in filled:
                filled.update(held)
            elif all(p in filled for p in held):
                filled.add(whole)
    # A stacked tensor is missing only where an expert's is: name those.
    missing = [n for n in targets if n not in filled and n not in covers]
    if missing:
        if model.config.architecture in _FUSED_LAYOUT:
            missing = _fused_names(missing, fused)
        shown = ", ".join(named(n) for n in missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        raise ModelLoadError(f"{source} lacks {len(missing)} tensor(s): {shown}")
    _permute_rotary(model)


# The architectures whose checkpoints hold q/k/v and gate/up fused: a missing tensor is named
# as they hold it.
_FUSED_LAYOUT = ("Phi3ForCausalLM",)


def _fused_names(
    missing: list[str], fused: dict[str, tuple[torch.Tensor, tuple[str, ...]]]
) -> list[str]:
    """``missing`` with the split names of each fused tensor that is missing whole replaced by
    the fused name (where it stood first)."""
    owner = {part: name for name, (_, parts) in fused.items() for part in parts}
    gone = set(missing)
    out: list[str] = []
    for n in missing:
        name = owner.get(n)
        if name is not None and set(fused[name][1]) <= gone:
            if name not in out:
                out.append(name)
        else:
            out.append(n)
    return out


def _permute_rotary(model: CausalLM) -> None:
    """Put the rows of every q and k head (weights, biases, Qwen3-style per-head norms) in
    ``layers.rotary_permutation``'s order, when the config rotates only part of each head."""
    cfg = model.config
    if cfg.rope_dim == cfg.head_dim:
        return
    perm = rotary_permutation(cfg.head_dim, cfg.rope_dim)
    q, kv = cfg.q_size, cfg.kv_size
    with torch.no_grad():
        for layer in model.model.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            attn = layer.self_attn
            for param in (attn.qkv_proj.weight, attn.qkv_proj.bias):
                if param is not None:
                    permute_rotary_rows_(param.data[:q], cfg.num_heads, perm)
                    permute_rotary_rows_(param.data[q : q + kv], cfg.num_kv_heads, perm)
            for norm in (attn.q_norm, attn.k_norm):
                if norm is not None:
                    permute_rotary_rows_(norm.weight.data, 1, perm)


def _targets(model: CausalLM) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of our parameter it fills: the embedding, the final norm, the
    head unless tied, and per layer its attention, its MLP (dense or experts) and its norms (two,
    or Gemma's four)."""
    cfg = model.config
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight.data,
        "model.norm.weight": model.model.norm.weight.data,
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight.data
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, (LlamaDecoderLayer, gemma.GemmaDecoderLayer))
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        qkv_params = [("weight", attn.qkv_proj.weight)]
        if attn.qkv_proj.bias is not None:
            qkv_params.append(("bias", attn.qkv_proj.bias))
        for kind, param in qkv_params:
            out[f"{p}self_attn.q_proj.{kind}"] = param.data[:q]
            out[f"{p}self_attn.k_proj.{kind}"] = param.data[q : q + kv]
            out[f"{p}self_attn.v_proj.{kind}"] = param.data[q + kv :]
        out[f"{p}self_attn.o_proj.weight"] = attn.o_proj.weight.data
        if attn.q_norm is not None and attn.k_norm is not None:
            out[f"{p}self_attn.q_norm.weight"] = attn.q_norm.weight.data
            out[f"{p}self_attn.k_norm.weight"] = attn.k_norm.weight.data
        if attn.o_proj.bias is not None:
            out[f"{p}self_attn.o_proj.bias"] = attn.o_proj.bias.data
        if isinstance(mlp, SwiGLU):  # Gemma's GeluMLP is one too
            out[f"{p}mlp.gate_proj.weight"] = mlp.gate_up_proj.weight.data[:inter]
            out[f"{p}mlp.up_proj.weight"] = mlp.gate_up_proj.weight.data[inter:]
            out[f"{p}mlp.down_proj.weight"] = mlp.down_proj.weight.data
        else:
            out.update(_moe_targets(mlp, p, cfg.architecture))
        norms = gemma.LAYER_NORMS if isinstance(layer, gemma.GemmaDecoderLayer) else (
            "input_layernorm", "post_attention_layernorm")
        for norm in norms:
            out[f"{p}{norm}.weight"] = getattr(layer, norm).weight.data
    return out


def _fused_targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, tuple[str, ...]]]:
    """Fused checkpoint names (Phi-3's) -> (the parameter they fill whole, the split names in
    ``_targets`` they stand for). Our rows are in their order: ``[q | k | v]``, ``[gate | up]``.
    Gemma checkpoints hold them split: none."""
    out: dict[str, tuple[torch.Tensor, tuple[str, ...]]] = {}
    if isinstance(model, gemma.GemmaForCausalLM):
        return out
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for kind, param in (("weight", attn.qkv_proj.weight), ("bias", attn.qkv_proj.bias)):
            if param is not None:
                out[f"{p}self_attn.qkv_proj.{kind}"] = (
                    param.data,
                    tuple(f"{p}self_attn.{x}_proj.{kind}" for x in ("q", "k", "v")),
                )
        gate_up = getattr(layer.mlp, "gate_up_proj", None)  # a dense MLP's (not experts')
        if isinstance(gate_up, Linear):
            out[f"{p}mlp.gate_up_proj.weight"] = (
                gate_up.weight.data,
                (f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"),
            )
    return out


# Per-expert tensor names: (gate, up, down) under each architecture's expert module.
_EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
    "Qwen2MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


def expert_names(arch: str, prefix: str, expert: int) -> tuple[str, str, str]:
    """The Hugging Face names of expert ``expert``'s gate, up and down weights in the layer of
    ``prefix`` (``model.layers.{i}.``), as the architecture's checkpoints name them."""
    module, gate, up, down = _EXPERT_NAMES[arch]
    stem = f"{prefix}{module}.experts.{expert}."
    return f"{stem}{gate}.weight", f"{stem}{up}.weight", f"{stem}{down}.weight"


def _moe_targets(mlp: torch.nn.Module, p: str, arch: str) -> dict[str, torch.Tensor]:
    """A mixture-of-experts layer's targets: the router, the stacked experts (as
    ``transformers`` 5 names them) and each expert's views of them, the shared expert."""
    assert isinstance(mlp, MoEMLP)
    module = _EXPERT_NAMES[arch][0]
    gate_up, down = mlp.experts.gate_up_proj.data, mlp.experts.down_proj.data
    inter = mlp.experts.intermediate_size
    out = {
        f"{p}{module}.gate.weight": mlp.gate.weight.data,
        f"{p}mlp.experts.gate_up_proj": gate_up,
        f"{p}mlp.experts.down_proj": down,
        # The experts' gate and up weights stacked apart, ``[E, I, hidden]`` each (GGUF's
        # ffn_gate_exps and ffn_up_exps).
        f"{p}mlp.experts.gate_proj": gate_up[:, :inter],
        f"{p}mlp.experts.up_proj": gate_up[:, inter:],
    }
    for e in range(mlp.experts.num_experts):
        g, u, d = expert_names(arch, p, e)
        out[g], out[u], out[d] = gate_up[e, :inter], gate_up[e, inter:], down[e]
    if mlp.shared_expert is not None and mlp.shared_expert_gate is not None:
        shared, sinter = mlp.shared_expert, mlp.shared_expert.down_proj.in_features
        out[f"{p}mlp.shared_expert.gate_proj.weight"] = shared.gate_up_proj.weight.data[:sinter]
        out[f"{p}mlp.shared_expert.up_proj.weight"] = shared.gate_up_proj.weight.data[sinter:]
        out[f"{p}mlp.shared_expert.down_proj.weight"] = shared.down_proj.weight.data
        out[f"{p}mlp.shared_expert_gate.weight"] = mlp.shared_expert_gate.weight.data
    return out


def _moe_layers(model: CausalLM) -> Iterator[tuple[str, MoEMLP]]:
    if isinstance(model, gemma.GemmaForCausalLM):  # Gemma has no experts
        return
    for i, layer in enumerate(model.model.layers):
        assert isinstance(layer, LlamaDecoderLayer)
        if isinstance(layer.mlp, MoEMLP):
            yield f"model.layers.{i}.", layer.mlp


def _aliases(model: CausalLM) -> dict[str, str]:
    """Other names of our targets: a Mixtral layer's experts and router under ``mlp`` (how
    ``transformers`` 5 holds them) and its stacked experts under ``block_sparse_moe``."""
    out: dict[str, str] = {}
    if model.config.architecture != "MixtralForCausalLM":
        return out
    for p, mlp in _moe_layers(model):
        out[f"{p}mlp.gate.weight"] = f"{p}block_sparse_moe.gate.weight"
        for stacked in ("gate_up_proj", "down_proj"):
            out[f"{p}block_sparse_moe.experts.{stacked}"] = f"{p}mlp.experts.{stacked}"
        for e in range(mlp.experts.num_experts):
            for name in expert_names("MixtralForCausalLM", p, e):
                out[name.replace(".block_sparse_moe.", ".mlp.", 1)] = name
    return out


def _covers(model: CausalLM) -> dict[str, tuple[str, ...]]:
    """Each stacked expert tensor -> the per-expert targets it holds (either fills both)."""
    arch = model.config.architecture
    out: dict[str, tuple[str, ...]] = {}
    for p, mlp in _moe_layers(model):
        names = [expert_names(arch, p, e) for e in range(mlp.experts.num_experts)]
        out[f"{p}mlp.experts.gate_proj"] = tuple(g for g, _, _ in names)
        out[f"{p}mlp.experts.up_proj"] = tuple(u for _, u, _ in names)
        out[f"{p}mlp.experts.gate_up_proj"] = tuple(n for g, u, _ in names for n in (g, u))
        out[f"{p}mlp.experts.down_proj"] = tuple(d for _, _, d in names)
    return out


def _read_tensors(
    file: Path, wanted: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``file`` named in ``wanted``, one at a time (on CPU)."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in wanted:
                        yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
        return
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        state = None
    except Exception as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e
    if state is None:
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True)
        except Exception as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    for name, tensor in state.items():
        if name in wanted:
            yield name, tensor


