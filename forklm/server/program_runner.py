"""How /v1/programs/run executes graphs: the engine as one program request sees it (so a client
disconnect can abort exactly that request's engine calls) and the JSON shape of a finished state."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

from forklm.frontend_dsl.backends.base import BackendError
from forklm.frontend_dsl.state import ProgramState
from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import InvalidArgumentError

_TOKEN_KEYS = ("prompt_tokens", "completion_tokens", "cached_tokens")


class TrackedEngine:
    """The slice of `Engine` that EngineBackend calls, recording the ids of in-flight requests.
    `cancel()` aborts them and makes later calls fail with BackendError, so a program whose
    client went away stops at its next gen instead of running to the end.

    A call that is still compiling its grammar when cancel() runs is not yet known to the engine
    and runs to its (bounded) end; every later call is refused.

    The run's calls share one engine session (opened at the first call), so the context each gen
    ends with stays pinned in the radix cache while the program goes on; `close()`, which the
    endpoint calls however the run ends, releases it."""

    def __init__(self, engine: Engine, on_result: Callable[[dict[str, Any]], None] | None = None):
        self.engine, self.tokenizer, self.on_result = engine, engine.tokenizer, on_result
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self.cancelled = False
        self._session: str | None = None
        self._closed = engine.parts.kv.pins is None  # no radix cache: nothing to pin

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 **kwargs: Any) -> Any:
        session = self._session_id()
        if session is not None:
            kwargs.setdefault("session_params", {"id": session})
        group = self.engine.prepare(prompt=prompt, sampling_params=sampling_params,
                                    input_ids=input_ids, **kwargs)
        rids = group.rids
        with self._lock:
            if self.cancelled:
                raise BackendError("program aborted: the client disconnected")
            self._live.update(rids)
        try:
            out = self.engine.run(group)
        except BaseException:
            self._forget(rids)
            raise
        if kwargs.get("stream"):
            return self._forget_after(out, rids)
        self._forget(rids)
        for result in out if isinstance(out, list) else [out]:
            self._record(result)
        return out

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def close(self) -> None:
        """Release the run's pinned context (idempotent); later calls run unpinned."""
        with self._lock:
            session, self._session, self._closed = self._session, None, True
        if session is not None:
            self.engine.close_session(session)

    def _session_id(self) -> str | None:
        with self._lock:
            if self._session is None and not self._closed:
                self._session = self.engine.open_session()
            return self._session

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            rids = list(self._live)
        for rid in rids:
            self.engine.abort(rid)

    def _forget(self, rids: list[str]) -> None:
        with self._lock:
            self._live.difference_update(rids)

    def _forget_after(self, chunks: Iterator[Any], rids: list[str]) -> Iterator[Any]:
        try:
            for chunk in chunks:
                if chunk["meta_info"]["finish_reason"] is not None:
                    self._record(chunk)
                yield chunk
        finally:
            self._forget(rids)

    def _record(self, result: dict[str, Any]) -> None:
        if self.on_result is not None:
            self.on_result(result)


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
