"""Tiny PEFT adapters for the LoRA tests: a tiny random Llama written by ``transformers`` and
adapters made by ``peft`` on it, with ``B`` randomized (a fresh adapter's ``B`` is 0, a no-op)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.replica.models.helpers import save_checkpoint, tiny_hf_model

# name -> LoraConfig keywords: ranks, alphas and targets that differ, rsLoRA on one.
ADAPTERS: dict[str, dict[str, Any]] = {
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "beta": dict(r=8, lora_alpha=16, use_rslora=True,
                 target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    "gamma": dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"]),
}


def make_adapter(base: Any, path: Path, seed: int, **lora: Any) -> Path:
    """Save a PEFT adapter of ``lora``'s settings on ``base`` (left unchanged) under ``path``,
    its A and B drawn from ``seed``."""
    import peft

    model = peft.get_peft_model(base, peft.LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(str(path))
    model.unload()  # the base model's modules back as they were
    return path


def write_checkpoint(root: Path, kind: str = "llama-gqa") -> tuple[Path, dict[str, Path]]:
    """A tiny checkpoint under ``root/base`` and the ``ADAPTERS`` under ``root/<name>``."""
    hf = tiny_hf_model(kind)
    base = save_checkpoint(hf, root / "base")
    paths = {name: make_adapter(hf, root / name, seed=i + 1, **cfg)
             for i, (name, cfg) in enumerate(ADAPTERS.items())}
    return base, paths


def reference(base: Path, adapters: dict[str, Path]) -> Any:
    """transformers + PEFT over ``base`` with every adapter loaded (by name)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(hf, str(adapters[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(str(adapters[name]), adapter_name=name)
    return model.eval()


@torch.no_grad()
def greedy(model: Any, adapter: str | None, prompt: list[int], new: int) -> list[int]:
    """Greedy tokens of ``prompt`` under ``adapter`` (None: the base) by full forwards."""
    ids = list(prompt)
    out = []
    ctx = model.disable_adapter() if adapter is None else _Using(model, adapter)
    with ctx:
        for _ in range(new):
            t = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
    return out


@torch.no_grad()
def logits(model: Any, adapter: str | None, prompt: list[int]) -> torch.Tensor:
    ctx = model.disable_adapter() if adapter is None else _Using(model, adapter)
    with ctx:
        return model(torch.tensor([prompt])).logits[0]


class _Using:
    def __init__(self, model: Any, name: str) -> None:
        self.model, self.name = model, name

    def __enter__(self) -> None:
        self.model.set_adapter(self.name)

    def __exit__(self, *exc: object) -> None:
        return None


def edit_config(path: Path, **changes: Any) -> None:
    """Rewrite keys of ``path``'s adapter_config.json."""
    cfg_path = path / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(changes)
    cfg_path.write_text(json.dumps(cfg))
