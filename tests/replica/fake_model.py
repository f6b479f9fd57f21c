"""A fake model whose outputs are known in advance, over a simulated paged KV cache.

The fake "runs" a StepPlan exactly as the real runner would: every fed token is written into
a pool of ``total_blocks * block_size`` slots through the request's block table, and a sampled
row reads every position of its sequence back through the table. The next token is a fixed hash of
what it read, so a wrong block table, a block shared by two requests, a recompute from the wrong
tokens or an off-by-one in positions all change the output.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierserve.replica.scheduler import (
    FinishedEvent,
    FinishReason,
    Request,
    RequestEvent,
    RequestId,
    SampledToken,
    Scheduler,
    StepPlan,
    TokenEvent,
)

VOCAB = 1000


def next_token(context: Sequence[int], vocab: int = VOCAB) -> int:
    """The fake model's output after reading ``context`` (positions 0..n-1)."""
    h = len(context)
    for t in context:
        h = (h * 1_000_003 + t + 1) & 0xFFFFFFFF
    return h % vocab


class FakeModel:
    """Feeds scheduled tokens through a paged pool and samples ``next_token`` of what it reads."""

    def __init__(self, scheduler: Scheduler, stop_token: int | None = None) -> None:
        self.s = scheduler
        blocks = scheduler.blocks
        self.B = blocks.block_size
        self.pool: dict[int, int] = {}  # slot -> token written there
        self.stop_token = stop_token
        self.steps = 0

    def _slot(self, rid: RequestId, pos: int) -> int:
        table = self.s.blocks.block_table(rid)
        assert pos // self.B < len(table), f"request {rid}: no block for position {pos}"
        return table[pos // self.B] * self.B + pos % self.B

    def read(self, rid: RequestId, pos: int) -> int | None:
        """The token the pool holds at ``rid``'s position ``pos`` (None: never written)."""
        return self.pool.get(self._slot(rid, pos))

    def _feed(self, rid: RequestId, start: int, n: int) -> None:
        toks = self.s.tokens(rid)
        assert toks is not None
        for p in range(start, start + n):
            self.pool[self._slot(rid, p)] = toks[p]

    def _sample(self, rid: RequestId, upto: int) -> SampledToken:
        ctx = [self.pool[self._slot(rid, p)] for p in range(upto)]
        tok = next_token(ctx)
        return SampledToken(rid, tok, stop=self.stop_token is not None and tok == self.stop_token)

    def run(self, plan: StepPlan) -> list[SampledToken]:
        """Execute ``plan`` and return one SampledToken per decode and per last chunk."""
        outs: list[SampledToken] = []
        for rid in plan.decode:
            toks = self.s.tokens(rid)
            assert toks is not None
            n = len(toks)
            self._feed(rid, n - 1, 1)
            outs.append(self._sample(rid, n))
        for c in plan.prefill:
            self._feed(c.id, c.start, c.len)
            if c.last:
                outs.append(self._sample(c.id, c.start + c.len))
        self.steps += 1
        return outs

    def step(self) -> tuple[StepPlan, list[RequestEvent]]:
        plan = self.s.schedule()
        return plan, self.s.on_step(self.run(plan))


def expected_output(
    prompt: Sequence[int], max_tokens: int, max_model_len: int, stop_token: int | None = None
) -> tuple[list[int], FinishReason]:
    """What a request generates alone: the fake model's answer, computed without a scheduler."""
    toks = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if stop_token is not None and t == stop_token:
            return out, FinishReason.STOP
        if len(out) >= max_tokens or len(toks) >= max_model_len:
            return out, FinishReason.LENGTH


def drive(
    s: Scheduler, model: FakeModel, max_steps: int = 100_000
) -> tuple[dict[RequestId, list[int]], dict[RequestId, FinishReason]]:
    """Step until nothing is unfinished; collect each request's tokens and finish reason."""
    tokens: dict[RequestId, list[int]] = {}
    reasons: dict[RequestId, FinishReason] = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            return tokens, reasons
        _, events = model.step()
        for e in events:
            if isinstance(e, TokenEvent):
                tokens.setdefault(e.id, []).append(e.token)
            elif isinstance(e, FinishedEvent):
                reasons[e.id] = e.reason
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def request(prompt_len: int, max_tokens: int, priority: int = 0, seed: int = 0) -> Request:
    """A request with a deterministic prompt of ``prompt_len`` tokens."""
    return Request([(seed * 7919 + i * 31) % VOCAB for i in range(prompt_len)], max_tokens, priority)
