"""EngineReplica: the body of one Ray Serve replica, a forklm Engine with the `forklm serve` app
around it. Requests arrive as ReplicaRequests over a Ray handle and go through that app."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from forklm.ray_serve.asgi_bridge import call_app
from forklm.ray_serve.messages import ReplicaRequest, ResponseHead
from forklm.server.config import ServerConfig

logger = logging.getLogger(__name__)


class EngineReplica:
    """Loads the engine in the replica's own process (Ray gives it its CPUs or GPU); Ray Serve
    calls __del__ when it stops the replica, which shuts the engine down."""

    def __init__(self, engine_kwargs: dict[str, Any], server_config: ServerConfig):
        from ray import serve

        from forklm.runtime.engine.engine import Engine
        from forklm.server.app import create_app

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine = Engine(**engine_kwargs)
        self.app = create_app(self.engine, server_config)
        logger.info("replica %s serves %s", self.replica_id, self.engine.config.model_path)

    async def handle(self, request: ReplicaRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer: a ResponseHead, then body chunks (call with stream=True)."""
        async for item in call_app(self.app, request, self.replica_id):
            yield item

    def check_health(self) -> None:
        """Ray Serve's periodic health check: raising (or not answering within the timeout,
        when the replica is stuck) gets the replica replaced."""
        if self.engine.closed:
            raise RuntimeError(f"replica {self.replica_id}: the engine has shut down")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
