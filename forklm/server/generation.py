"""How endpoints call the engine: admission against the bounded queue, the async engine API,
per-request timing and metrics. Endpoints prepare the engine call (Engine.prepare: validated,
tokenized, one request per sample); this admits, runs and times exactly those requests."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncGenerator
from dataclasses import InitVar, dataclass, field
from typing import Any

from starlette.requests import Request

from forklm.runtime.engine.engine import Engine
from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.engine.intake import RequestGroup
from forklm.runtime.engine.results import GenerateOutput, join_chunks
from forklm.runtime.errors import InvalidArgumentError
from forklm.server.chat_template import ControlTokenGuard
from forklm.server.config import ServerConfig
from forklm.server.errors import ApiError
from forklm.server.metrics import ServerMetrics
from forklm.server.tenants import Caller, TenantGate, Tenants

logger = logging.getLogger(__name__)
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks for its client
# Prompt text is bounded before it is tokenized, at context_len x this many characters. Text
# averages ~4 characters a token (English; code ~5), so a longer text cannot fit the context
# unless it is mostly long runs (the default model's longest token is 81 characters, a newline
# and 80 spaces); refusing those too is the price of never tokenizing megabytes to learn it.
MAX_CHARS_PER_TOKEN = 32


class Admission:
    """Counts requests (one per sample) the server has handed to the engine and not seen finish.
    A request that would push the count past `limit` is refused with 503 before anything is
    submitted, so every accepted request runs to its end."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s, self.admitted = limit, retry_after_s, 0

    def acquire(self, num: int) -> None:
        self.check(num)
        self.admitted += num

    @property
    def full(self) -> bool:
        return self.admitted >= self.limit

    def check(self, num: int) -> None:
        """Raise the 503 if `num` more requests would not fit now, or a 400 if they never can
        (retrying such a call would never succeed)."""
        if num > self.limit:
            raise ApiError(400, f"the call makes {num} engine requests (prompts x n), more than "
                           f"this server ever runs at once ({self.limit}: max_running_requests + "
                           "max_queued_requests); split it into smaller calls")
        if self.admitted + num > self.limit:
            raise ApiError(503, f"server busy: {self.admitted} requests in flight, limit "
                           f"{self.limit} (max_running_requests + max_queued_requests)",
                           headers={"Retry-After": str(self.retry_after_s)})

    def release(self, num: int) -> None:
        self.admitted -= num
        assert self.admitted >= 0, self.admitted


