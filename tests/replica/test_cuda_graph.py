"""The GPU decode path's host side, on CPU: a step's integer inputs packed into one buffer (equal,
field by field, to the batch built the old way, and one transfer per step), and the CUDA-graph
decode path's static, padded buckets (``tierserve.replica.cuda_graph``) run eagerly: the real rows' logits
equal the plain eager step's, and padding rows write nothing into real KV blocks.

Capture and replay themselves need a GPU: the tests marked ``gpu`` at the end run them there
(against the eager model, and an engine with graphs against one without); without one they skip."""

from __future__ import annotations

import os
import random
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tierserve.kernels.metadata import AttentionMetadata, SeqSpec, StepPacker, build_metadata
from tierserve.records import GenerateRequest
from tierserve.replica.config import EngineConfig
from tierserve.replica.cuda_graph import DecodeGraphs, capture_sizes
from tierserve.replica.engine import Engine
from tierserve.replica.kv_pool import KVPool, KVShape
from tierserve.replica.models.config import ModelConfig
from tierserve.replica.models.embedded import EMBEDDED_MODEL, build_model
from tierserve.replica.models.llama import LlamaForCausalLM, ModelOptions
from tierserve.replica.runner import ForwardBatch, ModelRunner, PromptRows
from tierserve.replica.sampler import SamplingParams
from tierserve.replica.scheduler import Scheduler, StepPlan

BS = 16


# ---------------------------------------------------------------- the packed step


