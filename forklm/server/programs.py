"""POST /v1/programs/run: run a whole program server-side in one request.

Request body (unknown fields are a 400):
- `program`: a graph object (`Graph.to_json()` of a traced program), or `program_text`: the
  textual syntax; exactly one of the two. Nothing in a request is executed as Python.
- `arguments`: the program arguments, one object, or a list of objects for a batch (one program
  run per item, all sharing engine batches and the radix cache). Default `{}`. Only the
  program's arguments: run defaults go in `sampling_params`.
- `sampling_params`: run defaults every gen inherits: SamplingParams names plus `return_logprob`,
  `logprob_start_len`, `top_logprobs_num`. Default `{}`.
- `stream`: with one item, Server-Sent Events as the program runs: `{"type": "text", "text"}`
  pieces, `{"type": "variable", "name", "value"}` as variables are set, one final
  `{"type": "result", ...result}`, then `data: [DONE]`.

Response: `{"results": [result, ...], "program": {"name", "num_nodes"}}`, one result per item in
input order; a result is `{"variables", "text", "messages", "meta_info"}`, where meta_info holds
`prompt_tokens`, `completion_tokens` and `cached_tokens` summed over the program's gens and each
variable's own meta under `variables`.

Errors: everything checked before running (body shape, the graph or its syntax, the server's
ProgramLimits, enforced while the graph is built, sampling values, argument names of every item)
is a 400 naming the problem, and nothing runs; this checking runs on a worker thread. A run
holds one admission slot per engine request it may have in flight at once (gen `n`, select
choices, fork branches, times the batch's items): a full queue is a 503, a run larger than the
whole queue a 400 (`max_parallel_requests`). A program that fails while running (an engine abort, a
gen's regex that does not compile, reading a variable that does not exist) does not fail the
batch: that item's result is only `{"error": {"message", "type", "param"}}` (HTTP 200), with
`type` `invalid_request_error` (the program is wrong), `backend_error` (the engine aborted) or
`server_error`. A client that disconnects aborts its programs' in-flight engine requests.
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, cast

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from forklm.frontend_dsl.backends.engine_backend import EngineBackend
from forklm.frontend_dsl.defaults import SAMPLING_FIELDS, RunDefaults
from forklm.frontend_dsl.interpreter import GraphProgram
from forklm.frontend_dsl.ir import (
    DEFAULT_MAX_NEW_TOKENS,
    Graph,
    ProgramLimitError,
    ProgramLimits,
    value_chars,
    walk,
)
from forklm.frontend_dsl.limits import max_in_flight
from forklm.frontend_dsl.state import ProgramState
from forklm.frontend_dsl.textual import ProgramSyntaxError, parse_program
from forklm.runtime.engine.engine import Engine
from forklm.runtime.engine.engine_request import LOGPROB_OPTIONS
from forklm.runtime.errors import InvalidArgumentError
from forklm.server.errors import SSE_DONE, ApiError, sse_event
from forklm.server.generation import Admission, tenancy
from forklm.server.program_runner import TrackedEngine, error_info, item_result, jsonable
from forklm.server.protocol import CacheSalt, Priority
from forklm.server.tenants import Caller, TenantGate, caller_of

router = APIRouter()

_DISCONNECT_POLL_S = 0.25


class ProgramRunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    program: dict[str, Any] | None = None
    program_text: str | None = None
    arguments: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    # Every engine call of the run gets these (see GenerateRequest's)
    cache_salt: CacheSalt = None
    priority: Priority = None


@router.post("/v1/programs/run")
async def run_programs(body: ProgramRunRequest, request: Request) -> Any:
    # Parsing and checking take time proportional to the request: off the event loop.
    plan = await asyncio.to_thread(_plan, body, request.app.state.config.program_limits)
    caller = caller_of(request)
    engine = _tracked_engine(request, tenancy(caller, body))
    backend = EngineBackend(engine)  # the EngineBackend logic over tracked calls
    admission = _admission(request)
    num = _admitted_requests(plan, admission)
    gate = _gate(request, caller)
    await gate.acquire(num)  # waits while the caller's key has its share running
    try:
        admission.acquire(num)
    except BaseException:
        gate.release(num)
        raise
    if body.stream:
        try:
            state = plan.program.run(backend=backend, stream=True,
                                     **{**plan.defaults.to_kwargs(), **plan.items[0]})
        except BaseException:
            admission.release(num)  # no stream exists to release it
            gate.release(num)
            _close_session(engine)
            raise
        # From its first step on, _released owns the slots and the session (released however
        # the stream ends).
        return await _started_stream(_released(_sse(state, engine, request), admission, gate,
                                               num, engine))

    def run_all() -> list[dict[str, Any]]:
        states = plan.program.run_batch(plan.items, backend=backend, **plan.defaults.to_kwargs())
        return [item_result(state) for state in states]

    try:
        results = await _watch_disconnect(request, engine, _in_thread(run_all))
    finally:
        admission.release(num)
        gate.release(num)
        _close_session(engine)
    return {"results": results, "program": plan.info}


@router.get("/v1/programs/tokenizer")
async def get_tokenizer(request: Request) -> dict[str, Any]:
    """The server model's tokenizer files (tokenizer.json, its config and chat template), so a
    RuntimeEndpoint tokenizes and renders chat turns exactly as this server does."""
    return {"files": await asyncio.to_thread(_tokenizer_files, request.app.state.engine)}


# -- validation ---------------------------------------------------------------------------------
class _Plan(NamedTuple):
    """A request checked and ready to run: nothing in it is left to validate."""

    program: GraphProgram
    defaults: RunDefaults
    items: list[dict[str, Any]]
    info: dict[str, Any]
    peak_requests: int  # engine requests one item may have in flight at once


def _plan(body: ProgramRunRequest, limits: ProgramLimits) -> _Plan:
    """Everything checked before running (on a worker thread: it is request-sized work): the
    graph, built under the limits, the run defaults and every item's arguments."""
    graph = _load_graph(body, limits)
    value_chars(body.sampling_params, "sampling_params")  # deep values overflow the stack later
    defaults = _run_defaults(body.sampling_params)
    sampling = defaults.sampling
    graph.check_limits(limits, sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS),
                       sampling.get("n", 1))
    items = body.arguments if isinstance(body.arguments, list) else [body.arguments]
    if body.stream and len(items) != 1:
        raise InvalidArgumentError("stream", True, f"streaming runs one program; got a batch of "
                                   f"{len(items)} arguments")
    value_chars(items, "arguments")  # argument values end up in texts, variables and results
    for item in items:  # a bad argument is a 400 before anything is admitted or runs
        _check_arguments(graph, item)
    info = {"name": graph.name, "num_nodes": len(walk(graph.nodes))}
    peak = max_in_flight(graph, sampling.get("n", 1))
    return _Plan(GraphProgram(graph), defaults, items, info, peak)


