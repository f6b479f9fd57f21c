"""Each check of a request runs once, at the edge its path enters by.

The parameters' ranges are ``SamplingParams``' (when the record is made), token ids against the
vocabulary the engine's (``add_request``, or once for ``generate``'s ``n`` samples, or once per
prompt in ``LLM.generate`` before any work), the admission rules the scheduler's (``add``; the
offline ``LLM`` also asks ``check`` before any work).
"""

from __future__ import annotations

import asyncio
import pickle
from collections import Counter
from collections.abc import Iterator

import pytest

from tierserve.records import GenerateRequest, InvalidSamplingParam, InvalidToken
from tierserve.replica.config import EngineConfig
from tierserve.replica.engine import Engine
from tierserve.replica.llm import LLM
from tierserve.replica.models.embedded import EMBEDDED_MODEL
from tierserve.replica.sampler import SamplingParams
from tierserve.replica.scheduler import Scheduler, TooLong

PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(EMBEDDED_MODEL, num_kv_blocks=64, block_size=16, max_num_seqs=8,
               max_model_len=128)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often the engine scans token ids and the scheduler applies its admission rules."""
    seen: Counter[str] = Counter()
    scan, admit = Engine._check_tokens, Scheduler._check

    def counted_scan(self: Engine, *args: object) -> None:
        seen["tokens"] += 1
        scan(self, *args)  # type: ignore[arg-type]

    def counted_admit(self: Scheduler, *args: object, **kwargs: object) -> None:
        seen["admission"] += 1
        admit(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "_check_tokens", counted_scan)
    monkeypatch.setattr(Scheduler, "_check", counted_admit)
    yield seen


def drain(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_add_request_checks_each_rule_once(llm: LLM, calls: Counter[str]) -> None:
    llm.engine.add_request(GenerateRequest.of([5, 6, 7], PARAMS))
    assert calls == {"tokens": 1, "admission": 1}
    drain(llm.engine)


def test_generate_scans_the_prompt_once_for_its_samples(calls: Counter[str]) -> None:
    engine = Engine(EngineConfig(model=EMBEDDED_MODEL, num_kv_blocks=64, max_model_len=128))
    engine.start()

    async def run() -> int:
        return len([o async for o in engine.generate(GenerateRequest.of([5, 6, 7], PARAMS, n=3)) if o.finished])

    try:
        assert asyncio.run(asyncio.wait_for(run(), timeout=60)) == 3
    finally:
        engine.shutdown()
    assert calls == {"tokens": 1, "admission": 3}


def test_llm_checks_every_prompt_before_any_work_and_not_again(
    llm: LLM, calls: Counter[str]
) -> None:
    llm.generate([[5, 6, 7], [8, 9]], PARAMS, use_tqdm=False)
    # Tokens once per prompt; admission once before any work (check) and once as it queues.
    assert calls == {"tokens": 2, "admission": 4}


def test_llm_refuses_a_bad_prompt_before_any_work(llm: LLM) -> None:
    free = llm.stats().free_blocks
    bias = SamplingParams(max_tokens=2, logit_bias={10**6: 1.0})
    with pytest.raises(InvalidToken, match="prompt 1: logit_bias: token id 1000000") as e:
        llm.generate([[5, 6], [7, 8]], [PARAMS, bias], use_tqdm=False)
    assert e.value.param == "logit_bias"
    with pytest.raises(TooLong, match="prompt 0: prompt has 200 tokens"):
        llm.generate([[5] * 200], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt 0: priority must be an integer"):
        llm.generate([[5, 6]], PARAMS, priority=["high"], use_tqdm=False)  # type: ignore[list-item]
    assert llm.stats().waiting == 0 and llm.stats().free_blocks == free


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids.1"),
        ({"logit_bias": {5: 101.0}}, "logit_bias.5"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_a_bad_parameter_names_its_field(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidSamplingParam) as e:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert e.value.param == param
    again = pickle.loads(pickle.dumps(e.value))
    assert (str(again), again.param) == (str(e.value), param)
