"""serve_ray(): `forklm serve --ray`: start (or join, with RAY_ADDRESS) a Ray cluster, run the
forklm application on Ray Serve at --host/--port, and stop it on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from forklm.ray_serve import require_ray
from forklm.server.config import ServerConfig

logger = logging.getLogger(__name__)
APP_NAME = "forklm"


def serve_ray(engine_kwargs: dict[str, Any], server_config: ServerConfig) -> int:
    """Run until a stop signal; the exit status (0 after a requested stop, 1 if it failed)."""
    require_ray()
    import ray
    from ray import serve

    from forklm.ray_serve.app import build_application

    ray.init()  # RAY_ADDRESS (or a running local cluster) is joined, else one is started here
    # after ray.init, whose own SIGTERM handler would end the process mid-shutdown
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        serve.start(http_options={"host": server_config.host, "port": server_config.port})
        serve.run(build_application(engine_kwargs, server_config), name=APP_NAME,
                  route_prefix="/")
        logger.info("forklm on Ray Serve: %d replicas (%s) on http://%s:%d",
                    server_config.dp_size, server_config.load_balance_method,
                    server_config.host, server_config.port)
        while not stop.wait(1.0):  # wakes for the signal handler
            pass
        return 0
    except RuntimeError as e:  # Ray Serve's deploy failures (a replica that cannot start)
        logger.error("forklm serve --ray: %s", e)
        return 1
    finally:
        serve.delete(APP_NAME)  # only this app: a cluster joined may serve others
        ray.shutdown()  # a cluster started here stops with it
        for sig, handler in previous.items():
            signal.signal(sig, handler)
