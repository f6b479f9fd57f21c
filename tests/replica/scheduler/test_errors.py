"""Error paths: bad requests, bad configs, unknown ids, bad policies."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tests.replica.fake_model import FakeModel, request
from tests.replica.scheduler.harness import caps
from tierserve.replica.block_space import FreeListBlocks
from tierserve.replica.config import EngineConfig
from tierserve.replica.prefill_policy import Chunked, WholePrompt
from tierserve.replica.scheduler import Request, SchedPolicy, Scheduler


@pytest.mark.parametrize("bad", [0, -1])
def test_request_needs_at_least_one_token(bad: int) -> None:
    with pytest.raises(ValueError, match=f"max_tokens must be at least 1, got {bad}"):
        Request([1, 2], bad)


@pytest.mark.parametrize("bad", [1.5, "3", True, None])
def test_request_max_tokens_must_be_an_int(bad: Any) -> None:
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        Request([1, 2], bad)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_num_seqs", 0, "max_num_seqs\n  Input should be greater than 0"),
        ("max_num_batched_tokens", -1, "max_num_batched_tokens\n  Input should be greater than 0"),
        ("max_waiting", 0, "max_waiting\n  Input should be greater than 0"),
        ("max_model_len", 1, "max_model_len\n  Input should be greater than or equal to 2"),
        ("aging_steps", -1, "aging_steps\n  Input should be greater than or equal to 0"),
        ("max_num_seqs", 2.5, "max_num_seqs\n  Input should be a valid integer"),
        ("scheduling_policy", "lifo", "scheduling_policy\n  Input should be 'fcfs' or 'priority'"),
        ("scheduling_policy", "FCFS", "scheduling_policy\n  Input should be 'fcfs' or 'priority'"),
    ],
)
def test_the_config_refuses_bad_caps_naming_the_field(field: str, value: Any, message: str) -> None:
    """The scheduler's caps are validated once, by the engine's config."""
    with pytest.raises(ValidationError) as e:
        EngineConfig(**{field: value})
    assert message in str(e.value)


def test_the_scheduler_needs_a_context() -> None:
    with pytest.raises(ValueError, match="needs a context of at least 2 tokens"):
        Scheduler(EngineConfig(), FreeListBlocks(4, range(8)))  # max_model_len unset


def test_fcfs_by_name_ranks_by_arrival() -> None:
    s = Scheduler(caps(policy="fcfs", max_seqs=1), FreeListBlocks(4, range(16)))
    first = s.add(request(2, 1, priority=0, seed=1))
    s.add(request(2, 1, priority=9, seed=2))
    assert [c.id for c in s.schedule().prefill] == [first], "FCFS: arrival order"
    assert s.policy is SchedPolicy.FCFS


def test_the_config_chooses_the_prefill_policy() -> None:
    chunked = Scheduler(EngineConfig(max_model_len=64, prefill_chunk_tokens=8),
                        FreeListBlocks(4, range(8)))
    assert isinstance(chunked.prefill_policy, Chunked) and chunked.prefill_policy.chunk_tokens == 8
    whole = Scheduler(caps(), FreeListBlocks(4, range(8)))
    assert isinstance(whole.prefill_policy, WholePrompt)


def test_abort_of_an_unknown_or_finished_id_returns_false() -> None:
    s = Scheduler(caps(), FreeListBlocks(4, range(8)))
    assert s.abort(0) is False
    assert s.abort(-1) is False
    rid = s.add(request(2, 1))
    m = FakeModel(s)
    m.step()
    assert not s.has_unfinished()
    assert s.abort(rid) is False
    assert s.tokens(rid) is None and s.prompt_len(rid) is None and not s.is_waiting(rid)


@pytest.mark.parametrize("bad", [0, -3])
def test_chunked_needs_a_positive_chunk(bad: int) -> None:
    with pytest.raises(ValueError, match=f"chunk_tokens must be positive, got {bad}"):
        Chunked(bad)


def test_policies_grant_what_the_seed_says() -> None:
    assert WholePrompt().chunk_len(5, 5, False) == 5
    assert WholePrompt().chunk_len(6, 5, False) == 0
    assert WholePrompt().chunk_len(60, 5, True) == 60, "alone: the whole prompt"
    assert Chunked(4).chunk_len(10, 3, False) == 3
    assert Chunked(4).chunk_len(10, 30, True) == 4
    assert Chunked(4).chunk_len(2, 30, False) == 2
    assert Chunked(4).chunk_len(10, 0, True) == 0
