"""Differential truth: our paged model against ``transformers``' own model on the same tiny random
checkpoint (saved with ``save_pretrained``, loaded through our loader), in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.replica.models.helpers import (
    TINY_KINDS,
    TINY_MAX_MODEL_LEN,
    PagedHarness,
    Work,
    hf_state_dict,
    save_checkpoint,
    tiny_hf_model,
)
from tierserve.replica.models.embedded import build_model
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions
from tierserve.replica.models.loader import load_model

pytestmark = pytest.mark.slow

LENGTHS = (1, 2, 3, 7, 12, 20, 33, 50)
NEW_TOKENS = 32


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in LENGTHS]


def _hf_greedy(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    """``generate`` (greedy) on a left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return [row[width:] for row in out.tolist()]


@pytest.fixture(scope="module", params=TINY_KINDS)
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Any, LlamaForCausalLM]:
    hf = tiny_hf_model(request.param)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    options = ModelOptions(max_model_len=TINY_MAX_MODEL_LEN.get(request.param))
    ours, _, cfg = load_model(str(path), dtype=torch.float32, device="cpu", options=options)
    assert cfg.vocab_size == hf.config.vocab_size
    return hf, ours


def test_prefill_logits_match_transformers(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size)
    # All eight prompts in one flat batch; every row's logits.
    got = PagedHarness(ours, len(prompts), 64).step(
        [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True
    )
    for p, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        assert logits.shape == want.shape
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)


def test_greedy_tokens_match_generate(pair: tuple[Any, LlamaForCausalLM]) -> None:
    hf, ours = pair
    prompts = _prompts(hf.config.vocab_size, seed=1)
    got = PagedHarness(ours, len(prompts), 96).greedy(prompts, NEW_TOKENS)
    assert got == _hf_greedy(hf, prompts)


def test_sharded_safetensors_and_pytorch_bin_load_the_same_weights(tmp_path: Path) -> None:
    hf = tiny_hf_model("llama-gqa", seed=3)
    single, _, _ = load_model(str(save_checkpoint(hf, tmp_path / "single")))
    sharded_dir = save_checkpoint(hf, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    sharded, _, _ = load_model(str(sharded_dir))
    bin_dir = tmp_path / "bin"
    save_checkpoint(hf, bin_dir)
    for f in bin_dir.glob("*.safetensors*"):
        f.unlink()
    torch.save(hf.state_dict(), bin_dir / "pytorch_model.bin")
    from_bin, _, _ = load_model(str(bin_dir))
    want = single.state_dict()
    for other in (sharded, from_bin):
        got = other.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_embedded_model_is_a_llama_to_transformers() -> None:
    ours = build_model()
    cfg = ours.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        tie_word_embeddings=True,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.load_state_dict(hf_state_dict(ours), strict=True)
    prompt = _prompts(cfg.vocab_size, seed=2)[-1]
    got = PagedHarness(ours, 1, 64).step([Work(0, 0, prompt)], all_rows=True)[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_qwen3_greedy_through_the_engine_in_chunks_and_across_preemption(
    deterministic: bool, tmp_path: Path
) -> None:
    """The whole engine (``LLM``) on a tiny Qwen3 checkpoint written by ``transformers``' own
    classes (per-head q/k norms, head_dim 32 != hidden / heads): eight prompts prefilled in
    chunks of 7 tokens, a KV pool of 10 blocks that cannot hold them all (requests are preempted
    and recomputed), greedy tokens equal to ``transformers``' ``generate``, in the default and
    the deterministic mode."""
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    hf = tiny_hf_model("qwen3", seed=7)
    assert hf.config.head_dim != hf.config.hidden_size // hf.config.num_attention_heads
    path = save_checkpoint(hf, tmp_path / "qwen3")
    prompts = _prompts(hf.config.vocab_size, seed=4)
    want = _hf_greedy(hf, prompts)
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        deterministic=deterministic,
        num_kv_blocks=10,
        block_size=16,
        max_num_seqs=8,
        max_model_len=128,
        prefill_chunk_tokens=7,
    )
    assert llm.engine.model_config.qk_norm
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.stats()
    assert stats.preemptions > 0 and stats.free_blocks == 10
