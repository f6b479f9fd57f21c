"""Quantized panels (``cpu_packing.pack_linear_quantized``): a weight that is exactly a GGUF Q4_1 or
Q8_0 dequantization is kept in that form, and the kernel gives the same bits as on its fp32
panels, for every row count, tile and path; anything else is refused and stays fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from tests.kernels.test_cpu_native import _has_avx512
from tierserve.kernels import cpu_abi, cpu_build, cpu_calibration, cpu_native, cpu_ops, cpu_packing
from tierserve.replica.models.layers import Linear

needs_native = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")

ROWS = (*range(1, 19), 24, 25, 40, 97, 433, 500)  # fused tiles (1-16), scratch, row blocks


def dequantized(
    shape: tuple[int, int], qtype: str, seed: int, scale: float = 0.05, values: Any = None
) -> torch.Tensor:
    """A random weight (or ``values``) as the loader gives it: quantized by the ``gguf``
    package, dequantized back (fp32)."""
    gen = np.random.default_rng(seed)
    w = (gen.standard_normal(shape) * scale if values is None else values).astype(np.float32)
    q = gguf.GGMLQuantizationType[qtype]
    back = gguf.quants.dequantize(gguf.quants.quantize(w, q), q).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))


# GGUF K-quant type -> the packed form it takes
K_FORMS = {"Q4_K": cpu_abi.QUANT_K4, "Q5_K": cpu_abi.QUANT_K5, "Q6_K": cpu_abi.QUANT_K6}


def k_dequantized(shape: tuple[int, int], qtype: str, seed: int) -> torch.Tensor:
    """A K-quant weight as the loader gives it: random blocks with sane fp16 scales
    (``gguf_helpers``), dequantized by the ``gguf`` package (fp32)."""
    from tests.replica.models.gguf_helpers import encode_tensor

    data, kind = encode_tensor(torch.zeros(shape), qtype, seed)
    back = gguf.quants.dequantize(data, kind).reshape(shape)
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))


NO_SUCH_FORM = r"4 or 8 bits or a K-quant form \(104, 105, 106\), got 5"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_native
@pytest.mark.parametrize(("qtype", "bits"), [("Q4_1", 4), ("Q8_0", 8), ("Q5_0", 8)])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (17, 32), (960, 576), (96, 1536)])
def test_quantized_panels_give_the_fp32_bits(qtype: str, bits: int, n: int, k: int) -> None:
    w = dequantized((n, k), qtype, seed=n + k)
    found = cpu_packing.pack_linear_quantized(w)
    assert found is not None
    packed, got_bits = found
    assert got_bits == bits and packed.dtype == torch.uint8
    assert tuple(packed.shape) == cpu_abi.quantized_shape(n, k, bits)
    # A fifth (Q4) or a quarter (Q8; Q5_0 takes the Q8 form) of the fp32 panels' bytes, or less.
    assert packed.numel() * (5 if bits == 4 else 3.7) <= 4 * np.prod(cpu_abi.packed_shape(n, k))
    assert same_bits(cpu_packing.unpack_linear_quantized(packed, bits, n, k), w)
    fp32 = cpu_packing.pack_linear(w)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        for b in (None, bias):
            want = cpu_ops.linear(x, fp32, n, b)
            assert same_bits(cpu_ops.linear_quantized(x, packed, bits, n, b), want), (m, b)
    # Strided rows (a view into a wider buffer) take the same path.
    wide = torch.randn(7, k + 32, generator=gen)
    assert same_bits(
        cpu_ops.linear_quantized(wide[:, :k], packed, bits, n), cpu_ops.linear(wide[:, :k], fp32, n)
    )


@needs_native
def test_edge_blocks_pack_exactly() -> None:
    """Blocks of one value (d = 0), all zeros (padded rows), and tiny weights whose d and m are
    fp16 subnormals: packed, and given back bit for bit."""
    gen = torch.Generator().manual_seed(13)
    for qtype, bits in (("Q4_1", 4), ("Q8_0", 8)):
        w = dequantized((32, 96), qtype, 14)
        w[0] = 0.0
        w[1] = dequantized((1, 96), qtype, 0, values=np.full((1, 96), 0.0371))[0]  # one value
        w[2] = dequantized((1, 96), qtype, 15, scale=5e-5)[0]  # d: fp16 subnormals (< 6.1e-5)
        assert 0 < w[2].abs().max() < 15 * 6.1e-5 and int((w[2] != 0).sum()) > 48
        found = cpu_packing.pack_linear_quantized(w)
        assert found is not None and found[1] == bits
        packed, got = found
        assert same_bits(cpu_packing.unpack_linear_quantized(packed, got, 32, 96), w)
        x = torch.randn(5, 96, generator=gen)
        want = cpu_ops.linear(x, cpu_packing.pack_linear(w), 32)
        assert same_bits(cpu_ops.linear_quantized(x, packed, got, 32), want)


@needs_native
def test_rows_do_not_depend_on_the_batch() -> None:
    """A row's bits are the same alone, in a fused tile, in the scratch path and in any row block."""
    n, k = 72, 576
    packed, bits = cpu_packing.pack_linear_quantized(dequantized((n, k), "Q4_1", 5)) or (None, 0)
    assert packed is not None
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(6))
    whole = cpu_ops.linear_quantized(x, packed, bits, n)
    for start, stop in ((0, 1), (3, 11), (20, 36), (431, 433), (95, 97), (500, 600), (1, 600)):
        got = cpu_ops.linear_quantized(x[start:stop], packed, bits, n)
        assert same_bits(got, whole[start:stop]), (start, stop)


