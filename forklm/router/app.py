"""create_router_app: the public server in front of the replicas (forklm serve --dp-size N)."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from forklm.router import endpoints
from forklm.router.metrics import RouterMetrics
from forklm.router.proxy import Proxy, max_retries
from forklm.router.replicas import ReplicaSet
from forklm.router.routing import NoReplicaError, Router
from forklm.server.app import GuardMiddleware
from forklm.server.config import ServerConfig
from forklm.server.errors import install_error_handlers


def create_router_app(replica_set: ReplicaSet, router: Router, client: httpx.AsyncClient,
                      config: ServerConfig) -> FastAPI:
    """The app; it sets app.state.router, .proxy, .config and .metrics for the routes. The
    GuardMiddleware of the single server checks the API key and bounds the body it reads."""
    app = FastAPI(title="forklm router", version="0.1.0")
    app.state.router, app.state.config = router, config
    app.state.proxy = Proxy(router, replica_set, client, max_retries(config))
    app.state.metrics = RouterMetrics()
    install_error_handlers(app)
    app.add_exception_handler(NoReplicaError, endpoints.no_replica)
    app.include_router(endpoints.router)
    app.add_middleware(GuardMiddleware, config=config, metrics=app.state.metrics)
    return app
