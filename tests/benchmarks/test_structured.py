"""The pure helpers of ``benchmarks.structured`` (no model runs here)."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

from benchmarks.structured import (
    FIELDS,
    SCHEMA,
    SUBJECTS,
    StepLog,
    example_record,
    kv_blocks,
    markdown_table,
    other_specs,
    ratio,
    subject,
    twin_params,
    user_message,
    validate_outputs,
)


def test_the_schema_is_a_typical_record_every_field_required() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    props = SCHEMA["properties"]
    assert 6 <= len(props) <= 10
    assert SCHEMA["required"] == list(props) == list(FIELDS)
    assert SCHEMA["additionalProperties"] is False
    assert props["landmarks"]["items"]["additionalProperties"] is False
    assert props["landmarks"]["maxItems"] and props["languages"]["maxItems"]


@pytest.mark.parametrize("i", range(len(SUBJECTS)))
def test_every_example_record_matches_the_schema(i: int) -> None:
    jsonschema.validate(example_record(subject(i)), SCHEMA)


def test_subjects_cycle_and_each_prompt_names_its_city_and_the_keys() -> None:
    assert subject(0) == subject(len(SUBJECTS)) != subject(1)
    message = user_message("Lima")
    assert "Lima" in message and all(f in message for f in FIELDS)


def test_validation_counts_parsed_valid_and_fails_only_a_stop_that_does_not_match() -> None:
    good = json.dumps(example_record("Oslo"))
    wrong = json.dumps(example_record("Oslo") | {"extra": 1})
    texts = [good, wrong, '{"name": "cut', wrong, good[:-1]]
    reasons = ["stop", "stop", "length", "length", "stop"]
    v = validate_outputs(texts, reasons, SCHEMA)
    assert (v.total, v.parsed, v.valid) == (5, 3, 1)
    assert v.valid_ids == [0]
    assert v.failures == [1, 4]
    assert v.finish == {"stop": 3, "length": 2}
    assert "output 1" in v.first_error


def test_the_twins_generate_exactly_their_constrained_counts_with_the_same_seeds() -> None:
    twins = twin_params([5, 1, 30], seed=10)
    assert [p.max_tokens for p in twins] == [5, 1, 30]
    assert [p.seed for p in twins] == [10, 11, 12]
    assert all(p.ignore_eos and p.structured is None and p.temperature == 0.7 for p in twins)


def test_the_kv_pool_holds_every_request_whole() -> None:
    assert kv_blocks(2, 256, 16, prompt_bound=100) == 2 * (23 + 1)  # ceil(357 / 16) = 23
    assert kv_blocks(64, 32, 16) >= 64 * (192 + 32 + 1) / 16


def test_the_step_log_keeps_every_step_and_ignores_the_rest() -> None:
    log = StepLog()
    log.step_done(0.5, 64, 0)
    log.request_done(None)
    log.rejected("queue_full", "")
    log.grammar_compiled("json", 1.0)
    log.grammar_lookup(True)
    assert log.steps == [(0.5, 64)]


def test_small_helpers() -> None:
    assert math.isnan(ratio(1.0, 0.0)) and ratio(3.0, 4.0) == 0.75
    table = markdown_table([("a", "b", "c")]).splitlines()
    assert table == ["| section | figure | value |", "|---|---|---|", "| a | b | c |"]
    assert set(other_specs()) == {"regex", "choice", "grammar"}
