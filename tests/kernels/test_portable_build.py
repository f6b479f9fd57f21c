"""The native kernels' portable loops (CPUs without AVX2/FMA): the source built for plain x86-64
and swapped in for the process's build, so every layer and the whole deterministic model run on
it. The deterministic mode's row independence must hold there too, not only on the vector
paths of the CPU running the suite."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.replica.models.helpers import PagedHarness, Work, row_mismatches
from tierserve.kernels import cpu_abi, cpu_build, cpu_native
from tierserve.kernels.attention import attention
from tierserve.kernels.metadata import SeqSpec, build_metadata
from tierserve.replica.models.embedded import build_model
from tierserve.replica.models.layers import Linear, RMSNorm, qk_norm_, silu_and_mul
from tierserve.replica.models.llama import ModelOptions

pytestmark = pytest.mark.skipif(
    cpu_build.compiler() is None or platform.machine() not in ("x86_64", "AMD64"),
    reason="needs a C++ compiler on x86-64",
)
SIZES = (1, 2, 3, 5, 7, 8, 13, 17, 64, 100)


@pytest.fixture(scope="module")
def portable_lib(tmp_path_factory: pytest.TempPathFactory) -> cpu_abi.NativeLib:
    """The portable build, loaded through the same signature check as the process's own."""
    return cpu_native.load_variant(
        Path(tmp_path_factory.mktemp("portable")), add=("-march=x86-64",), drop=("-march=native",)
    )


@pytest.fixture
def on_portable(
    portable_lib: cpu_abi.NativeLib, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Every native op of this process runs on the portable build."""
    monkeypatch.setattr(cpu_native, "_tried", True)
    monkeypatch.setattr(cpu_native, "_lib", portable_lib)
    monkeypatch.setattr(cpu_native, "_MAX_VECS", portable_lib.ts_max_vecs())
    monkeypatch.setattr(cpu_native, "_MAX_HEAD_DIM", portable_lib.ts_max_head_dim())
    yield


def test_portable_layers_keep_rows_independent(on_portable: None) -> None:
    gen = torch.Generator().manual_seed(4)
    for k, n in ((97, 67), (256, 40)):
        layer = Linear(k, n, True, deterministic=True)
        layer.weight.data = torch.randn(n, k, generator=gen)
        assert layer.bias is not None
        layer.bias.data = torch.randn(n, generator=gen)
        assert layer.pack_for_cpu()
        x = torch.randn(120, k, generator=gen)
        assert row_mismatches(layer, x, SIZES) == []
        # Against float64, within the forward-error bound of any fp32 summation order (a BLAS
        # result is one more fp32 summation: comparing with it would rest on its order).
        w, b = layer.dense_weight().double(), layer.bias.double()
        err = (layer(x).double() - (x.double() @ w.T + b)).abs()
        u = 2.0**-24
        gamma = (k + 1) * u / (1 - (k + 1) * u)
        assert bool((err <= gamma * (x.double().abs() @ w.abs().T + b.abs())).all())
    for width in (97, 576):
        norm = RMSNorm(width, 1e-5, deterministic=True)
        x = torch.randn(120, width, generator=gen)
        assert row_mismatches(norm, x, SIZES) == []
        torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        gate_up = torch.randn(120, 2 * width, generator=gen)
        assert row_mismatches(lambda t: silu_and_mul(t, deterministic=True), gate_up, SIZES) == []
    for head_dim in (32, 80):  # Qwen3's per-head q/k norm: 3 q, 1 k and 1 v head per row
        qw, kw = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)

        def heads_normed(
            t: torch.Tensor, qw: torch.Tensor = qw, kw: torch.Tensor = kw
        ) -> torch.Tensor:
            out = t.clone()
            qk_norm_(out.view(t.shape[0], 5, qw.shape[0]), qw, kw, 3, 1e-6, deterministic=True)
            return out

        x = torch.randn(120, 5 * head_dim, generator=gen)
        assert row_mismatches(heads_normed, x, SIZES) == []
        h = x.view(120, 5, head_dim)[:, :4]
        want = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        want = torch.cat([want[:, :3] * qw, want[:, 3:] * kw], dim=1)
        torch.testing.assert_close(heads_normed(x).view(120, 5, head_dim)[:, :4], want)


def test_portable_attention_rows_do_not_depend_on_the_batch(on_portable: None) -> None:
    """A decode row and a chunk's rows alone vs in a batch with other sequences (head_dim 16:
    a width the vector path also takes, so it is the portable loop's own answer here)."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 6, 2, 16, 16
    k_cache = torch.randn(64, bs, hkv, d, generator=gen)
    v_cache = torch.randn(64, bs, hkv, d, generator=gen)
    q = torch.randn(40, hq, d, generator=gen)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(5)]

    def run(specs: list[tuple[int, int, int]], rows: list[int]) -> torch.Tensor:
        """specs: (sequence, start, length); rows: the rows of q they take, in order."""
        meta = build_metadata([SeqSpec(s, n, tables[i]) for i, s, n in specs], bs)
        qs = q[rows]
        empty = torch.empty(len(rows), hkv, d)
        kc, vc = k_cache.clone(), v_cache.clone()
        return attention(
            qs, empty, empty, kc, vc, meta, d**-0.5, deterministic=True, kv_stored=True
        )

    alone_decode = run([(0, 40, 1)], [0])
    alone_chunk = run([(1, 20, 13)], list(range(1, 14)))
    together = run(
        [(2, 60, 1), (0, 40, 1), (3, 5, 1), (1, 20, 13), (4, 0, 9)],
        [20, 0, 21, *range(1, 14), *range(22, 31)],
    )
    assert torch.equal(together[1], alone_decode[0])
    assert torch.equal(together[3:16], alone_chunk)


def test_portable_deterministic_model_chunked_equals_whole(on_portable: None) -> None:
    model = build_model(ModelOptions(deterministic=True))
    prompt = torch.randint(3, 250, (29,), generator=torch.Generator().manual_seed(6)).tolist()
    whole = PagedHarness(model, 2, 64)
    want = whole.step([Work(0, 0, prompt)])[0]
    chunked = PagedHarness(model, 2, 64)
    for i, start in enumerate(range(0, len(prompt), 7)):  # beside another sequence's decodes
        got = chunked.step([Work(0, start, prompt[start : start + 7]), Work(1, i, [5 + i])])[0]
    assert torch.equal(got, want)
