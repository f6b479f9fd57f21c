"""Where tierserve's forward spends its time, by op, on one of ``benchmarks.throughput``'s mixes.

Run: ``python -m benchmarks.profile_ops`` (the real model, the shared-nothing mix of 64 requests:
about a minute on 2 cores); ``--mix shared``, ``--requests N``, ``--model
tiny|smollm2|smollm2-135m-instruct`` (``benchmarks.throughput``'s checkpoints), ``--json PATH``.
Nothing here asserts on time.

One engine (``tierserve.replica.llm.LLM``, the benchmark's options) generates the mix once after a short
warm-up, with every op of the model wrapped by a timer: each linear layer by its shape (``in x
out``, then ``decode`` in steps of decode rows only, ``prefill`` in steps with prefill rows),
attention split the same way (steps of decode rows only, steps with prefill rows), the native
RMSNorm (with its residual add), SiLU-and-mul and rotary-with-KV-store. It prints each op's
seconds and share of the forward's time, the calls, and for the linear layers the GFLOP/s they
ran at (2 x in x out per row); what is left of the forward (embedding, index ops, glue) is
``rest``. The timers cost some microseconds per call (some 270 calls per step), so the total
runs a little slower than ``benchmarks.throughput``'s.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.throughput import BUILDERS, MIXES, THREADS, Checkpoint, EngineOptions, make_mix
from tierserve.cluster.measure import load_avg_1m, machine


@dataclass(frozen=True, slots=True)
class OpTime:
    op: str
    seconds: float
    share: float  # of the forward's time
    calls: int
    gflops: float | None = None  # linear layers: the rate they ran at


class OpTimer:
    """Accumulates wall seconds and calls per op name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.flops: dict[str, float] = collections.defaultdict(float)

    def add(self, op: str, seconds: float, flops: float = 0.0) -> None:
        self.seconds[op] += seconds
        self.calls[op] += 1
        self.flops[op] += flops

    def timed(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(op, time.perf_counter() - t)

        return wrapper

    def table(self, forward_op: str = "forward") -> list[OpTime]:
        total = self.seconds[forward_op]
        ops = [k for k in self.seconds if k != forward_op]
        rows = [
            OpTime(
                k,
                self.seconds[k],
                self.seconds[k] / total if total else 0.0,
                self.calls[k],
                self.flops[k] / self.seconds[k] / 1e9 if self.flops[k] else None,
            )
            for k in ops
        ]
        rest = total - sum(r.seconds for r in rows)
        rows.sort(key=lambda r: -r.seconds)
        rows.append(OpTime("rest", rest, rest / total if total else 0.0, 0))
        return rows


@contextmanager
def instrumented(timer: OpTimer, runner: Any) -> Iterator[None]:
    """Wrap the model's ops (and the runner's forward) with ``timer``; undone on exit."""
    import tierserve.kernels.cpu_ops as native
    import tierserve.replica.models.layers as layers
    import tierserve.replica.models.llama as llama

    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, new: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, new)
        undo.append(lambda: setattr(owner, name, old))

    lin_forward = layers.Linear.forward
    model_forward = llama.LlamaModel.forward
    step = {"kind": "decode"}  # the kind of the step being run: its linears are named by it

    def model(self: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv: Any,
              meta: Any) -> Any:
        step["kind"] = "decode" if meta.num_tokens == meta.num_seqs else "prefill"
        return model_forward(self, input_ids, positions, kv, meta)

    def linear(self: Any, x: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return lin_forward(self, x)
        finally:
            flops = 2.0 * x.shape[0] * self.in_features * self.out_features
            timer.add(f"linear {self.in_features}x{self.out_features}, {step['kind']}",
                      time.perf_counter() - t, flops)

    attend = llama.attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
                  vc: torch.Tensor, meta: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return attend(q, k, v, kc, vc, meta, *args, **kwargs)
        finally:
            kind = "decode rows only" if meta.num_tokens == meta.num_seqs else "with prefill rows"
            timer.add(f"attention, {kind}", time.perf_counter() - t)

    patch(llama.LlamaModel, "forward", model)
    patch(layers.Linear, "forward", linear)
    patch(llama, "attention", attention)
    for name, op in (("rms_norm", "rms_norm (+ residual add)"), ("silu_and_mul", "silu_and_mul"),
                     ("qk_norm", "q/k norm per head (Qwen3)"),
                     ("rope_store", "rotary + KV store")):
        patch(native, name, timer.timed(op, getattr(native, name)))
    patch(runner, "forward", timer.timed("forward", runner.forward))
    try:
        yield
    finally:
        for u in reversed(undo):
            u()


def profile(ck: Checkpoint, mix_kind: str, requests: int, seed: int = 0) -> dict[str, Any]:
    """Generate the mix once under the timers; the op table and the run's totals."""
    from tierserve.replica.llm import LLM
    from tierserve.replica.sampler import SamplingParams

    mix = make_mix(mix_kind, requests, ck.id_range, seed)
    llm = LLM(ck.engine_model or str(ck.path), **EngineOptions().for_mix(mix))
    torch.set_num_threads(THREADS)
    llm.generate([list(mix[0].prompt[:16])], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
              for r in mix]
    timer = OpTimer()
    with instrumented(timer, llm.engine.runner):
        t0 = time.perf_counter()
        outs = llm.generate([list(r.prompt) for r in mix], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "model": ck.name,
        "mix": mix_kind,
        "requests": requests,
        "prompt_tokens": sum(len(r.prompt) for r in mix),
        "generated_tokens": tokens,
        "prefix_hit_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "wall_s": wall,
        "tok_s": tokens / wall,
        "forward_s": timer.seconds["forward"],
        "steps": timer.calls["forward"],
        "ops": [asdict(r) for r in timer.table()],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(BUILDERS), default="smollm2-135m-instruct")
    ap.add_argument("--mix", choices=MIXES, default="random")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures to this path")
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests must be at least 1, got {args.requests}")
    torch.set_num_threads(THREADS)
    info = machine()
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    with tempfile.TemporaryDirectory(prefix="tierserve-profile-") as tmp:
        ck = BUILDERS[args.model](Path(tmp))
        out = profile(ck, args.mix, args.requests, args.seed)
    info["load_avg_1m_after"] = load_avg_1m()
    print(
        f"{out['model']}, {out['mix']} mix, {out['requests']} requests: {out['prompt_tokens']} "
        f"prompt tokens ({out['prefix_hit_tokens']} found in the prefix cache), "
        f"{out['generated_tokens']} generated in {out['wall_s']:.1f} s = {out['tok_s']:.1f} tok/s; "
        f"forward {out['forward_s']:.1f} s over {out['steps']} steps"
    )
    print(f"{'op':32s} {'seconds':>8s} {'share':>7s} {'calls':>7s} {'GFLOP/s':>8s}")
    for r in out["ops"]:
        rate = f"{r['gflops']:8.0f}" if r["gflops"] else ""
        print(f"{r['op']:32s} {r['seconds']:8.2f} {r['share']:7.1%} {r['calls']:7d} {rate}")
    print(f"load average (1 min): {info['load_avg_1m_before']:.2f} before, "
          f"{info['load_avg_1m_after']:.2f} after")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
