"""bench.throughput's run labels: vLLM's matched run carries only the caps it was given (a
missing key failed the whole vLLM run with a KeyError)."""

from __future__ import annotations

from bench.throughput import _fmt_options


def test_a_run_label_names_only_the_caps_it_was_given() -> None:
    assert _fmt_options({"max_model_len": 1024, "max_num_seqs": 128,
                         "max_num_batched_tokens": 1024}) == (
        "max_num_seqs=128 max_num_batched_tokens=1024")
    assert _fmt_options({"max_num_seqs": 8, "max_num_batched_tokens": 256,
                         "prefill_chunk_tokens": 512, "num_kv_blocks": 64}) == (
        "max_num_seqs=8 max_num_batched_tokens=256 prefill_chunk_tokens=512 num_kv_blocks=64")
