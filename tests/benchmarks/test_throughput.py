"""benchmarks.throughput's pieces: run labels (vLLM's matched run carries only the caps it was given:
a missing key failed the whole vLLM run with a KeyError), the shared-prefix mix, the caps on
running requests, and cases that run and summarize apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.throughput import _fmt_options


def test_a_run_label_names_only_the_caps_it_was_given() -> None:
    assert _fmt_options({"max_model_len": 1024, "max_num_seqs": 128,
                         "max_num_batched_tokens": 1024}) == (
        "max_num_seqs=128 max_num_batched_tokens=1024")
    assert _fmt_options({"max_num_seqs": 8, "max_num_batched_tokens": 256,
                         "prefill_chunk_tokens": 512, "num_kv_blocks": 64}) == (
        "max_num_seqs=8 max_num_batched_tokens=256 prefill_chunk_tokens=512 num_kv_blocks=64")


def test_the_shared_mix_shares_whole_prefixes_and_keeps_its_lengths() -> None:
    from benchmarks.throughput import (
        SHARED_PREFIX_TOKENS,
        SHARED_PREFIXES,
        make_mix,
        request_mix,
    )

    mix = make_mix("shared", 10, (5, 900), seed=3)
    assert len(mix) == 10
    heads = [r.prompt[:SHARED_PREFIX_TOKENS] for r in mix]
    assert len(set(heads)) == SHARED_PREFIXES
    for i, r in enumerate(mix):
        assert r.prompt[:SHARED_PREFIX_TOKENS] == heads[i % SHARED_PREFIXES]
        assert 16 <= len(r.prompt) - SHARED_PREFIX_TOKENS <= 128
        assert 16 <= r.max_tokens <= 256
        assert all(5 <= t < 900 for t in r.prompt)
    # The lengths depend on the seed only: a smaller mix is the start of a larger one.
    assert [len(r.prompt) for r in make_mix("shared", 4, (0, 2), seed=3)] == [
        len(r.prompt) for r in mix[:4]
    ]
    assert make_mix("random", 6, (5, 900), seed=3) == request_mix(6, (5, 900), 3)
    with pytest.raises(ValueError, match="unknown mix 'zipf'"):
        make_mix("zipf", 4, (5, 900))


def test_the_cli_refuses_a_bad_mix_or_cap(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.throughput import main

    for argv, said in (
        (["--mix", "zipf"], "--mix takes a comma list of random, shared"),
        (["--concurrency", "8,x"], "--concurrency takes a comma list of positive integers"),
        (["--concurrency", "0"], "--concurrency takes a comma list of positive integers"),
    ):
        with pytest.raises(SystemExit) as exc:
            main(["--model", "tiny", *argv])
        assert exc.value.code == 2
        assert said in capsys.readouterr().err


def test_vllm_runs_take_the_cap_in_both_settings(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path) -> None:
    """A cap on running requests reaches vLLM's engine as max_num_seqs, at its defaults too."""
    import benchmarks.vllm_peer as peer
    from benchmarks.throughput import Checkpoint, EngineOptions, make_mix, run_vllm

    engines: list[dict[str, Any]] = []

    def fake_worker(job: Any, kv_cache_gib: float) -> dict[str, Any]:
        engines.append(dict(job.engine))
        ((_, reqs),) = job.sets
        done = [{"tokens": [7] * r.max_tokens} for r in reqs]
        return {"version": "0", "startup_s": 1.0, "process_s": 2.0,
                "sets": [{"wall_s": 0.5, "requests": done}]}

    monkeypatch.setattr(peer, "run_worker", fake_worker)
    ck = Checkpoint("m", tmp_path, (0, 9), 0, 1, 1)
    mix = make_mix("shared", 3, (0, 9))
    runs = [run_vllm(ck, mix, 0, EngineOptions(), s, cap) for s, cap in
            (("default", None), ("default", 8), ("matched", None), ("matched", 8))]
    assert [e.get("max_num_seqs") for e in engines] == [None, 8, 128, 8]
    assert [r.setting for r in runs] == [
        "default", "default max_num_seqs=8", "max_num_seqs=128 max_num_batched_tokens=1024",
        "max_num_seqs=8 max_num_batched_tokens=1024"]
    assert all(r.tokens == sum(q.max_tokens for q in mix) for r in runs)


