"""create_app(engine, config): the FastAPI app around one Engine (it holds no engine logic)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forklm.runtime.engine.engine import Engine
from forklm.server import (
    anthropic_api,
    embeddings_api,
    lora_api,
    native_api,
    openai_api,
    responses_api,
    score_api,
    tokenize_api,
)
from forklm.server.config import ServerConfig
from forklm.server.errors import error_body_at, install_error_handlers
from forklm.server.generation import GenerationService
from forklm.server.tenants import Caller, Tenants

logger = logging.getLogger(__name__)

# Reachable without the API key: a load balancer's liveness probe carries no credentials.
_OPEN_PATHS = frozenset({"/health"})


def create_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """The app; `app.state.engine`, `app.state.config` and `app.state.service` are set for the
    routers. The caller owns the engine (and shuts it down after the server stops)."""
    config = config or ServerConfig()
    app = FastAPI(title="forklm", version="0.1.0")
    app.state.engine = engine
    app.state.config = config
    tenants = Tenants.of(config)
    app.state.service = GenerationService(engine, config, keys=tenants)
    install_error_handlers(app)
    app.include_router(native_api.router)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(lora_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(score_api.router)
    _include_programs(app)
    app.add_middleware(GuardMiddleware, config=config, metrics=app.state.service.metrics,
                       tenants=tenants)
    return app


def _include_programs(app: FastAPI) -> None:
    try:
        from forklm.server import programs
    except ImportError as e:  # only a missing programs module is tolerated, not its bugs
        if e.name != "forklm.server.programs":
            raise
        logger.warning("forklm.server.programs is missing: /v1/programs/run is disabled")
        return
    app.include_router(programs.router)


def _bearer_token(header: bytes) -> bytes:
    """The token of an `Authorization: Bearer <token>` header (b"" for any other scheme); the
    scheme name is case-insensitive (RFC 9110), so `bearer <token>` is the same header."""
    scheme, _, token = header.partition(b" ")
    return token.strip(b" ") if scheme.lower() == b"bearer" else b""


class _BodyTooLarge(HTTPException):
    """Raised from receive(); an HTTPException so FastAPI's body parsing lets it through."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body over the limit of {limit} bytes "
                         "(max_request_body_bytes)")


class GuardMiddleware:
    """Pure ASGI (so streaming responses pass through untouched): the API key check, the body
    size limit (Content-Length, and counted while reading for chunked bodies), error counting."""

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: Any,
                 tenants: Tenants | None = None):
        self.app, self.config, self.metrics = app, config, metrics
        self.tenants = tenants or Tenants.of(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        caller: Caller | None = Caller()
        if self.tenants.needs_key and scope["path"] not in _OPEN_PATHS:
            # Anthropic's clients send the key as `x-api-key`, OpenAI's as a bearer token.
            key = (_bearer_token(headers.get(b"authorization", b""))
                   or headers.get(b"x-api-key", b"").strip(b" "))
            caller = self.tenants.authenticate(key)
            if caller is None:
                await self._reject(scope, send, 401, "missing or wrong API key: send "
                                   "'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                                   {"WWW-Authenticate": "Bearer"})
                return
        scope.setdefault("state", {})["caller"] = caller
        limit = self.config.max_request_body_bytes
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            await self._reject(scope, send, 400, "invalid Content-Length header")
            return
        if int(length) > limit:
            await self._reject(scope, send, 413, f"request body over the limit of {limit} bytes "
                               "(max_request_body_bytes)")
            return
        await self._call_counted(scope, receive, send, limit)

    async def _call_counted(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        seen, started = 0, False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 400:
                    self.metrics.http_errors.labels(status=str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(scope, send, 413, f"request body over the limit of {limit} "
                                   "bytes (max_request_body_bytes)")

    async def _reject(self, scope: Scope, send: Send, status: int, message: str,
                      headers: dict[str, str] | None = None) -> None:
        self.metrics.http_errors.labels(status=str(status)).inc()
        body = json.dumps(error_body_at(scope["path"], status, message)).encode()
        raw = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})