@needs_native
def test_weights_of_no_such_form_stay_fp32() -> None:
    gen = torch.Generator().manual_seed(7)
    assert cpu_packing.pack_linear_quantized(torch.randn(48, 64, generator=gen)) is None
    q4 = dequantized((48, 64), "Q4_1", 8)
    assert cpu_packing.pack_linear_quantized(q4[:, :40].contiguous()) is None  # k not a multiple of 32
    for bad in (float("nan"), float("inf")):
        broken = q4.clone()
        broken[47, 63] = bad
        assert cpu_packing.pack_linear_quantized(broken) is None
    huge = q4.clone()  # (w - m) / d far outside int range: refused, not cast out of range
    huge[5, :32] = 0.0
    huge[5, 1] = 3e38
    assert cpu_packing.pack_linear_quantized(huge) is None
    # A -0 weight: d * -0 is -0, but the stored integer gives d * 0 = +0: refused (Q8), and Q4's
    # fma(d, 0, m) is never -0 either. The Q6_K form's fp32 scale may be negative (its 16 inputs'
    # weights then -S * -q): it keeps that weight exactly.
    q8 = dequantized((48, 64), "Q8_0", 9)
    signed = q8.clone()
    signed[3, 7] = -0.0
    assert signed[3, 7].item() == 0.0 and cpu_packing.pack_linear_quantized(signed, (4, 8)) is None
    k6 = cpu_packing.pack_linear_quantized(signed)
    assert k6 is not None and k6[1] == cpu_abi.QUANT_K6
    assert same_bits(cpu_packing.unpack_linear_quantized(k6[0], k6[1], 48, 64), signed)
    one_off = q4.clone()  # one weight one ulp away from its block's grid: the whole layer stays fp32
    one_off[30, 17] = torch.nextafter(one_off[30, 17], torch.tensor(1.0))
    assert cpu_packing.pack_linear_quantized(one_off, bits_tried=(4,)) is None
    # A Q8_0 weight is no Q4 one.
    assert cpu_packing.pack_linear_quantized(q8, bits_tried=(4,)) is None
    assert cpu_packing.pack_linear_quantized(q8) is not None


