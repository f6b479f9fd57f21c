"""Multi-LoRA in one replica (docs/lora.md): PEFT adapters on a tiny random Llama, mixed with the
base model in one batch, against transformers + PEFT prompt by prompt; fewer slots than
adapters; a preemption; the prefix cache keyed by adapter; every refusal."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.replica.lora_helpers import (
    ADAPTERS,
    edit_config,
    greedy,
    logits,
    make_adapter,
    reference,
    write_checkpoint,
)
from tests.replica.models.helpers import PagedHarness, Work, tiny_hf_model
from tierserve import LLM, LoRARequest, SamplingParams
from tierserve.records import GenerateRequest
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.lora import (
    LoRAError,
    LoRAManager,
    ModelShapes,
    _runs,
    apply_lora,
    load_adapter,
)
from tierserve.replica.models.loader import load_model
from tierserve.replica.scheduler import Request, SampledToken, Scheduler

pytest.importorskip("peft")

NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], Any]:
    root = tmp_path_factory.mktemp("lora")
    base, paths = write_checkpoint(root)
    return base, paths, reference(base, paths)


@pytest.fixture(scope="module")
def llm(ckpt: tuple[Path, dict[str, Path], Any]) -> LLM:
    base, paths, _ = ckpt
    return LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
               num_kv_blocks=64, max_num_seqs=8, max_model_len=128,
               lora_modules=[{"name": "alpha", "path": str(paths["alpha"])}])


def _prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 260, (n,), generator=gen).tolist() for n in lengths]


def _req(name: str | None, paths: dict[str, Path]) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, list(ADAPTERS).index(name) + 1,
                                                 str(paths[name]))


def _check_tokens(llm: LLM, ckpt: tuple[Path, dict[str, Path], Any], names: list[str | None],
                  prompts: list[list[int]]) -> list[Any]:
    _, paths, ref = ckpt
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                        lora_request=[_req(n, paths) for n in names])
    for i, (p, n, o) in enumerate(zip(prompts, names, outs, strict=True)):
        assert o.outputs[0].token_ids == greedy(ref, n, p, NEW), f"prompt {i} under {n}"
    return outs


def test_two_adapters_and_the_base_in_one_batch_match_peft(
        llm: LLM, ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    names: list[str | None] = ["alpha", "beta", None, "alpha", "beta", None]
    prompts = _prompts((5, 9, 17, 3, 12, 7))
    _check_tokens(llm, ckpt, names, prompts)
    # The adapters change the answer (else the comparison above would prove nothing).
    _, _, ref = ckpt
    p = prompts[0]
    assert len({tuple(greedy(ref, n, p, NEW)) for n in ("alpha", "beta", None)}) == 3


def test_prefill_logits_match_peft(ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    base, paths, ref = ckpt
    model, _, _ = load_model(str(base), dtype=torch.float32, device="cpu")
    lora = LoRAManager(model, max_loras=3, max_rank=8, max_cpu_loras=3)
    for name, path in paths.items():
        lora.load(name, str(path))
    prompts = _prompts((6, 11, 4, 9), seed=3)
    names: list[str | None] = ["beta", None, "gamma", "alpha"]
    rows = [None if n is None else f"{n}#0" for n, p in zip(names, prompts, strict=True)
            for _ in p]
    with lora.running(lora.batch(rows)):
        got = PagedHarness(model, len(prompts), 64).step(
            [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True)
    for p, n, lg in zip(prompts, names, got, strict=True):
        torch.testing.assert_close(lg, logits(ref, n, p), rtol=0, atol=1e-4)
    lora.close()


def test_fewer_slots_than_adapters(ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """One slot, three adapters and the base, two adapters kept loaded: each step holds one
    adapter; adapters rotate through the slot and the host cache; every answer is its own."""
    base, _, _ = ckpt
    one = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2,
              num_kv_blocks=64, max_num_seqs=8, max_model_len=128)
    assert one.engine.lora is not None
    seen: list[set[str]] = []
    batch = one.engine.lora.batch

    def spy(rows: Any) -> Any:
        seen.append({n for n in rows if n is not None})
        return batch(rows)

    one.engine.lora.batch = spy  # type: ignore[method-assign]
    names: list[str | None] = ["alpha", "beta", "gamma", None, "beta", "alpha", "gamma"]
    _check_tokens(one, ckpt, names, _prompts((4, 7, 5, 6, 9, 3, 8), seed=5))
    assert seen and all(len(s) <= 1 for s in seen)
    assert {n.split("#")[0] for s in seen for n in s} == {"alpha", "beta", "gamma"}
    assert len(one.engine.loras()) <= 2


def test_running_adapters_pass_a_request_without_a_slot_and_match_peft(
        ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """Two slots, three adapters and the base, the bypass on: requests of the running adapters
    and of the base are admitted past gamma's while it has no slot; every answer is its own
    adapter's and no block stays held."""
    base, _, _ = ckpt
    two = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
              num_kv_blocks=64, max_num_seqs=8, max_model_len=128, lora_bypass_steps=4)
    scheduler = two.engine.scheduler
    may_pass = scheduler._may_pass
    passes: list[bool] = []

    def spy(seq: Any, passed: Any) -> bool:
        passes.append(may_pass(seq, passed))
        return passes[-1]

    scheduler._may_pass = spy  # type: ignore[method-assign]
    names: list[str | None] = ["alpha", "beta", "gamma", "alpha", None, "beta", "gamma", None]
    _check_tokens(two, ckpt, names, _prompts((6, 9, 5, 7, 4, 8, 3, 10), seed=11))
    assert True in passes  # gamma was passed
    stats = two.engine.stats()
    assert stats.running == stats.waiting == 0
    assert stats.free_blocks == stats.total_blocks
    assert not scheduler.running_adapters()  # nothing pinned


