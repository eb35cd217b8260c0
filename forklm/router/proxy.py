"""Proxy: relays one request to one replica, byte for byte (SSE chunk by chunk, errors with their
status and body), counting it in flight; a replica that fails mid-request leaves routing and the
request gets a 502 naming it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forklm.router.replicas import Replica, ReplicaSet
from forklm.router.routing import Router
from forklm.server.errors import SSE_DONE, ApiError, error_body, sse_event

# Hop-by-hop headers and those httpx/Starlette recompute; everything else passes through.
_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                  "te", "trailer", "upgrade", "content-encoding"})
_INFO_TIMEOUT_S = 5.0
_DISCONNECT_POLL_S = 0.5
T = TypeVar("T")


class ReplicaFailed(ApiError):
    def __init__(self, replica: Replica, exc: BaseException):
        super().__init__(502, f"{replica.name} failed during the request ({type(exc).__name__}: "
                         f"{exc}); it is removed from routing, retry the request")


class Proxy:
    """Sends one request to one replica and relays the answer; owns the in-flight counts."""

    def __init__(self, router: Router, replica_set: ReplicaSet, client: httpx.AsyncClient):
        self.router, self.replica_set, self.client = router, replica_set, client

    async def forward(self, request: Request, replica: Replica, body: bytes,
                      rids: list[str] | None = None,
                      on_answer: Callable[[bytes], None] | None = None) -> Response:
        """Relay; on_answer sees a 200 answer's body (a stream's first chunk)."""
        replica.in_flight += 1
        tracked = self.router.track_rids(rids or [], replica)

        def done() -> None:
            replica.in_flight -= 1
            self.router.untrack_rids(tracked)

        url = replica.url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = [(k, v) for k, v in request.headers.raw if k.decode().lower() not in _HOP]
        outgoing = self.client.build_request(request.method, url, headers=headers, content=body)
        try:
            resp = await _unless_disconnected(request, self.client.send(outgoing, stream=True))
        except httpx.HTTPError as e:
            done()
            raise await self.failed(replica, e) from e
        except ApiError:
            done()
            raise
        on_answer = on_answer if resp.status_code == 200 else None
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._relay(resp, replica, done, on_answer),
                                     status_code=resp.status_code, headers=_passed_headers(resp))
        try:
            content = await _unless_disconnected(request, resp.aread())
        except httpx.HTTPError as e:
            raise await self.failed(replica, e) from e
        finally:
            await resp.aclose()
            done()
        if on_answer is not None:
            on_answer(content)
        return Response(content, status_code=resp.status_code, headers=_passed_headers(resp))

    async def _relay(self, resp: httpx.Response, replica: Replica, done: Callable[[], None],
                     on_answer: Callable[[bytes], None] | None) -> AsyncIterator[bytes]:
        async def failure(e: Exception) -> ApiError:
            return await self.failed(replica, e)

        try:
            async for chunk in relay_sse(resp.aiter_bytes(), on_answer, httpx.HTTPError, failure):
                yield chunk
        finally:
            await resp.aclose()
            done()

    async def failed(self, replica: Replica, exc: BaseException) -> ReplicaFailed:
        """A transport error talking to `replica`: when its process is gone (or it refused the
        connection), it leaves routing now rather than at the next health check."""
        for _ in range(20):  # a killed process takes a moment to be reapable
            if replica.proc.poll() is not None:
                break
            await asyncio.sleep(0.025)
        replica.failed += 1
        if replica.proc.poll() is not None or isinstance(exc, httpx.ConnectError):
            self.remove(replica, f"{type(exc).__name__} during a request "
                        f"(exit code {replica.proc.poll()})")
        return ReplicaFailed(replica, exc)

    def remove(self, replica: Replica, reason: str) -> None:
        if self.replica_set.mark_dead(replica, reason):
            self.router.remove(replica)

    async def info(self, replica: Replica, path: str) -> dict[str, Any] | None:
        """A replica's JSON at GET path, or None when it does not answer."""
        try:
            r = await self.client.get(replica.url + path, headers=self.replica_set.headers,
                                      timeout=_INFO_TIMEOUT_S)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None


async def relay_sse(chunks: AsyncIterator[bytes], on_first: Callable[[bytes], None] | None,
                    failures: type[Exception] | tuple[type[Exception], ...],
                    failure: Callable[[Exception], Awaitable[ApiError]]) -> AsyncIterator[bytes]:
    """An SSE stream relayed chunk by chunk (on_first sees the first). Its headers are sent, so
    an upstream failure (one of `failures`) travels in-band: a half-sent event is ended, then
    failure(e)'s error event and the stream's end."""
    last = b"\n\n"
    try:
        async for chunk in chunks:
            if on_first is not None:
                on_first(chunk)
                on_first = None
            last = chunk or last
            yield chunk
    except failures as e:
        error = await failure(e)
        cut = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
        yield cut + sse_event(error_body(error.status, error.message)) + SSE_DONE


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await work, but cancel it (closing the replica connection, which aborts the replica's
    requests) when the client goes away: the replica's own server does the same for its
    clients, and the router must not hide a disconnect from it."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            raise ApiError(499, "client disconnected")  # nginx's status; no one reads it
    return task.result()


def _passed_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
