"""Engine: the in-process serving API (SGLang's offline Engine shape) over a background loop thread.
A call goes intake (validate, tokenize) -> grammar (compile constraints) -> submit."""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from forklm.runtime.config import EngineConfig
from forklm.runtime.cpu_threads import release_openmp_threads
from forklm.runtime.engine.builder import EngineParts, ModelInfo, build_engine_parts
from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.engine.loop import EngineLoop
from forklm.runtime.engine.loop_mailbox import mailbox_for
from forklm.runtime.engine.results import GenerateOutput, TokenLogprobs
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from forklm.runtime.engine.client import SessionEngineClient
    from forklm.runtime.engine.intake import RequestGroup
    from forklm.runtime.lora.registry import LoraRegistry
    from forklm.runtime.scheduling.request import Req, ReqOutput


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
        if self.config.device == "cpu":  # the forwards run on the engine thread's own team
            release_openmp_threads()
        self.tokenizer = self.parts.tokenizer
        self.model_info: ModelInfo = self.parts.model_info()
        self._loop = EngineLoop(self.parts)
        self._opening: set[str] = set()  # sessions opened without waiting, not yet open

    @property
    def last_error(self) -> Exception | None:
        """The exception of the last engine step that failed (its requests were aborted)."""
        return self._loop.last_error

    @property
    def closed(self) -> bool:
        """Whether the engine can run nothing more: shut down, or its loop thread has died."""
        return not self._loop.alive

    # -- public API ----------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | list[int] | None = None,
                 sampling_params: Any = None, input_ids: list[int] | list[list[int]] | None = None,
                 *, stream: bool = False, **options: Any) -> Any:
        """Generate for one prompt (a dict result) or a list, or n > 1 (a list of results, in
        prompt-major order). `options` are EngineRequest.from_call's: return_logprob,
        logprob_start_len, top_logprobs_num, rid, return_text_in_logprobs, session_params.

        With stream=True (single prompt), returns an iterator of chunk dicts whose `text` and
        `output_ids` are the increments; the last chunk of each sample carries the finish_reason
        in meta_info, and with n > 1 every chunk names its sample in `index`.
        A constraint (regex, json_schema, ebnf, choices, structural_tag) is compiled before
        anything is submitted, on the grammar thread pool while this call waits; one that does
        not compile raises a ValueError carrying xgrammar's reason, and no request of the call
        runs.
        Logprob entries are [logprob, token_id, text]; text is None with
        return_text_in_logprobs=False (and then never decoded).
        session_params={"id": sid} (a session from open_session) pins what each request ends
        with for that session.
        """
        group = self.prepare(EngineRequest.from_call(prompt, sampling_params, input_ids,
                                                     **options), stream=stream)
        if stream:
            return self._dicts(group, self.run_stream(group))
        return self._shaped(group, self.run(group))

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, *, stream: bool = False,
                             **options: Any) -> Any:
        """Awaitable twin of generate; with stream=True returns an async iterator of chunks."""
        group = self.prepare(EngineRequest.from_call(prompt, sampling_params, input_ids,
                                                     **options), stream=stream)
        if stream:
            return self._dicts_async(group, await self.async_stream(group))
        return self._shaped(group, await self.async_run(group))

    def encode(self, prompt: str | list[str] | list[int] | None = None,
               input_ids: list[int] | list[list[int]] | None = None, *,
               pooling: str | None = None, **options: Any) -> Any:
        """Embed one prompt (a dict with `embedding`, SGLang's shape) or a list (a list of
        them): the final-normed hidden states pooled by `pooling` (None: ModelInfo.pooling),
        not normalized. `options`: EngineRequest fields (rid, cache_salt, priority, tenant)."""
        request = EngineRequest(prompt, input_ids, SamplingParams(max_new_tokens=0),
                                pooling=pooling or self.model_info.pooling, **options)
        group = self.prepare(request)
        return self._shaped(group, self.run(group))

    # -- typed API (EngineClient): EngineRequest in, GenerateOutputs out ------------------------
    def generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        """Every result of `request`, in prompt-major order, when all have finished."""
        return self.run(self.prepare(request))

    def stream_outputs(self, request: EngineRequest) -> Iterator[GenerateOutput]:
        """The chunks of a single-prompt request as they are decoded (see run_stream)."""
        return self.run_stream(self.prepare(request, stream=True))

    async def async_generate_outputs(self, request: EngineRequest) -> list[GenerateOutput]:
        return await self.async_run(self.prepare(request))

    async def async_stream_outputs(self, request: EngineRequest
                                   ) -> AsyncIterator[GenerateOutput]:
        return await self.async_stream(self.prepare(request, stream=True))

    def prepare(self, request: EngineRequest, stream: bool = False) -> RequestGroup:
        """The intake alone: the request validated and tokenized into a RequestGroup (raises
        InvalidArgumentError naming the bad argument). Nothing is submitted yet: `run`,
        `run_stream`, `async_run` or `async_stream` does that, so a caller can count and track
        the requests first."""
        if request.pooling is not None and self.config.tp_size > 1:
            raise InvalidArgumentError("pooling", request.pooling, "embeddings need the hidden "
                                       "states, which a tensor-parallel engine does not gather")
        group = self.parts.intake.build(request, stream)
        session = request.session_id
        pins = self.parts.kv.pins
        if session is not None and (pins is None or (
                session not in pins.sessions and session not in self._opening)):
            raise InvalidArgumentError("session_params", session,
                                       "no open session of that id (open_session first)")
        return group

    def run(self, group: RequestGroup) -> list[GenerateOutput]:
        """Compile the group's constraints (here, not in the loop), submit it and wait for every
        result, in order."""
        self._compile(group)
        return [f.result() for f in self._submit_collect(group)]

    def run_stream(self, group: RequestGroup) -> Generator[GenerateOutput, None, None]:
        """Compile, submit, and yield the group's chunks as GenerateOutputs (text and output_ids
        are increments; `index` names each chunk's result). Closing it early aborts the requests
        still running."""
        self._compile(group)
        return self._stream_sync(group)

    async def async_run(self, group: RequestGroup) -> list[GenerateOutput]:
        """run on the caller's event loop (no thread waits)."""
        await self._compile_async(group)
        futures = [asyncio.wrap_future(f) for f in self._submit_collect(group)]
        return list(await asyncio.gather(*futures))

    async def async_stream(self, group: RequestGroup) -> AsyncGenerator[GenerateOutput, None]:
        """Compile the group's constraints, submit it, and return the async iterator of its
        chunks as GenerateOutputs (any number of prompts and samples; `index` names each chunk's
        result). Leaving the iterator early aborts the requests still running."""
        await self._compile_async(group)
        return self._stream_async(group)

    def abort(self, rid: str, tenant: str | None = None) -> None:
        """Abort a request by id: it finishes with finish_reason abort and frees its KV.
        With `tenant`, only a request of that tenant (EngineRequest.tenant; "" for none)."""
        self._loop.abort(rid, "aborted by the caller", tenant)

    def open_session(self, session_id: str | None = None, wait: bool = True) -> str:
        """Open a session (SGLang's open_session): requests sent with session_params={"id": it}
        leave the sequence they end with pinned in the radix cache until the session closes or
        idles (EngineConfig.session_idle_timeout_s). Returns its id (a fresh one by default).
        wait=False (a fresh id only) returns at once: the open is queued ahead of any request
        that uses it."""
        if not wait and session_id is not None:
            raise InvalidArgumentError("session_id", session_id,
                                       "only a fresh session opens without waiting")
        sid, opened = self._open_session_on_loop(session_id)
        if wait and not opened.result():
            raise InvalidArgumentError("session_id", sid, "a session of that id is already open")
        return sid

    async def async_open_session(self, session_id: str | None = None) -> str:
        """open_session on the caller's event loop: a fresh one at once (wait=False), a named
        one awaited (no thread waits for the step)."""
        if session_id is None:
            return self.open_session(wait=False)
        sid, opened = self._open_session_on_loop(session_id)
        if not await asyncio.wrap_future(opened):
            raise InvalidArgumentError("session_id", sid, "a session of that id is already open")
        return sid

    def _open_session_on_loop(self, session_id: str | None) -> tuple[str, Future]:
        pins = self.parts.kv.pins
        if pins is None:
            raise InvalidArgumentError("session", session_id, "sessions pin prefixes in the radix "
                                       "cache, which this engine runs without")
        sid = uuid.uuid4().hex if session_id is None else session_id
        if not isinstance(sid, str) or not sid or len(sid) > 256:
            raise InvalidArgumentError("session_id", session_id, "expected a non-empty string")
        self._opening.add(sid)

        def open_now() -> bool:
            try:
                return pins.open(sid)
            finally:
                self._opening.discard(sid)

        return sid, self._loop.call_soon(open_now)

    def close_session(self, session_id: str, wait: bool = True) -> bool:
        """Release a session's pinned prefixes and forget it; False when it was not open. With
        wait=False the release is queued for the engine thread and this returns True at once."""
        pins = self.parts.kv.pins
        if pins is None:
            return False
        closed = self._loop.call_soon(lambda: pins.close(session_id))
        return bool(closed.result()) if wait else True

    # -- LoRA adapters (EngineConfig.lora_paths / enable_lora) ----------------------------------
    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Load the PEFT adapter folder `lora_path` as `lora_name` (SGLang's names); requests
        name it in lora_path. Raises InvalidArgumentError naming what is wrong."""
        try:
            self._lora_registry().load(lora_name, lora_path)
        finally:  # the load's torch work must not leave this thread a team (see __init__)
            release_openmp_threads()

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving `lora_name`; requests already running with it finish with it."""
        self._lora_registry().unload(lora_name)

    @property
    def reads_images(self) -> bool:
        """Whether the model takes image_data (a vision-language model's vision stage)."""
        return self.parts.intake.vision is not None

    def lora_adapters(self) -> dict[str, str]:
        """The adapters served: name -> folder ({} when LoRA is off)."""
        return {} if self.parts.lora is None else self.parts.lora.folders()

    def _lora_registry(self) -> LoraRegistry:
        if self.parts.lora is None:
            raise InvalidArgumentError("enable_lora", self.config.enable_lora,
                                       "LoRA is off on this engine: start it with enable_lora "
                                       "or lora_paths to load adapters")
        return self.parts.lora

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are in flight."""
        return self._loop.call(self._loop.flush_now)

    def stats(self) -> dict[str, Any]:
        """Running/waiting requests, KV slots used/cached/free, cache hits, throughput."""
        return self._loop.call(self._loop.stats_now)

    def check_invariants(self) -> None:
        """Assert the KV accounting (free + cached + in use == capacity, nothing owned twice)."""
        self._loop.call(lambda: self.parts.kv.check_invariants(self.parts.scheduler.active_reqs()))

    def shutdown(self) -> None:
        """Stop the loop; pending requests finish with an abort. Also after the loop closed
        itself: it waits for the loop to release its runner (tensor-parallel workers)."""
        self._loop.stop()
        self.parts.grammar.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- submission ----------------------------------------------------------------------------
    def _compile(self, group: RequestGroup) -> None:
        compiling = self.parts.grammar.compile_all(group.reqs)
        self.parts.grammar.attach(group.reqs, compiling)  # waits here, not in the loop

    async def _compile_async(self, group: RequestGroup) -> None:
        compiling = self.parts.grammar.compile_all(group.reqs)
        if compiling:  # attach() raises a compile error; gathering here marks it retrieved.
            # Cancelled (the caller left), the gather cancels these futures: the compiles
            # no one else awaits are dropped or stop holding their place in the pool.
            await asyncio.gather(*map(asyncio.wrap_future, compiling.values()),
                                 return_exceptions=True)
        self.parts.grammar.attach(group.reqs, compiling)

    def _shaped(self, group: RequestGroup, results: list[GenerateOutput]) -> Any:
        dicts = [group.to_dict(r, self.tokenizer) for r in results]
        return dicts[0] if group.single else dicts

    def _dicts(self, group: RequestGroup,
               chunks: Generator[GenerateOutput, None, None]) -> Iterator[dict[str, Any]]:
        try:
            for chunk in chunks:
                yield group.to_dict(chunk, self.tokenizer, chunk=True)
        finally:
            chunks.close()  # aborts what still runs when the caller stops early

    async def _dicts_async(self, group: RequestGroup, chunks: AsyncGenerator[GenerateOutput, None]
                           ) -> AsyncIterator[dict[str, Any]]:
        try:
            async for chunk in chunks:
                yield group.to_dict(chunk, self.tokenizer, chunk=True)
        finally:
            await chunks.aclose()

    def _submit_collect(self, group: RequestGroup) -> list[Future]:
        """Submit the group; each future resolves to its request's GenerateOutput when it
        finishes. Cancelling a future aborts its request."""
        futures = [self._collector(req) for req in group.reqs]
        self._loop.submit(group.reqs)
        return futures

    def _collector(self, req: Req) -> Future:
        fut: Future = Future()
        text_parts: list[str] = []

        def sink(out: ReqOutput) -> None:
            text_parts.append(out.delta_text)
            if out.finished and not fut.done():
                fut.set_result(GenerateOutput.of(out.req, "".join(text_parts)))

        def on_done(f: Future) -> None:
            if f.cancelled() and not self._loop.closed:  # the caller gave up: stop computing
                self.abort(req.rid)

        req.sink = sink
        fut.add_done_callback(on_done)
        return fut

    def _stream_sync(self, group: RequestGroup) -> Generator[GenerateOutput, None, None]:
        events: queue.Queue[ReqOutput] = queue.Queue()
        for req in group.reqs:
            req.sink = events.put
        self._loop.submit(group.reqs)

        def chunks() -> Generator[GenerateOutput, None, None]:
            try:
                remaining = len(group)
                while remaining:
                    out = events.get()
                    remaining -= out.finished
                    yield _chunk(out)
            finally:
                self._abort_unfinished(group)

        return chunks()

    async def _stream_async(self, group: RequestGroup) -> AsyncGenerator[GenerateOutput, None]:
        mailbox = mailbox_for(asyncio.get_running_loop())
        events: asyncio.Queue[ReqOutput] = asyncio.Queue()
        for req in group.reqs:
            req.sink = lambda out: mailbox.post(events.put_nowait, out)
        self._loop.submit(group.reqs)
        try:
            remaining = len(group)
            while remaining:
                out = await events.get()
                remaining -= out.finished
                yield _chunk(out)
        finally:
            self._abort_unfinished(group)

    def _abort_unfinished(self, group: RequestGroup) -> None:
        """The caller stopped reading: the requests still running are aborted."""
        for req in group.reqs:
            if not req.finished and not self._loop.closed:
                self.abort(req.rid)


def _chunk(out: ReqOutput) -> GenerateOutput:
    chunk = GenerateOutput.of(out.req, out.delta_text, out.delta_ids, final=out.finished)
    if out.req.return_logprob:
        # its tokens' logprobs (and the prompt's with the first chunk): entries before
        # num_output are final, whatever the engine thread appends meanwhile
        start = out.num_output - len(out.delta_ids)
        chunk = dataclasses.replace(chunk, logprobs=TokenLogprobs.of(
            out.req, start, out.num_output, with_input=start == 0))
    return chunk


if TYPE_CHECKING:  # Engine fulfils the client contract (checked by mypy)
    def _as_client(engine: Engine) -> SessionEngineClient:
        return engine
