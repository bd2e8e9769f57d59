"""ASGI middleware of the app: the API key check, and requests cut off by shutdown.

Both are plain ASGI so they act before FastAPI routes or reads anything: a client without the
key gets its 401 before its body is read or validated.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quickdraft.server.errors import APIError

logger = logging.getLogger("quickdraft.server")

# The routes an API key leaves open: probes, scrapers, the API's description and the tokenizer's
# routes (open in vLLM). Every other one needs it: the unversioned routes that run the model
# (/score, /rerank, /classify, /pooling, /invocations) as much as /v1's (vLLM checks /v1 only).
OPEN_PATHS = frozenset(
    {"/health", "/ping", "/metrics", "/version", "/tokenize", "/detokenize", "/docs", "/redoc", "/openapi.json"}
)
# How long a request cut off by shutdown may take to receive its last words (a client that
# does not read must not hold the shutdown).
FINAL_WRITE_SECONDS = 1.0


class ApiKeyCheck:
    """Every route but OPEN_PATHS needs `Authorization: Bearer <key>`; anything else is a 401 in OpenAI's shape."""

    def __init__(self, app: ASGIApp, *, api_key: str, on_reject: Callable[[Scope, APIError], None]):
        self.app = app
        self._expected = api_key.encode("ascii")
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]):
            error = self._check(scope)
            if error is not None:
                self._on_reject(scope, error)
                response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> APIError | None:
        authorization = _header(scope, b"authorization")
        if authorization is None:
            return _unauthorized("missing API key: send the header Authorization: Bearer <key>")
        scheme, _, credentials = authorization.strip().partition(b" ")
        # compare_digest: the time taken does not tell how much of a guess was right.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(credentials.strip(), self._expected):
            return _unauthorized("incorrect API key provided")
        return None


def _is_protected(path: str) -> bool:
    return path not in OPEN_PATHS


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _unauthorized(message: str) -> APIError:
    return APIError(status=401, message=message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class EndCancelledRequests:
    """Ends quietly a request that uvicorn cancels at shutdown.

    The server's own drain (server.py) ends every admitted request when the grace period is
    over; what uvicorn may still cancel after it is a request that was not admitted yet (its
    body still arriving, its prompt being tokenized) or a stream whose client stopped reading.
    Such a request gets the same answer as the drained ones (a 503, or a stream's final error
    event and [DONE]) when it can still be written, and one log line instead of a traceback.
    """

    def __init__(self, app: ASGIApp, *, is_shutting_down: Callable[[], bool], error: Callable[[], APIError]):
        self.app = app
        self._is_shutting_down = is_shutting_down
        self._error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        response = _ResponseState()

        async def watched_send(message: Message) -> None:
            response.see(message)
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            if not self._is_shutting_down():
                raise
            _stop_propagating_cancellation()
            logger.warning("shutdown: %s %s was still running; ended it", scope["method"], scope["path"])
            try:
                await asyncio.wait_for(self._last_words(response, scope, receive, send), FINAL_WRITE_SECONDS)
            except (TimeoutError, OSError):
                pass  # the client is not reading or already gone: nothing more to tell it

    async def _last_words(self, response: _ResponseState, scope: Scope, receive: Receive, send: Send) -> None:
        error = self._error()
        if not response.started:
            await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
        elif response.is_event_stream and not response.complete:
            payload = json.dumps(error.body(), separators=(",", ":"))
            await send(
                {
                    "type": "http.response.body",
                    "body": f"data: {payload}\n\ndata: [DONE]\n\n".encode(),
                    "more_body": False,
                }
            )


class _ResponseState:
    def __init__(self) -> None:
        self.started = False
        self.complete = False
        self.is_event_stream = False

    def see(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.is_event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


def _stop_propagating_cancellation() -> None:
    # The cancellation was for this request's task and ends here: take it off the task's count,
    # or the timeout around the last words would take it for its own and misbehave.
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
