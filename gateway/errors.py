"""Errors as the REST API returns them: OpenAI's error object, gRPC statuses mapped to HTTP.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": ...}}

Every refusal names the field it is about (`param`); a status the gateway does not expect
from the scheduler becomes 500 and is logged with the request id.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc

# What the scheduler's status tells the caller to do, as HTTP says it.
GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
}


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status == 401:
        return "authentication_error"
    return "server_error" if status >= 500 else "invalid_request_error"


class ApiError(Exception):
    """A refusal with its HTTP status; `param` names the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type(status),
            "param": param,
            "code": code if code is not None else status,
        }
    }


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    """A 400 about `param`; the message says what is wrong and starts with the field."""
    return ApiError(400, f"{param}: {message}" if param else message, param, code)


def status_for(code: grpc.StatusCode) -> int:
    return GRPC_TO_HTTP.get(code, 500)


def body_parse_error(cause: BaseException | None) -> ApiError | None:
    """Why a JSON body could not be parsed at all, as a 400 naming `body` (FastAPI's own
    answer, "There was an error parsing the body", says neither what nor where): bytes that
    are not UTF-8, or JSON nested deeper than the parser recurses. None for other causes."""
    if isinstance(cause, UnicodeDecodeError):
        byte = cause.object[cause.start] if cause.start < len(cause.object) else None
        what = f"byte 0x{byte:02x}" if byte is not None else "the end"
        return invalid(
            "body",
            f"not valid {cause.encoding.upper()}: {what} at offset {cause.start} "
            f"({cause.reason}); send JSON encoded as UTF-8",
            "invalid_encoding",
        )
    if isinstance(cause, RecursionError):
        return invalid(
            "body",
            f"the JSON is nested too deeply to parse (arrays and objects "
            f"nest at most about {sys.getrecursionlimit()} levels)",
            "json_too_deep",
        )
    return None


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_from_loc(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content'; pydantic's names of union
    members ('str', 'list[int]', 'TextContentPart') are left out."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_NAMES and not part[:1].isupper():
            out += f".{part}" if out else part
        else:
            break  # a union member's name: what follows is that member's detail
    return out or None


def _message(error: Mapping[str, Any]) -> str:
    msg = str(error.get("msg", "invalid value"))
    return msg.removeprefix("Value error, ")


def from_validation_errors(errors: Iterable[Mapping[str, Any]], content_type: str = "") -> ApiError:
    """pydantic's errors (FastAPI's RequestValidationError) as one 400 naming the first field."""
    errors = list(errors)
    if not errors:
        return invalid(None, "invalid request body")
    first = errors[0]
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return invalid(None, f"the body is not valid JSON{': ' + str(detail) if detail else ''}", "invalid_json")
    loc = list(first.get("loc", ()))
    if loc in (["body"], []):
        if "json" not in content_type.lower():
            return invalid(
                None, "send the body as JSON with the header 'Content-Type: application/json'", "invalid_content_type"
            )
        if kind == "missing":
            return invalid(None, "the request has no body; send a JSON object")
        return invalid(None, f"the body must be a JSON object: {_message(first)}")
    param = _param_from_loc(loc)
    if kind == "missing":
        return invalid(param, "this field is required", "missing_field")
    if kind == "extra_forbidden":
        return invalid(
            param,
            "unknown field: this server does not support it (see /docs for the fields it takes)",
            "unsupported_field",
        )
    return invalid(param, _message(first))
