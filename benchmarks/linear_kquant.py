"""The native CPU linear layer on GGUF K-quant weights kept packed, against the same weights as fp32
panels, side by side, per shape (decode-shaped row counts).

    python -m benchmarks.linear_kquant [--rows 1,8,64] [--layers 18] [--repeats 7] [--threads 2]
                                  [--forms q8_0,q4_k,q5_k,q6_k] [--shapes qkv,o,gate_up,down,head]
                                  [--json out.json]

A step multiplies ``rows`` activation rows by one projection of every layer of a Gemma-3-270M-
shaped model (hidden 640, q 1024, k and v 256, intermediate 2048; 18 layers): qkv 640->1536,
o 1024->640, gate_up 640->4096, down 2048->640, and the tied head 640->262144 (one weight). Each
form's weights are random blocks of that GGUF type (sane fp16 scales) dequantized by the ``gguf``
package, as the loader gives them, then packed by ``cpu_packing.pack_linear_quantized`` in that
form (``fp32``: ``cpu_packing.pack_linear``'s panels of the same weights). One weight of up to
2,048 outputs is generated and packed per form and shape; larger ones repeat its panels, and each
layer is its own copy, so that a step streams every layer's weights from memory as a decode step
does. Each form's first output is checked against the fp32 panels' (the same bits).

For each (shape, rows) the forms run in rounds, in alternating order, in one process; a figure is
the least of ``--repeats`` rounds (the machine may be shared: the least is the least disturbed),
with the ratio fp32 time / its time (above 1: faster than fp32 panels). Nothing asserts on time.
A GGUF K-quant row is whole superblocks of 256 weights, so a real file holds a 640-input weight
in another type; the 640-input shapes here time the packed forms as such.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import gguf
import numpy as np
import torch

from benchmarks.linear_cpu import machine
from tierserve.kernels import cpu_abi, cpu_native, cpu_ops, cpu_packing

HIDDEN, Q, KV, INTER, VOCAB, LAYERS = 640, 1024, 256, 2048, 262144, 18
# (name, out_features, in_features, weights per step)
SHAPES = (
    ("qkv", Q + 2 * KV, HIDDEN, True),
    ("o", HIDDEN, Q, True),
    ("gate_up", 2 * INTER, HIDDEN, True),
    ("down", HIDDEN, INTER, True),
    ("head", VOCAB, HIDDEN, False),
)
# form -> (GGUF type, the packed form's code)
FORMS = {
    "q8_0": ("Q8_0", 8),
    "q4_k": ("Q4_K", cpu_abi.QUANT_K4),
    "q5_k": ("Q5_K", cpu_abi.QUANT_K5),
    "q6_k": ("Q6_K", cpu_abi.QUANT_K6),
}
# Byte offsets of the fp16 scales in a K-quant block (random bytes elsewhere).
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
BASE_ROWS = 2048

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(slots=True)
class Point:
    """One (shape, rows, form): the least milliseconds of a step, fp32 ms / ms."""

    shape: str
    rows: int
    form: str
    ms: float
    vs_fp32: float


def gguf_weight(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    """A random ``[n, k]`` weight of GGUF type ``qtype`` as the loader dequantizes it (fp32)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in K_SCALES:
        w = (rng.standard_normal((n, k)) / k**0.5).astype(np.float32)
        data = gguf.quants.quantize(w, kind)
    else:
        bs, ts = gguf.GGML_QUANT_SIZES[kind]
        cols = -(-k // bs) * bs  # whole superblocks, cut to k after
        raw = rng.integers(0, 256, size=(n, cols // bs, ts), dtype=np.uint8)
        for off in K_SCALES[qtype]:
            scale = rng.uniform(2e-4, 1e-3, size=(n, cols // bs)).astype(np.float16)
            raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(n, cols // bs, 2)
        data = raw.reshape(n, -1)
    back = gguf.quants.dequantize(data, kind).reshape(n, -1)[:, :k]
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))


def _repeat(packed: torch.Tensor, panels: int) -> torch.Tensor:
    """``packed`` (panels first) repeated to ``panels`` panels, a new tensor."""
    reps = -(-panels // packed.shape[0])
    return packed.repeat(reps, *([1] * (packed.dim() - 1)))[:panels].clone()


def _step_ms(fns: list[Linear], x: torch.Tensor) -> float:
    t = time.perf_counter()
    for fn in fns:
        fn(x)
    return (time.perf_counter() - t) * 1e3


def run(rows_list: list[int], layers: int, repeats: int, forms: list[str],
        shapes: list[str]) -> list[Point]:
    gen = torch.Generator().manual_seed(0)
    points: list[Point] = []
    names = ["fp32", *forms]
    for si, (name, n, k, per_layer) in enumerate(SHAPES):
        if name not in shapes:
            continue
        count = layers if per_layer else 1
        panels = -(-n // cpu_abi.PANEL)
        base = min(n, BASE_ROWS)
        ways: dict[str, list[Linear]] = {}
        checks: dict[str, tuple[torch.Tensor, Linear]] = {}
        for fi, form in enumerate(forms):
            qtype, code = FORMS[form]
            w = gguf_weight(base, k, qtype, seed=100 * si + fi)
            found = cpu_packing.pack_linear_quantized(w, bits_tried=(code,))
            if found is None:
                raise SystemExit(f"{form} weights {base}x{k} did not pack in their form")
            packed = found[0]
            fp32 = cpu_packing.pack_linear(w)
            checks[form] = (fp32, _quantized(packed, code, base))
            copies = [_repeat(packed, panels) for _ in range(count)]
            ways[form] = [_quantized(p, code, n) for p in copies]
            if fi == 0:  # the fp32 panels of the first form's weights
                ways["fp32"] = [_fp32(_repeat(fp32, panels), n) for _ in range(count)]
        for m in rows_list:
            x = torch.randn(m, k, generator=gen)
            for form, (fp32, fn) in checks.items():
                want = cpu_ops.linear(x, fp32, base)
                if not torch.equal(fn(x).view(torch.int32), want.view(torch.int32)):
                    raise SystemExit(f"{form}: not the fp32 panels' bits at {m} rows")
            for fns in ways.values():  # warm
                _step_ms(fns, x)
            times: dict[str, list[float]] = {f: [] for f in names}
            for r in range(repeats):
                for f in names if r % 2 == 0 else names[::-1]:
                    times[f].append(_step_ms(ways[f], x))
            best = {f: min(ts) for f, ts in times.items()}
            for f in names:
                ratio = round(best["fp32"] / best[f], 2)
                points.append(Point(name, m, f, round(best[f], 3), ratio))
            print(_line(points[-len(names):]), flush=True)
        del ways, checks
    return points


def _quantized(packed: torch.Tensor, code: int, n: int) -> Linear:
    return lambda x: cpu_ops.linear_quantized(x, packed, code, n)


def _fp32(packed: torch.Tensor, n: int) -> Linear:
    return lambda x: cpu_ops.linear(x, packed, n)


def _line(pts: list[Point]) -> str:
    head = f"{pts[0].shape:8s} {pts[0].rows:4d}"
    return head + "".join(f" | {p.ms:8.2f} {p.vs_fp32:5.2f}" for p in pts)


def table(points: list[Point], forms: list[str]) -> str:
    """Markdown: per shape and rows, each form's ms and fp32 ms / its ms."""
    names = ["fp32", *forms]
    lines = [
        "| shape | rows | " + " | ".join(f"{f} ms [vs fp32]" for f in names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    by_key: dict[tuple[str, int], dict[str, Point]] = {}
    for p in points:
        by_key.setdefault((p.shape, p.rows), {})[p.form] = p
    for (shape, m), ps in by_key.items():
        cells = [f"{ps[f].ms:.2f} [{ps[f].vs_fp32:.2f}]" for f in names]
        lines.append(f"| {shape} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_native.available():
        print(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
        return 2
    rows_list = [int(v) for v in args.rows.split(",")]
    forms = [f for f in args.forms.split(",") if f]
    unknown = set(forms) - set(FORMS)
    if unknown or not forms:
        ap.error(f"--forms: choose from {list(FORMS)} (got {sorted(unknown)})")
    if not rows_list or min(rows_list) < 1 or args.layers < 1 or args.repeats < 1:
        ap.error("--rows, --layers and --repeats must be positive")
    record = machine()
    print("machine:", record)
    print(f"{'shape':8s} rows" + "".join(f" | {f:>14s}" for f in ["fp32", *forms]))
    points = run(rows_list, args.layers, args.repeats, forms, args.shapes.split(","))
    print()
    print(table(points, forms))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": record, "forms": forms, "points": [asdict(p) for p in points]},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