def test_answers_survive_a_preemption(ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    base, _, _ = ckpt
    small = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                num_kv_blocks=6, block_size=8, max_num_seqs=4, max_model_len=48,
                enable_prefix_caching=False)
    names: list[str | None] = ["alpha", "beta", None, "beta"]
    _check_tokens(small, ckpt, names, _prompts((10, 9, 11, 8), seed=7))
    assert small.engine.stats().preemptions > 0
    assert not small.engine.scheduler.running_adapters()  # nothing pinned


def test_the_deterministic_mode_keeps_adapter_rows_batch_invariant(
        ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """Deterministic mode with adapters: a prompt's tokens and log-probabilities, bit for bit,
    are the same alone and in a mixed batch of both adapters and the base whose prompts are cut
    into chunks; and they are the tokens of transformers + PEFT."""
    base, paths, ref = ckpt
    det = LLM(str(base), deterministic=True, enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=3, num_kv_blocks=64, max_num_seqs=8, max_model_len=128,
              max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=1)
    names: list[str | None] = ["alpha", "beta", None, "alpha", "beta", None]
    prompts = _prompts((5, 21, 17, 3, 12, 30), seed=3)
    together = det.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False, lora_request=[_req(n, paths) for n in names])
    for i, (p, n) in enumerate(zip(prompts, names, strict=True)):
        (alone,) = det.generate([{"prompt_token_ids": p}], params, use_tqdm=False,
                                lora_request=_req(n, paths))
        a, t = alone.outputs[0], together[i].outputs[0]
        assert a.token_ids == t.token_ids == greedy(ref, n, p, NEW), f"prompt {i} under {n}"
        assert a.cumulative_logprob == t.cumulative_logprob, f"prompt {i} under {n}"
        assert [x[tok].logprob for x, tok in zip(a.logprobs or [], a.token_ids, strict=True)] == \
            [x[tok].logprob for x, tok in zip(t.logprobs or [], t.token_ids, strict=True)]


def test_prefix_cache_is_keyed_by_adapter(llm: LLM, ckpt: tuple[Path, dict[str, Path], Any]
                                          ) -> None:
    _, paths, ref = ckpt
    prompt = _prompts((40,), seed=9)[0]
    cached = []
    for name in ("alpha", "beta", None, "alpha", None):
        (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                              lora_request=_req(name, paths))
        assert out.outputs[0].token_ids == greedy(ref, name, prompt, NEW)
        cached.append(out.num_cached_tokens)
    # Another adapter or the base never finds a prefix computed under an adapter; the same
    # adapter (or the base again) does.
    assert cached[:3] == [0, 0, 0] and cached[3] > 0 and cached[4] > 0


