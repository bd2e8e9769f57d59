"""Request preprocessing off the event loop: JSON parsing, validation, prompt tokenization.

A prompt of a few MB takes seconds to tokenize; done on the event loop, it would stall every
other connection (streams, /health) for that long. Handlers therefore run this work in a small
thread pool (`Preprocessor`). A thread only helps while the work lets go of Python's GIL:
pure-Python code does every few milliseconds, and Tokenizer.encode runs tokenizers'
`encode_batch`, which releases it (tokenizers' `encode` holds it for the whole call). JSON
parsing and pydantic validation are C/Rust code that keep the GIL; their cost grows with the
number of JSON values and is bounded by --max-request-bytes.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from email.message import Message
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from quickdraft.server.errors import bad_request
from quickdraft.server.validation import non_json_body_error, validation_error_to_api_error

# Threads that parse and tokenize requests. Bounded: a burst of huge prompts queues here
# instead of holding one thread (and one copy of its prompt) each.
PREPROCESS_THREADS = 4

Model = TypeVar("Model", bound=BaseModel)
Result = TypeVar("Result")


class Preprocessor:
    """A bounded thread pool for the CPU-heavy part of handling a request."""

    def __init__(self, *, threads: int = PREPROCESS_THREADS):
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="quickdraft-preprocess")

    async def run(self, function: Callable[..., Result], /, *args: Any, **kwargs: Any) -> Result:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(function, *args, **kwargs))

    def close(self) -> None:
        # Work still queued belongs to requests that are being ended: drop it, do not wait.
        self._pool.shutdown(wait=False, cancel_futures=True)


# ---- body -> validated request ----------------------------------------------------------
def parse_request(raw: bytes, *, content_type: str | None, model: type[Model]) -> Model:
    """The validated request in `raw`; an APIError (400) naming what is wrong otherwise."""
    data = parse_json(raw, content_type=content_type)
    try:
        request = model.model_validate(data)
    except ValidationError as err:
        # Locations as FastAPI reports them ("body" first), so one converter serves both.
        errors = [{**error, "loc": ("body", *error["loc"])} for error in err.errors()]
        raise validation_error_to_api_error(errors) from None
    check_text(request)
    return request


def parse_json(raw: bytes, *, content_type: str | None) -> Any:
    """The JSON value in `raw`; an APIError (400) naming what is wrong otherwise."""
    if content_type and not is_json_content_type(content_type):
        raise non_json_body_error(raw)
    return _load_json(raw)


def is_json_content_type(content_type: str) -> bool:
    """application/json or application/*+json (the rule FastAPI applies), parameters allowed."""
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _load_json(raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request(
            "the request body is empty: send a JSON object with the request's fields", param=None, code="invalid_body"
        )
    try:
        return json.loads(raw)
    except UnicodeDecodeError as err:
        raise bad_request(
            f"malformed JSON body: not valid UTF-8 ({err.reason} at byte {err.start})", param=None, code="invalid_json"
        ) from None
    except json.JSONDecodeError as err:
        raise bad_request(f"malformed JSON body: {err}", param=None, code="invalid_json") from None
    except RecursionError:
        raise bad_request("malformed JSON body: nested too deeply", param=None, code="invalid_json") from None


# ---- unpaired surrogates ------------------------------------------------------------------
def check_text(request: BaseModel) -> None:
    """Refuse (400) any string of the request holding an unpaired UTF-16 surrogate.

    JSON may escape one ("\\ud800") but it is not Unicode text: the tokenizer cannot take it
    (TypeError: a 500) and no UTF-8 response can quote it. Every string field is checked, not
    only the prompt: stop strings, names and metadata end up in the tokenizer, logs or errors.
    """
    for name in type(request).model_fields:
        found = _find_surrogate(getattr(request, name), path=name)
        if found is not None:
            path, where = found
            raise bad_request(
                f"{path} contains an unpaired UTF-16 surrogate {where}: text must be valid Unicode",
                param=path,
                code="invalid_unicode",
            )


def _find_surrogate(value: Any, *, path: str) -> tuple[str, str] | None:
    """(field path, where in it) of the first unpaired surrogate in value, or None."""
    if isinstance(value, str):
        index = surrogate_index(value)
        return None if index is None else (path, f"({_escaped(value[index])}) at index {index}")
    if isinstance(value, BaseModel):
        items = ((name, getattr(value, name)) for name in type(value).model_fields)
    elif isinstance(value, dict):
        for key in value:
            if isinstance(key, str) and (index := surrogate_index(key)) is not None:
                return path, f"({_escaped(key[index])}) in a key, at index {index}"
        items = value.items()
    elif isinstance(value, list) and value and not isinstance(value[0], int):
        # Validated lists hold one type: a list of token ids (maybe millions) has no text.
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _find_surrogate(item, path=f"{path}.{key}")
        if found is not None:
            return found
    return None


def surrogate_index(text: str) -> int | None:
    """Index of the first unpaired surrogate in text, or None (the common case costs one scan)."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def _escaped(char: str) -> str:
    return f"\\u{ord(char):04x}"
