"""Error paths: bad requests, bad configs, unknown ids, bad policies."""

from __future__ import annotations

from typing import Any

import pytest

from replica.block_space import FreeListBlocks
from replica.prefill_policy import Chunked, WholePrompt
from replica.scheduler import Request, SchedPolicy, Scheduler, SchedulerConfig
from tests.fake_model import FakeModel, request


@pytest.mark.parametrize("bad", [0, -1])
def test_request_needs_at_least_one_token(bad: int) -> None:
    with pytest.raises(ValueError, match=f"max_tokens must be at least 1, got {bad}"):
        Request([1, 2], bad)


@pytest.mark.parametrize("bad", [1.5, "3", True, None])
def test_request_max_tokens_must_be_an_int(bad: Any) -> None:
    with pytest.raises(TypeError, match="max_tokens must be an int"):
        Request([1, 2], bad)


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("max_seqs", 0, "SchedulerConfig.max_seqs must be positive, got 0"),
        ("max_batch_tokens", -1, "SchedulerConfig.max_batch_tokens must be positive, got -1"),
        ("max_waiting", 0, "SchedulerConfig.max_waiting must be positive, got 0"),
        ("max_model_len", 0, "SchedulerConfig.max_model_len must be positive, got 0"),
        ("max_model_len", 1, "max_model_len must be at least 2"),
        ("aging_steps", -1, "SchedulerConfig.aging_steps must be >= 0, got -1"),
    ],
)
def test_config_rejects_bad_values(field: str, value: int, message: str) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises(ValueError) as e:
        SchedulerConfig(**kwargs)
    assert message in str(e.value)


@pytest.mark.parametrize(
    "field,value",
    [("max_seqs", 2.5), ("max_batch_tokens", "64"), ("aging_steps", 1.5), ("policy", "lifo")],
)
def test_config_rejects_values_of_the_wrong_type(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {field: value}
    with pytest.raises((TypeError, ValueError)) as e:
        SchedulerConfig(**kwargs)
    assert f"SchedulerConfig.{field}" in str(e.value), "the message names the field"


@pytest.mark.parametrize("name", ["fcfs", "FCFS"])
def test_a_policy_given_as_a_string_is_not_silently_priority(name: str) -> None:
    """``policy="fcfs"`` used to pass and rank by priority (``is SchedPolicy.FCFS`` is false).

    Either refuse it with a message naming the field, or take it as the SchedPolicy it names.
    """
    kwargs: dict[str, Any] = {"policy": name, "max_seqs": 1}
    try:
        cfg = SchedulerConfig(**kwargs)
    except (TypeError, ValueError) as e:
        assert "SchedulerConfig.policy" in str(e)
        return
    s = Scheduler(cfg, FreeListBlocks(4, range(16)))
    first = s.add(request(2, 1, priority=0, seed=1))
    s.add(request(2, 1, priority=9, seed=2))
    assert [c.id for c in s.schedule().prefill] == [first], "FCFS: arrival order"


def test_config_defaults_are_valid() -> None:
    cfg = SchedulerConfig()
    assert cfg.policy is SchedPolicy.FCFS and cfg.max_seqs > 0


def test_abort_of_an_unknown_or_finished_id_returns_false() -> None:
    s = Scheduler(SchedulerConfig(), FreeListBlocks(4, range(8)))
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
