"""The plan carries what the runner feeds (``Decode``, ``Chunk``): a fake runner that reads the
plan alone answers every request as it would alone.

``PlanModel`` is tests/replica/fake_model.py's model fed from the plan's records only (the token ids,
positions and block tables they carry), never from the scheduler; every step it also checks each
record against what the scheduler holds. Random traffic (priorities, chunked prefill, a tight
pool that preempts, a prefix cache, SLO-aware steps) must then end with every request's output
equal to ``expected_output``: a wrong token, position or table in a record changes it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tests.replica.fake_model import VOCAB, FakeModel, drive, expected_output, next_token
from tests.replica.scheduler.harness import caps
from tierserve.replica.block_space import BlockSpace, FreeListBlocks
from tierserve.replica.prefill_policy import Chunked, WholePrompt
from tierserve.replica.prefix_cache import PrefixCachingBlocks
from tierserve.replica.scheduler import (
    Chunk,
    Request,
    RequestId,
    SampledToken,
    SchedPolicy,
    Scheduler,
    StepPlan,
    TokenEvent,
)
from tierserve.replica.step_cost import CostPrior, StepCostModel


class PlanModel(FakeModel):
    """``FakeModel`` that feeds and reads through the plan's records alone."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(scheduler)
        self.admissions = 0
        self.cached_admissions = 0

    def _write(self, table: Sequence[int], pos: int, token: int) -> None:
        assert pos // self.B < len(table), f"no block for position {pos}"
        self.pool[table[pos // self.B] * self.B + pos % self.B] = token

    def _answer(self, rid: RequestId, table: Sequence[int], upto: int) -> SampledToken:
        B = self.B
        return SampledToken(rid, next_token([self.pool[table[p // B] * B + p % B]
                                           for p in range(upto)]))

    def _check(self, plan: StepPlan) -> None:
        """Each record against the scheduler's own state (before ``on_step`` changes it)."""
        s = self.s
        for d in plan.decodes:
            toks = s.tokens(d.id)
            assert toks is not None
            assert (d.token, d.position) == (toks[-1], len(toks) - 1), d
            assert list(d.block_table) == list(s.blocks.block_table(d.id)), d
        for c in plan.prefill:
            toks = s.tokens(c.id)
            assert toks is not None
            assert list(c.tokens) == list(toks[c.start : c.start + c.len]), c
            assert list(c.block_table) == list(s.blocks.block_table(c.id)), c
            assert c.prompt_len == s.prompt_len(c.id), c
            if c.cached_tokens is not None:  # the admitting chunk
                assert c.cached_tokens == s.cached_tokens(c.id), c
                self.admissions += 1
                self.cached_admissions += c.start > 0

    def run(self, plan: StepPlan) -> list[SampledToken]:
        self._check(plan)
        outs: list[SampledToken] = []
        for d in plan.decodes:
            self._write(d.block_table, d.position, d.token)
            outs.append(self._answer(d.id, d.block_table, d.position + 1))
        for c in plan.prefill:
            assert len(c.tokens) == c.len
            for k, t in enumerate(c.tokens):
                self._write(c.block_table, c.start + k, t)
            if c.last:
                outs.append(self._answer(c.id, c.block_table, c.start + c.len))
        self.steps += 1
        return outs


PRIOR = CostPrior(base_s=0.01, per_token_s=0.001, per_sequence_s=0.0, per_pair_s=0.0)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["whole", "chunked", "prefix", "slo"])
def test_a_runner_reading_only_the_plan_answers_every_request_as_alone(
    mode: str, seed: int
) -> None:
    rng = random.Random(seed)
    context = 160
    cfg = caps(max_seqs=6, max_batch_tokens=48, policy=SchedPolicy.PRIORITY, aging_steps=4,
               max_model_len=context)
    blocks: BlockSpace
    if mode == "prefix":
        blocks = PrefixCachingBlocks(4, range(40), 7)
    else:
        blocks = FreeListBlocks(4, range(40))  # tight: 160 positions, so preemptions happen
    cost = None
    if mode == "slo":
        cfg = cfg.model_copy(update={"slo_scheduling": True, "slo_headroom": 0.8})
        cost = StepCostModel(PRIOR)
    s = Scheduler(cfg, blocks, WholePrompt() if mode == "whole" else Chunked(8), cost=cost)
    model = PlanModel(s)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    want: dict[RequestId, list[int]] = {}
    early: dict[RequestId, list[int]] = {}  # tokens of the steps taken between arrivals
    for i in range(14):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        if mode == "prefix" and i % 2:
            prompt = shared + prompt
        max_tokens = rng.randint(1, 24)
        target = rng.choice([None, 0.04, 0.08]) if mode == "slo" else None
        rid = s.add(Request(prompt, max_tokens, rng.randint(0, 3), tpot_target_s=target))
        want[rid] = expected_output(prompt, max_tokens, context)[0]
        if rng.random() < 0.5:
            for e in model.step()[1]:
                if isinstance(e, TokenEvent):
                    early.setdefault(e.id, []).append(e.token)
    rest, _ = drive(s, model)
    got = {rid: early.get(rid, []) + rest.get(rid, []) for rid in want}
    assert got == want
    assert model.admissions >= len(want)
    if mode == "prefix":
        assert model.cached_admissions > 0, "no admission started after a cached prefix"


def test_chunk_equality_is_the_positions_planned() -> None:
    """A plan's chunks compare by the positions planned, whatever inputs they carry."""
    assert Chunk(3, 0, 5, True, (1, 2, 3, 4, 5), (0, 1), 5, 0) == Chunk(3, 0, 5, True)
    assert Chunk(3, 0, 5, True) != Chunk(3, 0, 5, False)
