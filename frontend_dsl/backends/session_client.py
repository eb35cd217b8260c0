"""SessionClient: one program run's view of an engine, whose requests share one engine session, so
the context each gen ends with stays pinned in the radix cache while the program goes on (waiting
on a tool, a select, its fork's siblings) instead of being evicted and computed again."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from forklm.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from forklm.runtime.engine.client import SessionEngineClient
    from forklm.runtime.engine.engine_request import EngineRequest
    from forklm.runtime.engine.results import GenerateOutput

T = TypeVar("T")

logger = logging.getLogger(__name__)


class SessionClient:
    """Wraps an engine client that has sessions (Engine in process, or a server's over HTTP:
    `open_session(wait=False)`, `async_open_session`, `close_session(sid, wait=False)` and
    `EngineRequest.session_id`). The session is opened at the first request and closed by
    `close()`, which does not wait. Pinning is an optimisation, never a failure: an engine that
    has no sessions (no radix cache), or one that no longer knows the session (it idled out),
    gets the requests without one."""

    def __init__(self, engine: SessionEngineClient):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self._lock = threading.Lock()
        self._sid: str | None = None
        self._closed = False
        self._opening: asyncio.Future[str | None] | None = None

    # -- the EngineClient surface --------------------------------------------------------------
    def generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        return self._pinned(self.engine.generate_outputs, request, self._session())

    def stream_outputs(self, request: EngineRequest) -> Iterator[GenerateOutput]:
        return self._pinned(self.engine.stream_outputs, request, self._session())

    async def async_generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        sid = await self._session_async()
        return await self._apinned(self.engine.async_generate_outputs, request, sid)

    async def async_stream_outputs(self, request: EngineRequest
                                   ) -> AsyncIterator[GenerateOutput]:
        sid = await self._session_async()
        return await self._apinned(self.engine.async_stream_outputs, request, sid)

    def _pinned(self, call: Callable[[EngineRequest], T], request: EngineRequest,
                sid: str | None) -> T:
        """call(request) in the session; again without it when the engine no longer knows it."""
        if sid is None:
            return call(request)
        try:
            return call(request.with_session(sid))
        except InvalidArgumentError as e:
            self._unless_session_gone(e, sid)
        return call(request)

    async def _apinned(self, call: Callable[[EngineRequest], Awaitable[T]],
                       request: EngineRequest, sid: str | None) -> T:
        if sid is None:
            return await call(request)
        try:
            return await call(request.with_session(sid))
        except InvalidArgumentError as e:
            self._unless_session_gone(e, sid)
        return await call(request)

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