@needs_native
def test_quantized_refusals_say_what_is_wrong() -> None:
    n, k = 40, 64
    packed, bits = cpu_packing.pack_linear_quantized(dequantized((n, k), "Q4_1", 10)) or (None, 0)
    assert packed is not None
    x = torch.randn(3, k)
    with pytest.raises(cpu_abi.NativeKernelError, match="is not \\[49 outputs"):
        cpu_ops.linear_quantized(x, packed, bits, 49)
    with pytest.raises(cpu_abi.NativeKernelError, match=NO_SUCH_FORM):
        cpu_ops.linear_quantized(x, packed, 5, n)
    with pytest.raises(cpu_abi.NativeKernelError, match="at 8 bits"):
        cpu_ops.linear_quantized(x, packed, 8, n)
    with pytest.raises(cpu_abi.NativeKernelError, match="fp32 CPU x"):
        cpu_ops.linear_quantized(x.double(), packed, bits, n)
    with pytest.raises(cpu_abi.NativeKernelError, match="bias must be"):
        cpu_ops.linear_quantized(x, packed, bits, n, torch.zeros(n + 1))
    with pytest.raises(cpu_abi.NativeKernelError, match="is not \\[40 outputs, 32 inputs"):
        cpu_ops.linear_quantized(torch.randn(3, 32), packed, bits, n)
    with pytest.raises(cpu_abi.NativeKernelError, match="fp32 CPU \\[out, in\\]"):
        cpu_packing.pack_linear_quantized(torch.zeros(4, 32, dtype=torch.float64))
    with pytest.raises(cpu_abi.NativeKernelError, match=NO_SUCH_FORM):
        cpu_packing.pack_linear_quantized(torch.zeros(4, 32), bits_tried=(5,))
    with pytest.raises(cpu_abi.NativeKernelError, match="at the Q4_K form \\(104\\)"):
        cpu_ops.linear_quantized(x, packed, cpu_abi.QUANT_K4, n)
    with pytest.raises(cpu_abi.NativeKernelError, match="40 inputs is not a multiple"):
        cpu_ops.linear_quantized(torch.randn(3, 40), packed, bits, n)
    with pytest.raises(cpu_abi.NativeKernelError, match="at 8 bits"):
        cpu_packing.unpack_linear_quantized(packed, 8, n, k)
    # The library itself refuses sizes that do not fit, without touching its output.
    lib = cpu_native.lib_or_raise()
    y = torch.full((3, n), 7.0)
    assert lib.ts_linear_q(x, k, 3, k - 1, packed, bits, n, None, y, n, 1) == -1  # k % 32
    assert lib.ts_linear_q(x, k, 3, k, packed, 6, n, None, y, n, 1) == -1
    assert lib.ts_linear_q(x, k - 1, 3, k, packed, bits, n, None, y, n, 1) == -1  # rows overlap
    assert torch.equal(y, torch.full((3, n), 7.0))
    out = torch.empty(cpu_abi.quantized_shape(n, k, 4), dtype=torch.uint8)
    assert lib.ts_pack_linear_q(torch.zeros(n, k), n, k, 3, out, 1) == -1
    assert lib.ts_pack_linear_q(torch.zeros(n, 40), n, 40, 4, out, 1) == -1
    assert lib.ts_unpack_linear_q(packed, n, 40, 4, torch.empty(3, 40, 16), 1) == -1


@needs_native
def test_linear_layer_keeps_quantized_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Linear.pack_for_cpu`` keeps a quantized weight quantized (default and deterministic
    modes), with the same outputs and ``dense_weight``; ``TIERSERVE_QUANTIZED_WEIGHTS=off``
    keeps fp32 panels; a bad setting is refused."""
    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "never")
    w = dequantized((40, 64), "Q4_1", 11)
    bias = torch.randn(40)
    x = torch.randn(5, 64)

    def layer(deterministic: bool) -> Linear:
        lin = Linear(64, 40, bias=True, deterministic=deterministic)
        lin.weight.data.copy_(w)
        assert lin.bias is not None
        lin.bias.data.copy_(bias)
        assert lin.pack_for_cpu()
        return lin

    fp32 = cpu_ops.linear(x, cpu_packing.pack_linear(w), 40, bias)
    for det in (False, True):
        lin = layer(det)
        assert lin.bits == 4 and lin.weight.dtype == torch.uint8 and "quantized=4-bit" in repr(lin)
        assert same_bits(lin(x), fp32) and same_bits(lin.dense_weight(), w)
    monkeypatch.setenv(cpu_packing.ENV_QUANTIZED, "off")
    lin = layer(False)
    assert lin.bits is None and lin.weight.dtype == torch.float32 and same_bits(lin(x), fp32)
    monkeypatch.setenv(cpu_packing.ENV_QUANTIZED, "sometimes")
    with pytest.raises(ValueError, match="TIERSERVE_QUANTIZED_WEIGHTS must be auto or off"):
        layer(False)


@needs_native
def test_a_q4_1_model_runs_quantized_with_the_fp32_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny tied model written as Q4_1 (as the default model ships): every linear layer packs
    quantized (the tied head too), and its logits are the fp32 panels' logits, bit for bit, in the
    default and the deterministic mode."""
    from tests.replica.models.gguf_helpers import write_gguf
    from tests.replica.models.helpers import PagedHarness, Work, tiny_hf_model
    from tierserve.replica.models.llama import ModelOptions
    from tierserve.replica.models.loader import load_model

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "never")
    src = tiny_hf_model("llama-tied", seed=3, hidden_size=256, intermediate_size=512, vocab_size=300)
    path = write_gguf(src, tmp_path / "tied-q4_1.gguf", "Q4_1")
    prompts = [Work(0, 0, [256, 72, 101, 108, 108, 111]), Work(1, 0, [256, 44, 32, 119])]

    def logits(quantized: str, deterministic: bool) -> tuple[torch.Tensor, set[int | None]]:
        monkeypatch.setenv(cpu_packing.ENV_QUANTIZED, quantized)
        net, _, _ = load_model(str(path), options=ModelOptions(deterministic=deterministic))
        net.pack_for_cpu()
        bits = {m.bits for m in net.modules() if isinstance(m, Linear)}
        return torch.cat(PagedHarness(net, 2, 64).step(prompts, all_rows=True)), bits

    for det in (False, True):
        q, q_bits = logits("auto", det)
        f, f_bits = logits("off", det)
        assert q_bits == {4} and f_bits == {None}
        assert same_bits(q, f)


