"""benchmarks.lora's own logic, without timing: the adapters it writes carry PEFT's key names
(so vLLM reads the same files), the base/mixed interleave and its medians and ratios, the token
comparisons, vLLM's LoRA job and its worker's LoRA requests, a vLLM failure reported and not
raised, the CLI's refusals, and the whole run on a tiny checkpoint (every run present, the plain
engine's base tokens those of the LoRA engine's base rows)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import lora as bench
from benchmarks.lora import (
    PLAIN,
    PROJECTIONS,
    TIERSERVE,
    VLLM,
    Run,
    Setup,
    agreement,
    changed,
    schedule,
    summarize,
)
from tierserve import LoRARequest
from tierserve.replica.lora import ModelShapes, load_adapter

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, ModelShapes]:
    """A tiny Llama checkpoint (transformers), its HF model and tierserve's shapes of it."""
    from tests.replica.models.helpers import save_checkpoint, tiny_hf_model
    from tierserve.replica.models.loader import load_model

    hf = tiny_hf_model("llama-gqa")
    path = save_checkpoint(hf, tmp_path_factory.mktemp("lora-bench") / "base")
    model, _, _ = load_model(str(path), dtype=torch.float32, device="cpu")
    return path, hf, ModelShapes.of(model)


def test_written_adapters_have_peft_s_key_names_and_shapes(
        tiny: tuple[Path, Any, ModelShapes], tmp_path: Path) -> None:
    """``write_adapter``'s tensors are named and shaped as PEFT saves an adapter on every
    projection of the Hugging Face checkpoint; tierserve loads it at its rank."""
    import peft
    from safetensors import safe_open

    _, hf, shapes = tiny
    ours = bench.write_adapter(shapes, tmp_path / "ours", rank=4, seed=0)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8,
                                                    target_modules=list(PROJECTIONS)))
    model.save_pretrained(str(tmp_path / "peft"))
    model.unload()

    def tensors(folder: Path) -> dict[str, tuple[int, ...]]:
        with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    assert tensors(ours) == tensors(tmp_path / "peft")
    config = json.loads((ours / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert load_adapter("a", str(ours), shapes, max_rank=4).rank == 4


def test_interleave_medians_and_ratios() -> None:
    assert schedule(2) == [("base", 1), ("mixed", 1), ("base", 2), ("mixed", 2)]
    with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
        schedule(0)
    assert bench.mixed_adapters(5, 2) == [0, 1, 0, 1, 0]
    runs = [Run(TIERSERVE, "base", 1, 2.0, 100), Run(TIERSERVE, "mixed", 1, 2.0, 80),
            Run(TIERSERVE, "base", 2, 1.0, 100), Run(TIERSERVE, "mixed", 2, 1.0, 90),
            Run(TIERSERVE, "base", 3, 4.0, 100), Run(TIERSERVE, "mixed", 3, 4.0, 70),
            Run(PLAIN, "base", 1, 2.0, 100)]
    s = summarize(runs)
    assert s["systems"][TIERSERVE]["base"] == {"tokens_per_s": [50.0, 100.0, 25.0],
                                               "median": 50.0}
    assert s["systems"][TIERSERVE]["mixed"]["median"] == 40.0
    r = s["ratios"]
    assert r["mixed_over_base"] == 0.8 and r["base_lora_engine_over_plain_engine"] == 1.0
    assert r["vllm_mixed_over_base"] is None and r["tierserve_over_vllm_mixed"] is None
    s = summarize([*runs, Run(VLLM, "base", 1, 1.0, 25), Run(VLLM, "mixed", 1, 1.0, 20)])
    assert s["ratios"]["vllm_mixed_over_base"] == 0.8
    assert s["ratios"]["tierserve_over_vllm_base"] == 2.0
    assert s["ratios"]["tierserve_over_vllm_mixed"] == 2.0
    assert s["ratios"]["vllm_base_lora_engine_over_plain_engine"] is None
    s = summarize([Run(VLLM, "base", 1, 1.0, 25), Run(bench.VLLM_PLAIN, "base", 1, 1.0, 50)])
    assert s["ratios"]["vllm_base_lora_engine_over_plain_engine"] == 0.5
    assert Run(VLLM, "base", 1, 0.0, 5).tokens_per_s == 0.0


def test_token_agreement_and_changes() -> None:
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    b = [[1, 2, 3, 4], [5, 0, 7, 8], [9, 9]]
    assert agreement(a, b) == {"requests": 3, "identical": 2, "positions_equal": 0.9,
                               "common_prefix": round((1 + 0.25 + 1) / 3, 3)}
    assert changed(a, b) == 1 and changed(a, a) == 0
    with pytest.raises(ValueError, match="2 answers against 3"):
        agreement(a[:2], b)


def _setup(tmp_path: Path, requests: int = 3, adapters: int = 2, rank: int = 4) -> Setup:
    loras = []
    for i in range(adapters):
        folder = tmp_path / f"a{i}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"r": rank}))
        loras.append(LoRARequest(f"a{i}", i + 1, str(folder)))
    prompts = [[10 + i] * 12 for i in range(requests)]
    return Setup(prompts, 3, loras, repeats=2,
                 assign=bench.mixed_adapters(requests, adapters))


def test_vllm_job_carries_the_adapters_and_the_interleave(tmp_path: Path) -> None:
    setup = _setup(tmp_path)
    job = bench.vllm_job("m", setup, max_num_seqs=3, max_num_batched_tokens=8)
    assert job.engine["enable_lora"] is True and job.engine["max_loras"] == 2
    assert job.engine["max_cpu_loras"] == 2
    assert job.engine["max_lora_rank"] == 8  # rank 4 is not one of vLLM's: the next it takes
    assert job.engine["enable_prefix_caching"] is False and job.engine["max_num_seqs"] == 3
    assert job.engine["max_num_batched_tokens"] == 15  # at least the longest request
    assert [label for label, _ in job.sets] == ["base 1", "mixed 1", "base 2", "mixed 2"]
    assert [q.adapter for q in job.sets[0][1]] == [None, None, None]
    assert [q.adapter for q in job.sets[1][1]] == [0, 1, 0]
    assert [q.adapter for q in job.warmup] == [None, None, None, 0, 1, 0]
    assert [q.prompt_token_ids for q in job.warmup] == setup.prompts * 2
    assert [(a.name, a.id) for a in job.adapters] == [("a0", 1), ("a1", 2)]
    sent = json.loads(json.dumps(asdict(job)))  # what the worker reads
    assert sent["adapters"][1]["path"] == setup.adapters[1].lora_path
    assert sent["sets"][1][1][2]["adapter"] == 0
    plain = bench.vllm_job("m", setup, max_num_seqs=3, max_num_batched_tokens=8, lora=False)
    assert "enable_lora" not in plain.engine and plain.adapters == []
    assert [label for label, _ in plain.sets] == ["base 1"]
    assert [q.adapter for q in plain.warmup] == [None, None, None]
    assert bench.vllm_rank(16) == 16 and bench.vllm_rank(17) == 32
    with pytest.raises(ValueError, match="ranks up to 512, got 600"):
        bench.vllm_rank(600)


def test_vllm_runs_read_back_and_a_failure_says_why(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    import benchmarks.vllm_peer as peer

    setup = _setup(tmp_path)

    def fake_worker(job: Any, kv_cache_gib: float) -> dict[str, Any]:
        sets = [{"label": label, "wall_s": 0.5,
                 "requests": [{"tokens": [7 if q.adapter is None else 8] * q.max_tokens}
                              for q in reqs]} for label, reqs in job.sets]
        return {"version": "0", "startup_s": 1.0, "process_s": 2.0, "sets": sets}

    monkeypatch.setattr(peer, "run_worker", fake_worker)
    runs, tokens, info = bench.run_vllm("m", setup, 3, 64)
    assert [(r.system, r.kind, r.repeat, r.tokens) for r in runs] == [
        (VLLM, "base", 1, 9), (VLLM, "mixed", 1, 9), (VLLM, "base", 2, 9), (VLLM, "mixed", 2, 9)]
    assert tokens["mixed"] == [[8, 8, 8]] * 3 and info["engine"]["enable_lora"] is True
    runs, tokens, info = bench.run_vllm("m", setup, 3, 64, lora=False)
    assert [(r.system, r.kind, r.repeat) for r in runs] == [(bench.VLLM_PLAIN, "base", 1)]
    assert "enable_lora" not in info["engine"]

    def short_worker(job: Any, kv_cache_gib: float) -> dict[str, Any]:
        out = fake_worker(job, kv_cache_gib)
        out["sets"][1]["requests"][0]["tokens"] = [1]
        return out

    monkeypatch.setattr(peer, "run_worker", short_worker)
    with pytest.raises(RuntimeError, match="vllm generated 7 tokens in a mixed run, 9 were"):
        bench.run_vllm("m", setup, 3, 64)
    err = RuntimeError("vllm worker failed (1):\nINFO loading\nTraceback (most recent call "
                       "last):\n  File \"x.py\", line 1\nValueError: LoRA is not supported\n")
    assert bench.failure_line(err) == "ValueError: LoRA is not supported"
    assert bench.failure_line(RuntimeError("no luck\nat all")) == "no luck"


def test_worker_passes_lora_requests_only_when_a_request_names_one() -> None:
    from benchmarks import vllm_worker

    assert vllm_worker._loras({"adapters": []}) == [] and vllm_worker._loras({}) == []

    class FakeLLM:
        def __init__(self) -> None:
            self.kwargs: list[dict[str, Any]] = []

        def generate(self, prompts: list[Any], params: list[Any], **kw: Any) -> list[Any]:
            self.kwargs.append(kw)
            return []

    llm = FakeLLM()
    plain = [{"prompt_token_ids": [1], "max_tokens": 2}]
    vllm_worker._generate(llm, dict, plain)
    assert llm.kwargs[-1] == {"use_tqdm": False}  # the other benchmarks' calls, unchanged
    vllm_worker._generate(llm, dict, [*plain, {"prompt_token_ids": [2], "max_tokens": 2,
                                               "adapter": 1}], ["A", "B"])
    assert llm.kwargs[-1]["lora_request"] == [None, "B"]


def test_the_cli_refuses_bad_counts(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in ((["--repeats", "0"], "--repeats must be at least 1, got 0"),
                       (["--adapters", "0"], "--adapters must be at least 1, got 0"),
                       (["--max-tokens", "-1"], "--max-tokens must be at least 1, got -1"),
                       (["--vllm", "--rank", "600"], "vLLM serves LoRA ranks up to 512, got 600")):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.slow
def test_a_whole_quick_run_on_a_tiny_checkpoint(tiny: tuple[Path, Any, ModelShapes],
                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Two interleaved pairs and the plain engine's run, all in the JSON record; the plain
    engine's greedy tokens equal the LoRA engine's base rows' (the base pays nothing in kind).
    With ``--vllm`` (its worker faked): a LoRA engine that fails is printed with its reason and
    the run goes on to the plain vLLM engine."""
    import benchmarks.vllm_peer as peer

    def worker(job: Any, kv_cache_gib: float) -> dict[str, Any]:
        if job.adapters:
            raise RuntimeError("vllm worker failed (1):\nTraceback (most recent call last):\n"
                               "NotImplementedError: LoRA is not supported here\n")
        sets = [{"label": label, "wall_s": 1.0, "requests": [{"tokens": [3] * q.max_tokens}
                                                             for q in reqs]}
                for label, reqs in job.sets]
        return {"version": "0", "startup_s": 1.0, "process_s": 2.0, "sets": sets}

    monkeypatch.setattr(peer, "run_worker", worker)
    out = tmp_path / "lora.json"
    assert bench.main(["--model", str(tiny[0]), "--quick", "--repeats", "2", "--adapters", "2",
                       "--rank", "4", "--vllm", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["system"], r["kind"], r["repeat"]) for r in result["runs"]] == [
        (TIERSERVE, "base", 1), (TIERSERVE, "mixed", 1), (TIERSERVE, "base", 2),
        (TIERSERVE, "mixed", 2), (PLAIN, "base", 1), (bench.VLLM_PLAIN, "base", 1)]
    assert all(r["tokens"] == 4 * 4 for r in result["runs"])
    ratios = result["summary"]["ratios"]
    assert ratios["mixed_over_base"] is not None
    assert ratios["base_lora_engine_over_plain_engine"] is not None
    assert ratios["vllm_mixed_over_base"] is None
    same = result["tokens"]["plain_vs_lora_engine_base"]
    assert same["identical"] == same["requests"] == 4
    why = "NotImplementedError: LoRA is not supported here"
    assert result["vllm_error"] == why and "machine" in result and VLLM not in result
    assert f"vllm did not run: {why}" in capsys.readouterr().out
