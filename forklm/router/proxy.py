"""Proxy: relays one request to a replica, byte for byte (SSE chunk by chunk, errors with their
status and body), counting it in flight. A replica that fails leaves routing; its request is
resent to another replica if the client has not had a byte yet, else its stream ends with an
error event naming the replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from forklm.router.replicas import Replica, ReplicaSet
from forklm.router.routing import NoReplicaError, Router
from forklm.server.config import ServerConfig
from forklm.server.errors import SSE_DONE, ApiError, error_body, sse_event

# Hop-by-hop headers and those httpx/Starlette recompute; everything else passes through.
_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                  "te", "trailer", "upgrade", "content-encoding"})
_INFO_TIMEOUT_S = 5.0
_DISCONNECT_POLL_S = 0.5
T = TypeVar("T")
logger = logging.getLogger(__name__)


class ReplicaFailed(ApiError):
    def __init__(self, replica: Replica, exc: BaseException):
        fate = "it is out of routing until restarted" if replica.death else "it stays in routing"
        super().__init__(502, f"{replica.name} failed during the request ({type(exc).__name__}: "
                         f"{exc}); {fate}")


def max_retries(config: ServerConfig) -> int:
    """--retry-max-retries, or 0 with --disable-retries."""
    return 0 if config.disable_retries else config.retry_max_retries


# (a 200 answer's body or a stream's first chunk, the replica that sent it)
OnAnswer = Callable[[bytes, Replica], None]
Pick = Callable[[list[Replica]], Replica]  # a replica for the request, none of those given


class Proxy:
    """Sends one request to a replica and relays the answer; owns the in-flight counts. A
    replica that fails before the client got a byte is retried on another (`send`)."""

    def __init__(self, router: Router, replica_set: ReplicaSet, client: httpx.AsyncClient,
                 max_retries: int = 0):
        self.router, self.replica_set, self.client = router, replica_set, client
        self.max_retries = max_retries

    async def send(self, request: Request, body: bytes, pick: Pick,
                   rids: list[str] | None = None, on_answer: OnAnswer | None = None) -> Response:
        """forward to pick([])'s replica; when that replica fails before the client got a byte
        (nothing was returned, so nothing can be repeated), to pick(the failed ones)'s, at most
        max_retries more times. The last failure is the answer when no replica is left."""
        failed: list[Replica] = []
        last: ReplicaFailed | None = None
        while True:
            try:
                replica = pick(failed)
            except NoReplicaError:
                if last is None:
                    raise
                raise last from None
            try:
                return await self.forward(request, replica, body, rids, on_answer)
            except ReplicaFailed as e:
                failed.append(replica)
                last = e
                if len(failed) > self.max_retries:
                    raise
                logger.warning("%s %s: %s; resending it (retry %d of %d)", request.method,
                               request.url.path, e.message, len(failed), self.max_retries)

    async def forward(self, request: Request, replica: Replica, body: bytes,
                      rids: list[str] | None = None,
                      on_answer: OnAnswer | None = None) -> Response:
        """Relay to `replica`; ReplicaFailed when it fails before the client got a byte. A
        stream's first chunk is read before its response starts, so that holds for streams
        too; a stream that fails later ends with an in-band error event. on_answer sees a 200
        answer first."""
        replica.in_flight += 1
        tracked = self.router.track_rids(rids or [], replica)
        resp: httpx.Response | None = None
        streaming = False  # the relay generator now owns resp and the in-flight count

        async def done() -> None:
            if resp is not None:
                await resp.aclose()
            replica.in_flight -= 1
            self.router.untrack_rids(tracked)

        try:
            resp = await _unless_disconnected(request, self.client.send(
                self._outgoing(request, replica, body), stream=True))
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                chunks = resp.aiter_bytes()
                first = await _unless_disconnected(request, anext(chunks, b""))
                if on_answer is not None and resp.status_code == 200:
                    on_answer(first, replica)
                streaming = True
                return StreamingResponse(self._relay(first, chunks, replica, done),
                                         status_code=resp.status_code,
                                         headers=_passed_headers(resp))
            content = await _unless_disconnected(request, resp.aread())
        except httpx.HTTPError as e:
            raise await self.failed(replica, e) from e
        finally:
            if not streaming:
                await done()
        if on_answer is not None and resp.status_code == 200:
            on_answer(content, replica)
        return Response(content, status_code=resp.status_code, headers=_passed_headers(resp))

    def _outgoing(self, request: Request, replica: Replica, body: bytes) -> httpx.Request:
        url = replica.url + request.url.path
        if request.url.query:
            url += "?" + request.url.query
        headers = [(k, v) for k, v in request.headers.raw if k.decode().lower() not in _HOP]
        return self.client.build_request(request.method, url, headers=headers, content=body)

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], replica: Replica,
                     done: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        async def failure(e: Exception) -> ApiError:
            return await self.failed(replica, e)

        try:
            async for chunk in relay_sse(first, chunks, httpx.HTTPError, failure):
                yield chunk
        finally:
            await done()

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


async def relay_sse(first: bytes, rest: AsyncIterator[bytes],
                    failures: type[Exception] | tuple[type[Exception], ...],
                    failure: Callable[[Exception], Awaitable[ApiError]]) -> AsyncIterator[bytes]:
    """An SSE stream relayed chunk by chunk: first (already read), then rest. Its headers are
    sent, so an upstream failure (one of `failures`) travels in-band: a half-sent event is
    ended, then failure(e)'s error event and the stream's end."""
    last = first or b"\n\n"
    try:
        if first:
            yield first
        async for chunk in rest:
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