def _variant_bits(lib: cpu_abi.NativeLib, fused_like_this_build: bool) -> None:
    """``lib`` (another build of the source) computes the quantized product with its own fp32
    panels' bits, fused and scratch paths, Q4, Q8 and the K-quant forms; a build that fuses its
    multiply-adds as this process's build does (every FMA build) gives this build's bits too."""
    for qtype in ("Q4_1", "Q8_0", *K_FORMS):
        if qtype in K_FORMS:
            n, k = 40, 256
            w = k_dequantized((n, k), qtype, 12)
        else:
            n, k = 40, 96
            w = dequantized((n, k), qtype, 12)
        packed, bits = cpu_packing.pack_linear_quantized(w) or (None, 0)
        assert packed is not None
        other = torch.empty_like(packed)
        assert lib.ts_pack_linear_q(w, n, k, bits, other, 2) == 0
        assert torch.equal(other, packed)  # the same layout
        fp32 = cpu_packing.pack_linear(w)
        bias = torch.randn(n)
        for m in (1, 3, 4, 5, 8, 9, 16, 17, 40):
            x = torch.randn(m, k)
            y, want = torch.empty(m, n), torch.empty(m, n)
            assert lib.ts_linear_q(x, k, m, k, packed, bits, n, bias, y, n, 2) == 0
            assert lib.ts_linear_f32(x, k, m, k, fp32, n, bias, want, n, 2) == 0
            assert same_bits(y, want), (qtype, m)
            if fused_like_this_build:
                assert same_bits(y, cpu_ops.linear_quantized(x, packed, bits, n, bias)), (qtype, m)


@needs_native
@pytest.mark.parametrize(
    "flags",
    [("-march=x86-64",), ("-mno-avx512f",), ("-mno-avx512f", "-mno-f16c")],
    ids=["portable", "avx2", "avx2-without-f16c"],
)
def test_other_builds_give_the_same_bits(tmp_path: Path, flags: tuple[str, ...]) -> None:
    import platform

    if cpu_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler on x86-64")
    if "-mno-avx512f" in flags and not _has_avx512():
        pytest.skip("this CPU's own build is the AVX2 one")
    drop = ("-march=native",) if "-march=x86-64" in flags else ()
    _variant_bits(cpu_native.load_variant(tmp_path, add=flags, drop=drop), not drop)


@needs_native
@pytest.mark.parametrize("qtype", list(K_FORMS))
@pytest.mark.parametrize(("n", "k"), [(40, 256), (17, 512), (96, 768)])
def test_k_quant_panels_give_the_fp32_bits(qtype: str, n: int, k: int) -> None:
    """A K-quant weight packs in its form (the fewest bytes that fit), gives every weight back
    exactly, and the product has the fp32 panels' bits at every row count and path."""
    w = k_dequantized((n, k), qtype, seed=n + k)
    found = cpu_packing.pack_linear_quantized(w)
    assert found is not None
    packed, bits = found
    assert bits == K_FORMS[qtype] and packed.dtype == torch.uint8
    assert tuple(packed.shape) == cpu_abi.quantized_shape(n, k, bits)
    # 384 (Q4_K) or 640 bytes per 16 x 32 block, against 2,048 in fp32.
    assert packed.numel() * (5.3 if bits == cpu_abi.QUANT_K4 else 3.2) <= 4 * np.prod(
        cpu_abi.packed_shape(n, k)
    )
    assert same_bits(cpu_packing.unpack_linear_quantized(packed, bits, n, k), w)
    fp32 = cpu_packing.pack_linear(w)
    gen = torch.Generator().manual_seed(n)
    bias = torch.randn(n, generator=gen)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen)
        for b in (None, bias):
            want = cpu_ops.linear(x, fp32, n, b)
            assert same_bits(cpu_ops.linear_quantized(x, packed, bits, n, b), want), (m, b)
    wide = torch.randn(7, k + 32, generator=gen)
    assert same_bits(
        cpu_ops.linear_quantized(wide[:, :k], packed, bits, n), cpu_ops.linear(wide[:, :k], fp32, n)
    )


