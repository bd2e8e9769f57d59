"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status.

Every error body has a string `code` (clients branch on it): the raiser's, or the status's
default below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# OpenAI's `type` for each status class we answer with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",  # OpenAI's own type for a wrong key (code: invalid_api_key)
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}

# `code` of an error raised without one (framework errors: unknown route, wrong method, ...).
DEFAULT_CODES = {
    400: "invalid_request",
    401: "invalid_api_key",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    500: "internal_error",
    503: "service_unavailable",
}

# Seconds a client should wait before retrying a request refused because the queue is full.
QUEUE_FULL_RETRY_AFTER_SECONDS = 1


@dataclass
class APIError(Exception):
    """An error to send to the client as it is; raised anywhere below a handler."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] | None = None  # extra response headers (Retry-After, Connection, ...)

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(status=self.status, message=self.message, param=self.param, code=self.code)


def error_body(*, status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    if code is None:
        code = DEFAULT_CODES.get(status, "invalid_request" if status < 500 else "internal_error")
    return {
        "error": {
            "message": _encodable(message),
            "type": error_type,
            "param": None if param is None else _encodable(param),
            "code": code,
        }
    }


def _encodable(text: str) -> str:
    # A message may quote the client's text (a field name, a template's complaint); an unpaired
    # surrogate in it would make the JSON response itself unencodable (a 500 instead of the error).
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, *, param: str | None, code: str | None = "invalid_value") -> APIError:
    return APIError(status=400, message=message, param=param, code=code)


def queue_full(*, in_flight: int, max_in_flight: int) -> APIError:
    return APIError(
        status=429,
        code="queue_full",
        headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_SECONDS)},
        message=f"too many requests in flight ({in_flight}, --max-queue {max_in_flight}); retry later",
    )


def shutting_down() -> APIError:
    # Connection: close, so a client's pool does not reuse a connection that is about to go away.
    return APIError(
        status=503, message="the server is shutting down", code="shutting_down", headers={"Connection": "close"}
    )