@dataclass
class GenerationService:
    """The per-app object endpoints use (app.state.service)."""

    engine: Engine
    config: ServerConfig
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    # The API keys and each key's share of the engine: `keys`, else the config's (Tenants.of).
    keys: InitVar[Tenants | None] = None
    tenants: Tenants = field(init=False)
    admission: Admission = field(init=False)
    guard: ControlTokenGuard | None = field(init=False)  # None: control tokens in chats count

    def __post_init__(self, keys: Tenants | None) -> None:
        limit = self.engine.config.max_running_requests + self.config.max_queued_requests
        self.admission = Admission(limit, self.config.retry_after_s)
        self.tenants = keys or Tenants.of(self.config)
        self.guard = (None if self.config.allow_special_tokens_in_content
                      else ControlTokenGuard(self.engine.tokenizer))

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.engine.config.model_path

    def check_text_size(self, name: str, num_chars: int) -> None:
        """A 400 naming `name` when text of `num_chars` characters cannot fit the context (see
        MAX_CHARS_PER_TOKEN); call it before tokenizing or rendering the text."""
        context_len = self.engine.model_info.context_len
        limit = context_len * MAX_CHARS_PER_TOKEN
        if num_chars > limit:
            raise InvalidArgumentError(name, f"<{num_chars} characters>", f"over the limit of "
                                       f"{limit} characters ({MAX_CHARS_PER_TOKEN} per token of "
                                       f"the model's context_length {context_len})")

    def unavailable_reason(self) -> str | None:
        """Why the server cannot take a request now (for /health), or None when it can."""
        if self.engine.closed:  # a lost tensor-parallel worker closes it: say so
            error = getattr(self.engine, "last_error", None)  # stand-ins in tests lack it
            return "the engine has shut down" + (f": {error}" if error is not None else "")
        if self.admission.full:
            return (f"server busy: {self.admission.admitted} requests in flight, limit "
                    f"{self.admission.limit}")
        return None

    async def generate(self, endpoint: str, group: RequestGroup,
                       request: Request | None = None) -> list[GenerateOutput]:
        """Run a prepared call (Engine.prepare) and return its results, in order.
        With the HTTP `request`, a client that disconnects before the results aborts the call
        (its KV returns to the pool) instead of letting it run to the end for nobody."""
        if request is None:
            return await self._run(endpoint, group)
        task = asyncio.ensure_future(self._run(endpoint, group))
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # closing the stream aborts its engine requests
        if task.cancelled():  # a routine event, not an error: one line, no traceback
            logger.info("client disconnected from %s: aborted %d request(s)", endpoint,
                        len(group))
            raise ApiError(499, "client disconnected")  # nginx's status; no one reads it
        return task.result()

    async def _run(self, endpoint: str, group: RequestGroup) -> list[GenerateOutput]:
        return await _collect(await self.open_stream(endpoint, group), len(group))

    async def open_stream(self, endpoint: str, group: RequestGroup) -> ChunkStream:
        """Admit the group's requests, compile their constraints and start them (errors here
        become HTTP statuses); returns the chunks of all of them: each chunk's text/output_ids
        are increments, `index` names its result, and each result's last chunk is `finished`. The admission is released when the stream ends or is closed.

        Awaiting the first chunk here starts the iterator: a started async generator is closed by
        the event loop even if the response never iterates it (client gone before the headers),
        which aborts the requests and releases the admission; an unstarted one would leak both."""
        num = len(group)
        gate = self.tenants.gate_of(group.reqs[0].tenant)
        await gate.acquire(num)  # waits while the caller's key has its share running
        try:
            self.admission.acquire(num)
        except BaseException:
            gate.release(num)
            raise
        try:
            chunks = await self.engine.async_stream(group)
        except BaseException:
            self.admission.release(num)
            gate.release(num)
            raise
        timed = self._timed(endpoint, chunks, num, gate)
        return ChunkStream(await timed.__anext__(), timed)

    async def _timed(self, endpoint: str, chunks: AsyncGenerator[GenerateOutput, None],
                     num: int, gate: TenantGate) -> AsyncGenerator[GenerateOutput, None]:
        """Pass chunks through, timing each result's first token and the rest. Closing this
        iterator early (client gone) closes the engine's, which aborts the requests."""
        start, first = time.perf_counter(), dict[int, float]()
        try:
            async for chunk in chunks:
                i = chunk.index
                if i not in first and (chunk.output_ids or chunk.finished):
                    first[i] = time.perf_counter()
                if chunk.finished:
                    self.metrics.record_output(endpoint, chunk, gate.name)
                    self.metrics.record_timing(first[i] - start, time.perf_counter() - first[i],
                                               chunk.completion_tokens)
                yield chunk
        finally:
            await chunks.aclose()
            self.admission.release(num)
            gate.release(num)
            logger.info("%s: %d request(s) of key %r done in %.3f s", endpoint, num, gate.name,
                        time.perf_counter() - start)


def tenancy(caller: Caller, body: Any) -> dict[str, Any]:
    """EngineRequest's cache_salt, priority and tenant for a request `body` (its cache_salt and
    priority fields, where it has them) sent by `caller`."""
    return {"cache_salt": caller.cache_salt(getattr(body, "cache_salt", None)),
            "priority": getattr(body, "priority", None), "tenant": caller.name or None}


def with_caller_session(request: EngineRequest, caller: Caller) -> EngineRequest:
    """`request` with its session (if any) as the engine knows the caller's sessions."""
    if request.session_id is None:
        return request
    return request.with_session(caller.session_id(request.session_id))


class ChunkStream:
    """A started stream of GenerateOutput chunks, its first chunk already received and held back.
    aclose() ends it early: the engine aborts the requests and frees their KV."""

    def __init__(self, first: GenerateOutput, rest: AsyncGenerator[GenerateOutput, None]):
        self._first: GenerateOutput | None = first
        self._rest = rest

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


def json_safe_logprobs(meta: dict[str, Any]) -> dict[str, Any]:
    """JSON has no -inf: a logprob of a token the grammar masked becomes -9999.0 (OpenAI's
    convention for "impossible"), so responses never fail to encode. Changes `meta` in place."""
    for key, value in meta.items():
        if key.endswith("logprobs") and isinstance(value, list):
            meta[key] = finite(value)
    return meta


def finite(x: Any) -> Any:
    """x (a number or nested lists of them) with -inf as -9999.0 and other non-finite as None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else (-9999.0 if x < 0 else None)
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


async def _collect(chunks: ChunkStream, num: int) -> list[GenerateOutput]:
    """A stream's chunks joined into one result per index."""
    parts: list[list[GenerateOutput]] = [[] for _ in range(num)]
    try:
        async for chunk in chunks:
            parts[chunk.index].append(chunk)
    finally:
        await chunks.aclose()
    return [join_chunks(p) for p in parts]
