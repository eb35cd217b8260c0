"""call_app: one ReplicaRequest through the replica's own forklm ASGI app, in-process, so every
endpoint, check and error of `forklm serve` applies unchanged; the answer comes back as a
ResponseHead and then body chunks, as the app sends them (SSE events stay separate)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

from forklm.ray_serve.messages import ReplicaRequest, ResponseHead
from forklm.server.errors import error_body

logger = logging.getLogger(__name__)
_DONE: Message = {"type": "forklm.done"}  # the app returned


def _scope(request: ReplicaRequest) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request.method, "scheme": "http", "path": request.path,
            "raw_path": request.path.encode(), "query_string": request.query, "root_path": "",
            "headers": request.headers, "server": ("ray-serve", 80), "client": None}


async def call_app(app: ASGIApp, request: ReplicaRequest,
                   replica: str) -> AsyncIterator[ResponseHead | bytes]:
    """Yield the head, then each non-empty body chunk. When the caller stops early (its client
    went away), the app sees http.disconnect and is cancelled, so the engine aborts the request."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(_scope(request), receive, sent.put)
        except Exception:  # the app's own error middleware already answered 500 if it could
            logger.exception("%s %s failed in the replica", request.method, request.path)
        finally:
            sent.put_nowait(_DONE)

    task = asyncio.create_task(run())
    try:
        async for item in _answer(sent, replica):
            yield item
    finally:
        gone.set()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _answer(sent: asyncio.Queue[Message],
                  replica: str) -> AsyncIterator[ResponseHead | bytes]:
    started = False
    while True:
        message = await sent.get()
        if message is _DONE:
            if not started:  # the app ended without answering: a bug, said as a 500
                yield ResponseHead(500, [(b"content-type", b"application/json")], replica)
                yield json.dumps(error_body(500, "the replica sent no response")).encode()
            return
        if message["type"] == "http.response.start":
            started = True
            yield ResponseHead(message["status"], list(message.get("headers", [])), replica)
        elif message["type"] == "http.response.body":
            if message.get("body"):
                yield bytes(message["body"])
            if not message.get("more_body", False):
                return
