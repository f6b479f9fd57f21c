"""The embedded default: same weights on every build (and machine), a byte tokenizer that
round-trips text and any bytes, a working chat template, and the loader's name for it."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

from tierserve.replica.models.embedded import (
    BOS_ID,
    EMBEDDED_MODEL,
    EOS_ID,
    PAD_ID,
    build_model,
    build_tokenizer,
    embedded_config,
)
from tierserve.replica.models.loader import load_model, load_tokenizer

# sha256 over (name, fp32 bytes) of the sorted state dict; changes only if the weights change.
WEIGHTS_SHA256 = "11870c39c691699db5b167185cbbfa4821e0e484247cadd7da29e31cde10a483"


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def test_weights_are_the_same_on_every_build() -> None:
    a, b = build_model(), build_model()
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert _digest(a) == WEIGHTS_SHA256


def test_weights_do_not_depend_on_the_thread_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _digest(build_model()) == WEIGHTS_SHA256
    finally:
        torch.set_num_threads(before)


def test_loader_builds_the_embedded_default() -> None:
    model, tok, cfg = load_model(EMBEDDED_MODEL)
    assert cfg == embedded_config()
    assert cfg.vocab_size == len(tok) == 263
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (4, 256, 8, 2)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    assert cfg.bos_token_id == tok.bos_token_id == BOS_ID
    assert cfg.eos_token_ids == (tok.eos_token_id,) == (EOS_ID,)
    assert tok.pad_token_id == PAD_ID
    assert load_tokenizer(EMBEDDED_MODEL).encode("x") == tok.encode("x")


def test_text_round_trips() -> None:
    tok = build_tokenizer()
    for text in [
        "",
        "hello world",
        "  spaces\tand\nlines ",
        "héllo wörld",
        "日本語 🙂 ∑",
        "<b>&amp;",
    ]:
        ids = tok.encode(text)
        assert ids[0] == BOS_ID
        assert ids[1:] == list(text.encode("utf-8"))
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_any_bytes_decode_like_python_with_replacement() -> None:
    tok = build_tokenizer()
    rng = random.Random(0)
    cases = [bytes(range(256)), b"\xff\xfe", b"\xe2\x82", b"ok\xc3", b"\xf0\x9f\x99"]
    cases += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(200)]
    for raw in cases:
        assert tok.decode(list(raw)) == raw.decode("utf-8", errors="replace")


def test_special_tokens_and_decode_of_mixed_ids() -> None:
    tok = build_tokenizer()
    assert tok.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"]) == [BOS_ID, EOS_ID, PAD_ID]
    assert tok.decode([BOS_ID, 104, 105, EOS_ID]) == "<|bos|>hi<|eos|>"
    assert tok.decode([BOS_ID, 104, 105, EOS_ID], skip_special_tokens=True) == "hi"


def test_chat_template() -> None:
    tok = build_tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\n"
    enc: Any = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids: list[int] = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    role_ids = [tok.convert_tokens_to_ids(t) for t in ("<|system|>", "<|user|>", "<|end|>")]
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert all(r in ids for r in role_ids)
    assert tok.decode(ids) == text
