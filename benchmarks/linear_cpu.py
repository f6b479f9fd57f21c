"""The native CPU linear layer against the libraries torch ships, side by side, per shape.

    python -m benchmarks.linear_cpu [--rows 1,2,4,...,512] [--layers 30] [--repeats 5] [--threads 2]
                               [--impls native,native-avx2,torch,mkl-packed,onednn,panels-bmm]
                               [--avx2] [--json out.json] [--plot out.png]

A step multiplies ``rows`` activation rows by one projection of every layer of a SmolLM2-135M-
shaped model: ``--layers`` distinct random fp32 weights of that shape (qkv 576->960, o 576->576,
gate_up 576->3072, down 1536->576), so that the weights stream from memory as in a real decode
step and do not sit in the cache; the output head (576->49152) is one weight. The ways to do it:

- ``native``: ``tierserve.kernels.cpu_ops.linear`` on the panels of ``cpu_packing.pack_linear``, the
  build this CPU gets (AVX-512 where the compiler sees it, else AVX2, else portable);
- ``native-avx2``: the same source built without AVX-512 (only on a CPU with it);
- ``torch``: ``torch.nn.functional.linear`` on the ``[out, in]`` weight (MKL's sgemm);
- ``mkl-packed``: ``torch.ops.mkl._mkl_linear`` on a weight that
  ``torch.ops.mkl._mkl_reorder_linear_weight`` packed for exactly this row count (it falls back
  to ``F.linear`` on the original, which it also keeps, at any other row count);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by
  ``torch.ops.mkldnn._reorder_linear_weight`` (one copy, any row count);
- ``panels-bmm``: a library batched GEMM (``torch.matmul``) straight on the native panels, no
  second copy of the weight (``panels_bmm``).

For each (rows, shape) the ways run in rounds, in alternating order, one process; a figure is the
median over ``--repeats`` rounds, with GFLOP/s and the ratio native time / its time (above 1: it
is faster than the native kernel). ``--avx2`` runs the whole comparison as an AVX2-only CPU would
(MKL, oneDNN and ATen limited to AVX2, the native kernel built without AVX-512). Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tierserve.cluster.measure import machine as common_machine
from tierserve.cluster.measure import pyplot
from tierserve.kernels import cpu_abi, cpu_build, cpu_native, cpu_ops, cpu_packing

HIDDEN, INTER, QKV, VOCAB = 576, 1536, 960, 49152
# (name, out_features, in_features, weights per step)
SHAPES = (
    ("qkv", QKV, HIDDEN, True),
    ("o", HIDDEN, HIDDEN, True),
    ("gate_up", 2 * INTER, HIDDEN, True),
    ("down", HIDDEN, INTER, True),
    ("head", VOCAB, HIDDEN, False),
)
IMPLS = ("native", "native-avx2", "torch", "mkl-packed", "onednn", "panels-bmm")
ROWS = "1,2,4,8,16,32,64,128,256,512"
# What limits each library to AVX2 (read once, at load). oneDNN has its own: without it, its
# column is still AVX-512 under MKL's limit.
AVX2_ENV = {
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Point:
    """One (shape, rows, way): the median milliseconds of a step, GFLOP/s, native ms / ms."""

    shape: str
    rows: int
    impl: str
    ms: float
    gflops: float
    vs_native: float


def machine() -> dict[str, object]:
    """``tierserve.cluster.measure.machine`` plus the CPU flags and environment this benchmark depends on."""
    have = set(cpu_build.cpu_flags().split())
    flags = sorted(f for f in ("avx2", "fma", "avx512f", "avx512bw", "amx_tile") if f in have)
    return common_machine(
        cpu_flags=flags, env={k: os.environ[k] for k in AVX2_ENV if k in os.environ}
    )


def _on(lib: cpu_abi.NativeLib | None, fn: Linear) -> Linear:
    """``fn`` with ``lib`` as the process's native library (the same Python path as ``native``)."""
    if lib is None:
        return fn

    def run(x: torch.Tensor) -> torch.Tensor:
        before = cpu_native._lib
        cpu_native._lib = lib
        try:
            return fn(x)
        finally:
            cpu_native._lib = before

    return run


