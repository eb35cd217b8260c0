"""SessionClient: one program run's view of an engine, whose requests share one engine session, so
the context each gen ends with stays pinned in the radix cache while the program goes on (waiting
on a tool, a select, its fork's siblings) instead of being evicted and computed again."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from forklm.runtime.errors import InvalidArgumentError

logger = logging.getLogger(__name__)


class SessionClient:
    """Wraps an engine client that has sessions (Engine in process, or a server's over HTTP:
    `open_session(wait=False)`, `async_open_session`, `close_session(sid, wait=False)` and
    `session_params` on generate). The session is opened at the first request and closed by `close()`, which
    does not wait. Pinning is an optimisation, never a failure: an engine that has no sessions
    (no radix cache), or one that no longer knows the session (it idled out), gets the
    requests without one."""

    def __init__(self, engine: Any):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self._lock = threading.Lock()
        self._sid: str | None = None
        self._closed = False
        self._opening: asyncio.Future[str | None] | None = None

    # -- the EngineClient surface --------------------------------------------------------------
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        sid = self._session()
        if sid is None:
            return self.engine.generate(*args, **kwargs)
        try:
            return self.engine.generate(*args, session_params={"id": sid}, **kwargs)
        except InvalidArgumentError as e:
            self._unless_session_gone(e, sid)
        return self.engine.generate(*args, **kwargs)

    async def async_generate(self, *args: Any, **kwargs: Any) -> Any:
        sid = await self._session_async()
        if sid is None:
            return await self.engine.async_generate(*args, **kwargs)
        try:
            return await self.engine.async_generate(*args, session_params={"id": sid}, **kwargs)
        except InvalidArgumentError as e:
            self._unless_session_gone(e, sid)
        return await self.engine.async_generate(*args, **kwargs)

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def close(self) -> None:
        """Release the pinned context (idempotent; queued, not waited for); later requests run
        without a session."""
        with self._lock:
            sid, self._sid, self._closed = self._sid, None, True
        if sid is not None:
            try:
                self.engine.close_session(sid, wait=False)
            except Exception as e:  # noqa: BLE001 - a closed engine has no pins left to release
                logger.debug("closing session %s: %s", sid, e)

    @property
    def session_id(self) -> str | None:
        return self._sid

    # -- the session ---------------------------------------------------------------------------
    def _session(self) -> str | None:
        with self._lock:  # fork branches share the session: the first request opens it
            if self._sid is None and not self._closed:
                self._sid = self._open()
                self._closed = self._sid is None
            return self._sid

    async def _session_async(self) -> str | None:
        if self._sid is not None or self._closed:
            return self._sid
        if self._opening is None:  # one open however many branches ask at once
            self._opening = asyncio.ensure_future(self._open_async())
        sid = await asyncio.shield(self._opening)
        return None if self._closed else sid

    async def _open_async(self) -> str | None:
        try:
            sid: str | None = await self.engine.async_open_session()
        except InvalidArgumentError as e:  # no radix cache: nothing to pin
            logger.debug("no session (%s); the program runs unpinned", e)
            sid = None
        with self._lock:
            if self._closed:  # closed while opening: release what was just opened
                if sid is not None:
                    self.engine.close_session(sid, wait=False)
                return None
            self._sid = sid
            self._closed = sid is None
        return sid

    def _open(self) -> str | None:
        try:
            sid: str = self.engine.open_session(wait=False)  # queued ahead of the first gen
        except InvalidArgumentError as e:  # no radix cache: nothing to pin
            logger.debug("no session (%s); the program runs unpinned", e)
            return None
        return sid

    def _unless_session_gone(self, error: InvalidArgumentError, sid: str) -> None:
        """Re-raise `error` unless it says the engine no longer knows the session; then the
        session is dropped and the caller sends the request without it."""
        if error.name != "session_params":
            raise error
        logger.debug("session %s is gone (%s); the program goes on unpinned", sid, error)
        with self._lock:
            if self._sid == sid:
                self._sid, self._closed = None, True
