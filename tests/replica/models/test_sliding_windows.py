"""Sliding-window models: ``ModelConfig.layer_windows`` from Hugging Face configs, and tiny
checkpoints with windows far shorter than their prompts against ``transformers``' own models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tests.replica.models.helpers import PagedHarness, Work, save_checkpoint, tiny_hf_model
from tierserve.kernels import cpu_native
from tierserve.replica.models.config import ModelConfig, ModelLoadError
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions
from tierserve.replica.models.loader import load_model

WINDOW = 8
PROMPT_LENGTHS = (20, 27, 33, 50)
NEW_TOKENS = 12


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    out = hf.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def _base(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=3,
        max_position_embeddings=512,
    )
    base.update(overrides)
    return base


def test_mistral_windows_every_layer() -> None:
    cfg = ModelConfig.from_hf(transformers.MistralConfig(**_base(sliding_window=16)))
    assert cfg.sliding_window == 16 and cfg.layer_types is None
    assert cfg.layer_windows() == (16, 16, 16)
    full = ModelConfig.from_hf(transformers.MistralConfig(**_base(sliding_window=None)))
    assert full.layer_windows() == (None, None, None)


def test_qwen2_windows_the_layers_its_config_names() -> None:
    """From ``max_window_layers`` (transformers derives ``layer_types`` from it), from an explicit
    ``layer_types``, and none without ``use_sliding_window``."""
    derived = transformers.Qwen2Config(
        **_base(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    )
    cfg = ModelConfig.from_hf(derived)
    assert cfg.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert cfg.layer_windows() == (None, 16, 16)
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    explicit = transformers.Qwen3Config(
        **_base(use_sliding_window=True, sliding_window=16, layer_types=types)
    )
    assert ModelConfig.from_hf(explicit).layer_windows() == (16, None, 16)
    off = transformers.Qwen2Config(**_base(sliding_window=16))
    assert ModelConfig.from_hf(off).layer_windows() == (None, None, None)


def test_layer_types_survive_the_json_round_trip() -> None:
    hf = transformers.Qwen2Config(
        **_base(use_sliding_window=True, sliding_window=16, max_window_layers=2)
    )
    cfg = ModelConfig.from_hf(hf)
    back = ModelConfig.from_json(json.loads(json.dumps(cfg.to_json())))
    assert back == cfg and back.layer_windows() == (None, None, 16)
    legacy = cfg.to_json()
    del legacy["layer_types"]  # a config written before the field existed
    assert ModelConfig.from_json(legacy).layer_types is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"layer_types": ("full_attention",)}, "names 1 layers but the model has 3"),
        (
            {"layer_types": ("full_attention", "linear_attention", "full_attention")},
            "'linear_attention' not supported",
        ),
        ({"sliding_window": 0}, "sliding_window must be at least 1"),
    ],
)
def test_bad_layer_types_or_window_are_refused(change: dict[str, Any], message: str) -> None:
    data = ModelConfig.from_hf(transformers.MistralConfig(**_base(sliding_window=16))).to_json()
    data.update(change)
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_json(data)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = tiny_hf_model("mistral", seed=5, sliding_window=WINDOW, attn_implementation="eager")
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("mistral-window"))


def test_a_window_shorter_than_the_context_is_served(mistral: tuple[Any, Path]) -> None:
    """No longer refused: the model serves its whole context with its window."""
    _, path = mistral
    model, _, cfg = load_model(str(path), dtype=torch.float32, device="cpu")
    assert cfg.sliding_window == WINDOW < model.max_model_len
    assert all(layer.self_attn.window == WINDOW for layer in model.model.layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("deterministic", "native"),
    [(False, False), (False, True), (True, True)],
    ids=["torch", "native", "deterministic"],
)
def test_mistral_window_greedy_tokens_match_transformers(
    mistral: tuple[Any, Path],
    deterministic: bool,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Window 8 on prompts of 20 to 50 tokens: prefill logits of every row and greedy tokens as
    ``transformers`` computes them, with the prompt whole and in chunks of 7."""
    if native and not cpu_native.available():
        pytest.skip(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
    monkeypatch.setattr(cpu_native, "enabled", native)
    hf, path = mistral
    options = ModelOptions(deterministic=deterministic)
    ours, _, _ = load_model(str(path), dtype=torch.float32, device="cpu", options=options)
    prompts = _prompts(hf.config.vocab_size, seed=3)
    got = PagedHarness(ours, len(prompts), 96).step(
        [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True
    )
    for p, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    greedy = PagedHarness(ours, len(prompts), 96).greedy(prompts, NEW_TOKENS)
    assert greedy == [_hf_greedy(hf, p) for p in prompts]
    chunked = _greedy_in_chunks(ours, prompts[-1], 7)
    assert chunked == greedy[-1]


def _greedy_in_chunks(model: LlamaForCausalLM, prompt: list[int], chunk: int) -> list[int]:
    """The prompt prefilled ``chunk`` tokens a step beside another sequence's decodes, then
    greedy decodes: a window cutting through the cached prefix of every chunk."""
    harness = PagedHarness(model, 2, 96)
    other = [7]
    for start in range(0, len(prompt), chunk):
        logits = harness.step(
            [Work(0, start, prompt[start : start + chunk]), Work(1, len(other) - 1, [other[-1]])]
        )
        other.append(int(logits[1].argmax()))
    out = [int(logits[0].argmax())]
    for _ in range(NEW_TOKENS - 1):
        out.append(int(harness.step([Work(0, len(prompt) + len(out) - 1, [out[-1]])])[0].argmax()))
    return out


@pytest.mark.slow
def test_qwen2_with_some_windowed_layers_matches_transformers(tmp_path: Path) -> None:
    """Layer 0 full, layer 1 windowed (``max_window_layers=1``): each layer gets its own window."""
    hf = tiny_hf_model(
        "qwen2",
        seed=6,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
        attn_implementation="eager",
    )
    assert list(hf.config.layer_types) == ["full_attention", "sliding_attention"]
    ours, _, cfg = load_model(str(save_checkpoint(hf, tmp_path / "c")), dtype=torch.float32)
    assert cfg.layer_windows() == (None, WINDOW)
    prompts = _prompts(hf.config.vocab_size, seed=4)
    got = PagedHarness(ours, len(prompts), 96).step(
        [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True
    )
    for p, logits in zip(prompts, got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits, want, rtol=0, atol=1e-4)
    greedy = PagedHarness(ours, len(prompts), 96).greedy(prompts, NEW_TOKENS)
    assert greedy == [_hf_greedy(hf, p) for p in prompts]


@pytest.mark.slow
def test_mistral_window_through_the_engine_with_prefix_cache_chunks_and_preemption(
    mistral: tuple[Any, Path],
) -> None:
    """The whole engine on the window-8 checkpoint: prompts that share a 40-token prefix (the
    second and later admissions read it from the prefix cache, a window cutting through it),
    prefilled in chunks of 7, in a pool of 10 blocks too small for all of them (requests are
    preempted and recomputed): greedy tokens equal to ``transformers``' on every prompt."""
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    hf, path = mistral
    gen = torch.Generator().manual_seed(9)
    shared = torch.randint(0, hf.config.vocab_size, (40,), generator=gen).tolist()
    prompts = [
        shared + torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist()
        for n in (3, 9, 1, 14, 6, 11)
    ]
    want = [_hf_greedy(hf, p) for p in prompts]
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        num_kv_blocks=10,
        block_size=16,
        max_num_seqs=6,
        max_model_len=128,
        prefill_chunk_tokens=7,
    )
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any((o.num_cached_tokens or 0) > 0 for o in outs), "no prompt read the shared prefix"
    assert llm.stats().preemptions > 0
