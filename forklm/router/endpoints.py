"""The router's routes: its own /health, /get_server_info and /metrics; the endpoints whose
target is not one policy pick (/flush_cache and unknown aborts go to all, session ends to their
replica); and a catch-all that routes every other request and relays it."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from forklm.router.metrics import RouterMetrics
from forklm.router.proxy import Proxy
from forklm.router.replicas import Replica
from forklm.router.routing import NoReplicaError, Router, request_rids
from forklm.server.config import ServerConfig
from forklm.server.errors import ApiError, error_body
from forklm.server.tenants import caller_of

router = APIRouter()
# Bodies above this are parsed off the event loop (routing reads only a few fields).
_PARSE_INLINE_BYTES = 64 * 1024


def parts_of(request: Request) -> tuple[Router, Proxy]:
    return request.app.state.router, request.app.state.proxy


@router.api_route("/health", methods=["GET", "HEAD"], response_model=None)
async def health(request: Request) -> Response:
    """200 while one replica is alive (HEAD: the status alone); the body counts the replicas
    alive and starting (restarting: not routed to yet) and the restarts since start."""
    routing, _ = parts_of(request)
    alive = len(routing.alive())
    status = 200 if alive else 503
    if request.method == "HEAD":
        return Response(status_code=status)
    return JSONResponse({"status": "ok" if alive else "unavailable", "replicas_alive": alive,
                         "replicas_starting": sum(r.starting for r in routing.replicas),
                         "dp_size": len(routing.replicas),
                         "restarts": sum(r.restarts for r in routing.replicas)},
                        status_code=status)


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """A replica's server info, plus every replica's router counters and engine stats."""
    routing, proxy = parts_of(request)
    config: ServerConfig = request.app.state.config
    infos = await _gather(proxy, "/get_server_info")
    first = next((i for i in infos if i is not None), {})
    replicas = [{**replica.counters(), "internal_state": _stats(info)}
                for replica, info in zip(routing.replicas, infos)]
    return {**first, "dp_size": config.dp_size,
            "load_balance_method": config.load_balance_method, "replicas": replicas,
            "internal_states": [r["internal_state"] for r in replicas if r["internal_state"]]}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    routing, proxy = parts_of(request)
    stats = [_stats(info) for info in await _gather(proxy, "/get_server_info")]
    registry: RouterMetrics = request.app.state.metrics
    return Response(registry.render(routing.replicas, stats),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Every replica flushes; the first refusal (requests in flight) is the answer."""
    routing, proxy = parts_of(request)
    alive = routing.alive()
    answers = await _forward_to_all(request, proxy, alive, await request.body())
    for replica, answer in zip(alive, answers):
        if answer.status_code == 200:
            routing.policy.forget(replica.index)  # its cache is empty: so is its tree
    failed = [a for a in answers if a.status_code != 200]
    return failed[0] if failed else JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """To the replica running the rid; an rid the router does not know goes to all."""
    routing, proxy = parts_of(request)
    body, rid = await _body_and_field(request, "rid")
    target = routing.rids.get(rid) if rid is not None else None
    targets = [target] if target is not None else routing.alive()
    answers = await _forward_to_all(request, proxy, targets, body)
    return next((a for a in answers if a.status_code != 200), answers[0])


async def _body_and_field(request: Request, field: str) -> tuple[bytes, str | None]:
    """The raw body (relayed as it is) and its JSON string `field`, when it has one."""
    body = await request.body()
    parsed = await parse_body(body)
    value = parsed.get(field) if isinstance(parsed, dict) else None
    return body, value if isinstance(value, str) else None


async def _forward_to_all(request: Request, proxy: Proxy, targets: list[Replica],
                          body: bytes) -> list[Response]:
    """`request` relayed to every target at once; refused when there is none."""
    if not targets:
        raise NoReplicaError("no replica is alive")
    return list(await asyncio.gather(*(proxy.forward(request, r, body) for r in targets)))


@router.post("/open_session")
async def open_session(request: Request) -> Response:
    routing, proxy = parts_of(request)

    def remember(answer: bytes, replica: Replica) -> None:
        routing.remember_session(json.loads(answer), replica)

    pick = functools.partial(routing.pick, "/open_session", None)
    return await proxy.send(request, await request.body(), pick, on_answer=remember)


@router.post("/close_session")
async def close_session(request: Request) -> Response:
    routing, proxy = parts_of(request)
    body, sid = await _body_and_field(request, "session_id")
    if sid is None:
        return await proxy.send(request, body, routing.pick_idle)  # the replica's 400
    replica = routing.sessions.get(sid)
    if replica is None:
        raise ApiError(404, f"no open session {sid!r}")
    answer = await proxy.forward(request, replica, body)
    if answer.status_code == 200:
        routing.sessions.pop(sid, None)
    return answer


@router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"],
                  response_model=None)
async def relay(request: Request) -> Response:
    """Reads go to the least loaded replica; the rest are routed (affinity, then the policy).
    A replica that fails before the client got a byte: the request goes to another."""
    routing, proxy = parts_of(request)
    if request.method in ("GET", "OPTIONS"):
        return await proxy.send(request, b"", routing.pick_idle)
    body = await request.body()
    parsed = await parse_body(body)
    remember = routing.remember_response if request.url.path == "/v1/responses" else None
    pick = functools.partial(routing.pick, request.url.path, parsed,
                             key_salt=caller_of(request).key_salt)
    return await proxy.send(request, body, pick, request_rids(parsed), remember)


async def no_replica(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(error_body(503, f"{exc}: every replica has died"), status_code=503)


def _stats(info: dict[str, Any] | None) -> dict[str, Any] | None:
    return ((info or {}).get("internal_states") or [None])[0]


async def parse_body(body: bytes) -> Any:
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
