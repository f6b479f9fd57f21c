"""One error type at the bottom: every refusal, wherever it is made, is a ``ServingError``
(status, code, param), crosses processes whole, and is translated in one place by the replica's
deployment (into an ``ErrorRecord``) and by the ingress (into the API's error JSON)."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest

from tierserve.cluster.gate import Shed
from tierserve.cluster.structured import SchemaCheckBusy, StructuredError
from tierserve.cluster.tiers import AuthError, PriorityError, TenantError
from tierserve.cluster.tool_calls import ToolMessageError
from tierserve.records import (
    BadRequest,
    EngineDead,
    ErrorRecord,
    InvalidSamplingParam,
    InvalidToken,
    ServingError,
    TooManyRequests,
)
from tierserve.replica.scheduler import EmptyPrompt, NeverFits, QueueFull, TooLong
from tierserve.replica.structured import GrammarError

ROOT = Path(__file__).resolve().parents[1]

# Each refusal the code raises, as it raises it, with what a client must see.
KINDS: list[tuple[ServingError, int, str, str | None]] = [
    (InvalidSamplingParam("top_p must be in (0, 1]", "top_p"), 400, "invalid_request", "top_p"),
    (InvalidToken("token 99999 is not in the vocabulary", "prompt"), 400, "invalid_token",
     "prompt"),
    (EngineDead("the step loop stopped"), 503, "replica_unavailable", None),
    (QueueFull(8), 429, "queue_full", None),
    (EmptyPrompt(), 400, "empty", "prompt"),
    (TooLong(300, 256), 400, "too_long", None),
    (NeverFits(40, 32), 400, "never_fits", None),
    (GrammarError("x: too complex", "response_format", "grammar_too_complex"), 400,
     "grammar_too_complex", "response_format"),
    (GrammarError("over the cap", "tools", "too_many_compiles", 429), 429, "too_many_compiles",
     "tools"),
    (AuthError("the API key is not valid"), 401, "invalid_api_key", None),
    (PriorityError("X-TL-Priority must be an integer"), 400, "invalid_priority",
     "X-TL-Priority"),
    (TenantError("bad tenant", param="X-Tenant"), 400, "invalid_tenant", "X-Tenant"),
    (Shed(429, "band_full", "tier 'batch' is full", retry_after=7), 429, "shed", None),
    (StructuredError("response_format: bad", "response_format"), 400,
     "invalid_structured_output", "response_format"),
    (SchemaCheckBusy("too many checks", retry_after=2), 429, "busy", None),
    (ToolMessageError("bad arguments", "messages.1.tool_calls.0"), 400, "invalid_request",
     "messages.1.tool_calls.0"),
]


@pytest.mark.parametrize(("error", "status", "code", "param"), KINDS,
                         ids=[type(k[0]).__name__ + str(i) for i, k in enumerate(KINDS)])
def test_every_refusal_is_one_type_and_crosses_processes_whole(
        error: ServingError, status: int, code: str, param: str | None) -> None:
    assert isinstance(error, ServingError)
    assert (error.status, error.code, error.param) == (status, code, param)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert vars(again) == vars(error)
    assert again.record() == ErrorRecord(status, code, str(error), param)


def test_a_refusal_keeps_what_its_kind_adds() -> None:
    shed = pickle.loads(pickle.dumps(Shed(503, "late", "held too long", retry_after=3)))
    assert (shed.reason, shed.retry_after, shed.status) == ("late", 3, 503)
    full = pickle.loads(pickle.dumps(QueueFull(12)))
    assert (full.limit, full.reason) == (12, "queue_full")
    assert isinstance(InvalidSamplingParam("m", "n"), ValueError)  # callers that catch that


def test_a_record_comes_back_as_the_error_it_was() -> None:
    record = ErrorRecord(429, "queue_full", "the waiting queue is full", None, "r1")
    error = ServingError.of(record)
    assert error.record() == record and error.status == 429 and error.replica == "r1"
    assert TooManyRequests("later").code == "busy" and BadRequest("no").status == 400


def _raises_with_a_literal_status(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, int) and 400 <= node.args[0].value < 600:
            found.append(ast.unparse(node)[:80])
    return found


@pytest.mark.parametrize("part", ["cluster/ingress.py", "cluster/edge.py"])
def test_the_ingress_names_its_refusals_instead_of_their_status(part: str) -> None:
    """A refusal is raised by its kind (``BadRequest``, ``TooManyRequests``, ...), never as a
    status number; only the error answer itself writes a status."""
    literal = [c for c in _raises_with_a_literal_status(ROOT / part)
               if not c.startswith(("error_response(", "JSONResponse("))]
    assert literal == []


def test_the_deployment_translates_refusals_in_one_place() -> None:
    source = (ROOT / "replica" / "deployment.py").read_text()
    assert len(re.findall(r"except ServingError", source)) == 1
    assert not re.search(r"except \(?(AdmitError|GrammarError|InvalidToken|EngineDead)", source)
