"""The batched LoRA kernels (``tierserve.kernels.lora``) against torch, under the interpreter on
tiny shapes: rows of two adapters interleaved with base rows, a rank below the slots' own, an
output slice at an offset (a q/k/v part of the fused projection)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierserve.kernels import lora as tlora

pytestmark = pytest.mark.triton


def _segments(slot_of_row: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    slots = list(dict.fromkeys(s for s in slot_of_row if s >= 0))
    rows: list[int] = []
    start = [0]
    for s in slots:
        rows.extend(i for i, t in enumerate(slot_of_row) if t == s)
        start.append(len(rows))
    i32 = torch.int32
    return torch.tensor(rows, dtype=i32), torch.tensor(start, dtype=i32), torch.tensor(slots,
                                                                                        dtype=i32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    t, k, n, slots, rank, offset, width = 21, 24, 20, 3, 5, 7, 40
    x = torch.randn(t, k, generator=gen).to(dtype)
    a = torch.randn(slots, rank, k, generator=gen).to(dtype)
    b = torch.randn(slots, n, rank, generator=gen).to(dtype)
    out = torch.randn(t, width, generator=gen).to(dtype)
    slot_of_row = [(-1, 2, 0, 2)[i % 4] for i in range(t)]
    rows, start, seg_slot = _segments(slot_of_row)
    want = out.clone()
    for i, s in enumerate(slot_of_row):
        if s >= 0:
            h = (x[i].float() @ a[s].float().t()).to(dtype)
            want[i, offset : offset + n] += (h.float() @ b[s].float().t()).to(dtype)
    got = out.clone()
    tlora.lora_add(x, got, a, b, offset, rows, start, seg_slot)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * 4)
    base = [i for i, s in enumerate(slot_of_row) if s < 0]
    assert torch.equal(got[base], out[base])  # the base model's rows are untouched
    assert torch.equal(got[:, :offset], out[:, :offset])  # and the other parts


def test_lora_add_refuses_shapes_that_do_not_fit() -> None:
    x, out = torch.zeros(4, 8), torch.zeros(4, 8)
    rows, start, seg = _segments([0, 0, -1, 0])
    with pytest.raises(ValueError, match="do not fit"):
        tlora.lora_add(x, out, torch.zeros(1, 2, 6), torch.zeros(1, 8, 2), 0, rows, start, seg)
    with pytest.raises(ValueError, match="do not fit"):
        tlora.lora_add(x, out, torch.zeros(1, 2, 8), torch.zeros(1, 8, 2), 4, rows, start, seg)


def test_the_model_with_adapters_on_the_kernels_matches_torch(tmp_path: Path) -> None:
    """The tiny Llama with three adapters and the base in one batch: the Triton path's logits
    are the torch path's (fp32)."""
    pytest.importorskip("peft")
    from tests.replica.lora_helpers import write_checkpoint
    from tests.replica.models.helpers import PagedHarness, Work
    from tierserve.replica.lora import LoRAManager
    from tierserve.replica.models.loader import load_model

    base, paths = write_checkpoint(tmp_path)
    model, _, _ = load_model(str(base), dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 260, (n,), generator=gen).tolist() for n in (5, 3, 6, 4)]
    names = ["beta", None, "alpha", "gamma"]
    # The manager's keys: name#id (loaded below with id 0).
    rows = [None if n is None else f"{n}#0" for n, p in zip(names, prompts, strict=True)
            for _ in p]
    got = []
    for triton_path in (False, True):
        lora = LoRAManager(model, max_loras=3, max_rank=8, max_cpu_loras=3,
                           use_triton=triton_path)
        for name, path in paths.items():
            lora.load(name, str(path))
        # On the kernels, one warm-up launch per distinct part (q and o alike here; k, v, the
        # fused qkv, gate, up, the fused gate_up, down): none on the torch path.
        assert lora.warm_up() == (8 if triton_path else 0)
        with lora.running(lora.batch(rows)):
            got.append(PagedHarness(model, len(prompts), 32).step(
                [Work(i, 0, p) for i, p in enumerate(prompts)], all_rows=True))
        lora.close()
    for torch_rows, triton_rows in zip(*got, strict=True):
        torch.testing.assert_close(triton_rows, torch_rows, rtol=1e-4, atol=1e-4)
