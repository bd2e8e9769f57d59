"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# OpenAI's `type` for each status class we answer with.
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


@dataclass
class APIError(Exception):
    """An error to send to the client as it is; raised anywhere below a handler."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return error_body(status=self.status, message=self.message, param=self.param, code=self.code)


def error_body(*, status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None, code: str | None = "invalid_value") -> APIError:
    return APIError(status=400, message=message, param=param, code=code)
