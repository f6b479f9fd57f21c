"""The embedded default model ``tierserve-tiny``: a small Llama with fixed pseudo-random weights and
a byte-level tokenizer, built in-process (no download). Its text is gibberish by design.

Weights: integers from a seeded ``torch.Generator`` (``randint``: integer-only sampling, no
transcendental math) scaled by a constant in fp32, so every machine and thread count gives the
same bits. Tokenizer: ids 0-255 are the bytes, then the special tokens of ``SPECIAL_TOKENS``.
"""

from __future__ import annotations

import math

import torch

from tierserve.replica.models.embedded_spec import (
    BOS_ID,
    CHAT_TEMPLATE,
    EMBEDDED_MODEL,
    EOS_ID,
    PAD_ID,
    SEED,
    SPECIAL_TOKENS,
    _byte_chars,
    build_tokenizer,
    embedded_config,
)
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions, check_deterministic

__all__ = [
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EMBEDDED_MODEL",
    "EOS_ID",
    "PAD_ID",
    "SEED",
    "SPECIAL_TOKENS",
    "_byte_chars",
    "build_model",
    "build_tokenizer",
    "embedded_config",
]

_INT_RANGE = 1 << 12


def build_model(
    options: ModelOptions | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """The embedded model, weights generated on CPU in fp32 then cast/moved."""
    if options is not None:
        # Refuse before generating weights (the model is built on CPU in fp32, then moved).
        check_deterministic(options, embedded_config(), device, dtype)
    model = LlamaForCausalLM(embedded_config(), options, device="cpu", dtype=torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Uniform in [-a, a): std a / sqrt(3). Linears get std 1 / sqrt(fan_in); the
            # (tied) embedding std 0.07, so logits spread by about one unit.
            a = 0.125 if "embed_tokens" in name else math.sqrt(3.0 / param.shape[1])
            torch.randint(-_INT_RANGE, _INT_RANGE, tuple(param.shape), generator=gen, out=param)
            param.mul_(a / _INT_RANGE)
    model = model.to(device=device, dtype=dtype).eval()
    if model.options.deterministic:
        model.pack_for_cpu()  # checks the mode can run here; its layers need the packed weights
    return model
