"""How /v1/programs/run executes graphs: the engine as one program request sees it (so a client
disconnect can abort exactly that request's engine calls) and the JSON shape of a finished state."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from forklm.frontend_dsl.backends.base import BackendError
from forklm.frontend_dsl.state import ProgramState
from forklm.runtime.engine.engine import Engine
from forklm.runtime.engine.results import GenerateOutput
from forklm.runtime.errors import InvalidArgumentError

if TYPE_CHECKING:
    from forklm.runtime.engine.client import EngineClient
    from forklm.runtime.engine.engine_request import EngineRequest
    from forklm.runtime.engine.intake import RequestGroup

_TOKEN_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


class TrackedEngine:
    """The engine as one program request sees it (an EngineClient), recording the ids of its
    in-flight requests. `cancel()` aborts them and makes later calls fail with BackendError, so
    a program whose client went away stops at its next gen instead of running to the end.

    A call that is still compiling its grammar when cancel() runs is not yet known to the engine
    and runs to its (bounded) end; every later call is refused.

    The run's calls share one engine session (opened at the first call), so the context each gen
    ends with stays pinned in the radix cache while the program goes on; `close()`, which the
    endpoint calls however the run ends, releases it. `on_result` sees every finished result."""

    def __init__(self, engine: Engine,
                 on_result: Callable[[GenerateOutput], None] | None = None,
                 tenancy: dict[str, Any] | None = None):
        self.engine, self.tokenizer, self.on_result = engine, engine.tokenizer, on_result
        # cache_salt, priority and tenant every call of the run gets (generation.tenancy)
        self.tenancy = tenancy or {}
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self.cancelled = False
        self._session: str | None = None
        self._closed = engine.parts.kv.pins is None  # no radix cache: nothing to pin

    # -- EngineClient --------------------------------------------------------------------------
    def generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        group = self._admit(request)
        try:
            outs = self.engine.run(group)
        finally:
            self._forget(group.rids)
        return self._recorded(outs)

    def stream_outputs(self, request: EngineRequest) -> Iterator[GenerateOutput]:
        group = self._admit(request, stream=True)
        try:
            chunks = self.engine.run_stream(group)
        except BaseException:
            self._forget(group.rids)
            raise
        return self._forget_after(chunks, group.rids)

    async def async_generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        group = self._admit(request)
        try:
            outs = await self.engine.async_run(group)
        finally:
            self._forget(group.rids)
        return self._recorded(outs)

    async def async_stream_outputs(self, request: EngineRequest
                                   ) -> AsyncIterator[GenerateOutput]:
        group = self._admit(request, stream=True)
        try:
            chunks = await self.engine.async_stream(group)
        except BaseException:
            self._forget(group.rids)
            raise
        return self._aforget_after(chunks, group.rids)

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    # -- the run -------------------------------------------------------------------------------
    def close(self) -> None:
        """Release the run's pinned context (idempotent); later calls run unpinned."""
        with self._lock:
            session, self._session, self._closed = self._session, None, True
        if session is not None:
            self.engine.close_session(session)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            rids = list(self._live)
        for rid in rids:
            self.engine.abort(rid)

    def _admit(self, request: EngineRequest, stream: bool = False) -> RequestGroup:
        """The request prepared in the run's session, its rids recorded (or BackendError once
        the run is cancelled)."""
        session = self._session_id()
        if session is not None and request.session_id is None:
            request = request.with_session(session)
        if self.tenancy:
            request = dataclasses.replace(request, **self.tenancy)
        group = self.engine.prepare(request, stream=stream)
        with self._lock:
            if self.cancelled:
                raise BackendError("program aborted: the client disconnected")
            self._live.update(group.rids)
        return group

    def _session_id(self) -> str | None:
        with self._lock:
            if self._session is None and not self._closed:
                self._session = self.engine.open_session()
            return self._session

    def _forget(self, rids: list[str]) -> None:
        with self._lock:
            self._live.difference_update(rids)

    def _forget_after(self, chunks: Iterator[GenerateOutput], rids: list[str]
                      ) -> Iterator[GenerateOutput]:
        try:
            for chunk in chunks:
                self._recorded([chunk])
                yield chunk
        finally:
            self._forget(rids)

    async def _aforget_after(self, chunks: AsyncIterator[GenerateOutput], rids: list[str]
                             ) -> AsyncIterator[GenerateOutput]:
        try:
            async for chunk in chunks:
                self._recorded([chunk])
                yield chunk
        finally:
            self._forget(rids)

    def _recorded(self, outs: list[GenerateOutput]) -> list[GenerateOutput]:
        if self.on_result is not None:
            for out in outs:
                if out.finished:
                    self.on_result(out)
        return outs


# -- results ------------------------------------------------------------------------------------
def item_result(state: ProgramState) -> dict[str, Any]:
    """A finished state as JSON: variables, text, messages, and meta_info with the token counts
    summed over the program's gens plus each variable's own meta under `variables`; or, when the
    program failed, only `error`."""
    error = state.error()
    if error is not None:
        return {"error": error_info(error)}
    variables = state.variables()
    metas = {name: state.get_meta_info(name) for name in variables}
    totals = dict.fromkeys(_TOKEN_KEYS, 0)
    _add_tokens(list(metas.values()), totals)
    return {"variables": jsonable(variables), "text": state.text(), "messages": state.messages(),
            "meta_info": {**totals, "variables": jsonable(metas)}}


def error_info(error: BaseException) -> dict[str, Any]:
    """An item's error object; `type` says whose fault it was."""
    if isinstance(error, BackendError):
        kind = "backend_error"  # the engine aborted or refused a call while the program ran
    elif isinstance(error, (ValueError, TypeError, LookupError)):
        kind = "invalid_request_error"  # the program (part of the request) is wrong
    else:
        kind = "server_error"
    param = error.name if isinstance(error, InvalidArgumentError) else None
    return {"message": str(error) or type(error).__name__, "type": kind, "param": param}


def _add_tokens(metas: Any, totals: dict[str, int]) -> None:
    """Sum the engine counts of every gen meta (a join holds lists of the branches' metas)."""
    if isinstance(metas, list):
        for m in metas:
            _add_tokens(m, totals)
    elif isinstance(metas, dict) and all(k in metas for k in _TOKEN_KEYS):
        for k in _TOKEN_KEYS:
            totals[k] += int(metas[k])


def jsonable(x: Any) -> Any:
    """`x` with non-finite floats as None (JSON has no -inf; a choice with no scored token has
    mean logprob -inf) and non-JSON values as their str."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return str(x)


if TYPE_CHECKING:  # TrackedEngine fulfils the client contract (checked by mypy)
    def _as_client(engine: TrackedEngine) -> EngineClient:
        return engine