@needs_native
def test_k_quant_edge_blocks_pack_exactly() -> None:
    """Sub-blocks whose scale or offset is 0 (Q4_K's sc or m, Q6_K's sc: -0 weights where q is
    negative), superblocks of d = 0, Q6_K's negative scales (-0 where q is 0), and fp16
    subnormal d: packed, and given back bit for bit."""
    from tests.replica.models.gguf_helpers import encode_tensor

    gen = torch.Generator().manual_seed(21)
    for qtype, scale_bytes in (("Q4_K", (4, 16)), ("Q5_K", (4, 16)), ("Q6_K", (192, 208))):
        data, kind = encode_tensor(torch.zeros(24, 512), qtype, 22)
        blocks = data.reshape(24, 2, -1)
        lo, hi = scale_bytes
        blocks[0, :, lo:hi] = 0  # every sub-block scale (and Q4_K/Q5_K min) 0
        blocks[1, 0, lo : lo + 3] = 0  # a few
        blocks[2, :, hi : hi + 2] = 0  # Q6_K: d = 0 (S = -0 where sc < 0); else some q = 0
        blocks[3, :, 0:2] = 0  # Q4_K, Q5_K: d = 0 (each sub-block one value); Q6_K: some q
        sub = np.array([3e-6], dtype=np.float16).view(np.uint8)  # an fp16 subnormal
        off = 208 if qtype == "Q6_K" else 0
        blocks[4, :, off : off + 2] = sub
        if qtype == "Q6_K":
            blocks[5, :, 192:208] = 0x80  # every scale -128
        w = torch.from_numpy(
            np.ascontiguousarray(gguf.quants.dequantize(data, kind).reshape(24, 512), np.float32)
        )
        assert bool(torch.signbit(w[w == 0]).any()) == (qtype == "Q6_K"), qtype
        found = cpu_packing.pack_linear_quantized(w)
        assert found is not None and found[1] == K_FORMS[qtype], qtype
        packed, bits = found
        assert same_bits(cpu_packing.unpack_linear_quantized(packed, bits, 24, 512), w), qtype
        x = torch.randn(5, 512, generator=gen)
        want = cpu_ops.linear(x, cpu_packing.pack_linear(w), 24)
        assert same_bits(cpu_ops.linear_quantized(x, packed, bits, 24), want), qtype


@needs_native
def test_weights_of_no_k_quant_form_stay_fp32() -> None:
    """A weight one ulp off its sub-block's grid, one of another K-quant's form, or plain fp32:
    refused by the forms it is not (the layer stays fp32 where none fits)."""
    forms = tuple(K_FORMS.values())
    gen = torch.Generator().manual_seed(23)
    assert cpu_packing.pack_linear_quantized(torch.randn(48, 256, generator=gen), forms) is None
    for qtype, form in K_FORMS.items():
        w = k_dequantized((32, 256), qtype, 24)
        one_off = w.clone()
        one_off[30, 77] = torch.nextafter(one_off[30, 77], torch.tensor(1.0))
        assert cpu_packing.pack_linear_quantized(one_off, bits_tried=(form,)) is None, qtype
        broken = w.clone()
        broken[1, 200] = float("nan")
        assert cpu_packing.pack_linear_quantized(broken, bits_tried=(form,)) is None, qtype
    # Q6_K's sub-blocks of 16 with scales of their own are no Q4_K/Q5_K sub-block of 32; nor
    # is Q5_K's 0 .. 31 a Q4_K 0 .. 15.
    q6 = k_dequantized((32, 256), "Q6_K", 25)
    assert cpu_packing.pack_linear_quantized(q6, (cpu_abi.QUANT_K4, cpu_abi.QUANT_K5)) is None
    q5 = k_dequantized((32, 256), "Q5_K", 26)
    assert cpu_packing.pack_linear_quantized(q5, (cpu_abi.QUANT_K4,)) is None
    # A fused layer of Q4_K rows beside Q6_K rows (qkv with a Q6_K v) fits no one form.
    mixed = torch.cat([k_dequantized((32, 256), "Q4_K", 27), q6])
    assert cpu_packing.pack_linear_quantized(mixed) is None