def _check_arguments(graph: Graph, item: dict[str, Any]) -> None:
    """An item holds the program's arguments only (run defaults such as `n` go in
    sampling_params, where the limits count them), all those without a default."""
    unknown = sorted(set(item) - set(graph.args))
    if unknown:
        raise InvalidArgumentError(unknown[0], item[unknown[0]], f"not an argument of program "
                                   f"{graph.name} {graph.args} (run defaults go in "
                                   "sampling_params)")
    missing = [a for a in graph.args if a not in item and a not in graph.arg_defaults]
    if missing:
        raise InvalidArgumentError(missing[0], None, f"missing argument of program "
                                   f"{graph.name} {graph.args}")


def _admitted_requests(plan: _Plan, admission: Admission) -> int:
    """The admission slots a run takes: every request its items may have in flight at once
    (a batch runs its items side by side); a run that could never fit is a 400, not a 503."""
    num = len(plan.items) * plan.peak_requests
    if num > admission.limit:
        raise ProgramLimitError("max_parallel_requests", num, f"the run may have {num} engine "
                                f"requests in flight at once ({len(plan.items)} item(s) x "
                                f"{plan.peak_requests}: gen n samples, select choices, fork "
                                f"branches); this server admits at most {admission.limit}")
    return num


def _load_graph(body: ProgramRunRequest, limits: ProgramLimits) -> Graph:
    if (body.program is None) == (body.program_text is None):
        raise InvalidArgumentError("program", None, "give exactly one of program (a graph "
                                   "object from trace().to_json()) or program_text")
    if body.program is not None:
        return Graph.from_json(body.program, limits)
    assert body.program_text is not None
    try:
        return parse_program(body.program_text, limits)
    except ProgramSyntaxError as e:  # its message gives line, column and what was expected
        raise ApiError(400, f"program_text: {e}", "program_text") from e


def _run_defaults(sampling: dict[str, Any]) -> RunDefaults:
    """Run defaults: SamplingParams names (validated together now) and the logprob options; a
    null means "no default" (SGLang's reading)."""
    defaults, unknown = RunDefaults.from_kwargs(
        {k: v for k, v in sampling.items() if v is not None})
    if unknown:
        key, value = next(iter(unknown.items()))
        raise InvalidArgumentError(f"sampling_params.{key}", value, "unknown run default; "
                                   f"known: {', '.join(sorted(SAMPLING_FIELDS))}, "
                                   f"{', '.join(LOGPROB_OPTIONS)}")
    return defaults.checked()