def test_adapters_loaded_listed_unloaded(llm: LLM, ckpt: tuple[Path, dict[str, Path], Any]
                                         ) -> None:
    _, paths, _ = ckpt
    engine = llm.engine
    engine.load_lora(LoRARequest("gamma", 3, str(paths["gamma"])))
    assert "gamma" in [r.lora_name for r in engine.loras()]
    engine.unload_lora("gamma")
    assert "gamma" not in [r.lora_name for r in engine.loras()]
    with pytest.raises(LoRAError, match="not loaded"):
        engine.unload_lora("gamma")
    # In use (a running request pins it): refused, not deferred.
    rid = engine.add_request(GenerateRequest.of([5, 6, 7], GREEDY,
                                                lora=_req("alpha", paths)))
    while "alpha#1" not in engine.scheduler.running_adapters():
        engine.step()
    with pytest.raises(LoRAError, match="in use"):
        engine.unload_lora("alpha")
    engine.abort(rid)
    assert not engine.scheduler.running_adapters()
    # By name: every id of it (the static alpha's and alpha#1); by key: that one only.
    engine.load_lora(LoRARequest("beta", 5, str(paths["beta"])))
    engine.load_lora(LoRARequest("beta", 6, str(paths["beta"])))  # replaces beta#5 (unused)
    assert [r.lora_int_id for r in engine.loras() if r.lora_name == "beta"] == [6]
    assert engine.unload_lora("beta", 6) == ["beta#6"]
    dropped = engine.unload_lora("alpha")
    assert dropped and all(k.startswith("alpha#") for k in dropped)
    assert "alpha" not in [r.lora_name for r in engine.loras()]
    # A waiting request pins nothing: its adapter may be unloaded, and it loads it again.
    rid = engine.add_request(GenerateRequest.of([5, 6, 7], GREEDY, lora=_req("beta", paths)))
    for key in engine.lora.names() if engine.lora is not None else []:
        if key.startswith("beta#"):
            engine.unload_lora("beta")
    while engine.has_unfinished():
        engine.step()
    assert not engine.scheduler.running_adapters()


