"""The OpenAI embeddings API as the service speaks it: request parsing, error bodies, the model card.

Everything here is pure: it turns request bytes and headers into what the
service needs, or into the ApiError (status and OpenAI-shaped body) that
refuses the request. examples/minilm/README.md lists every field and status.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["ApiError", "MODEL_ALIASES", "MODEL_NAME", "PRIORITY_HEADER", "PRIORITY_RANGE", "TIMEOUT_HEADER",
           "encode_row", "http_error", "model_card", "model_not_found", "parse_priority", "parse_request",
           "parse_timeout", "read_body"]

MODEL_NAME = "all-MiniLM-L6-v2"
MODEL_ALIASES = (MODEL_NAME, "sentence-transformers/all-MiniLM-L6-v2")  # the names a request may use
TIMEOUT_HEADER = "x-request-timeout"
PRIORITY_HEADER = "x-priority"
PRIORITY_RANGE = (-100, 100)
_FIELDS = ("input", "model", "encoding_format", "dimensions", "user")


class ApiError(Exception):
    """A request the service refuses: an HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def parse_priority(value: str | None) -> int:
    if value is None:
        return 0
    lo, hi = PRIORITY_RANGE
    try:
        p = int(value.strip())
    except ValueError:
        p = None
    if p is None or not lo <= p <= hi:
        raise ApiError(400, f"the X-Priority header must be an integer in [{lo}, {hi}], got {value[:40]!r}",
                       code="invalid_header")
    return p


def parse_timeout(value: str | None, default: float | None) -> float | None:
    if value is None:
        return default
    try:
        t = float(value.strip())
    except ValueError:
        t = math.nan
    if not 0 < t < math.inf:
        raise ApiError(400, f"the X-Request-Timeout header must be a positive number of seconds, got {value[:40]!r}",
                       code="invalid_header")
    return t if default is None else min(t, default)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused once it passes `limit` bytes (before reading it all, when declared)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body of {declared} bytes exceeds the limit of {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(body: bytes, limit: int) -> tuple[list[str], str]:
    """(texts, encoding_format) of an embeddings request body, or the ApiError that refuses it."""
    try:
        payload: Any = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ApiError(400, f"We could not parse the JSON body of your request: {e}", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {_json_type(payload)}",
                       code="invalid_json")
    for name in payload:
        if name not in _FIELDS:
            raise ApiError(400, f"Unrecognized request argument supplied: {name[:60]}", param=name[:60],
                           code="unknown_parameter")

    name = _field(payload, "model", str, required=True)
    if name not in MODEL_ALIASES:
        raise model_not_found(name)

    texts = _texts(payload, limit)

    encoding = _field(payload, "encoding_format", str) or "float"
    if encoding not in ("float", "base64"):
        raise ApiError(400, f"encoding_format must be 'float' or 'base64', got {encoding[:40]!r}",
                       param="encoding_format", code="invalid_value")

    dims = _field(payload, "dimensions", int)
    if dims is not None and dims != 384:
        raise ApiError(400, f"dimensions={dims} is not supported: {MODEL_NAME} makes 384-dimensional vectors, and "
                            "it was not trained for shortened ones (omit dimensions, or pass 384)",
                       param="dimensions", code="unsupported_value")

    _field(payload, "user", str)  # accepted and ignored
    return texts, encoding


def _field(payload: dict[str, Any], name: str, kind: type, *, required: bool = False) -> Any:
    value = payload.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"you must provide a {name} parameter", param=name, code="missing_parameter")
        return None
    if not isinstance(value, kind) or isinstance(value, bool):
        want = {str: "a string", int: "an integer"}[kind]
        raise ApiError(422, f"{name} must be {want}, got {_json_type(value)}", param=name, code="invalid_type")
    return value


def _texts(payload: dict[str, Any], limit: int) -> list[str]:
    value = payload.get("input")
    if value is None:
        raise ApiError(400, "you must provide an input parameter", param="input", code="missing_parameter")
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ApiError(422, f"input must be a string or an array of strings, got {_json_type(value)}",
                       param="input", code="invalid_type")
    if not value:
        raise ApiError(400, "input must not be an empty array", param="input", code="invalid_value")
    if all(_is_int(v) for v in value) or all(isinstance(v, list) and all(_is_int(t) for t in v) for v in value):
        raise ApiError(400, f"token-id input is not supported: {MODEL_NAME} has its own tokenizer; send the texts "
                            "as strings", param="input", code="unsupported_input")
    if len(value) > limit:
        raise ApiError(413, f"{len(value)} inputs in one request; at most {limit} are accepted (split them over "
                            "several requests: concurrent requests share engine runs)", param="input",
                       code="too_many_inputs")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise ApiError(422, f"input[{i}] must be a string, got {_json_type(v)}", param="input",
                           code="invalid_type")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages a client understands."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    names: dict[type, str] = {dict: "an object", list: "an array", str: "a string"}
    return names.get(type(value), type(value).__name__)


def encode_row(row: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(np.ascontiguousarray(row, dtype="<f4").tobytes()).decode("ascii")
    floats: list[float] = row.tolist()
    return floats


def model_card() -> dict[str, Any]:
    return {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "tandem"}


def model_not_found(name: str) -> ApiError:
    return ApiError(404, f"The model `{name[:100]}` does not exist; this service serves {MODEL_NAME}.",
                    param="model", code="model_not_found")


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a wrong method) in OpenAI's error shape."""
    what = {404: "Invalid URL", 405: "Method not allowed"}.get(exc.status_code, exc.detail)
    return ApiError(exc.status_code, f"{what} ({request.method} {request.url.path})",
                    headers=dict(exc.headers or {})).response()
