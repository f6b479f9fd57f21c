"""The ingress's error answer: ``ApiError`` carries an HTTP status and what
``tierserve.cluster.protocol.error_body`` writes of it (``{"error": {"message", "type", "code",
"param"}}``); the ingress answers it as JSON, or, once a stream has begun, as its last SSE event."""

from __future__ import annotations

from typing import Any

from tierserve.cluster.protocol import error_body


class ApiError(Exception):
    """An error answer: its HTTP status, what ``error_body`` writes of it and, for a refusal
    under load, its ``Retry-After`` (None: the config's ``retry_after_s``)."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.code, self.param)
