"""Decode steps replayed from CUDA graphs: one replay instead of a thousand kernel launches.

A pure-decode step of ``n`` sequences runs as the graph of the smallest captured batch size
(a "bucket", ``capture_sizes``) that holds it. Every bucket owns static device buffers, all views
of one int64 tensor: token ids, positions and slots ``[B]`` (int64), then sequence lengths
``[B]`` and block tables ``[B, W]`` (int32), each section on 16 bytes, ``W`` the blocks of
``max_model_len``; the query offsets (``0 .. B``) and the logits rows (``0 .. B - 1``) are
constants. A step fills a pinned host buffer (one, sized for the largest bucket) and moves
it with ONE non-blocking copy into those buffers; the graph, captured over them, then runs.

Padding rows (``n .. B - 1``) are decodes of token 0 at position 0 with context length 1, whose
slot is ``pad_slot`` and whose block table points at ``pad_block``. On the triton backend
``pad_slot`` is -1: the KV stores (``tierserve.kernels.triton_kv``, ``tierserve.kernels.fused``) skip negative
slots, so a padding row writes nothing; its attention reads one position of ``pad_block`` (block
0 by default; reading it is harmless) and its logits are dropped. Backends whose store does not
skip negative slots need ``pad_slot``/``pad_block`` at a block that the block space never hands
out (a reserved block).

Capture (``capture``, CUDA only) happens once at start-up, largest bucket first, into one shared
memory pool: every bucket is run once eagerly (which compiles its Triton kernels), then captured.
The metadata a graph is captured with says every row may be ``max_model_len`` long
(``seq_lens_host``), so whatever the kernels pick from the host lengths (the decode split count)
covers every context a replay can see; the kernels read the real lengths from ``seq_lens``.

Without a capture (CPU, or ``capture`` not called) ``run`` calls the model on the bucket's padded
static buffers eagerly: the same inputs the graph would see. Tests run that path on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tierserve.arith import ceil_div, round_up
from tierserve.kernels.metadata import AttentionMetadata, PackedStep, SeqSpec

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def capture_sizes(max_batch: int) -> list[int]:
    """The bucketed batch sizes up to ``max_batch``: 1, 2, 4, 8, then every multiple of 8, and
    ``max_batch`` itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    small = [s for s in (1, 2, 4, 8) if s < max_batch]
    eights = list(range(16, max_batch, 8))
    return [*small, *eights, max_batch]


@dataclass(frozen=True, slots=True)
class GraphStep:
    """A staged decode step: ``rows`` real sequences in the bucket of ``bucket`` rows, their
    context lengths, and the stage it was (a stale one is refused: its buffers were reused)."""

    bucket: int
    rows: int
    seq_lens_host: list[int]
    generation: int


@dataclass(frozen=True, slots=True)
class _Layout:
    """A bucket buffer's sections: int64 word offsets of positions, slots and the int32 part
    (``base``), the int32 offset of the block tables within it, and the total words."""

    words: int
    pos: int
    slot: int
    base: int
    tab: int


@dataclass(slots=True)
class _Bucket:
    size: int
    words: int
    buffer: torch.Tensor  # int64 [words] on the device: every variable input below is a view
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    cu_q_lens: torch.Tensor
    logits_indices: torch.Tensor
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    output: torch.Tensor | None = None


