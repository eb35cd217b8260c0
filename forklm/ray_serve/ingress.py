"""The Ray Serve ingress: the public HTTP app. Every forklm endpoint (native, OpenAI, programs)
is relayed to the engine replica the request router picks by the request's prompt (or its
session's replica); the replicas' server info, metrics, cache flush and aborts go to all."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from forklm.ray_serve.affinity import Affinity
from forklm.ray_serve.ingress_metrics import IngressMetrics
from forklm.ray_serve.messages import ReplicaRequest
from forklm.ray_serve.relay import Relay
from forklm.router.endpoints import parse_body
from forklm.router.prompts import prompt_text
from forklm.router.proxy import max_retries
from forklm.server.app import GuardMiddleware
from forklm.server.config import ServerConfig
from forklm.server.errors import ApiError, install_error_handlers
from forklm.server.tenants import caller_of

routes = APIRouter()


def create_ingress_app(engine: DeploymentHandle, config: ServerConfig,
                       num_replicas: int) -> FastAPI:
    """The app; app.state.relay sends to the replicas. The single server's GuardMiddleware
    checks the API key and bounds the body before anything is relayed."""
    app = FastAPI(title="forklm on Ray Serve", version="0.1.0")
    app.state.relay = Relay(engine, num_replicas, max_retries(config))
    app.state.config = config
    app.state.metrics, app.state.affinity = IngressMetrics(), Affinity()
    install_error_handlers(app)
    app.include_router(routes)
    app.add_middleware(GuardMiddleware, config=config, metrics=app.state.metrics)
    return app


@serve.ingress()
class Ingress:
    """The ingress deployment; Ray Serve calls __serve_build_asgi_app__ in each ingress replica."""

    def __init__(self, engine: DeploymentHandle, config: ServerConfig, num_replicas: int):
        self.engine, self.config, self.num_replicas = engine, config, num_replicas

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_ingress_app(self.engine, self.config, self.num_replicas)


def _replica_request(request: Request, body: bytes, route_key: str = "",
                     replica: str | None = None) -> ReplicaRequest:
    return ReplicaRequest(request.method, request.url.path, request.url.query.encode(),
                          list(request.scope["headers"]), body, route_key, replica=replica)


def _relay(request: Request) -> Relay:
    return request.app.state.relay


@routes.api_route("/health", methods=["GET", "HEAD"], response_model=None)
async def health(request: Request) -> Response:
    """The fleet's health, as the --dp-size router's: 200 while one engine replica answers its
    own /health 200; the body says how many do (Ray Serve restarts the others)."""
    ask = ReplicaRequest("GET", "/health", b"", list(request.scope["headers"]), b"")
    answers = await _relay(request).fan_out(ask)
    alive = sum(head.status == 200 for head, _ in answers)
    status = 200 if alive else 503
    if request.method == "HEAD":
        return Response(status_code=status)
    return JSONResponse({"status": "ok" if alive else "unavailable", "replicas_alive": alive,
                         "dp_size": _relay(request).num_replicas}, status_code=status)


@routes.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    """A replica's server info, plus every replica's engine stats (internal_states)."""
    ask = ReplicaRequest("GET", "/get_server_info", b"", list(request.scope["headers"]), b"")
    answers = await _relay(request).fan_out(ask)
    infos = [(head.replica, json.loads(body)) for head, body in answers if head.status == 200]
    if not infos:
        raise ApiError(503, "no engine replica answered")
    config: ServerConfig = request.app.state.config
    replicas = [{"replica": rid, "internal_state": (info.get("internal_states") or [None])[0]}
                for rid, info in infos]
    return {**infos[0][1], "dp_size": len(replicas),
            "load_balance_method": config.load_balance_method, "replicas": replicas,
            "internal_states": [r["internal_state"] for r in replicas]}


@routes.get("/metrics")
async def metrics(request: Request) -> Response:
    """The ingress's error counts and each replica's engine stats, labelled by replica."""
    info = await get_server_info(request)
    registry: IngressMetrics = request.app.state.metrics
    return Response(registry.render(info["replicas"]),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@routes.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Every replica flushes; the first refusal (requests in flight) is the answer."""
    return await _to_all(request, JSONResponse({"success": True, "message": "Cache flushed."}))


@routes.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """To every replica (an rid a replica does not run is a no-op there)."""
    return await _to_all(request, JSONResponse({"success": True}))


async def _to_all(request: Request, success: Response) -> Response:
    answers = await _relay(request).fan_out(_replica_request(request, await request.body()))
    if not answers:
        raise ApiError(503, "no engine replica answered")
    failed = [(head, body) for head, body in answers if head.status != 200]
    if failed:
        head, body = failed[0]
        return Response(body, status_code=head.status, media_type="application/json")
    return success


@routes.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE",
                                           "OPTIONS"], response_model=None)
async def relay(request: Request) -> Response:
    """Any other request: to its session's (or stored response's) replica, else to the one the
    policy picks for its prompt (reads: the least loaded)."""
    body, path = await request.body(), request.url.path
    parsed = await parse_body(body) if body else None
    affinity: Affinity = request.app.state.affinity
    forward = _replica_request(request, body,
                               prompt_text(path, parsed, caller_of(request).key_salt),
                               affinity.replica_for(path, parsed))
    return await _relay(request).answer(
        forward, lambda head, first: affinity.answered(path, parsed, head, first))
