"""The replica's grammar compile queue (``tierserve.replica.structured.Grammars``): a request that
leaves while its grammar compiles takes nothing with it, compiles run by priority, and a tenant
has at most its share of them under way.

Each test holds the worker's first compile open (``Hold``) to line requests up behind it; the
compiles themselves are small.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest

from tierserve.records import StructuredOutput
from tierserve.replica.models.embedded_spec import EOS_ID, build_tokenizer, embedded_config
from tierserve.replica.structured import GrammarError, Grammars


@functools.cache
def _tokenizer() -> Any:
    return build_tokenizer()


def make(**kw: Any) -> Grammars:
    return Grammars(_tokenizer(), embedded_config().vocab_size, [EOS_ID], **kw)


def regex(tag: str) -> StructuredOutput:
    return StructuredOutput("regex", f"{tag}[0-9]{{1,3}}")


class Hold:
    """Holds each compile of ``grammars`` before the worker until ``release``; ``order``: the
    specs in the order they reached the worker."""

    def __init__(self, grammars: Grammars) -> None:
        self.gate = threading.Event()
        self.reached = threading.Event()
        self.order: list[str] = []
        compile_job = grammars._compile_job

        def held(job: Any) -> Any:
            self.order.append(job.plan.key[1])
            self.reached.set()
            assert self.gate.wait(60)
            return compile_job(job)

        grammars._compile_job = held  # type: ignore[method-assign]

    async def first_reached(self) -> None:
        assert await asyncio.to_thread(self.reached.wait, 60)

    def release(self) -> None:
        self.gate.set()


async def queued(coro: Any) -> asyncio.Task[Any]:
    """``coro`` as a task that has reached the queue (its lookup runs before its first wait)."""
    task = asyncio.ensure_future(coro)
    await asyncio.sleep(0)
    return task


def test_a_waiter_that_leaves_cancels_nothing_the_others_wait_for() -> None:
    g = make()
    hold = Hold(g)
    spec = regex("shared")

    async def run() -> None:
        first = await queued(g.prepare(regex("first")))
        await hold.first_reached()
        leaving = await queued(g.prepare(spec))
        staying = await queued(g.prepare(spec))
        assert g.waiting == 3
        leaving.cancel()
        await asyncio.sleep(0)
        hold.release()
        assert await staying is not None
        await first
        with pytest.raises(asyncio.CancelledError):
            await leaving
        # Compiled once, kept, and served to the next request without a compile.
        compiled = g.compiled
        assert await g.prepare(spec) is not None
        assert g.compiled == compiled == 2

    asyncio.run(run())
    assert g.waiting == 0


def test_a_queued_compile_no_one_waits_for_is_dropped_and_the_next_request_compiles_it() -> None:
    g = make()
    hold = Hold(g)
    spec = regex("dropped")

    async def run() -> None:
        first = await queued(g.prepare(regex("ahead")))
        await hold.first_reached()
        only = await queued(g.prepare(spec))
        only.cancel()
        await asyncio.sleep(0)
        assert g.waiting == 1  # the first request's
        hold.release()
        await first
        assert hold.order == [regex("ahead").spec]  # never sent to the worker
        assert await g.prepare(spec) is not None  # queued again, compiled, no error
        assert hold.order == [regex("ahead").spec, spec.spec]

    asyncio.run(run())
    assert g.compiled == 2 and g.waiting == 0


def test_a_running_compile_whose_waiters_all_left_finishes_and_is_cached() -> None:
    g = make()
    hold = Hold(g)
    spec = regex("left")

    async def run() -> None:
        task = await queued(g.prepare(spec))
        await hold.first_reached()
        task.cancel()
        await asyncio.sleep(0)
        hold.release()
        with pytest.raises(asyncio.CancelledError):
            await task
        while g.compiled == 0:  # it still finishes, on the dispatcher
            await asyncio.sleep(0.01)
        assert await g.prepare(spec) is not None

    asyncio.run(run())
    assert g.compiled == 1 and g.waiting == 0


def test_a_failed_compile_is_not_kept_and_fails_each_of_its_waiters_with_its_own_field() -> None:
    g = make()
    hold = Hold(g)
    bad_a = StructuredOutput("regex", "(", "guided_regex")
    bad_b = StructuredOutput("regex", "(", "structured_outputs.regex")

    async def run() -> list[BaseException | Any]:
        first = await queued(g.prepare(regex("before")))
        await hold.first_reached()
        tasks = [await queued(g.prepare(bad_a)), await queued(g.prepare(bad_b))]
        hold.release()
        await first
        return list(await asyncio.gather(*tasks, return_exceptions=True))

    errors = [e for e in asyncio.run(run()) if isinstance(e, GrammarError)]
    assert [(e.param, e.code, e.status) for e in errors] == [
        ("guided_regex", "invalid_structured_output", 400),
        ("structured_outputs.regex", "invalid_structured_output", 400)]
    assert hold.order.count("(") == 1  # one compile for both
    with pytest.raises(GrammarError, match="does not compile"):  # not cached: compiled again
        g.compile(bad_a)
    assert hold.order.count("(") == 2


def test_compiles_run_by_priority_then_in_arrival_order() -> None:
    g = make()
    hold = Hold(g)
    specs = {name: regex(name) for name in ("x", "a", "b", "c", "d")}

    async def run() -> None:
        tasks = [await queued(g.prepare(specs["x"], priority=0, tenant=None))]
        await hold.first_reached()
        for name, priority in (("a", 0), ("b", 5), ("c", 0), ("d", 5)):
            tasks.append(await queued(g.prepare(specs[name], priority=priority, tenant=None)))
        # A request of a higher tier for "c" lifts that compile to its priority.
        tasks.append(await queued(g.prepare(specs["c"], priority=9, tenant=None)))
        hold.release()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert hold.order == [specs[n].spec for n in ("x", "c", "b", "d", "a")]


def test_a_tenant_has_at_most_its_share_of_compiles_queued_or_running() -> None:
    g = make(compiles_per_tenant=2)
    hold = Hold(g)

    async def run() -> None:
        tasks = [await queued(g.prepare(regex("t1"), tenant="acme"))]
        await hold.first_reached()
        tasks.append(await queued(g.prepare(regex("t2"), tenant="acme")))
        with pytest.raises(GrammarError) as e:
            await g.prepare(regex("t3"), tenant="acme")
        assert (e.value.status, e.value.code) == (429, "too_many_compiles")
        assert "at most 2" in str(e.value)
        # Another tenant, a compile already under way, and the offline path are not capped.
        tasks.append(await queued(g.prepare(regex("t3"), tenant="other")))
        tasks.append(await queued(g.prepare(regex("t2"), tenant="acme")))
        tasks.append(await queued(g.prepare(regex("t4"), tenant=None)))
        hold.release()
        await asyncio.gather(*tasks)
        # Done: the tenant's share is free again.
        assert await g.prepare(regex("t5"), tenant="acme") is not None

    asyncio.run(run())
    assert g.waiting == 0


def test_a_grammar_error_keeps_its_code_and_status_through_pickling() -> None:
    import pickle

    e = GrammarError("too complex", "guided_json", "grammar_too_complex", 400)
    back = pickle.loads(pickle.dumps(e))
    assert (str(back), back.param, back.code, back.status) == (
        "too complex", "guided_json", "grammar_too_complex", 400)
    plain = pickle.loads(pickle.dumps(GrammarError("bad", "r")))
    assert (plain.code, plain.status) == ("invalid_structured_output", 400)