def _assert_same_meta(got: AttentionMetadata, want: AttentionMetadata, width: int | None = None) -> None:
    for name in ("slot_mapping", "seq_lens", "cu_q_lens", "positions"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    tables = got.block_tables if width is None else got.block_tables[:, : want.block_tables.shape[1]]
    assert tables.dtype == want.block_tables.dtype and torch.equal(tables, want.block_tables)
    if width is not None:  # wider tables: the extra columns are padding (0)
        assert not got.block_tables[:, want.block_tables.shape[1] :].any()
    for name in ("num_decodes", "max_q_len", "max_seq_len", "block_size", "seq_lens_host", "q_lens_host"):
        assert getattr(got, name) == getattr(want, name), name


def _random_step(rng: random.Random) -> tuple[list[SeqSpec], list[int], list[int]]:
    decodes, chunks = rng.randint(0, 6), rng.randint(0, 3)
    if decodes + chunks == 0:
        decodes = 1
    specs: list[SeqSpec] = []
    next_block = rng.randrange(50)
    for i in range(decodes + chunks):
        q_len = 1 if i < decodes else rng.randint(1, 40)
        if i >= decodes and q_len == 1:
            q_len = 2  # a chunk of one token would count as a decode
        start = rng.randint(0, 90)
        blocks = -(-(start + q_len) // BS) + rng.randint(0, 2)  # tables may run past the need
        specs.append(SeqSpec(start, q_len, list(range(next_block, next_block + blocks))))
        next_block += blocks + rng.randint(0, 3)
    tokens = sum(s.q_len for s in specs)
    ids = [rng.randrange(1000) for _ in range(tokens)]
    rows = sorted(rng.sample(range(tokens), rng.randint(0, tokens)))  # none: only chunks
    return specs, ids, rows


def test_the_packed_step_equals_build_metadata_over_random_steps() -> None:
    rng = random.Random(0)
    packer = StepPacker("cpu")
    for _ in range(300):
        specs, ids, rows = _random_step(rng)
        got = packer.pack(specs, BS, ids, rows)
        _assert_same_meta(got.meta, build_metadata(specs, BS))
        assert got.input_ids.dtype == torch.int64 and got.input_ids.tolist() == ids
        assert got.logits_indices.dtype == torch.int64 and got.logits_indices.tolist() == rows


def test_the_packed_step_refuses_what_build_metadata_refuses() -> None:
    packer = StepPacker("cpu")
    with pytest.raises(ValueError, match="at least one sequence"):
        packer.pack([], BS, [], [])
    with pytest.raises(ValueError, match="block table has 1 blocks"):
        packer.pack([SeqSpec(10, 10, [0])], BS, list(range(10)), [9])
    with pytest.raises(ValueError, match="3 token ids for a step of 2"):
        packer.pack([SeqSpec(0, 2, [0])], BS, [1, 2, 3], [1])


class _Uploads:
    """A stand-in device: counts host-to-device transfers and hands back a copy."""

    def __init__(self) -> None:
        self.calls = 0
        self.last: torch.Tensor | None = None

    def __call__(self, host: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = host.clone()
        return self.last


def test_one_transfer_per_step_and_every_tensor_a_view_of_it() -> None:
    uploads = _Uploads()
    packer = StepPacker("cpu", upload=uploads)
    rng = random.Random(1)
    for step in range(50):
        specs, ids, rows = _random_step(rng)
        got = packer.pack(specs, BS, ids, rows)
        assert uploads.calls == step + 1 == packer.transfers
        assert uploads.last is not None
        storage = uploads.last.untyped_storage().data_ptr()
        for t in (got.input_ids, got.logits_indices, got.meta.slot_mapping, got.meta.positions,
                  got.meta.seq_lens, got.meta.cu_q_lens, got.meta.block_tables):
            assert t.untyped_storage().data_ptr() == storage
        _assert_same_meta(got.meta, build_metadata(specs, BS))
        assert got.input_ids.tolist() == ids and got.logits_indices.tolist() == rows


def _legacy_batch(
    runner: ModelRunner,
    plan: StepPlan,
    scheduler: Scheduler,
    prompt_logits_for: Collection[int],
) -> ForwardBatch:
    """The batch as the runner built it before the packed step, one tensor per field, and
    before the plan carried its inputs: each asked of the scheduler."""
    blocks = scheduler.blocks
    ids: list[int] = []
    specs: list[SeqSpec] = []
    rows: list[int] = []
    sampled: list[int] = []
    for rid in plan.decode:
        toks = scheduler.tokens(rid)
        assert toks is not None
        ids.append(toks[-1])
        specs.append(SeqSpec(len(toks) - 1, 1, blocks.block_table(rid)))
        rows.append(len(ids) - 1)
        sampled.append(rid)
    extra: list[int] = []
    prompt_rows: list[PromptRows] = []
    for c in plan.prefill:
        toks = scheduler.tokens(c.id)
        assert toks is not None
        base = len(ids)
        ids.extend(toks[c.start : c.start + c.len])
        specs.append(SeqSpec(c.start, c.len, blocks.block_table(c.id)))
        if c.last:
            rows.append(len(ids) - 1)
            sampled.append(c.id)
        if c.id in prompt_logits_for:
            count = min(c.start + c.len, (scheduler.prompt_len(c.id) or 0) - 1) - c.start
            if count > 0:
                extra.extend(range(base, base + count))
                prompt_rows.append(PromptRows(c.id, c.start, count))
    return ForwardBatch(
        torch.tensor(ids, dtype=torch.int64),
        build_metadata(specs, runner.pool.block_size),
        torch.tensor(rows + extra, dtype=torch.int64),
        sampled,
        prompt_rows,
    )


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _drain(engine: Engine) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            return tokens
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    raise AssertionError("the engine did not finish")


def test_the_runner_builds_the_old_batch_with_one_transfer_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random requests through a real engine (chunked prefill, prefix caching, prompt
    log-probabilities): every step's batch equals the old construction field by field, and its
    integer inputs cross to the (stand-in) device in exactly one transfer."""
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=96, max_num_seqs=8,
                                 prefill_chunk_tokens=24, max_model_len=256))
    runner = engine.runner
    uploads = _Uploads()
    runner.packer = StepPacker("cpu", upload=uploads)
    build = runner.build_batch
    steps = {"n": 0, "mixed": 0, "decodes_only": 0, "prompt_rows": 0}

    def checked(plan: StepPlan, scoring: Collection[int] = ()) -> ForwardBatch:
        before = uploads.calls
        got = build(plan, scoring)
        assert uploads.calls == before + 1
        want = _legacy_batch(runner, plan, engine.scheduler, scoring)
        _assert_same_meta(got.meta, want.meta)
        assert torch.equal(got.input_ids, want.input_ids)
        assert torch.equal(got.logits_indices, want.logits_indices)
        assert got.sampled == want.sampled and got.prompt_rows == want.prompt_rows
        assert got.graph is None
        steps["n"] += 1
        steps["mixed"] += bool(plan.decode and plan.prefill)
        steps["decodes_only"] += not plan.prefill
        steps["prompt_rows"] += bool(got.prompt_rows)
        return got

    monkeypatch.setattr(runner, "build_batch", checked)
    rng = random.Random(2)
    shared = _prompts(1, seed=9, lo=40, hi=40)[0]
    for i, p in enumerate(_prompts(14, seed=3, hi=80)):
        prompt = shared[: rng.randint(0, 40)] + p  # some share a cached prefix
        params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0, ignore_eos=True,
                                prompt_logprobs=1 if i % 4 == 0 else None)
        engine.add_request(GenerateRequest.of(prompt, params))
    _drain(engine)
    assert steps["n"] > 10 and min(steps.values()) > 0, steps


# ---------------------------------------------------------------- padded decode buckets


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    with pytest.raises(ValueError):
        capture_sizes(0)


class _Setup:
    """A model, a pool of ``real`` blocks plus one reserved padding block (the last), the
    sequences' block tables, and an eager twin of the caches."""

    def __init__(
        self, model: LlamaForCausalLM, seqs: int, max_len: int, seed: int, device: str = "cpu"
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = device
        self.max_len = max_len
        per_seq = -(-max_len // BS)
        self.real = seqs * per_seq
        dtype = model.model.embed_tokens.weight.dtype
        shape = KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, dtype)
        self.pool = KVPool(shape, self.real + 1, device)
        order = list(range(self.real))
        random.Random(seed).shuffle(order)  # tables are scattered, as a free list leaves them
        self.tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(seqs)]
        rng = random.Random(seed + 1)
        self.tokens = [[rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(2, 30))]
                       for _ in range(seqs)]
        # Prefill every sequence but its last token, eagerly, in one step.
        specs = [SeqSpec(0, len(t) - 1, tb) for t, tb in zip(self.tokens, self.tables, strict=True)]
        ids = [x for t in self.tokens for x in t[:-1]]
        meta = build_metadata(specs, BS, device)
        model(torch.tensor(ids, device=device), meta.positions, self.pool.kv_caches, meta,
              torch.tensor([0], device=device))
        self.eager = [(k.clone(), v.clone()) for k, v in self.pool.kv_caches]

    def graphs(self, max_batch: int) -> DecodeGraphs:
        return DecodeGraphs(self.model, self.pool.kv_caches, BS, self.max_len, max_batch, "cpu",
                            pad_slot=self.real * BS, pad_block=self.real)

    def decode_specs(self, which: Sequence[int]) -> tuple[list[int], list[SeqSpec]]:
        ids = [self.tokens[i][-1] for i in which]
        specs = [SeqSpec(len(self.tokens[i]) - 1, 1, self.tables[i]) for i in which]
        return ids, specs

    def eager_step(self, which: Sequence[int]) -> torch.Tensor:
        ids, specs = self.decode_specs(which)
        meta = build_metadata(specs, BS, self.device)
        return self.model(torch.tensor(ids, device=self.device), meta.positions, self.eager, meta,
                          torch.arange(len(which), device=self.device))

    def advance(self, which: Sequence[int], logits: torch.Tensor) -> None:
        for i, row in zip(which, logits, strict=True):
            self.tokens[i].append(int(row.argmax()))

    def snapshot(self) -> list[torch.Tensor]:
        return [c.clone() for pair in self.pool.kv_caches for c in pair]

    def assert_only_real_slots_changed(
        self, before: list[torch.Tensor], specs: Sequence[SeqSpec], exact: bool, tol: float = 1e-5
    ) -> None:
        """Against ``before`` (the pool before the step), only the real rows' slots of real
        blocks changed, and those hold what the eager step wrote (``exact``: bit for bit)."""
        written = torch.zeros(self.real * BS, dtype=torch.bool, device=self.device)
        for s in specs:
            written[s.block_table[s.start // BS] * BS + s.start % BS] = True
        now = [c for pair in self.pool.kv_caches for c in pair]
        eager = [c for pair in self.eager for c in pair]
        for c, c0, ce in zip(now, before, eager, strict=True):
            flat, flat0, flate = (x[: self.real].reshape(self.real * BS, -1) for x in (c, c0, ce))
            assert torch.equal(flat[~written], flat0[~written])
            if exact:
                assert torch.equal(flat[written], flate[written])
            else:
                torch.testing.assert_close(flat[written], flate[written], atol=tol, rtol=tol)


def _steps() -> Iterator[list[int]]:
    """Decode steps over 11 sequences: sizes inside buckets, a bucket reused with fewer rows
    after more (stale rows must turn into padding), every size exactly a bucket too."""
    rng = random.Random(5)
    for n in (5, 7, 5, 1, 3, 11, 2, 8, 4, 16 - 5, 6):
        yield sorted(rng.sample(range(11), n))


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_padded_bucketed_decode_equals_the_eager_step(deterministic: bool) -> None:
    """The bucket's padded static buffers, run eagerly (the inputs a CUDA graph would replay),
    give the real rows the eager step's logits: bit for bit in the deterministic mode (a row's
    bits do not depend on the batch), within fp32 rounding otherwise; and the padding rows write
    only into the reserved block."""
    model = build_model(ModelOptions(deterministic=deterministic))
    setup = _Setup(model, seqs=11, max_len=96, seed=7)
    graphs = setup.graphs(max_batch=16)
    assert graphs.sizes == [1, 2, 4, 8, 16]
    pad = setup.pool.kv_caches[0][0][setup.real]
    for which in _steps():
        ids, specs = setup.decode_specs(which)
        staged = graphs.stage(ids, specs)
        assert staged is not None
        packed, step = staged
        assert step.bucket == graphs.bucket_for(len(which)) and step.rows == len(which)
        _assert_same_meta(packed.meta, build_metadata(specs, BS), width=graphs.max_blocks)
        assert packed.input_ids.tolist() == ids
        bucket = graphs._buckets[step.bucket]  # rows past the step's: padding, none left stale
        n = step.rows
        assert (bucket.slot_mapping[n:] == setup.real * BS).all() and not bucket.positions[n:].any()
        assert (bucket.seq_lens[n:] == 1).all() and (bucket.block_tables[n:, 0] == setup.real).all()
        before = setup.snapshot()
        got = graphs.run(step)
        want = setup.eager_step(which)
        assert got.shape == want.shape
        if deterministic:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        setup.assert_only_real_slots_changed(before, specs, exact=deterministic)
        if step.bucket > step.rows:
            assert pad.any()  # the padding rows did write: into the reserved block only
        setup.advance(which, want)


def test_the_runner_replays_pure_decode_steps_and_keeps_greedy_outputs() -> None:
    """An engine whose runner stages pure-decode steps in padded buckets (eager replay on CPU,
    deterministic model, one reserved padding block) generates what the plain engine does."""
    cfg = EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64, max_num_seqs=6,
                       prefill_chunk_tokens=32, max_model_len=128, deterministic=True)
    plain = Engine(cfg)
    graphed = Engine(cfg)
    old = graphed.runner
    shape = old.pool.shape
    pool = KVPool(shape, old.pool.num_blocks + 1)  # the block space hands out the first 64 only
    graphs = DecodeGraphs(old.model, pool.kv_caches, shape.block_size, 128, 6, "cpu",
                          pad_slot=old.pool.num_blocks * shape.block_size,
                          pad_block=old.pool.num_blocks)
    runner = ModelRunner(old.model, pool, "cpu", graphs=graphs)
    graphed.runner = runner
    replays = {"n": 0}
    run = graphs.run

    def counted(step: Any) -> torch.Tensor:
        replays["n"] += 1
        return run(step)

    graphs.run = counted  # type: ignore[method-assign]
    rng = random.Random(4)
    for engine in (plain, graphed):
        rng.seed(4)
        for p in _prompts(9, seed=6, hi=50):
            engine.add_request(GenerateRequest.of(p, SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0,
                                                 ignore_eos=True)))
    want, got = _drain(plain), _drain(graphed)
    assert got == want
    assert replays["n"] > 5


def test_stage_refuses_what_no_bucket_holds_and_a_stale_step_is_refused() -> None:
    model = build_model()
    setup = _Setup(model, seqs=5, max_len=48, seed=1)
    graphs = setup.graphs(max_batch=4)
    ids, specs = setup.decode_specs(range(5))
    assert graphs.stage(ids, specs) is None  # 5 rows, the largest bucket holds 4
    far = [SeqSpec(48, 1, list(range(4)))]  # position 48 needs a 4th block; max_len holds 3
    assert graphs.stage([1], far) is None
    assert graphs.stage([1, 2], [SeqSpec(0, 2, [0])]) is None  # not a decode
    first = graphs.stage(*setup.decode_specs([0, 1]))
    second = graphs.stage(*setup.decode_specs([2]))
    assert first is not None and second is not None
    with pytest.raises(RuntimeError, match="reused by a later step"):
        graphs.run(first[1])
    assert graphs.run(second[1]).shape == (1, model.config.vocab_size)


def test_verify_compares_run_with_the_eager_model_on_padding_rows() -> None:
    model = build_model()
    setup = _Setup(model, seqs=2, max_len=32, seed=2)
    graphs = setup.graphs(max_batch=4)
    before = setup.snapshot()
    assert graphs.verify() == []  # not captured: run is the eager model itself
    for c, c0 in zip((c for pair in setup.pool.kv_caches for c in pair), before, strict=True):
        assert torch.equal(c[: setup.real], c0[: setup.real])  # padding rows wrote no real block
    run = graphs.run
    graphs.run = lambda step: run(step) * 1.5  # type: ignore[method-assign]
    assert graphs.verify() == [1, 2, 4]


def test_graphs_stay_off_on_cpu_and_with_enforce_eager() -> None:
    model = build_model()
    cfg = model.config
    pool = KVPool(KVShape(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BS, torch.float32), 8)
    runner = ModelRunner(model, pool, "cpu")
    assert runner.graphs is None and runner.graphs_off_reason is not None
    assert "CUDA device" in runner.graphs_off_reason
    eager = ModelRunner(model, pool, "cpu", enforce_eager=True)
    assert eager.graphs is None and eager.graphs_off_reason == "enforce_eager"
    # CUDA asked for where there is none (or a capture that fails): logged, and the runner eager.
    triton = LlamaForCausalLM(model.config, ModelOptions(attention_backend="triton"))
    failed = ModelRunner(triton, pool, "cuda", max_model_len=64)
    assert failed.graphs is None and failed.graphs_off_reason is not None
    assert failed.graphs_off_reason.startswith("capture failed")
    assert ModelRunner(triton, pool, "cuda", enforce_eager=True).graphs_off_reason == "enforce_eager"
    assert EngineConfig().enforce_eager is False
    assert EngineConfig(enforce_eager=True).enforce_eager is True


# ---------------------------------------------------------------- the triton backend


def _triton_interpreted() -> bool:
    from tierserve.kernels import triton_attention

    return torch.cuda.is_available() or triton_attention.interpreted()


@pytest.mark.triton
@pytest.mark.skipif(not _triton_interpreted(), reason="Triton kernels compiled for a GPU we lack")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_triton_padding_rows_skip_the_store_with_a_negative_slot(fused: bool) -> None:
    """On the triton backend the padding rows' slot is -1: no block is reserved, and the cache
    (block 0 included, which the padding rows read) changes only at the real rows' slots."""
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=97, hidden_size=64, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                      rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=128, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg, ModelOptions(attention_backend="triton", fused_kernels=fused))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.2 if p.dim() > 1 else 0.05) + (p.dim() == 1))
    model.eval()
    setup = _Setup(model, seqs=3, max_len=32, seed=3)
    graphs = DecodeGraphs(model, setup.pool.kv_caches, BS, 32, 4, "cpu")
    assert graphs.pad_slot == -1 and graphs.pad_block == 0
    which = [0, 2, 1]  # 3 rows in the bucket of 4
    ids, specs = setup.decode_specs(which)
    staged = graphs.stage(ids, specs)
    assert staged is not None and staged[1].bucket == 4
    before = setup.snapshot()
    got = graphs.run(staged[1])
    want = setup.eager_step(which)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Block 0 (which the padding row reads) and every other slot but the real rows' unchanged.
    setup.assert_only_real_slots_changed(before, specs, exact=False)
    for c, c0 in zip((c for pair in setup.pool.kv_caches for c in pair), before, strict=True):
        assert torch.equal(c[setup.real], c0[setup.real])  # the spare block too