# ---------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def shapes(ckpt: tuple[Path, dict[str, Path], Any]) -> ModelShapes:
    model, _, _ = load_model(str(ckpt[0]), dtype=torch.float32, device="cpu")
    return ModelShapes.of(model)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_refusals(shapes: ModelShapes, ckpt: tuple[Path, dict[str, Path], Any],
                  tmp_path: Path) -> None:
    _, paths, _ = ckpt
    alpha, beta = paths["alpha"], paths["beta"]

    def refused(path: Path, match: str, max_rank: int = 8) -> None:
        with pytest.raises(LoRAError, match=match):
            load_adapter("x", str(path), shapes, max_rank)

    refused(tmp_path / "nowhere", "no such directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "not a PEFT adapter: no adapter_config.json")
    refused(beta, "rank 8 is above max_lora_rank 4", max_rank=4)
    binary = _copy(alpha, tmp_path / "bin")
    (binary / "adapter_model.safetensors").rename(binary / "adapter_model.bin")
    refused(binary, r"adapter_model.bin \(a pickle\) is not loaded")
    for name, changes, match in [
        ("dora", {"use_dora": True}, "DoRA"),
        ("save", {"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ("embed", {"target_modules": ["embed_tokens", "q_proj"]}, "embeddings"),
        ("lacks", {"target_modules": ["c_attn"]}, "not one this model has"),
        ("bias", {"bias": "all"}, "bias 'all'"),
        ("prefix", {"peft_type": "PREFIX_TUNING"}, "PREFIX_TUNING"),
        ("pattern", {"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ]:
        bad = _copy(alpha, tmp_path / name)
        edit_config(bad, **changes)
        refused(bad, match)
    # Tensors edited by hand: a layer the model lacks, an A without its B, a stray tensor.
    from safetensors.torch import load_file, save_file

    weights = load_file(str(alpha / "adapter_model.safetensors"))
    key = next(k for k in weights if ".layers.1.self_attn.q_proj.lora_A" in k)
    for name, edit, match in [
        ("deep", lambda w: w.__setitem__(key.replace("layers.1.", "layers.7."), w.pop(key)),
         "layer 7 is beyond the model's 2 layers"),
        ("half", lambda w: w.pop(key.replace("lora_A", "lora_B")), "without its pair"),
        ("stray", lambda w: w.__setitem__("base_model.model.lm_head.weight", w[key].clone()),
         "embeddings or the output head"),
    ]:
        bad = _copy(alpha, tmp_path / name)
        edited = dict(weights)
        edit(edited)
        save_file(edited, str(bad / "adapter_model.safetensors"))
        refused(bad, match)
    # An adapter of another base (hidden size 32): its shapes do not fit.
    other = tiny_hf_model("llama", hidden_size=32, intermediate_size=64)
    refused(make_adapter(other, tmp_path / "other", 1, r=4, target_modules=["q_proj"]),
            "do not fit the base model")


def test_refusals_leave_nothing_loaded(llm: LLM, tmp_path: Path) -> None:
    before = llm.engine.loras()
    with pytest.raises(ValueError, match="no such directory"):
        llm.generate("hi", GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("ghost", 9, str(tmp_path / "ghost")))
    with pytest.raises(ValueError, match="not loaded and the request gives no path"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("ghost", 9))
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=[None, None])
    assert llm.engine.loras() == before
    assert not llm.engine.has_unfinished()


def test_engine_without_lora_refuses_an_adapter(ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    base, paths, _ = ckpt
    plain = LLM(str(base), num_kv_blocks=16, max_num_seqs=2, max_model_len=64)
    assert plain.engine.lora is None and plain.engine.loras() == []
    with pytest.raises(ValueError, match="enable_lora is off"):
        plain.generate("hi", GREEDY, use_tqdm=False, lora_request=_req("alpha", paths))
    with pytest.raises(ValueError, match="enable_lora is off"):
        plain.engine.load_lora(LoRARequest("alpha", 1, str(paths["alpha"])))


def test_a_bad_static_adapter_fails_the_start(ckpt: tuple[Path, dict[str, Path], Any],
                                              tmp_path: Path) -> None:
    base, _, _ = ckpt
    with pytest.raises(LoRAError, match=r"lora_modules\[0\] \('bad'\).*no such directory"):
        LLM(str(base), enable_lora=True, num_kv_blocks=16, max_model_len=64,
            lora_modules=[{"name": "bad", "path": str(tmp_path / "nope")}])


@pytest.mark.parametrize("options, match", [
    ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "at least max_loras"),
    ({"lora_modules": [{"name": "a", "path": "/x"}]}, "needs enable_lora"),
    ({"enable_lora": True, "max_cpu_loras": 2,
      "lora_modules": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}, "twice"),
    ({"enable_lora": True, "lora_modules": [{"name": "a b", "path": "/x"}]}, "name"),
    ({"enable_lora": True, "max_lora_rank": 0}, "max_lora_rank"),
])
def test_bad_lora_settings(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_options("tierserve-tiny", **options)


def test_lora_request_fields() -> None:
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/x")
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    assert LoRARequest("a", 7, "/x").key == "a#7"  # an adapter's identity: name and id
    from tierserve.records import static_lora_id

    ids = {static_lora_id("a", "/x"), static_lora_id("a", "/y"), static_lora_id("b", "/x")}
    assert len(ids) == 3 and all(0 < i < 2**63 for i in ids)
    assert static_lora_id("a", "/x") == static_lora_id("a", "/x")


def test_a_static_adapter_has_the_id_of_its_name_and_path(
        ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """The replica gives a ``lora_modules`` adapter ``static_lora_id(name, path)``, the id the
    ingress's registry computes too: a request carrying it finds the adapter loaded."""
    from tierserve.records import static_lora_id

    base, paths, ref = ckpt
    path = str(paths["gamma"])
    one = LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=32, max_model_len=64,
              lora_modules=[{"name": "g", "path": path}])
    assert one.engine.loras() == [LoRARequest("g", static_lora_id("g", path), path)]
    prompt = _prompts((6,), seed=2)[0]
    (out,) = one.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("g", static_lora_id("g", path), path))
    assert out.outputs[0].token_ids == greedy(ref, "gamma", prompt, NEW)
    assert len(one.engine.loras()) == 1  # the same entry, not a second copy


def test_pinned_entries_are_never_evicted_and_a_new_id_replaces_an_unused_copy(
        ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """The cache evicts only what no running request pins; a load that would need a pinned
    entry gone keeps nothing (the adapter was checked, a request loads it later); a name's new
    id replaces an unpinned copy of the name, never a pinned one."""
    base, paths, _ = ckpt
    model, _, _ = load_model(str(base), dtype=torch.float32, device="cpu")
    lora = LoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=2)
    assert lora.load("alpha", str(paths["alpha"]), 1)
    assert lora.load("beta", str(paths["beta"]), 2)
    assert not lora.load("gamma", str(paths["gamma"]), 3, pinned={"alpha#1", "beta#2"})
    assert lora.names() == ["alpha#1", "beta#2"]
    assert lora.load("gamma", str(paths["gamma"]), 3, pinned={"alpha#1"})  # evicts beta#2
    assert lora.names() == ["alpha#1", "gamma#3"]
    # alpha loaded again from other weights (a new id): not while alpha#1 is pinned; then it
    # replaces it, and the cache keeps one copy of the name.
    assert not lora.load("alpha", str(paths["beta"]), 9, pinned={"alpha#1"})
    assert lora.load("alpha", str(paths["beta"]), 9)
    assert lora.names() == ["gamma#3", "alpha#9"]
    assert lora.get("alpha#9") is not None and lora.get("alpha#9").rank == 8  # type: ignore[union-attr]
    with pytest.raises(LoRAError, match="in use"):
        lora.unload("alpha", pinned={"alpha#9"})
    assert lora.unload("alpha#9") == ["alpha#9"]
    with pytest.raises(LoRAError, match="not loaded"):
        lora.unload("alpha")
    with pytest.raises(LoRAError, match="above max_loras"):
        lora.batch(["gamma#3", "alpha#9"])
    lora.close()


def test_the_base_model_an_adapter_names_must_be_the_engine_s(
        ckpt: tuple[Path, dict[str, Path], Any], tmp_path: Path) -> None:
    """``base_model_name_or_path`` compared by ``model_identity``: another model is a 400
    ``lora_base_mismatch`` naming both, unless ``lora_base_check`` is off; the same model under
    another spelling (org prefix, ``.gguf``, a quantisation suffix), or none named, is taken."""
    from tierserve.replica.engine_config import base_model_names
    from tierserve.replica.lora import model_identity

    assert model_identity("HuggingFaceTB/SmolLM2-135M-Instruct") == \
        model_identity("SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert model_identity("/models/gemma-3-270m-q4_k_m.gguf") == \
        model_identity("google/gemma-3-270m") == "gemma-3-270m"
    assert model_identity("org/Model-GGUF") == "model"
    assert {model_identity(n) for n in base_model_names("smollm2-135m-instruct")} == \
        {"smollm2-135m-instruct"}
    base, paths, _ = ckpt
    model, _, _ = load_model(str(base), dtype=torch.float32, device="cpu")
    lora = LoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=1,
                       base_names=base_model_names(str(base)))
    # peft wrote no base name here (the base was in memory): taken on its shapes.
    assert lora.load("alpha", str(paths["alpha"]), 1)
    other = _copy(paths["alpha"], tmp_path / "other")
    edit_config(other, base_model_name_or_path="meta-llama/Llama-3.2-1B")
    with pytest.raises(LoRAError, match=r"Llama-3\.2-1B") as e:
        lora.load("other", str(other), 2)
    assert e.value.code == "lora_base_mismatch" and e.value.status == 400
    same = _copy(paths["alpha"], tmp_path / "same")
    edit_config(same, base_model_name_or_path=f"someone/{base.name.upper()}-Q8_0.gguf")
    assert lora.load("same", str(same), 3)
    for i, empty in enumerate((None, "")):
        unnamed = _copy(paths["alpha"], tmp_path / f"unnamed{i}")
        edit_config(unnamed, base_model_name_or_path=empty)
        assert lora.load("unnamed", str(unnamed), 4 + i)
    lora.close()
    off = LoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=1,
                      base_names=base_model_names(str(base)), base_check=False)
    assert off.load("other", str(other), 2)
    off.close()


# ---------------------------------------------------------------------- the scheduler


def test_a_step_holds_at_most_max_loras_adapters_and_none_starves() -> None:
    cfg = EngineConfig(enable_lora=True, max_loras=2, max_num_seqs=16, max_model_len=256,
                       prefill_chunk_tokens=None)
    s = Scheduler(cfg, FreeListBlocks(4, range(200)))
    names = [None, "a", "b", "c", "a", "d", None, "c", "b", "d", "e"]
    ids = {s.add(Request([1, 2, 3, 4, 5], 3 + i % 4, lora=n)): n for i, n in enumerate(names)}
    left = set(ids)
    for _ in range(200):
        if not left:
            break
        plan = s.schedule()
        rows = [d.id for d in plan.decodes] + [c.id for c in plan.prefill]
        assert len({ids[r] for r in rows if ids[r] is not None}) <= 2
        running = {seq.lora for seq in s._running if seq.lora is not None}
        assert len(running) <= 2
        sampled = [d.id for d in plan.decodes] + [c.id for c in plan.prefill if c.last]
        for e in s.on_step([SampledToken(r, 7) for r in sampled]):
            if hasattr(e, "reason"):
                left.discard(e.id)
    assert not left  # every adapter's requests ran to their end


# ---------------------------------------------------------------------- the deployment


def test_the_deployment_loads_lists_unloads_and_reports_adapters(
        ckpt: tuple[Path, dict[str, Path], Any], tmp_path: Path) -> None:
    import asyncio

    from tierserve.records import ErrorRecord, RequestOutput, RoutingStats
    from tierserve.replica.deployment import LLMServer

    base, paths, ref = ckpt
    server = LLMServer(engine={"model": str(base), "device": "cpu", "num_kv_blocks": 32,
                               "max_num_seqs": 4, "num_threads": 1, "max_model_len": 64,
                               "enable_lora": True, "max_loras": 2, "max_lora_rank": 8})
    try:
        def sync(coro: Any) -> Any:
            return asyncio.run(asyncio.wait_for(coro, timeout=60))

        assert sync(server.load_lora_adapter("beta", str(paths["beta"]), 2)) is None
        assert [r.lora_name for r in server.list_lora_adapters()] == ["beta"]
        stats = RoutingStats.from_dict(server.record_routing_stats())
        assert stats is not None and stats.lora_adapters == ("beta#2",)  # keys: name#id
        assert stats.max_loras == 2  # the router's sign that this replica serves adapters
        assert server.engine.stats().lora_adapters_loaded == 1
        bad = sync(server.load_lora_adapter("bad", str(tmp_path / "nope")))
        assert isinstance(bad, ErrorRecord) and bad.status == 400  # an admin's: the detail
        assert bad.code == "invalid_lora_adapter" and "no such directory" in bad.message
        missing = sync(server.unload_lora_adapter("nope"))
        assert isinstance(missing, ErrorRecord) and missing.status == 404

        prompt = [5, 9, 14, 20]

        async def run(lora: LoRARequest) -> list[RequestOutput | ErrorRecord]:
            request = GenerateRequest.of(prompt, GREEDY, lora=lora)
            return [item async for item in server.generate(request)]

        items = asyncio.run(asyncio.wait_for(run(LoRARequest("beta", 2)), timeout=60))
        tokens = [t for i in items if isinstance(i, RequestOutput) for t in i.token_ids]
        assert tokens == greedy(ref, "beta", prompt, NEW)
        # A request whose adapter cannot be loaded here: 503 adapter_unavailable naming the
        # adapter only (never its path), with this replica's id so the ingress tries another.
        for lora in (LoRARequest("ghost", 4), LoRARequest("ghost", 5, str(tmp_path / "gone"))):
            (refused,) = sync(run(lora))
            assert isinstance(refused, ErrorRecord) and refused.status == 503
            assert refused.code == "adapter_unavailable" and "'ghost'" in refused.message
            assert str(tmp_path) not in refused.message and refused.replica == server.replica_id
        assert server.engine.stats().free_blocks == server.engine.stats().total_blocks
        assert sync(server.unload_lora_adapter("beta")) is None
        assert server.list_lora_adapters() == []
    finally:
        server.engine.shutdown()


def test_more_active_adapters_than_the_cache_holds_are_all_answered(
        ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """A served engine (its step loop and loader thread) with one slot and one adapter in host
    memory, and requests of three adapters and the base at once: none is refused (a request
    waits while its adapter loads, and for a slot), each answer is its own adapter's, and no
    block is held after."""
    import asyncio

    from tierserve.records import ErrorRecord, RequestOutput
    from tierserve.replica.deployment import LLMServer

    base, paths, ref = ckpt
    server = LLMServer(engine={"model": str(base), "device": "cpu", "num_kv_blocks": 48,
                               "max_num_seqs": 8, "num_threads": 1, "max_model_len": 64,
                               "enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
                               "max_lora_rank": 8, "lora_bypass_steps": 2})
    names: list[str | None] = ["alpha", "beta", "gamma", None, "gamma", "beta", "alpha"]
    prompts = _prompts((5, 7, 4, 6, 9, 3, 8), seed=21)

    async def one(name: str | None, prompt: list[int]) -> list[RequestOutput | ErrorRecord]:
        request = GenerateRequest.of(prompt, GREEDY, lora=_req(name, paths))
        return [item async for item in server.generate(request)]

    async def all_at_once() -> list[list[RequestOutput | ErrorRecord]]:
        return await asyncio.gather(*(one(n, p) for n, p in zip(names, prompts, strict=True)))

    try:
        answers = asyncio.run(asyncio.wait_for(all_at_once(), timeout=120))
        for i, (n, p, items) in enumerate(zip(names, prompts, answers, strict=True)):
            assert not [x for x in items if isinstance(x, ErrorRecord)], f"prompt {i} refused"
            tokens = [t for x in items if isinstance(x, RequestOutput) for t in x.token_ids]
            assert tokens == greedy(ref, n, p, NEW), f"prompt {i} under {n}"
        stats = server.engine.stats()
        assert stats.free_blocks == stats.total_blocks and stats.running == stats.waiting == 0
        assert len(server.engine.loras()) == 1
    finally:
        server.engine.shutdown()


def test_a_failed_load_ends_only_the_requests_of_that_adapter(
        llm: LLM, ckpt: tuple[Path, dict[str, Path], Any], tmp_path: Path) -> None:
    """Requests queued by ``add_request`` (a server's path: the adapter is loaded at admission,
    by the loader thread): one adapter's folder is gone, so its two requests end in
    ``adapter_unavailable`` naming the adapter, never the path; the other adapter's and the
    base's are answered; no block stays held."""
    _, paths, ref = ckpt
    engine = llm.engine
    prompt = _prompts((6,), seed=17)[0]
    gone = LoRARequest("lost", 41, str(tmp_path / "lost"))
    loras: list[LoRARequest | None] = [gone, _req("gamma", paths), None, gone]
    rids = [engine.add_request(GenerateRequest.of(prompt, GREEDY, lora=lo)) for lo in loras]
    outs: dict[Any, list[Any]] = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    for rid, lo in zip(rids, loras, strict=True):
        last = outs[rid][-1]
        assert last.finished
        if lo is gone:
            assert last.finish_reason == "error" and last.error_code == "adapter_unavailable"
            assert "'lost'" in (last.failure or "") and str(tmp_path) not in (last.failure or "")
        else:
            tokens = [t for o in outs[rid] for t in o.token_ids]
            assert tokens == greedy(ref, None if lo is None else "gamma", prompt, NEW)
    stats = engine.stats()
    assert stats.free_blocks == stats.total_blocks and "lost#41" not in engine.lora.names()  # type: ignore[union-attr]


def test_a_name_loaded_again_with_a_new_id_never_finds_the_old_blocks(
        llm: LLM, ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """Identity is name and id: ``beta`` reloaded from gamma's weights under a new id answers as
    gamma, finds none of the prefix blocks the old ``beta`` computed, and replaces the old copy
    (unused) in the cache."""
    _, paths, ref = ckpt
    prompt = _prompts((40,), seed=13)[0]
    old = LoRARequest("beta", 2, str(paths["beta"]))
    new = LoRARequest("beta", 77, str(paths["gamma"]))
    cached = []
    for lora, as_ in ((old, "beta"), (old, "beta"), (new, "gamma"), (new, "gamma")):
        (out,) = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                              lora_request=lora)
        assert out.outputs[0].token_ids == greedy(ref, as_, prompt, NEW)
        cached.append(out.num_cached_tokens)
    assert cached[1] > 0 and cached[2] == 0 and cached[3] > 0
    assert [r.lora_int_id for r in llm.engine.loras() if r.lora_name == "beta"] == [77]


def test_fused_targets_under_partial_rotary_match_peft(tmp_path: Path) -> None:
    """Phi-3 (partial rotary) fuses q/k/v and gate/up in its checkpoint: an adapter on
    ``qkv_proj`` and ``gate_up_proj`` adds into the whole module, its q/k rows permuted as the
    model's are."""
    hf = tiny_hf_model("phi3-partial")
    from tests.replica.models.helpers import save_checkpoint

    base = save_checkpoint(hf, tmp_path / "base")
    paths = {"fused": make_adapter(hf, tmp_path / "fused", 4, r=4, lora_alpha=8,
                                   target_modules=["qkv_proj", "o_proj", "gate_up_proj"])}
    ref = reference(base, paths)
    model, _, _ = load_model(str(base), dtype=torch.float32, device="cpu")
    lora = LoRAManager(model, max_loras=1, max_rank=8, max_cpu_loras=1)
    lora.load("fused", str(paths["fused"]))
    prompts = _prompts((6, 5), seed=11)
    names: list[str | None] = ["fused", None]
    rows = [None if n is None else f"{n}#0" for n, p in zip(names, prompts, strict=True)
            for _ in p]
    with lora.running(lora.batch(rows)):
        got = PagedHarness(model, len(prompts), 32).step(
            [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True)
    for p, n, lg in zip(prompts, names, got, strict=True):
        torch.testing.assert_close(lg, logits(ref, n, p), rtol=0, atol=1e-4)
    assert not torch.allclose(logits(ref, "fused", prompts[0]), logits(ref, None, prompts[0]))
    lora.close()


def test_rows_in_runs_and_rows_interleaved_add_the_same(
        llm: LLM, ckpt: tuple[Path, dict[str, Path], Any]) -> None:
    """The CPU path applies an adapter in place on runs of contiguous rows (the runner orders a
    step's rows by adapter) and, for rows in any other order, over padded segments: both add
    the same into every row, and nothing into the base's."""
    _, paths, _ = ckpt
    lora = llm.engine.lora
    assert lora is not None
    keys = {"alpha": "alpha#101", "beta": "beta#102"}
    for name, key in keys.items():
        assert lora.load(name, str(paths[name]), int(key.split("#")[1]))
    assert _runs([-1, 0, 0, 1, 1, 1, -1, 0]) == [(1, 3, 0), (3, 6, 1), (7, 8, 0)]
    parts = [p for (layer, _), p in lora._parts.items() if layer == 0]
    width = max(p.offset + p.out_features for p in parts)
    xs = {id(p): torch.randn(24, p.a.shape[2]) for p in parts}  # each part's input rows
    interleaved = [(keys["alpha"], keys["beta"], None)[i % 3] for i in range(24)]
    perm = sorted(range(24), key=lambda i: (interleaved[i] is not None, interleaved[i] or ""))
    ordered = [interleaved[i] for i in perm]
    outs = []
    for rows, order in ((interleaved, list(range(24))), (ordered, perm)):
        batch = lora.batch(rows)
        assert batch is not None and (batch.runs is None) == (rows is interleaved)
        out = torch.zeros(24, width)
        for p in parts:
            apply_lora(xs[id(p)][order], out, [p], batch)
        assert out[[i for i, k in enumerate(rows) if k is None]].abs().sum() == 0
        assert out.abs().sum() > 0
        outs.append(out)
    torch.testing.assert_close(outs[0][perm], outs[1], rtol=1e-5, atol=1e-5)
