"""Decode-attention benchmark on a CUDA GPU: Triton paged attention vs SDPA on gathered K/V.

    python -m benchmarks.kernels_gpu [--batches 1,4,16,64,256] [--contexts 512,2048,8192] [--json out.json]

For each (batch, context) every sequence decodes one token over ``context`` cached positions held in
randomly scattered blocks of a paged pool. Reported per row: Triton time, achieved bandwidth
(bytes of K and V read / time) and its share of the GPU's peak, the deterministic kernel's time,
and ``torch.nn.functional.scaled_dot_product_attention`` on the same K/V already gathered into
contiguous ``[batch, kv_heads, context, head_dim]`` tensors (it pays no gather; the paged kernel
does). Exits with a message on a machine without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tierserve.arith import ceil_div
from tierserve.cluster.measure import machine

# HBM peak in bytes/s by device-name fragment (first match wins); --peak-tbps overrides.
PEAK_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("H800", 3.35e12),
    ("GH200", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 0.864e12),
    ("L4", 0.3e12),
    ("A10G", 0.6e12),
]


@dataclass(slots=True)
class Row:
    """One measured (batch, context) point; times in microseconds."""

    batch: int
    context: int
    kv_splits: int
    triton_us: float
    triton_gbps: float
    peak_fraction: float
    triton_det_us: float
    sdpa_us: float
    max_abs_diff: float


def peak_bandwidth(name: str) -> float | None:
    """Peak memory bandwidth of a GPU by its name, or None if unknown."""
    for fragment, peak in PEAK_BANDWIDTH:
        if fragment in name:
            return peak
    return None


def _parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def measure(
    batch: int,
    context: int,
    *,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    peak: float | None,
) -> Row:
    """Time one decode step of ``batch`` sequences with ``context`` cached positions each."""
    import triton.testing

    from tierserve.kernels import triton_attention
    from tierserve.kernels.metadata import SeqSpec, build_metadata

    dev = torch.device("cuda")
    blocks_per_seq = ceil_div(context, block_size)
    num_blocks = batch * blocks_per_seq + 1
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
    perm = (torch.randperm(num_blocks - 1, device="cpu") + 1).view(batch, blocks_per_seq)
    specs = [SeqSpec(context - 1, 1, perm[b].tolist()) for b in range(batch)]
    meta = build_metadata(specs, block_size, dev)
    q = torch.randn((batch, q_heads, head_dim), generator=gen, device=dev, dtype=dtype)
    scale = head_dim**-0.5

    splits = triton_attention.auto_kv_splits(dev, batch * kv_heads, context)

    def run_triton() -> torch.Tensor:
        return triton_attention.paged_attention(q, k_cache, v_cache, meta, scale)

    def run_det() -> torch.Tensor:
        return triton_attention.paged_attention(
            q, k_cache, v_cache, meta, scale, deterministic=True
        )

    tables = meta.block_tables[:, :blocks_per_seq].long()
    k = k_cache[tables].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2)
    v = v_cache[tables].reshape(batch, -1, kv_heads, head_dim)[:, :context].transpose(1, 2)
    k, v = k.contiguous(), v.contiguous()
    q4 = q.unsqueeze(2)

    def run_sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True).squeeze(2)

    diff = (run_triton().float() - run_sdpa().float()).abs().max().item()
    t_ms = triton.testing.do_bench(run_triton, warmup=25, rep=100, return_mode="median")
    det_ms = triton.testing.do_bench(run_det, warmup=25, rep=100, return_mode="median")
    sdpa_ms = triton.testing.do_bench(run_sdpa, warmup=25, rep=100, return_mode="median")
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    gbps = kv_bytes / (t_ms * 1e-3) / 1e9
    return Row(
        batch=batch,
        context=context,
        kv_splits=splits,
        triton_us=t_ms * 1e3,
        triton_gbps=gbps,
        peak_fraction=gbps * 1e9 / peak if peak else float("nan"),
        triton_det_us=det_ms * 1e3,
        sdpa_us=sdpa_ms * 1e3,
        max_abs_diff=diff,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--peak-tbps", type=float, help="peak memory bandwidth in TB/s")
    parser.add_argument("--json", help="also write the results (and the GPU name) to this file")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print(
            "benchmarks.kernels_gpu needs a CUDA GPU: torch.cuda.is_available() is False on this "
            "machine, so nothing was measured. Run it where `nvidia-smi` lists a GPU.",
            file=sys.stderr,
        )
        return 2

    import triton

    name = torch.cuda.get_device_name()
    peak = args.peak_tbps * 1e12 if args.peak_tbps else peak_bandwidth(name)
    dtype = getattr(torch, args.dtype)
    info = machine(gpu=name, triton=triton.__version__, cuda=torch.version.cuda)
    print(f"GPU: {name}   torch {torch.__version__}   triton {triton.__version__}")
    print(f"host: {info['cpu']} x{info['cores_usable']}, Python {info['python']}")
    print(
        f"decode: q_heads={args.q_heads} kv_heads={args.kv_heads} head_dim={args.head_dim} "
        f"block_size={args.block_size} dtype={args.dtype}   peak "
        + (f"{peak / 1e12:.2f} TB/s" if peak else "unknown (pass --peak-tbps)")
    )
    header = (
        f"{'batch':>6} {'ctx':>6} {'splits':>6} {'triton us':>10} {'GB/s':>8} {'%peak':>6} "
        f"{'det us':>9} {'sdpa us':>9} {'vs sdpa':>8} {'max|diff|':>10}"
    )
    print(header)
    print("-" * len(header))
    rows: list[Row] = []
    for context in _parse_ints(args.contexts):
        for batch in _parse_ints(args.batches):
            try:
                row = measure(
                    batch,
                    context,
                    q_heads=args.q_heads,
                    kv_heads=args.kv_heads,
                    head_dim=args.head_dim,
                    block_size=args.block_size,
                    dtype=dtype,
                    peak=peak,
                )
            except torch.OutOfMemoryError:
                print(f"{batch:>6} {context:>6}  out of GPU memory, skipped")
                torch.cuda.empty_cache()
                continue
            torch.cuda.empty_cache()  # the pool of this point is garbage now
            rows.append(row)
            print(
                f"{row.batch:>6} {row.context:>6} {row.kv_splits:>6} {row.triton_us:>10.1f} "
                f"{row.triton_gbps:>8.0f} {100 * row.peak_fraction:>5.0f}% "
                f"{row.triton_det_us:>9.1f} {row.sdpa_us:>9.1f} "
                f"{row.sdpa_us / row.triton_us:>7.2f}x {row.max_abs_diff:>10.2e}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "gpu": name,
                    "machine": info,
                    "peak_bytes_per_s": peak,
                    "rows": [asdict(r) for r in rows],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
