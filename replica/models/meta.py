"""A model's config and tokenizer without its weights (and without torch): what the ingress
needs to validate and tokenize requests. The embedded model, a packaged model, a GGUF file (its
metadata), a checkpoint directory or a hub id (config and tokenizer files only)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported where a tokenizer is loaded, not with the module
    from transformers import PreTrainedTokenizerBase

from tierserve.replica.models import embedded_spec, gguf_loader
from tierserve.replica.models.catalog import packaged_file
from tierserve.replica.models.config import ModelConfig, ModelLoadError

_CONFIG_FILES = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "tokenizer*"]


def load_tokenizer(model: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer alone, a ``PreTrainedTokenizerBase`` (typed ``Any``: its methods' unions of
    return types get in callers' way); no weights are read or fetched. Raises ``ModelLoadError``."""
    if model == embedded_spec.EMBEDDED_MODEL:
        return embedded_spec.build_tokenizer()
    gguf = gguf_file(model)
    if gguf is not None:
        return gguf_loader.gguf_tokenizer(gguf)
    return _tokenizer_from(resolve_checkpoint(model, weights=False), trust_remote_code)


def load_model_config(model: str, trust_remote_code: bool = False) -> ModelConfig:
    """The model's config alone (no weights read or fetched). Raises ``ModelLoadError``."""
    if model == embedded_spec.EMBEDDED_MODEL:
        return embedded_spec.embedded_config()
    gguf = gguf_file(model)
    if gguf is not None:
        return gguf_loader.gguf_model_config(gguf)
    return read_config(resolve_checkpoint(model, weights=False), trust_remote_code)


def resolve_checkpoint(model: str, weights: bool = True) -> Path:
    """A local directory for ``model``: the directory itself, or a hub snapshot (downloaded once,
    then cached by ``huggingface_hub``; ``weights`` False fetches config and tokenizer only)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ModelLoadError(
            f"model {model!r} is not a checkpoint directory, a hub id (org/name) or "
            f"{embedded_spec.EMBEDDED_MODEL!r}"
        )
    patterns = [*_CONFIG_FILES, "*.safetensors"] if weights else _CONFIG_FILES
    try:
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(model, allow_patterns=patterns))
        if weights and not any(local.glob("*.safetensors")):
            local = Path(snapshot_download(model, allow_patterns=[*_CONFIG_FILES, "*.bin"]))
    except Exception as e:
        raise ModelLoadError(
            f"model {model!r} is not a local directory and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e})"
        ) from e
    return local


def read_config(path: Path, trust_remote_code: bool = False) -> ModelConfig:
    """``ModelConfig`` from ``path/config.json`` through ``AutoConfig`` (plus the end-of-sequence
    ids of ``generation_config.json``). Raises ``ModelLoadError``."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} has no config.json; a checkpoint directory needs config.json, weights and "
            "tokenizer files (as written by save_pretrained)"
        )
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
    cfg = ModelConfig.from_hf(hf)
    extra = _generation_eos(path)
    if extra:
        eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *extra)))
        cfg = dataclasses.replace(cfg, eos_token_ids=eos)
    return cfg


def _generation_eos(path: Path) -> tuple[int, ...]:
    """End-of-sequence ids of ``generation_config.json`` (chat models often list more there)."""
    file = path / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (ValueError, AttributeError):
        return ()
    if isinstance(eos, int):
        return (eos,)
    if isinstance(eos, list):
        return tuple(e for e in eos if isinstance(e, int))
    return ()


def gguf_file(model: str) -> Path | None:
    """The GGUF file ``model`` stands for (a packaged model, a ``.gguf`` file, a folder holding
    one), or None. Raises ``ModelLoadError`` (a packaged model whose package is missing)."""
    return packaged_file(model) or gguf_loader.find_gguf(model)


def _tokenizer_from(path: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(
            f"cannot load a tokenizer from {path} ({type(e).__name__}: {e}); the checkpoint "
            "directory needs tokenizer files (tokenizer.json or tokenizer.model)"
        ) from e