@needs_native
def test_linear_layer_keeps_k_quant_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Linear.pack_for_cpu`` keeps a K-quant weight in its form (both modes) with the fp32
    panels' outputs; ``TIERSERVE_QUANTIZED_WEIGHTS=off`` keeps fp32 panels."""
    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "never")
    w = k_dequantized((48, 256), "Q4_K", 27)
    x = torch.randn(5, 256)
    fp32 = cpu_ops.linear(x, cpu_packing.pack_linear(w), 48)
    for det, setting in ((False, "auto"), (True, "auto"), (False, "off")):
        monkeypatch.setenv(cpu_packing.ENV_QUANTIZED, setting)
        lin = Linear(256, 48, deterministic=det)
        lin.weight.data.copy_(w)
        assert lin.pack_for_cpu()
        if setting == "off":
            assert lin.bits is None and lin.weight.dtype == torch.float32
        else:
            assert lin.bits == cpu_abi.QUANT_K4 and "quantized=Q4_K" in repr(lin)
        assert same_bits(lin(x), fp32) and same_bits(lin.dense_weight(), w)


@needs_native
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_k_quant_model_runs_quantized_with_the_fp32_bits(
    qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny tied model written in a K-quant (every 2-D tensor): every linear layer packs in
    its form (the tied head too), with the fp32 panels' logits, bit for bit."""
    from tests.replica.models.gguf_helpers import write_gguf
    from tests.replica.models.helpers import PagedHarness, Work, tiny_hf_model
    from tierserve.replica.models.llama import ModelOptions
    from tierserve.replica.models.loader import load_model

    monkeypatch.setenv("TIERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(cpu_calibration.ENV_LIBRARY_ROWS, "never")
    src = tiny_hf_model("llama-tied", seed=3, hidden_size=256, intermediate_size=512, vocab_size=300)
    path = write_gguf(src, tmp_path / f"tied-{qtype}.gguf", qtype)
    prompts = [Work(0, 0, [256, 72, 101, 108, 108, 111]), Work(1, 0, [256, 44, 32, 119])]

    def logits(quantized: str) -> tuple[torch.Tensor, set[int | None]]:
        monkeypatch.setenv(cpu_packing.ENV_QUANTIZED, quantized)
        net, _, _ = load_model(str(path), options=ModelOptions(deterministic=True))
        bits = {m.bits for m in net.modules() if isinstance(m, Linear)}
        return torch.cat(PagedHarness(net, 2, 64).step(prompts, all_rows=True)), bits

    q, q_bits = logits("auto")
    f, f_bits = logits("off")
    assert q_bits == {K_FORMS[qtype]} and f_bits == {None}
    assert same_bits(q, f)


@needs_native
def test_q5_0_and_q8_0_in_one_fused_weight_take_the_q8_form() -> None:
    """Gemma 3 270M's file holds q and k in Q5_0 and v in Q8_0 (gate and up in Q5_0): fused into
    one qkv weight they still pack, as Q8 (d of either sign: Q5_0's d is the extreme weight / -16,
    so a block's zero weights are -0 where d is negative, and stay so)."""
    q, k, v = (dequantized((n, 640), t, seed) for n, t, seed in
               ((64, "Q5_0", 1), (32, "Q5_0", 2), (32, "Q8_0", 3)))
    k[3, :32] = dequantized((1, 32), "Q5_0", 0, values=np.full((1, 32), 0.25))[0]
    w = torch.cat([q, k, v])
    assert bool((w == 0).any()) and bool(torch.signbit(w[w == 0]).any())  # -0 weights present
    found = cpu_packing.pack_linear_quantized(w)
    assert found is not None and found[1] == 8
    packed, bits = found
    assert same_bits(cpu_packing.unpack_linear_quantized(packed, bits, 128, 640), w)
    x = torch.randn(9, 640, generator=torch.Generator().manual_seed(4))
    want = cpu_ops.linear(x, cpu_packing.pack_linear(w), 128)
    assert same_bits(cpu_ops.linear_quantized(x, packed, bits, 128), want)
