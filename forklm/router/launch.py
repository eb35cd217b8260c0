"""serve_dp(): `forklm serve --dp-size N`: start N replicas, wait until each is healthy, serve
the router until SIGTERM/SIGINT (supervising the replicas meanwhile: stuck or dead ones are
restarted), then stop the replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from types import FrameType
from typing import Any

import httpx
import uvicorn

from forklm.router.app import create_router_app
from forklm.router.policies import make_policy
from forklm.router.replicas import ReplicaSet, replica_threads
from forklm.router.routing import Router
from forklm.router.supervisor import HealthCheck, Supervisor
from forklm.server.config import ServerConfig
from forklm.server.tenants import load_api_keys

logger = logging.getLogger(__name__)
_STARTUP_TIMEOUT_S = 900.0  # a replica loads (and may first convert) the model
# ServerConfig fields the router keeps for itself; the replicas get every other flag given.
_ROUTER_ONLY = ("host", "port", "dp_size", "load_balance_method", "retry_max_retries",
                "disable_retries", "health_check_timeout_secs", "health_check_interval_secs",
                "health_failure_threshold")


class _Stopped(Exception):
    pass


def replica_flags(engine_kwargs: dict[str, Any], server_kwargs: dict[str, Any],
                  dp_size: int) -> dict[str, Any]:
    """The flags each replica is started with: the user's, minus the router's, plus its share
    of the CPU threads."""
    flags = {**engine_kwargs, **{k: v for k, v in server_kwargs.items() if k not in _ROUTER_ONLY}}
    flags["num_threads"] = replica_threads(dp_size, flags.get("num_threads"))
    return flags


def _own_credentials(config: ServerConfig) -> dict[str, str]:
    """The Authorization the router sends on its own calls to the replicas (server info,
    cache flushes): --api-key's, else the keys file's first key; none without keys."""
    key = config.api_key
    if key is None and config.api_keys_file is not None:
        key = load_api_keys(config.api_keys_file)[0].key
    return {"Authorization": f"Bearer {key}"} if key else {}


def serve_dp(engine_kwargs: dict[str, Any], config: ServerConfig,
             server_kwargs: dict[str, Any]) -> int:
    """Run the router and its replicas; the exit status (0 after a requested stop)."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health probe
    headers = _own_credentials(config)
    replica_set = ReplicaSet(replica_flags(engine_kwargs, server_kwargs, config.dp_size),
                             config.dp_size, headers)
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        replica_set.start()
        asyncio.run(_serve(replica_set, config))
        return 0
    except _Stopped:
        return 0
    except (RuntimeError, TimeoutError) as e:
        logger.error("forklm serve --dp-size %d: %s", config.dp_size, e)
        return 1
    finally:
        replica_set.stop(config.graceful_shutdown_s + 5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _serve(replica_set: ReplicaSet, config: ServerConfig) -> None:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(None, connect=10.0)  # generation may take long; connecting may not
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await replica_set.wait_ready(client, _STARTUP_TIMEOUT_S)
        router = Router(replica_set.replicas, make_policy(config.load_balance_method,
                                                          config.dp_size))
        app = create_router_app(replica_set, router, client, config)
        server = uvicorn.Server(uvicorn.Config(
            app, host=config.host, port=config.port, lifespan="off", log_level=config.log_level,
            timeout_graceful_shutdown=int(config.graceful_shutdown_s) + 5))
        logger.info("routing %s over %d replicas on http://%s:%d", config.load_balance_method,
                    config.dp_size, config.host, config.port)
        supervisor = Supervisor(replica_set, app.state.proxy, HealthCheck.of(config),
                                _STARTUP_TIMEOUT_S)
        watcher = asyncio.create_task(supervisor.run())
        try:
            await server.serve()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher  # its restarts are cancelled before the replicas are stopped


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    logger.info("router stopped on signal %d", signum)
    raise _Stopped(signum)
