"""What ``tierserve-tiny`` is, without its weights: its name, config, special tokens, chat
template and byte-level tokenizer. Torch-free (the ingress tokenizes with it); the weights are
built by ``tierserve.replica.models.embedded``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:  # imported where the tokenizer is built: transformers takes ~0.5 s to import
    from transformers import PreTrainedTokenizerFast

from tierserve.replica.models.byte_level import byte_chars
from tierserve.replica.models.config import ModelConfig

EMBEDDED_MODEL = "tierserve-tiny"
SEED = 0x7E5E
SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role ' ~ message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def embedded_config() -> ModelConfig:
    """4 layers, hidden 256, 8 query and 2 KV heads of 32, MLP 768, 2048 positions, tied head."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=256 + len(SPECIAL_TOKENS),
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=768,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        pad_token_id=PAD_ID,
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: every byte is a token (no merges); encoding prepends ``<|bos|>``;
    decoding any id sequence works (invalid UTF-8 becomes U+FFFD)."""
    chars = _byte_chars()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A",
        pair="<|bos|> $A <|bos|> $B",
        special_tokens=[("<|bos|>", BOS_ID)],
    )
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def _byte_chars() -> dict[int, str]:
    """A printable stand-in character for every byte (the byte-level pre-tokenizer's alphabet)."""
    return byte_chars()
