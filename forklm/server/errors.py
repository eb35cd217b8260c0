"""HTTP errors in the OpenAI shape `{"error": {message, type, param, code}}` (Anthropic's
`{"type": "error", "error": {type, message}}` under /v1/messages), the exception handlers that
produce them, and SSE framing helpers shared by the streaming endpoints."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from forklm.runtime.errors import EngineShutdownError, InvalidArgumentError

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
# pydantic puts the tried union member into an error's loc ("text", "str"); it is no field name.
_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|literal|function-\w+|[\w-]+\[.*\])$")
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "request_too_large",
          499: "client_closed_request", 503: "service_unavailable_error"}
# Anthropic's Messages API (anthropic_api) answers every error under this path in its own shape.
ANTHROPIC_PATH = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                    503: "overloaded_error"}


class ApiError(Exception):
    """An error the server answers with `status` and the OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The body; text echoed from the request is made encodable (a lone surrogate in a field
    name would otherwise fail the error response itself)."""
    return {"error": {"message": _utf8(message), "type": _TYPES.get(status, "server_error"),
                      "param": None if param is None else _utf8(param), "code": status}}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": _utf8(message)}}


def error_body_at(path: str, status: int, message: str,
                  param: str | None = None) -> dict[str, Any]:
    """The error body in the shape the endpoint at `path` speaks."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_body(status, message)
    return error_body(status, message, param)


def _utf8(text: str) -> str:
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _error_response(request: Request, status: int, message: str, param: str | None = None,
                    headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body_at(request.url.path, status, message, param),
                        status_code=status, headers=headers)


def sse_event(payload: Any) -> bytes:
    """One Server-Sent Event carrying a JSON payload."""
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


async def sse_frames(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[bytes]:
    """A stream of JSON events as SSE frames, ended by `data: [DONE]`; an error after the first
    frame travels in-band (see sse_error), and the events are closed however the stream ends."""
    try:
        async for event in events:
            yield sse_event(event)
    except Exception as e:  # headers are sent: report in-band
        yield sse_error(e)
    finally:
        await events.aclose()
    yield SSE_DONE


def sse_error(exc: BaseException) -> bytes:
    """An error that happens after a stream started: the status line is already sent, so the
    error travels as an event (the client then sees `data: [DONE]`)."""
    if isinstance(exc, InvalidArgumentError):
        return sse_event(error_body(400, str(exc), exc.name))
    if isinstance(exc, ApiError):
        return sse_event(error_body(exc.status, exc.message, exc.param))
    return sse_event(error_body(500, f"internal error: {exc!r}"))


def install_error_handlers(app: FastAPI) -> None:
    """Every client mistake becomes a 4xx with a body naming the problem; only bugs give 500."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(InvalidArgumentError, _invalid_argument)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(EngineShutdownError, _engine_shutdown)
    app.add_exception_handler(Exception, _unexpected)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _error_response(request, exc.status, exc.message, exc.param, exc.headers)


async def _invalid_argument(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, InvalidArgumentError)
    return _error_response(request, 400, str(exc), exc.name)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return _error_response(request, 400, f"malformed JSON body: {first.get('msg', '')}")
    loc = [str(p) for p in first.get("loc", ()) if not _UNION_TAG.match(str(p))]
    param = ".".join(loc[1:] if loc and loc[0] in ("body", "query", "path") else loc) or None
    param = (first.get("ctx") or {}).get("param") or param  # a whole-body check names its field
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return _error_response(request, 400, message, param)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return _error_response(request, exc.status_code, str(exc.detail), None,
                           dict(exc.headers or {}))


async def _engine_shutdown(request: Request, exc: Exception) -> JSONResponse:
    return _error_response(request, 503, str(exc))


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return _error_response(request, 500, f"internal server error: {type(exc).__name__}")
