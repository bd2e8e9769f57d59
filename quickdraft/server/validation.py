"""FastAPI/pydantic validation errors -> one OpenAI-style 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from quickdraft.server.errors import APIError, bad_request

# Parts of a pydantic error location that name a union member's type, not a field.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def validation_error_to_api_error(errors: Sequence[dict[str, Any]]) -> APIError:
    if not errors:
        return bad_request("invalid request body", param=None)
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return bad_request(f"malformed JSON body: {detail}", param=None, code="invalid_json")
    param = field_path(first.get("loc", ()))
    if first.get("type") == "string_unicode":  # a name pydantic cannot read (values are checked later)
        return bad_request(
            f"{param or 'a field name of the body'}: not valid Unicode (an unpaired UTF-16 surrogate)",
            param=param,
            code="invalid_unicode",
        )
    if param is None:
        return _body_error(first)
    if first.get("type") == "extra_forbidden":
        return bad_request(
            f"{param}: unrecognized request argument (not a parameter this server supports)",
            param=param,
            code="unsupported_parameter",
        )
    # A union field fails once per member: say all of what it could have been.
    messages = list(dict.fromkeys(e.get("msg", "") for e in errors if field_path(e.get("loc", ())) == param))
    return bad_request(
        f"{param}: {' or '.join(messages)} (got {_describe(first.get('input'))})", param=param, code="invalid_type"
    )


def _body_error(error: dict[str, Any]) -> APIError:
    """The body as a whole is wrong: not JSON, not sent as JSON, or not an object."""
    body = error.get("input")
    if isinstance(body, (bytes, str)):  # a non-JSON content type: FastAPI did not parse it
        return non_json_body_error(body)
    return bad_request(
        f"the request body must be a JSON object with the request's fields (got {_describe(body)})",
        param=None,
        code="invalid_body",
    )


def non_json_body_error(body: bytes | str) -> APIError:
    """A body sent with a content type other than JSON: say whether it is JSON at all."""
    try:
        json.loads(body)
    except (ValueError, RecursionError) as err:
        return bad_request(f"malformed JSON body: {err}", param=None, code="invalid_json")
    return bad_request(
        "the request body must be JSON sent with Content-Type: application/json", param=None, code="invalid_body"
    )


def _describe(value: Any) -> str:
    """The JSON type of a value, for messages (never the value itself: it may be huge)."""
    if value is None:
        return "null"
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    return names.get(type(value), type(value).__name__)


def field_path(location: Sequence[Any]) -> str | None:
    """("body", "messages", 0, "str", "content") -> "messages.0.content"; None for the body itself."""
    parts = [part for part in location[1:] if not _is_type_tag(part)]
    if not parts:
        return None
    return ".".join(str(part) for part in parts)


def _is_type_tag(part: Any) -> bool:
    if isinstance(part, int):
        return False
    text = str(part)
    return "[" in text or text.lower() in _TYPE_TAGS or text[:1].isupper()