def test_cases_run_every_mix_at_every_cap_and_summarize_apart(tmp_path: Path) -> None:
    """tierserve on the tiny model over both mixes at a cap of 2: one summary per case, every
    requested token generated, the prefix cache hit on the shared mix."""
    from benchmarks.throughput import SHARED_PREFIX_TOKENS, Plan, run_all, summarize

    plan = Plan(models=["tiny"], rounds={"tiny": 1}, requests={"tiny": 6}, batch_sizes=[2],
                cb_settings=[(2, 64)], systems=["tierserve"], mixes=["random", "shared"],
                concurrency=[2])
    lines: list[str] = []
    runs, chosen = run_all(plan, tmp_path, lines.append)
    assert [r.model for r in runs] == ["tiny c2", "tiny shared c2"]
    assert all(r.info["options"]["max_num_seqs"] == 2 for r in runs)
    assert runs[1].info["case"] == {"model": "tiny", "mix": "shared", "concurrency": 2}
    summary = summarize(runs, plan, chosen)
    assert list(summary) == ["tiny c2", "tiny shared c2"]
    assert all(s["systems"]["tierserve"]["tok_s_median"] > 0 for s in summary.values())
    # Requests 4 and 5 reuse the prefixes of 0 and 1 (computed by then: two run at a time); on
    # the random mix only the warm-up request's one block (the first 16 tokens of request 0).
    assert runs[1].info["prefix_hit_tokens"] >= 2 * SHARED_PREFIX_TOKENS
    assert runs[0].info["prefix_hit_tokens"] <= 16


def test_vllm_sets_run_in_order_and_a_short_answer_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``run_sets``, what the throughput and prefix benchmarks run on vLLM: one job, its sets in
    the order given, and a set whose requests fell short of their ``max_tokens`` refused."""
    import benchmarks.vllm_peer as peer

    jobs: list[Any] = []

    def fake_worker(job: Any, kv_cache_gib: float) -> dict[str, Any]:
        jobs.append(job)
        return {"sets": [{"label": label,
                          "requests": [{"tokens": [1] * min(r.max_tokens, 2)} for r in reqs]}
                         for label, reqs in job.sets]}

    monkeypatch.setattr(peer, "run_worker", fake_worker)
    out = peer.run_sets("m", {"a": [((1, 2), 2)], "b": [([3], 1)]}, {"max_num_seqs": 2},
                        mode="stepped", warmup=[([5], 4)])
    (job,) = jobs
    assert [label for label, _ in job.sets] == ["a", "b"] and job.mode == "stepped"
    assert job.sets[0][1][0].prompt_token_ids == [1, 2] and job.engine == {"max_num_seqs": 2}
    assert job.warmup[0].max_tokens == 4 and [s["label"] for s in out["sets"]] == ["a", "b"]
    with pytest.raises(RuntimeError, match="generated 2 tokens for the set 'c', 3 were requested"):
        peer.run_sets("m", {"c": [([1], 3)]}, {})


def test_llamacpp_needs_a_server_and_a_gguf(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The llama.cpp peer says how to get a server when there is none, refuses a checkpoint that
    is not a GGUF file, and a failed run is reported, not raised (the other systems go on)."""
    from benchmarks import llamacpp_peer, throughput

    monkeypatch.setenv(llamacpp_peer.ENV_BIN, str(tmp_path / "no-such-binary"))
    with pytest.raises(FileNotFoundError, match=r"build one as benchmarks/llamacpp_peer\.py"):
        llamacpp_peer.server_binary()
    mix = [throughput.Req((5, 6, 7), 4)]
    opts = throughput.EngineOptions()
    hf_dir = throughput.Checkpoint("hf", tmp_path, (4, 100), 0, 1, 10)
    with pytest.raises(RuntimeError, match="not a GGUF checkpoint"):
        throughput.run_llamacpp(hf_dir, mix, 0, opts)
    gguf = throughput.Checkpoint("g", tmp_path, (4, 100), 0, 1, 10, gguf_file="m.gguf")
    failed = throughput._llamacpp_setting(gguf, mix, 0, opts, None, None)
    assert failed.tokens == 0 and "FileNotFoundError: no llama-server" in failed.info["error"]
