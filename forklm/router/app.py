"""create_router_app: the public server in front of the replicas. It parses a request's JSON
only to route it, then relays it byte for byte: SSE chunk by chunk, errors with their status and
body. A replica that fails mid-request is removed, and its requests get a 502 naming it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from forklm.router.metrics import RouterMetrics
from forklm.router.replicas import Replica, ReplicaSet
from forklm.router.routing import NoReplicaError, Router, request_rids
from forklm.server.app import GuardMiddleware
from forklm.server.config import ServerConfig
from forklm.server.errors import SSE_DONE, ApiError, error_body, install_error_handlers, sse_event

# Hop-by-hop headers and those httpx/Starlette recompute; everything else passes through.
_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                  "te", "trailer", "upgrade", "content-encoding"})
# Bodies above this are parsed off the event loop (routing reads only a few fields).
_PARSE_INLINE_BYTES = 64 * 1024
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
        last = b"\n\n"
        try:
            async for chunk in resp.aiter_bytes():
                if on_answer is not None:
                    on_answer(chunk)
                    on_answer = None
                last = chunk or last
                yield chunk
        except httpx.HTTPError as e:  # headers are sent: the error travels in-band
            failure = await self.failed(replica, e)
            cut = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a half-sent event first
            yield cut + sse_event(error_body(failure.status, failure.message)) + SSE_DONE
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


def create_router_app(replica_set: ReplicaSet, router: Router, client: httpx.AsyncClient,
                      config: ServerConfig) -> FastAPI:
    app = FastAPI(title="forklm router", version="0.1.0")
    proxy = Proxy(router, replica_set, client)
    metrics = RouterMetrics()
    app.state.proxy, app.state.router = proxy, router
    install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"], response_model=None)
    async def health(request: Request) -> Response:
        alive = len(router.alive())
        status = 200 if alive else 503
        if request.method == "HEAD":
            return Response(status_code=status)
        return JSONResponse({"status": "ok" if alive else "unavailable",
                             "replicas_alive": alive, "dp_size": len(router.replicas)},
                            status_code=status)

    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        infos = await _gather(proxy, "/get_server_info")
        first = next((i for i in infos if i is not None), {})
        replicas = []
        for replica, info in zip(router.replicas, infos):
            state = ((info or {}).get("internal_states") or [None])[0]
            replicas.append({**replica.counters(), "internal_state": state})
        return {**first, "dp_size": config.dp_size,
                "load_balance_method": config.load_balance_method, "replicas": replicas,
                "internal_states": [r["internal_state"] for r in replicas if r["internal_state"]]}

    @app.get("/metrics")
    async def get_metrics() -> Response:
        infos = await _gather(proxy, "/get_server_info")
        stats = [((i or {}).get("internal_states") or [None])[0] for i in infos]
        return Response(metrics.render(router.replicas, stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        body = await request.body()
        if not router.alive():
            raise NoReplicaError("no replica is alive")
        answers = await asyncio.gather(*(proxy.forward(request, r, body) for r in router.alive()))
        for replica in router.alive():
            router.policy.forget(replica.index)  # its cache is empty: so is its tree
        failed = [a for a in answers if a.status_code != 200]
        if failed:
            return failed[0]
        return JSONResponse({"success": True, "message": "Cache flushed."})

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await request.body()
        parsed = await _parse(body)
        rid = parsed.get("rid") if isinstance(parsed, dict) else None
        target = router.rids.get(rid) if isinstance(rid, str) else None
        targets = [target] if target is not None else router.alive()
        if not targets:
            raise NoReplicaError("no replica is alive")
        answers = await asyncio.gather(*(proxy.forward(request, r, body) for r in targets))
        return next((a for a in answers if a.status_code != 200), answers[0])

    @app.post("/open_session")
    async def open_session(request: Request) -> Response:
        body = await request.body()
        replica = router.pick("/open_session", None)
        answer = await proxy.forward(request, replica, body)
        if answer.status_code == 200:
            router.remember_session(json.loads(bytes(answer.body)), replica)
        return answer

    @app.post("/close_session")
    async def close_session(request: Request) -> Response:
        body = await request.body()
        parsed = await _parse(body)
        sid = parsed.get("session_id") if isinstance(parsed, dict) else None
        replica = router.sessions.get(sid) if isinstance(sid, str) else None
        if replica is None:
            if not isinstance(sid, str):
                return await proxy.forward(request, router.pick_idle(), body)  # its 400
            raise ApiError(404, f"no open session {sid!r}")
        answer = await proxy.forward(request, replica, body)
        if answer.status_code == 200:
            router.sessions.pop(str(sid), None)
        return answer

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
                   response_model=None)
    async def relay(request: Request) -> Response:
        if request.method in ("GET", "OPTIONS"):
            return await proxy.forward(request, router.pick_idle(), b"")
        body = await request.body()
        parsed = await _parse(body)
        for _ in range(len(router.replicas)):
            replica = router.pick(request.url.path, parsed)
            remember = None
            if request.url.path == "/v1/responses":
                remember = functools.partial(router.remember_response, replica=replica)
            try:
                return await proxy.forward(request, replica, body, request_rids(parsed), remember)
            except ReplicaFailed as e:
                if replica.alive or not isinstance(e.__cause__, httpx.ConnectError):
                    raise  # it may have run: only a refused connection is safe to resend
        raise NoReplicaError("no replica is alive")

    app.add_exception_handler(NoReplicaError, _no_replica)
    app.add_middleware(GuardMiddleware, config=config, metrics=metrics)
    return app


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


async def _parse(body: bytes) -> Any:
    """The body as JSON for routing, None when it is not JSON (the replica will say why)."""
    try:
        if len(body) > _PARSE_INLINE_BYTES:
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body) if body else None
    except ValueError:
        return None


async def _gather(proxy: Proxy, path: str) -> list[dict[str, Any] | None]:
    async def one(replica: Replica) -> dict[str, Any] | None:
        return await proxy.info(replica, path) if replica.alive else None

    return list(await asyncio.gather(*(one(r) for r in proxy.router.replicas)))


def _passed_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}


async def _no_replica(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(503, f"{exc}: every replica has died"), status_code=503)