def panels_bmm(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ W.T`` by a library batched GEMM on the native panels: panel ``p`` is the ``[in, 16]``
    matrix of outputs ``16 p .. 16 p + 15``, so one GEMM of ``x`` (broadcast, not copied) per
    panel gives ``y`` in panel order, copied once into ``[M, out]``."""
    m, k = x.shape
    panels = packed.shape[0]
    part = torch.bmm(x.expand(panels, m, k), packed)  # [panels, M, 16]
    y = part.transpose(0, 1).reshape(m, panels * cpu_abi.PANEL)
    return y if out_features == y.shape[1] else y[:, :out_features].contiguous()


def _mkl_packed(x: torch.Tensor, wm: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.ops.mkl._mkl_linear(x, wm, w, None, rows)


def _onednn(x: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, wd, None, "none", [], "")


def _native(x: torch.Tensor, p: torch.Tensor, n: int) -> torch.Tensor:
    return cpu_ops.linear(x, p, n)


def _ways(
    impls: list[str],
    weights: list[torch.Tensor],
    packed: list[torch.Tensor],
    rows: int,
    avx2_lib: cpu_abi.NativeLib | None,
) -> dict[str, list[Linear]]:
    """way -> one function per weight, prepared for ``rows`` rows (the MKL pack is per count)."""
    out: dict[str, list[Linear]] = {}
    for impl in impls:
        fns: list[Linear] = []
        for w, p in zip(weights, packed, strict=True):
            n = w.shape[0]
            if impl == "native":
                fns.append(functools.partial(_native, p=p, n=n))
            elif impl == "native-avx2":
                fns.append(_on(avx2_lib, functools.partial(_native, p=p, n=n)))
            elif impl == "torch":
                fns.append(functools.partial(F.linear, weight=w))
            elif impl == "mkl-packed":
                wm = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
                fns.append(functools.partial(_mkl_packed, wm=wm, w=w, rows=rows))
            elif impl == "onednn":
                wd = torch.ops.mkldnn._reorder_linear_weight(w)
                fns.append(functools.partial(_onednn, wd=wd))
            elif impl == "panels-bmm":
                fns.append(functools.partial(panels_bmm, packed=p, out_features=n))
        out[impl] = fns
    return out


def _step_ms(fns: list[Linear], x: torch.Tensor) -> float:
    t = time.perf_counter()
    for fn in fns:
        fn(x)
    return (time.perf_counter() - t) * 1e3


def run(
    rows_list: list[int], layers: int, repeats: int, impls: list[str], shapes: list[str]
) -> list[Point]:
    gen = torch.Generator().manual_seed(0)
    avx2_lib = None
    if "native-avx2" in impls:
        avx2_lib = cpu_native.load_variant(
            Path(tempfile.mkdtemp(prefix="tierserve-bench-")), add=("-mno-avx512f",)
        )
    points: list[Point] = []
    for name, n, k, per_layer in SHAPES:
        if name not in shapes:
            continue
        count = layers if per_layer else 1
        weights = [torch.randn(n, k, generator=gen) / k**0.5 for _ in range(count)]
        packed = [cpu_packing.pack_linear(w) for w in weights]
        for m in rows_list:
            x = torch.randn(m, k, generator=gen)
            ways = _ways(impls, weights, packed, m, avx2_lib)
            ref = F.linear(x, weights[0])
            for impl, fns in ways.items():  # each agrees with F.linear, and is warm
                got = fns[0](x)
                torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-3, msg=impl)
                _step_ms(fns, x)
            times: dict[str, list[float]] = {impl: [] for impl in ways}
            for r in range(repeats):
                for impl in impls if r % 2 == 0 else impls[::-1]:
                    times[impl].append(_step_ms(ways[impl], x))
            del ways
            med = {impl: statistics.median(ts) for impl, ts in times.items()}
            flops = 2.0 * m * n * k * count
            for impl in impls:
                points.append(
                    Point(
                        name,
                        m,
                        impl,
                        round(med[impl], 3),
                        round(flops / med[impl] / 1e6, 1),
                        round(med["native"] / med[impl], 2) if "native" in med else 0.0,
                    )
                )
            print(_line(points[-len(impls) :]), flush=True)
    return points


def _line(pts: list[Point]) -> str:
    head = f"{pts[0].shape:8s} {pts[0].rows:4d}"
    return head + "".join(
        f" | {p.ms:8.2f} {p.gflops:6.1f} {p.vs_native:5.2f}" for p in pts
    )


def table(points: list[Point], impls: list[str]) -> str:
    """Markdown: per shape and rows, each way's ms, GFLOP/s and native ms / its ms."""
    lines = [
        "| shape | rows | " + " | ".join(f"{i} ms (GFLOP/s) [vs native]" for i in impls) + " |",
        "|---|---:|" + "---:|" * len(impls),
    ]
    by_key: dict[tuple[str, int], dict[str, Point]] = {}
    for p in points:
        by_key.setdefault((p.shape, p.rows), {})[p.impl] = p
    for (shape, m), ps in by_key.items():
        cells = [f"{ps[i].ms:.2f} ({ps[i].gflops:.0f}) [{ps[i].vs_native:.2f}]" for i in impls]
        lines.append(f"| {shape} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot(points: list[Point], impls: list[str], path: str) -> None:
    plt = pyplot()
    names = list(dict.fromkeys(p.shape for p in points))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for impl in impls:
            pts = [p for p in points if p.shape == name and p.impl == impl]
            ax.plot([p.rows for p in pts], [p.vs_native for p in pts], "o-", label=impl)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(name)
        ax.set_xlabel("rows")
    axes[0][0].set_ylabel("native time / its time")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--avx2", action="store_true", help="as an AVX2-only CPU (see above)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    args = ap.parse_args(argv)
    if args.avx2 and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        # MKL and ATen read these once, at load: start again with them set.
        os.execve(
            sys.executable,
            [sys.executable, "-m", "benchmarks.linear_cpu", *(argv or sys.argv[1:])],
            {**os.environ, **AVX2_ENV},
        )
    torch.set_num_threads(args.threads)
    if args.avx2:
        variant = cpu_native.load_variant(
            Path(tempfile.mkdtemp(prefix="tierserve-bench-")), add=("-mno-avx512f",)
        )
        cpu_native._lib, cpu_native._tried = variant, True
    if not cpu_native.available():
        print(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
        return 2
    rows_list = [int(v) for v in args.rows.split(",")]
    impls = [i for i in args.impls.split(",") if i]
    flags = machine()["cpu_flags"]
    if "native-avx2" in impls and (args.avx2 or "avx512f" not in flags):  # type: ignore[operator]
        impls.remove("native-avx2")  # it would be the native build itself
    unknown = set(impls) - set(IMPLS)
    if unknown or "native" not in impls:
        ap.error(f"--impls: choose from {IMPLS}, native included (got {sorted(unknown)})")
    if not rows_list or min(rows_list) < 1 or args.layers < 1 or args.repeats < 1:
        ap.error("--rows, --layers and --repeats must be positive")
    record = machine()
    print("machine:", record)
    print(f"{'shape':8s} rows" + "".join(f" | {i:>21s}" for i in impls))
    print(f"{'':13s}" + " | ms, GFLOP/s, vs native" * len(impls))
    points = run(rows_list, args.layers, args.repeats, impls, args.shapes.split(","))
    print()
    print(table(points, impls))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"machine": record, "impls": impls, "points": [asdict(p) for p in points]},
                f,
                indent=1,
            )
    if args.plot:
        _plot(points, impls, args.plot)
        print("plot:", args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
