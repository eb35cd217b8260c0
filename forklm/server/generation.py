"""How endpoints call the engine: admission against the bounded queue, the async engine API,
per-request timing and metrics. Endpoints build the engine arguments; this runs them."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from forklm.runtime.engine import Engine
from forklm.server.config import ServerConfig
from forklm.server.errors import ApiError
from forklm.server.metrics import ServerMetrics

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streamed request checks for its client


class Admission:
    """Counts requests (one per sample) the server has handed to the engine and not seen finish.
    A request that would push the count past `limit` is refused with 503 before anything is
    submitted, so every accepted request runs to its end."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s, self.admitted = limit, retry_after_s, 0

    def acquire(self, num: int) -> None:
        self.check(num)
        self.admitted += num

    def check(self, num: int) -> None:
        """Raise the 503 if `num` more requests would not fit now."""
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
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        limit = self.engine.config.max_running_requests + self.config.max_queued_requests
        self.admission = Admission(limit, self.config.retry_after_s)

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.engine.config.model_path

    async def generate(self, endpoint: str, call: dict[str, Any],
                       request: Request | None = None) -> Any:
        """Run one engine call (async_generate keywords, no stream); its result dict or list.
        With the HTTP `request`, a client that disconnects before the result aborts the call
        (its KV returns to the pool) instead of letting it run to the end for nobody."""
        if request is None:
            return await self._generate(endpoint, call)
        task = asyncio.ensure_future(self._generate(endpoint, call))
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()  # cancelling async_generate aborts its engine requests
        return await task

    async def _generate(self, endpoint: str, call: dict[str, Any]) -> Any:
        num = count_reqs(call)
        if num == 1 and _is_single(call):  # streamed inside, to time the first token
            return await _collect(await self.open_stream(endpoint, call))
        self.admission.acquire(num)
        try:
            result = await self.engine.async_generate(**call)
        finally:
            self.admission.release(num)
        for r in result if isinstance(result, list) else [result]:
            self.metrics.record_result(endpoint, r)
            _make_json_safe(r["meta_info"])
        return result

    async def open_stream(self, endpoint: str, call: dict[str, Any]) -> ChunkStream:
        """Admit, validate and start a streamed call (errors here become HTTP statuses) and return
        its chunks: each chunk's text/output_ids are increments; the last has finish_reason."""
        self.admission.acquire(1)
        return await self._start(endpoint, call)

    async def open_streams(self, endpoint: str,
                           calls: list[dict[str, Any]]) -> AsyncIterator[tuple[int, dict]]:
        """Several single streams at once (OpenAI n > 1 or a prompt list), merged as (index,
        chunk) in arrival order; admitted together or not at all, and started concurrently."""
        self.admission.acquire(len(calls))
        started = await asyncio.gather(*(self._start(endpoint, c) for c in calls),
                                       return_exceptions=True)
        failed = [s for s in started if isinstance(s, BaseException)]
        if failed:
            for s in started:
                if isinstance(s, ChunkStream):
                    await s.aclose()
            raise failed[0]
        return _merge([s for s in started if isinstance(s, ChunkStream)])

    async def _start(self, endpoint: str, call: dict[str, Any]) -> ChunkStream:
        """Submit one admitted call and wait for its first chunk. The admission is released when
        the stream ends or is closed, or here if it cannot start.

        Awaiting the first chunk here starts the iterator: a started async generator is closed by
        the event loop even if the response never iterates it (client gone before the headers),
        which aborts the request and releases its admission; an unstarted one would leak both."""
        try:
            chunks = await self.engine.async_generate(**call, stream=True)
        except BaseException:
            self.admission.release(1)
            raise
        timed = self._timed(endpoint, chunks)
        return ChunkStream(await timed.__anext__(), timed)

    async def _timed(self, endpoint: str, chunks: Any) -> AsyncGenerator[dict, None]:
        """Pass chunks through, timing the first token and the rest. Closing this iterator early
        (client gone) closes the engine's, which aborts the request and frees its KV."""
        start, first = time.perf_counter(), None
        try:
            async for chunk in chunks:
                meta = chunk["meta_info"]
                _make_json_safe(meta)
                if first is None and (chunk["output_ids"] or meta["finish_reason"]):
                    first = time.perf_counter()
                if meta["finish_reason"] is not None and first is not None:
                    self.metrics.record_result(endpoint, chunk)
                    self.metrics.record_timing(first - start, time.perf_counter() - first,
                                               meta["completion_tokens"])
                yield chunk
        finally:
            await chunks.aclose()
            self.admission.release(1)


class ChunkStream:
    """A started stream of chunk dicts, its first chunk already received and held back.
    aclose() ends it early: the engine aborts the request and frees its KV."""

    def __init__(self, first: dict[str, Any], rest: AsyncGenerator[dict[str, Any], None]):
        self._first: dict[str, Any] | None = first
        self._rest = rest

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await self._rest.__anext__()

    async def aclose(self) -> None:
        self._first = None
        await self._rest.aclose()


def _make_json_safe(meta: dict[str, Any]) -> None:
    """JSON has no -inf: a logprob of a token the grammar masked becomes -9999.0 (OpenAI's
    convention for "impossible"), so responses never fail to encode."""
    for key, value in meta.items():
        if key.endswith("logprobs") and isinstance(value, list):
            meta[key] = _finite(value)


def _finite(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else (-9999.0 if x < 0 else None)
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def count_reqs(call: dict[str, Any]) -> int:
    """Engine requests a call makes (prompts x n), for admission; a malformed call counts 1 and
    is then rejected by the engine's own validation."""
    prompt = call.get("prompt", call.get("input_ids"))
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(
        prompt[0], int) else 1
    params = call.get("sampling_params")
    params_list = params if isinstance(params, list) else [params] * num_prompts
    total = 0
    for p in params_list:
        n = p.get("n", 1) if isinstance(p, dict) else getattr(p, "n", 1)
        total += n if isinstance(n, int) and n >= 1 else 1
    return max(total, 1)


def _is_single(call: dict[str, Any]) -> bool:
    prompt = call.get("prompt", call.get("input_ids"))
    return isinstance(prompt, str) or (isinstance(prompt, list) and bool(prompt)
                                       and isinstance(prompt[0], int))


async def _collect(chunks: ChunkStream) -> dict[str, Any]:
    """A stream's chunks joined into one result dict (the last chunk carries the final meta)."""
    text: list[str] = []
    ids: list[int] = []
    last: dict[str, Any] = {}
    try:
        async for chunk in chunks:
            text.append(chunk["text"])
            ids.extend(chunk["output_ids"])
            last = chunk
    finally:
        await chunks.aclose()
    return {"text": "".join(text), "output_ids": ids, "meta_info": last["meta_info"]}


async def _merge(streams: list[ChunkStream]) -> AsyncIterator[tuple[int, dict]]:
    """Interleave async iterators; on early close every one is closed (aborting its request)."""
    queue: asyncio.Queue[tuple[int, dict | None]] = asyncio.Queue()

    async def pump(i: int, stream: ChunkStream) -> None:
        try:
            async for chunk in stream:
                await queue.put((i, chunk))
        finally:
            await stream.aclose()
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, chunk = await queue.get()
            if chunk is None:
                remaining -= 1
            else:
                yield i, chunk
        for t in tasks:
            t.result()  # re-raise a stream's error
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