# ---------------------------------------------------------------- on a GPU (skipped without one)

_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def GPU(fn: Any) -> Any:
    """Marks a test as needing a GPU (``gpu``, ``triton``), skipped without one."""
    return pytest.mark.gpu(pytest.mark.triton(_NO_GPU(fn)))


def _tiny_triton(dtype: torch.dtype) -> LlamaForCausalLM:
    model = build_model(ModelOptions(attention_backend="triton"))
    return model.to("cuda", dtype).eval()


@GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_replayed_graphs_give_the_eager_logits_and_write_only_real_slots(
    dtype: torch.dtype,
) -> None:
    model = _tiny_triton(dtype)
    setup = _Setup(model, seqs=11, max_len=96, seed=7, device="cuda")
    graphs = DecodeGraphs(model, setup.pool.kv_caches, BS, 96, 16, "cuda")
    graphs.capture()
    assert graphs.captured and graphs.verify() == []
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for which in _steps():
        ids, specs = setup.decode_specs(which)
        staged = graphs.stage(ids, specs)
        assert staged is not None
        before = setup.snapshot()
        got = graphs.run(staged[1]).float()
        want = setup.eager_step(which).float()
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, atol=tol * scale, rtol=tol)
        setup.assert_only_real_slots_changed(before, specs, exact=False, tol=tol)
        setup.advance(which, want)


@GPU
def test_gpu_engine_with_graphs_generates_what_the_eager_engine_does() -> None:
    cfg = EngineConfig(model=EMBEDDED_MODEL, device="cuda", dtype="float32", num_kv_blocks=64,
                       max_num_seqs=6, prefill_chunk_tokens=32, max_model_len=128)
    graphed, plain = Engine(cfg), Engine(cfg)
    assert graphed.runner.graphs is not None, graphed.runner.graphs_off_reason
    plain.runner.graphs = None
    rng = random.Random(4)
    for engine in (plain, graphed):
        rng.seed(4)
        for p in _prompts(9, seed=6, hi=50):
            engine.add_request(GenerateRequest.of(p, SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0,
                                                 ignore_eos=True)))
    assert _drain(graphed) == _drain(plain)