class DecodeGraphs:
    """Static buffers, and on CUDA captured graphs, for pure-decode steps of up to
    ``max_batch`` sequences (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        kv_caches: KVCaches,
        block_size: int,
        max_model_len: int,
        max_batch: int,
        device: torch.device | str,
        *,
        pad_slot: int = -1,
        pad_block: int = 0,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_blocks = ceil_div(max_model_len, block_size)
        self.device = torch.device(device)
        self.pad_slot = pad_slot
        self.pad_block = pad_block
        self.sizes = capture_sizes(max_batch)
        self.captured = False
        self.generation = 0
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._buckets = {b: self._new_bucket(b) for b in self.sizes}

    # ---------------------------------------------------------------- buffers

    def _layout(self, b: int) -> _Layout:
        """Where bucket ``b``'s sections sit in its buffer (each on 16 bytes)."""
        rows = round_up(b, 2)  # int64 words per [b] section, rounded to 16 bytes
        tab = round_up(b, 4)  # int32 offset of the block tables
        n32 = tab + b * self.max_blocks
        return _Layout(words=3 * rows + ceil_div(n32, 4) * 2, pos=rows, slot=2 * rows, base=3 * rows,
                       tab=tab)

    def _new_bucket(self, b: int) -> _Bucket:
        lay = self._layout(b)
        words = lay.words
        dev = self.device
        buf = torch.zeros(words, dtype=torch.int64, device=dev)
        i32 = buf[lay.base :].view(torch.int32)
        bucket = _Bucket(
            size=b,
            words=words,
            buffer=buf,
            input_ids=buf[0:b],
            positions=buf[lay.pos : lay.pos + b],
            slot_mapping=buf[lay.slot : lay.slot + b],
            seq_lens=i32[0:b],
            block_tables=i32[lay.tab : lay.tab + b * self.max_blocks].view(b, self.max_blocks),
            cu_q_lens=torch.arange(b + 1, dtype=torch.int32, device=dev),
            logits_indices=torch.arange(b, dtype=torch.int64, device=dev),
        )
        host = torch.empty(words, dtype=torch.int64)
        self._fill_padding(host.numpy(), b, 0)
        bucket.buffer.copy_(host)
        return bucket

    def _fill_padding(self, a: np.ndarray, b: int, n: int) -> None:
        """Rows ``n .. b - 1`` of bucket ``b``'s layout in ``a`` become padding rows."""
        lay = self._layout(b)
        a[n:b] = 0
        a[lay.pos + n : lay.pos + b] = 0
        a[lay.slot + n : lay.slot + b] = self.pad_slot
        i32 = a[lay.base : lay.words].view(np.int32)
        i32[n:b] = 1
        grid = i32[lay.tab : lay.tab + b * self.max_blocks].reshape(b, self.max_blocks)
        grid[n:b] = 0
        grid[n:b, 0] = self.pad_block

    def _host_buffer(self, words: int) -> np.ndarray:
        if self.device.type == "cpu":
            raise AssertionError("a CPU bucket is filled in place")
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy has read the buffer
            self._event = None
        if self._host is None or self._host.numel() < words:
            largest = self._layout(self.sizes[-1]).words
            pin = self.device.type == "cuda" and torch.cuda.is_available()
            self._host = torch.empty(max(words, largest), dtype=torch.int64, pin_memory=pin)
        return self._host[:words].numpy()

    # ---------------------------------------------------------------- steps

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket that holds ``n`` rows (None: too many)."""
        for b in self.sizes:
            if b >= n:
                return b
        return None

    def stage(
        self, input_ids: Sequence[int], seqs: Sequence[SeqSpec]
    ) -> tuple[PackedStep, GraphStep] | None:
        """Lay a pure-decode step (``seqs`` all of ``q_len`` 1, ``input_ids`` one each) into its
        bucket's static buffers; None when it does not fit (no bucket that large, a context past
        ``max_model_len``, or a sequence that is not a decode). The returned tensors are views of
        the real rows of the buffers (valid until the next ``stage``), as ``StepPacker`` lays
        them out apart from the block tables' width (``max_model_len``'s blocks)."""
        n = len(seqs)
        b = self.bucket_for(n)
        if b is None or n == 0 or len(input_ids) != n:
            return None
        bs = self.block_size
        mb = self.max_blocks
        seq_lens: list[int] = []
        for s in seqs:
            end = s.start + 1
            need = ceil_div(end, bs)
            if s.q_len != 1 or s.start < 0 or need > mb or len(s.block_table) < need:
                return None
            seq_lens.append(end)
        bucket = self._buckets[b]
        lay = self._layout(b)
        words = lay.words
        # On CPU the static buffer itself is filled: nothing to copy.
        a = bucket.buffer.numpy() if self.device.type == "cpu" else self._host_buffer(words)
        a[0:n] = input_ids
        a[lay.pos : lay.pos + n] = [s.start for s in seqs]
        a[lay.slot : lay.slot + n] = [
            s.block_table[s.start // bs] * bs + s.start % bs for s in seqs
        ]
        i32 = a[lay.base : words].view(np.int32)
        i32[0:n] = seq_lens
        grid = i32[lay.tab : lay.tab + b * mb].reshape(b, mb)
        grid[0:n] = 0
        for i, s in enumerate(seqs):
            need = ceil_div(seq_lens[i], bs)
            grid[i, :need] = s.block_table[:need]
        self._fill_padding(a, b, n)
        if self.device.type != "cpu":
            host = self._host
            assert host is not None
            bucket.buffer.copy_(host[:words], non_blocking=True)
            if self.device.type == "cuda":
                self._event = torch.cuda.Event()
                self._event.record()
        self.generation += 1
        meta = AttentionMetadata(
            slot_mapping=bucket.slot_mapping[:n],
            block_tables=bucket.block_tables[:n],
            seq_lens=bucket.seq_lens[:n],
            cu_q_lens=bucket.cu_q_lens[: n + 1],
            positions=bucket.positions[:n],
            num_decodes=n,
            max_q_len=1,
            max_seq_len=max(seq_lens),
            block_size=bs,
            seq_lens_host=seq_lens,
            q_lens_host=[1] * n,
        )
        packed = PackedStep(bucket.input_ids[:n], bucket.logits_indices[:n], meta)
        return packed, GraphStep(b, n, seq_lens, self.generation)

    def _meta(self, bucket: _Bucket, seq_lens_host: list[int]) -> AttentionMetadata:
        """Metadata of every row of ``bucket`` (padding included) with these host lengths."""
        b = bucket.size
        return AttentionMetadata(
            slot_mapping=bucket.slot_mapping,
            block_tables=bucket.block_tables,
            seq_lens=bucket.seq_lens,
            cu_q_lens=bucket.cu_q_lens,
            positions=bucket.positions,
            num_decodes=b,
            max_q_len=1,
            max_seq_len=max(seq_lens_host),
            block_size=self.block_size,
            seq_lens_host=seq_lens_host,
            q_lens_host=[1] * b,
        )

    def _call(self, bucket: _Bucket, meta: AttentionMetadata) -> torch.Tensor:
        out: torch.Tensor = self.model(
            bucket.input_ids, bucket.positions, self.kv_caches, meta, bucket.logits_indices
        )
        return out

    @torch.inference_mode()
    def run(self, step: GraphStep) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (model dtype) of the staged step's real rows: the graph's
        replay, or (not captured) the model called on the padded static buffers. The result
        may be a view of the graph's output, overwritten by the next replay."""
        if step.generation != self.generation:
            raise RuntimeError(
                "this decode step's static buffers were reused by a later step: forward each "
                "built batch before building the next"
            )
        bucket = self._buckets[step.bucket]
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.output is not None
            return bucket.output[: step.rows]
        lens = step.seq_lens_host + [1] * (bucket.size - step.rows)
        return self._call(bucket, self._meta(bucket, lens))[: step.rows]

    # ---------------------------------------------------------------- capture

    def _reset(self, bucket: _Bucket) -> None:
        """Every row of ``bucket`` a padding row (nothing it runs writes to the cache)."""
        host = torch.empty(bucket.words, dtype=torch.int64)
        self._fill_padding(host.numpy(), bucket.size, 0)
        bucket.buffer.copy_(host)
        self.generation += 1  # a step staged before is stale now

    def _reserve_split_scratch(self) -> None:
        """Size the attention kernels' split scratch for the largest decode launch before any
        capture, where the kernels offer it, so that no captured launch sees it reallocated."""
        from tierserve.kernels import triton_attention

        reserve = getattr(triton_attention, "reserve_split_scratch", None)
        bound = getattr(triton_attention, "max_split_rows", None)
        cfg = getattr(self.model, "config", None)
        if reserve is None or bound is None or cfg is None:
            return
        group = cfg.num_heads // cfg.num_kv_heads
        reserve(self.device, bound(self.device, group), cfg.head_dim)

    def capture(self) -> None:
        """Warm up and capture every bucket's graph (CUDA only), largest first, in one memory
        pool. The buckets hold padding rows while captured, so nothing is written to the cache."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, not {self.device}")
        self._reserve_split_scratch()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.sizes):
                bucket = self._buckets[b]
                self._reset(bucket)
                meta = self._meta(bucket, [self.max_model_len] * b)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self._call(bucket, meta)  # compiles this bucket's kernels outside capture
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._call(bucket, meta)
                bucket.graph, bucket.output = graph, out
        torch.cuda.synchronize(self.device)
        self.captured = True

    def verify(self, rtol: float = 2e-2) -> list[int]:
        """The buckets whose ``run`` disagrees with the model called eagerly on the same inputs
        (every row padding: nothing is written to the cache) by more than ``rtol`` of the
        logits' scale; a start-up check that the captured graphs compute what the model does."""
        bad: list[int] = []
        with torch.inference_mode():
            for b in self.sizes:
                bucket = self._buckets[b]
                self._reset(bucket)
                lens = [1] * b
                got = self.run(GraphStep(b, b, lens, self.generation)).float().clone()
                want = self._call(bucket, self._meta(bucket, lens)).float()
                scale = float(want.abs().max()) or 1.0
                if not torch.allclose(got, want, atol=rtol * scale, rtol=rtol):
                    bad.append(b)
        return bad