def _tracked_engine(request: Request, fields: dict[str, Any]) -> TrackedEngine:
    service = getattr(request.app.state, "service", None)
    on_result = None
    if service is not None:
        on_result = functools.partial(service.metrics.record_output, "programs",
                                      key=fields["tenant"] or "")
    return TrackedEngine(request.app.state.engine, on_result, fields)


def _gate(request: Request, caller: Caller) -> TenantGate:
    service = getattr(request.app.state, "service", None)
    if service is None:  # an app without the generation service: no shares to keep
        return TenantGate(caller.name, None, None)
    return cast(TenantGate, service.tenants.gate_of(caller.name))


def _admission(request: Request) -> Admission:
    service = getattr(request.app.state, "service", None)
    if service is None:  # an app without the generation service: no queue bound to share
        return Admission(limit=1 << 62, retry_after_s=1)
    return cast(Admission, service.admission)


async def _released(events: AsyncIterator[bytes], admission: Admission, gate: TenantGate,
                    num: int, engine: TrackedEngine) -> AsyncGenerator[bytes, None]:
    """The stream's events; its admission slots and pinned context are released when it ends,
    however it ends (once started: see _started_stream)."""
    try:
        async for event in events:
            yield event
    finally:
        admission.release(num)
        gate.release(num)
        _close_session(engine)


async def _started_stream(events: AsyncGenerator[bytes, None]) -> StreamingResponse:
    """The response for `events`, started here: a started async generator is closed by the
    event loop even if the response never iterates it (client gone before the headers), which
    runs its `finally` (abort, release); an unstarted one would never run it."""
    try:
        first = await events.__anext__()
    except StopAsyncIteration:  # the client left before the first event
        first = b""

    async def with_first() -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for event in events:
                yield event
        finally:
            await events.aclose()

    return StreamingResponse(with_first(), media_type="text/event-stream")


# -- running ------------------------------------------------------------------------------------
def _close_session(engine: TrackedEngine) -> None:
    """Release the run's pinned context without waiting: called from `finally` blocks that a
    client disconnect cancels, where an awaited close (or a not yet started executor job) would
    be cancelled with them and leave the session open."""
    threading.Thread(target=engine.close, name="forklm-program-session", daemon=True).start()


def _in_thread(fn: Callable[[], Any]) -> asyncio.Future[Any]:
    """fn's result, computed on a thread of its own: a program waits on the engine for its whole
    run, and asyncio.to_thread's small shared pool would cap how many run at once."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(error: BaseException | None, value: Any) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as e:  # handed to the awaiting handler (a 400 or a 500 there)
            value, error = None, e
        loop.call_soon_threadsafe(settle, error, value)

    threading.Thread(target=run, name="forklm-program-batch", daemon=True).start()
    return future


async def _watch_disconnect(request: Request, engine: TrackedEngine, work: Any) -> Any:
    """Await `work`; if the client disconnects first, abort its engine calls (the program then
    fails fast) and still wait for the worker thread to end."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            engine.cancel()
            break
    return await task


async def _sse(state: ProgramState, engine: TrackedEngine,
               request: Request) -> AsyncIterator[bytes]:
    """The state's events as SSE; leaving early (client gone) aborts the program."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    def produce() -> None:
        try:
            for event in _events(state):
                loop.call_soon_threadsafe(queue.put_nowait, event)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=produce, name="forklm-program-sse", daemon=True).start()
    finished = False
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            if event is None:
                break
            yield sse_event(event)
        finished = True
        yield SSE_DONE
    finally:
        if not finished:
            engine.cancel()  # the producer thread then ends as soon as the program fails


def _events(state: ProgramState) -> Iterator[dict[str, Any]]:
    """Text pieces and variables as they happen, then the item's result (or its error)."""
    try:
        for event in state.stream_events():
            if event[0] == "text":
                yield {"type": "text", "text": event[1]}
            else:
                yield {"type": "variable", "name": jsonable(event[1]), "value": jsonable(event[2])}
    except Exception:  # the same error is reported in the result event below
        pass
    try:
        yield {"type": "result", **item_result(state)}
    except Exception as e:  # a bug in shaping the result must still end the stream cleanly
        yield {"type": "result", "error": error_info(e)}


@functools.lru_cache(maxsize=4)
def _tokenizer_files(engine: Engine) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        engine.tokenizer.save_pretrained(tmp, legacy_format=False)
        return {p.name: p.read_text(encoding="utf-8") for p in Path(tmp).iterdir() if p.is_file()}
