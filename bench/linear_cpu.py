"""The native CPU linear layer against ``torch.nn.functional.linear`` (MKL), side by side.

    python -m bench.linear_cpu [--rows 1,4,8,16,32,64,128,512] [--layers 30] [--repeats 5]
                               [--json out.json] [--plot out.png]

One "step" multiplies ``rows`` activation rows through the linear layers of a SmolLM2-135M-shaped
model (``--layers`` decoder layers of qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576, each with its own random fp32 weight, so that the weights stream from memory as in a
real decode step and do not sit in the cache) and, separately, through its output head
(576->49152). Each is timed for both implementations in alternation, in one process; the
figure is the median of ``--repeats`` steps, with the ratio torch / native (above 1: the native
kernel is faster) and each one's GFLOP/s. Nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_native

HIDDEN, INTER, QKV, VOCAB = 576, 1536, 960, 49152


@dataclass(slots=True)
class Row:
    """One (part, rows) point; times in milliseconds per step."""

    part: str
    rows: int
    torch_ms: float
    native_ms: float
    ratio: float
    torch_gflops: float
    native_gflops: float


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _layers(
    dense: list[list[torch.Tensor]],
    packed: list[list[torch.Tensor]] | None,
    x: torch.Tensor,
    xi: torch.Tensor,
) -> None:
    """One step through every layer's projections: ``F.linear`` on the dense weights, or the
    native kernel on the packed ones."""
    for i, ws in enumerate(dense):
        for j, w in enumerate(ws):
            inp = xi if w.shape[1] == INTER else x
            if packed is None:
                F.linear(inp, w)
            else:
                cpu_native.linear(inp, packed[i][j], w.shape[0])


def run(rows_list: list[int], layers: int, repeats: int) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    dense = [[torch.randn(n, k, generator=gen) for n, k in shapes] for _ in range(layers)]
    packed = [[cpu_native.pack_linear(w) for w in layer] for layer in dense]
    head = torch.randn(VOCAB, HIDDEN, generator=gen)
    head_packed = cpu_native.pack_linear(head)
    out: list[Row] = []
    for m in rows_list:
        x = torch.randn(m, HIDDEN, generator=gen)
        xi = torch.randn(m, INTER, generator=gen)

        layers_torch = functools.partial(_layers, dense, None, x, xi)
        layers_native = functools.partial(_layers, dense, packed, x, xi)
        flops_layers = 2.0 * m * layers * sum(n * k for n, k in shapes)
        flops_head = 2.0 * m * VOCAB * HIDDEN
        for part, ft, fn, flops in (
            ("layers", layers_torch, layers_native, flops_layers),
            (
                "head",
                functools.partial(F.linear, x, head),
                functools.partial(cpu_native.linear, x, head_packed, VOCAB),
                flops_head,
            ),
        ):
            # torch, native, torch, native: each one's better median.
            t1, n1, t2, n2 = (_median_ms(f, repeats) for f in (ft, fn, ft, fn))
            t_ms, n_ms = min(t1, t2), min(n1, n2)
            out.append(
                Row(
                    part,
                    m,
                    round(t_ms, 3),
                    round(n_ms, 3),
                    round(t_ms / n_ms, 2),
                    round(flops / t_ms / 1e6, 1),
                    round(flops / n_ms / 1e6, 1),
                )
            )
            r = out[-1]
            print(
                f"{part:7s} rows {m:4d}  torch {r.torch_ms:8.2f} ms ({r.torch_gflops:6.1f} GFLOP/s)"
                f"  native {r.native_ms:8.2f} ms ({r.native_gflops:6.1f} GFLOP/s)"
                f"  torch/native {r.ratio:.2f}x",
                flush=True,
            )
    return out


def _plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for part, style in (("layers", "o-"), ("head", "s--")):
        pts = [r for r in rows if r.part == part]
        ax.plot([r.rows for r in pts], [r.ratio for r in pts], style, label=part)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per step")
    ax.set_ylabel("torch time / native time")
    ax.set_title("Native CPU linear vs F.linear (SmolLM2-135M shapes, fp32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if not cpu_native.available():
        print(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
        return 2
    torch.set_num_threads(args.threads)
    rows_list = [int(v) for v in args.rows.split(",")]
    if not rows_list or min(rows_list) < 1 or args.layers < 1 or args.repeats < 1:
        ap.error("--rows, --layers and --repeats must be positive")
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    record = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
    }
    print("machine:", record)
    rows = run(rows_list, args.layers, args.repeats)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": record, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if args.plot:
        _plot(rows, args.plot)
        print("plot:", args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
