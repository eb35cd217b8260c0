"""serve(): run the app under uvicorn until SIGTERM/SIGINT, then shut down gracefully."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

import forklm.startup as startup
from forklm.runtime.config import EngineConfig
from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import ForkLMError
from forklm.server.config import ServerConfig

logger = logging.getLogger(__name__)
# Seconds uvicorn still waits after the grace period, for aborted requests to send their answer.
_ABORT_FLUSH_S = 5
# Seconds without a request before the idle warm-ups run (see _warm_up_when_idle).
WARM_UP_AFTER_IDLE_S = 0.3


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the engine, serve until a stop signal, return the exit status (0 on a clean stop).

    On SIGTERM uvicorn stops accepting connections and waits up to graceful_shutdown_s for
    in-flight requests to finish; then the engine shuts down, which ends the ones left with
    finish_reason abort (each still gets its answer), and serve returns 0."""
    from forklm.server.app import create_app

    engine = Engine(**dataclasses.asdict(engine_config))
    try:
        app = create_app(engine, server_config)
        server = _GracefulServer(engine, server_config.graceful_shutdown_s, uvicorn.Config(
            app, host=server_config.host, port=server_config.port, lifespan="off",
            log_level=server_config.log_level,
            timeout_graceful_shutdown=int(server_config.graceful_shutdown_s) + _ABORT_FLUSH_S))
        # uvicorn re-raises the stop signal after its shutdown, into the handlers it found at
        # start; these make that a logged no-op, so a requested stop exits 0 instead of 143.
        previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGTERM, signal.SIGINT)}
        # Off the start-up path: xgrammar's import and vocabulary tables, for the first
        # constrained request to find them ready (imported beside the engine's load instead, it
        # slowed that load by more than it saved: benchmarks/startup.py), and the control-token
        # guard's tokenizer copy (0.1 s of create_app before).
        guard = app.state.service.guard
        warm_ups = [engine.parts.grammar.warm_up] + ([guard.warm_up] if guard else [])
        threading.Thread(target=_warm_up_when_idle, args=(engine, warm_ups),
                         name="idle-warm-up", daemon=True).start()
        startup.started()  # the garbage collector back on, start-up's objects frozen
        logger.info("serving %s on http://%s:%d (OpenAI API under /v1)", engine.config.model_path,
                    server_config.host, server_config.port)
        try:
            server.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return 0 if server.started else 1
    finally:
        engine.shutdown()


def _warm_up_when_idle(engine: Engine, warm_ups: list[Callable[[], None]],
                       idle_s: float = WARM_UP_AFTER_IDLE_S) -> None:
    """The warm-ups, once the engine has had no request for idle_s: the grammar's holds the GIL
    for 0.2-0.5 s, which requests sent the moment the server is up would otherwise wait out (the
    first request's TTFT was 3x the later ones' at 1B). A request that needs one first does the
    same setup itself."""
    quiet_since = time.monotonic()
    while not engine.closed:
        time.sleep(idle_s / 6)
        try:
            stats = engine.stats()
        except ForkLMError:  # shut down meanwhile
            return
        if stats["running"] or stats["waiting"]:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= idle_s:
            for warm_up in warm_ups:
                warm_up()
            return


class _GracefulServer(uvicorn.Server):
    """uvicorn's shutdown, plus: once the grace period is over, the engine is shut down, which
    finishes every in-flight request with finish_reason abort. Their handlers then answer
    normally (a result or a stream's last event) instead of being cancelled mid-response."""

    def __init__(self, engine: Engine, grace_s: float, config: uvicorn.Config):
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.grace_s, lambda: loop.run_in_executor(
            None, self.engine.shutdown))
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def _stopped(signum: int, frame: FrameType | None) -> None:
    logger.info("server stopped on signal %d", signum)
