"""What the checked native boundary costs per call: the same C functions called raw through
ctypes (addresses from ``data_ptr()``, the way the module called them before the boundary
checked its arguments) and through ``tierserve.kernels.cpu_abi``'s checked functions (each pointer
argument checked against its kind), on inputs so small that the call is all there is.

    python -m benchmarks.native_call_overhead [--calls 20000] [--rounds 7]

Rounds alternate the two ways (and the public wrappers that callers use), in one process; the
figure is each one's median over the rounds, in microseconds per call. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tierserve.kernels import cpu_native, cpu_ops, cpu_packing


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls * 1e6


def cases() -> dict[str, Callable[[], object]]:
    """name -> a zero-argument call; ``raw``/``checked`` pairs call the same C function."""
    lib = cpu_native.lib_or_raise()
    raw = lib.cdll
    x, w = torch.randn(1, 16), torch.randn(16, 16)
    packed = cpu_packing.pack_linear(w)
    y = torch.empty(1, 16)
    gate_up, out = torch.randn(1, 32), torch.empty(1, 16)
    return {
        "linear raw ctypes": lambda: raw.ts_linear_f32(
            x.data_ptr(), 16, 1, 16, packed.data_ptr(), 16, None, y.data_ptr(), 16, 1
        ),
        "linear checked": lambda: lib.ts_linear_f32(x, 16, 1, 16, packed, 16, None, y, 16, 1),
        "silu_mul raw ctypes": lambda: raw.ts_silu_mul_f32(
            gate_up.data_ptr(), 32, out.data_ptr(), 1, 16, 1
        ),
        "silu_mul checked": lambda: lib.ts_silu_mul_f32(gate_up, 32, out, 1, 16, 1),
        "cpu_ops.linear": lambda: cpu_ops.linear(x, packed, 16),
        "cpu_ops.silu_and_mul": lambda: cpu_ops.silu_and_mul(gate_up),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    if not cpu_native.available():
        print(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
        return 2
    torch.set_num_threads(1)
    todo = cases()
    times: dict[str, list[float]] = {name: [] for name in todo}
    for r in range(args.rounds):
        names = list(todo) if r % 2 == 0 else list(reversed(todo))
        for name in names:
            times[name].append(_per_call_us(todo[name], args.calls))
    for name, ts in times.items():
        print(f"{name:26s} {statistics.median(ts):7.2f} us/call")
    for base in ("linear", "silu_mul"):
        extra = statistics.median(times[f"{base} checked"]) - statistics.median(
            times[f"{base} raw ctypes"]
        )
        print(f"{base}: the checks add {extra:.2f} us/call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
