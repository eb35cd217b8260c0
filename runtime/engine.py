"""Engine: the in-process serving API (SGLang's offline Engine shape) over a background loop thread."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from forklm.runtime.builder import EngineParts, build_engine_parts
from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import EngineShutdownError
from forklm.runtime.output_processor import finish, process_logits
from forklm.runtime.request import FinishReason, Req, ReqOutput
from forklm.runtime.results import build_result, request_inputs

logger = logging.getLogger(__name__)


class Engine:
    """An LLM engine in this process: continuous batching over a radix-cached paged KV pool.

    `Engine(model_path=None, **config)`; None means the default model. Every EngineConfig field is
    accepted as a keyword. The loop runs in a daemon thread; all methods are thread-safe.
    """

    def __init__(self, model_path: str | None = None, **config: Any):
        if model_path is not None:
            config["model_path"] = model_path
        self.config = EngineConfig.from_kwargs(**config)
        self.parts: EngineParts = build_engine_parts(self.config)
        self.tokenizer = self.parts.tokenizer
        self._inbox: queue.Queue[Callable[[], None]] = queue.Queue()
        self._reqs: dict[str, Req] = {}
        self._seed_counter = itertools.count()
        self._stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0,
                       "forward_s": 0.0, "step_s": 0.0, "steps": 0, "decode_steps": 0,
                       "decode_tokens": 0, "decode_s": 0.0, "prefill_tokens": 0, "prefill_s": 0.0}
        self._closed = False
        self.last_error: Exception | None = None
        self._thread = threading.Thread(target=self._loop, name="forklm-engine", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | list[int] | None = None,
                 sampling_params: Any = None, input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None, stream: bool = False,
                 rid: str | list[str] | None = None) -> Any:
        """Generate for one prompt (a dict result) or a list (a list of results, in order).

        With stream=True (single prompt), returns an iterator of chunk dicts whose `text` and
        `output_ids` are the increments; the last chunk carries the finish_reason in meta_info.
        A constraint (regex, json_schema, ebnf, choices) is compiled before anything is submitted,
        on the grammar thread pool while this call waits; one that does not compile raises a
        ValueError carrying xgrammar's reason, and no request of the call runs.
        """
        items, single = request_inputs(self, prompt, input_ids, sampling_params, return_logprob,
                                       logprob_start_len, top_logprobs_num, rid, stream)
        self.parts.grammar.compile_all(items)
        self.parts.grammar.attach(items)  # waits for compilation, here and not in the engine loop
        if stream:
            return self._stream_sync(items[0])
        waiters = [self._submit_collect(item) for item in items]
        results = [w.result() for w in waiters]
        return results[0] if single and len(results) == 1 else results

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, return_logprob: bool = False,
                             logprob_start_len: int | None = None,
                             top_logprobs_num: int | None = None, stream: bool = False,
                             rid: Any = None) -> Any:
        """Awaitable twin of generate; with stream=True returns an async iterator of chunks."""
        items, single = request_inputs(self, prompt, input_ids, sampling_params, return_logprob,
                                       logprob_start_len, top_logprobs_num, rid, stream)
        compiling = self.parts.grammar.compile_all(items)
        if compiling:  # attach() raises a compile error; gathering here marks it retrieved
            await asyncio.gather(*map(asyncio.wrap_future, compiling), return_exceptions=True)
        self.parts.grammar.attach(items)
        if stream:
            return self._stream_async(items[0])
        futures = [asyncio.wrap_future(self._submit_collect(item)) for item in items]
        results = await asyncio.gather(*futures)
        return results[0] if single and len(results) == 1 else list(results)

    def abort(self, rid: str) -> None:
        """Abort a request by id: it finishes with finish_reason abort and frees its KV."""
        self._post(lambda: self._abort_now(rid, "aborted by the caller"))

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are in flight."""
        return self._call(self._flush_now)

    def stats(self) -> dict[str, Any]:
        """Running/waiting requests, KV slots used/cached/free, cache hits, throughput."""
        return self._call(self._stats_now)

    def check_invariants(self) -> None:
        """Assert the KV accounting (free + cached + in use == capacity, nothing owned twice)."""
        self._call(lambda: self.parts.kv.check_invariants(self.parts.scheduler.active_reqs()))

    def shutdown(self) -> None:
        """Stop the loop; pending requests finish with an abort."""
        if self._closed:
            return
        self._post(self._stop_now)
        self._thread.join(timeout=30)
        self.parts.grammar.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- submission ----------------------------------------------------------------------------
    def new_generator(self, seed: int | None) -> torch.Generator:
        if seed is None:
            seed = self.config.random_seed * 1_000_003 + next(self._seed_counter)
        return torch.Generator().manual_seed(seed)

    def _submit_collect(self, item: Req) -> Future:
        """Submit one request; the future resolves to its result dict when it finishes."""
        fut: Future = Future()
        text_parts: list[str] = []

        def sink(out: ReqOutput) -> None:
            text_parts.append(out.delta_text)
            if out.finished and not fut.done():
                fut.set_result(build_result(out.req, "".join(text_parts), self.tokenizer))

        def on_done(f: Future) -> None:
            if f.cancelled() and not self._closed:  # the caller gave up: stop computing for it
                self.abort(item.rid)

        item.sink = sink
        self._post(lambda: self._add_now(item))
        fut.add_done_callback(on_done)
        return fut

    def _stream_sync(self, item: Req) -> Iterator[dict[str, Any]]:
        events: queue.Queue[ReqOutput] = queue.Queue()
        item.sink = events.put
        self._post(lambda: self._add_now(item))

        def chunks() -> Iterator[dict[str, Any]]:
            try:
                while True:
                    out = events.get()
                    yield build_result(out.req, out.delta_text, self.tokenizer, out.delta_ids,
                                       final=out.finished)
                    if out.finished:
                        return
            finally:
                if not item.finished and not self._closed:  # the caller stopped reading
                    self.abort(item.rid)

        return chunks()

    async def _stream_async(self, item: Req) -> AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[ReqOutput] = asyncio.Queue()
        item.sink = lambda out: loop.call_soon_threadsafe(events.put_nowait, out)
        self._post(lambda: self._add_now(item))
        try:
            while True:
                out = await events.get()
                yield build_result(out.req, out.delta_text, self.tokenizer, out.delta_ids,
                                   final=out.finished)
                if out.finished:
                    return
        finally:
            if not item.finished and not self._closed:  # the caller stopped reading
                self.abort(item.rid)

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    # -- the loop (engine thread only below) ---------------------------------------------------
    def _post(self, fn: Callable[[], None]) -> None:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        self._inbox.put(fn)

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread (between steps) and return its result."""
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, not swallowed
                fut.set_exception(e)

        self._post(run)
        return fut.result()

    def _loop(self) -> None:
        if self.config.num_threads:
            torch.set_num_threads(self.config.num_threads)
        while not self._closed:
            self._drain_inbox(block=not self.parts.scheduler.has_work)
            if not self._closed:
                self._guarded_step()

    def _guarded_step(self) -> None:
        """A bug in a step must not hang callers: fail every active request loudly instead."""
        try:
            self._step()
            if self.config.debug_check_invariants:
                self.parts.kv.check_invariants(self.parts.scheduler.active_reqs())
        except Exception as e:
            logger.exception("engine step failed; aborting all requests")
            self.last_error = e
            for rid in list(self._reqs):
                self._abort_now(rid, f"internal error: {e!r}")

    def _drain_inbox(self, block: bool) -> None:
        try:
            fn = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            fn()
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        sched, t0 = self.parts.scheduler, time.perf_counter()
        batch = sched.schedule()
        self._emit_aborted()
        if batch is None:
            return
        try:
            t1 = time.perf_counter()
            logits, layout = self.parts.runner.forward(batch)
            t2 = time.perf_counter()
            num_generated = process_logits(batch, logits, layout, self.parts.grammar)
        except Exception as e:  # a failing batch must not hang its callers or stop the engine
            logger.exception("engine step failed")
            for req in batch.reqs:
                sched.abort(req)  # idempotent; also removes requests that finished mid-step
                self._reqs.pop(req.rid, None)
                if not req.finished:
                    finish(req, FinishReason("abort", message=f"engine error: {e}"))
            return
        sched.after_step(batch)
        self._record_step(batch, time.perf_counter() - t0, t2 - t1, num_generated)

    def _record_step(self, batch: Any, step_s: float, forward_s: float, num_generated: int) -> None:
        s = self._stats
        s["steps"] += 1
        s["step_s"] += step_s
        s["forward_s"] += forward_s
        s["generated_tokens"] += num_generated
        if batch.is_decode or batch.is_catch_up:
            s["decode_steps"] += 1
            s["decode_tokens"] += num_generated
            s["decode_s"] += step_s
        else:
            s["prefill_tokens"] += sum(batch.extend_lens)
            s["prefill_s"] += step_s

    def _emit_aborted(self) -> None:
        sched = self.parts.scheduler
        while sched.aborted:
            req = sched.aborted.pop()
            self._reqs.pop(req.rid, None)
            finish(req, req.finish_reason or FinishReason("abort"))

    def _add_now(self, req: Req) -> None:
        if req.rid in self._reqs:
            finish(req, FinishReason("abort", message=f"duplicate rid {req.rid!r}"))
            return
        self._reqs[req.rid] = req
        wrapped = req.sink

        def sink(out: ReqOutput) -> None:
            if out.finished:
                self._reqs.pop(out.rid, None)
                self._stats["prompt_tokens"] += len(out.req.origin_input_ids)
                self._stats["cached_tokens"] += out.req.cached_tokens
            wrapped(out)

        req.sink = sink
        self.parts.scheduler.waiting.append(req)

    def _abort_now(self, rid: str, message: str) -> None:
        req = self._reqs.get(rid)
        if req is None or req.finished:
            return
        self.parts.scheduler.abort(req)
        finish(req, FinishReason("abort", message=message))

    def _flush_now(self) -> bool:
        if self.parts.scheduler.has_work:
            return False
        self.parts.kv.flush()
        return True

    def _stop_now(self) -> None:
        for rid in list(self._reqs):
            self._abort_now(rid, "engine shut down")
        self._closed = True

    def _stats_now(self) -> dict[str, Any]:
        sched, kv, s = self.parts.scheduler, self.parts.kv, self._stats
        cached = kv.cache.total_size if kv.cache else 0
        free = kv.allocator.num_free
        return {
            "running": len(sched.running) + (1 if sched.chunked_req else 0),
            "waiting": len(sched.waiting),
            "kv_capacity": kv.allocator.capacity,
            "kv_free": free,
            "kv_cached": cached,
            "kv_used": kv.allocator.capacity - free - cached,
            # distinct tokens the reserved slots stand for (cache + running requests' own tokens)
            "kv_tokens_needed": cached + sum(r.num_computed - r.prefix_len
                                             for r in sched.active_reqs() if r.row is not None),
            "prompt_tokens": s["prompt_tokens"],
            "cache_hit_tokens": s["cached_tokens"],
            "cache_hit_rate": s["cached_tokens"] / max(s["prompt_tokens"], 1),
            "generated_tokens": s["generated_tokens"],
            "decode_tokens_per_s": s["decode_tokens"] / s["decode_s"] if s["decode_s"] else 0.0,
            "prefill_tokens_per_s": s["prefill_tokens"] / s["prefill_s"] if s["prefill_s"] else 0.0,
            "steps": s["steps"],
            "overhead_ms_per_step": 1000 * (s["step_s"] - s["forward_s"]) / max(s["steps"], 1),
            "forward_ms_per_step": 1000 * s["forward_s"] / max(s["steps"], 1),
        }
