"""The offline API on the real default model (SmolLM2-135M-Instruct), short: ``LLM()`` with no
argument, vLLM's shapes from ``generate`` (``n``, log-probabilities) and ``chat``. The shapes'
details are tested on the tiny model (tests/replica/test_llm.py, tests/cluster/test_offline_chat.py)."""

from __future__ import annotations

import pytest

from tierserve import LLM, SamplingParams

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=64, max_num_seqs=4)


def test_generate_with_n_samples_and_logprobs(llm: LLM) -> None:
    p = SamplingParams(n=2, max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=1)
    (r,) = llm.generate("The capital of France is", p, use_tqdm=False)
    assert r.prompt == "The capital of France is" and r.finished
    first, second = r.outputs
    assert [first.index, second.index] == [0, 1]
    assert first.text.startswith(" Paris") and second.token_ids == first.token_ids  # greedy
    assert first.logprobs is not None and all(
        e[t].rank == 1 and e[t].decoded_token for t, e in zip(first.token_ids, first.logprobs,
                                                              strict=True))
    assert first.cumulative_logprob is not None and first.cumulative_logprob < 0
    assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(r.prompt_token_ids)


def test_chat_renders_the_conversation_with_the_models_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    (r,) = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert r.prompt_token_ids == list(tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert r.prompt is not None and r.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in r.outputs[0].text
