"""SGLang-native endpoints: /generate, /separate_reasoning, health, model/server info, flush_cache, abort_request,
metrics. Streaming /generate sends SGLang's default shape: each event carries the cumulative
`text` and `output_ids` so far (clients slice from their last position), then `data: [DONE]`."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from forklm.parsers.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningStream,
    get_reasoning_parser,
)
from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.engine.intake import NO_IMAGES, RequestGroup
from forklm.runtime.engine.results import GenerateOutput, TokenLogprobs
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams
from forklm.server.errors import ApiError, sse_frames
from forklm.server.generation import (
    ChunkStream,
    GenerationService,
    json_safe_logprobs,
    tenancy,
    with_caller_session,
)
from forklm.server.image_inputs import decode_image_data, image_limits
from forklm.server.protocol import (
    AbortRequest,
    CloseSessionRequest,
    GenerateRequest,
    OpenSessionRequest,
    SeparateReasoningRequest,
)
from forklm.server.tenants import Caller, caller_of

router = APIRouter()
_HEALTH_TIMEOUT_S = 30.0
VERSION = "0.1.0"


def service_of(request: Request) -> GenerationService:
    return request.app.state.service


@router.post("/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Any:
    service = service_of(request)
    reasoning = _reasoning_of(service, body)
    for text in [body.text] if isinstance(body.text, str) else body.text or ():
        service.check_text_size("text", len(text))
    # tokenizing grows with the request
    group = await asyncio.to_thread(_prepare, service, body, caller_of(request))
    tokenizer = service.engine.tokenizer
    if body.stream:
        chunks = await service.open_stream("generate", group)
        return StreamingResponse(sse_frames(_cumulative(chunks, group, tokenizer, reasoning)),
                                 media_type="text/event-stream")
    results = []
    for out in await service.generate("generate", group, request):
        result = _as_json(group, out, tokenizer)
        if reasoning is not None:
            _put_reasoning(result, reasoning.parse(out.text, _opened(group, out.index, reasoning)))
        results.append(result)
    return results[0] if group.single else results


@router.post("/separate_reasoning")
async def separate_reasoning(body: SeparateReasoningRequest, request: Request) -> dict[str, Any]:
    """SGLang's endpoint: a reply's reasoning and its content (text)."""
    name = body.reasoning_parser or service_of(request).config.reasoning_parser
    if name is None:
        raise InvalidArgumentError("reasoning_parser", None, "is needed: the server was started "
                                   "without --reasoning-parser")
    split = get_reasoning_parser(name).parse(body.text)
    return {"text": split.content, "reasoning_text": split.reasoning}


def _reasoning_of(service: GenerationService, body: GenerateRequest) -> ReasoningParser | None:
    if not body.separate_reasoning:
        return None
    if service.config.reasoning_parser is None:
        raise InvalidArgumentError("separate_reasoning", True, "needs the server started with "
                                   "--reasoning-parser")
    return get_reasoning_parser(service.config.reasoning_parser)


def _opened(group: RequestGroup, index: int, reasoning: ReasoningParser) -> bool:
    """Whether result `index`'s prompt (when given as text) already opened the reasoning."""
    prompt = group.prompts[group.prompt_index(index)]
    return isinstance(prompt, str) and reasoning.opens_in(prompt)


def _put_reasoning(result: dict[str, Any], split: ReasoningDelta) -> None:
    result["text"], result["reasoning_text"] = split.content, split.reasoning


def _as_json(group: RequestGroup, out: GenerateOutput, tokenizer: Any,
             chunk: bool = False) -> dict[str, Any]:
    result = group.to_dict(out, tokenizer, chunk)
    json_safe_logprobs(result["meta_info"])
    return result


# GenerateRequest fields forklm cannot honour -> why; each is a 400 unless null/false.
UNSUPPORTED_FIELDS = {
    "custom_logit_processor": "forklm runs no custom logit processors",
    "return_hidden_states": "forklm does not return hidden states",
}


def _check_supported(body: GenerateRequest) -> None:
    for name, why in UNSUPPORTED_FIELDS.items():
        value = getattr(body, name)
        values = value if isinstance(value, list) else [value]
        if any(v is not None and v is not False for v in values):
            shown = value if isinstance(value, bool) else "<given>"
            raise InvalidArgumentError(name, shown, f"is not supported: {why}")


def _prepare(service: GenerationService, body: GenerateRequest, caller: Caller) -> RequestGroup:
    _check_supported(body)
    reasoning = _reasoning_of(service, body)
    # a reasoning format whose markers are special tokens (gpt-oss) must see them in the text
    keep = {"skip_special_tokens": False} if reasoning and reasoning.special_tokens_in_text else {}
    params = body.sampling_params
    if isinstance(params, list):
        params = [{**keep, **_drop_nulls(p)} for p in params]
    elif params is not None or keep:
        params = {**keep, **_drop_nulls(params or {})}
    request = EngineRequest.from_call(
        prompt=body.text, input_ids=body.input_ids, sampling_params=params,
        return_logprob=body.return_logprob, logprob_start_len=body.logprob_start_len,
        top_logprobs_num=body.top_logprobs_num, rid=body.rid,
        return_text_in_logprobs=body.return_text_in_logprobs, session_params=body.session_params,
        lora_path=body.lora_path, image_data=_images(service, body))
    request = with_caller_session(dataclasses.replace(request, **tenancy(caller, body)), caller)
    return service.engine.prepare(request, stream=body.stream)


def _images(service: GenerationService, body: GenerateRequest) -> Any:
    """The request's image_data decoded under the server's limits (a text model refuses it
    before anything is decoded)."""
    if body.image_data is None:
        return None
    if not service.engine.reads_images:
        raise InvalidArgumentError("image_data", "<given>", NO_IMAGES)
    return decode_image_data(body.image_data, isinstance(body.text, str),
                             image_limits(service.config))


def _drop_nulls(params: dict[str, Any]) -> dict[str, Any]:
    """SGLang treats a null sampling field as "use the default"."""
    return {k: v for k, v in params.items() if v is not None}


async def _cumulative(chunks: ChunkStream, group: RequestGroup, tokenizer: Any,
                      reasoning: ReasoningParser | None = None) -> AsyncGenerator[dict, None]:
    """SGLang's stream shape: every event carries its result's text and ids so far (and, with
    n > 1, the result's `index`). A result with stream_interval N gets an event once N new
    tokens have come (and at its end) instead of at every step. With a reasoning parser, `text`
    is the content so far and `reasoning_text` the reasoning so far."""
    splitters: dict[int, _Splitter] = {}
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    intervals = {r.index: r.sampling_params.stream_interval or 1 for r in group.reqs}
    unsent: dict[int, int] = {}  # tokens since the result's last event
    logprobs: dict[int, _StreamedLogprobs] = {}
    try:
        async for chunk in chunks:
            i = chunk.index
            texts[i] = texts.get(i, "") + chunk.text
            ids[i] = ids.get(i, []) + chunk.output_ids
            unsent[i] = unsent.get(i, 0) + len(chunk.output_ids)
            if chunk.logprobs is not None:
                logprobs.setdefault(i, _StreamedLogprobs()).add(chunk)
            if unsent[i] < intervals[i] and not chunk.finished:
                continue
            unsent[i] = 0
            event = {**_as_json(group, chunk, tokenizer, chunk=True), "text": texts[i],
                     "output_ids": ids[i]}
            if i in logprobs:
                with_text = tokenizer if group.return_text_in_logprobs else None
                event["meta_info"].update(json_safe_logprobs(logprobs[i].take(with_text)))
            if reasoning is not None:
                splitter = splitters.setdefault(
                    i, _Splitter(reasoning.stream(_opened(group, i, reasoning))))
                _put_reasoning(event, splitter.take(texts[i], chunk.finished))
            yield event
    finally:
        await chunks.aclose()


class _StreamedLogprobs:
    """One streamed result's logprobs as SGLang's incremental stream sends them: each event
    the entries of the tokens it adds (the prompt's with the first), and
    output_token_logprobs_length, the entries sent so far."""

    def __init__(self) -> None:
        self.pending: TokenLogprobs | None = None
        self.sent = 0

    def add(self, chunk: GenerateOutput) -> None:
        assert chunk.logprobs is not None
        self.pending = chunk.logprobs if self.pending is None else self.pending + chunk.logprobs

    def take(self, tokenizer: Any) -> dict[str, Any]:
        part = self.pending or TokenLogprobs([], [], None, None)
        self.pending = None
        meta = part.to_meta(tokenizer)
        self.sent += len(part.output_token)
        meta["output_token_logprobs_length"] = self.sent
        return meta


class _Splitter:
    """One streamed result's reasoning and content so far, fed only the text not yet seen."""

    def __init__(self, stream: ReasoningStream):
        self.stream, self.seen, self.reasoning, self.content = stream, 0, "", ""

    def take(self, text: str, finished: bool) -> ReasoningDelta:
        parts = [self.stream.feed(text[self.seen:])] + ([self.stream.finish()] if finished else [])
        self.seen = len(text)
        for part in parts:
            self.reasoning += part.reasoning
            self.content += part.content
        return ReasoningDelta(self.reasoning, self.content)


@router.get("/health", response_model=None)
@router.head("/health", response_model=None)
async def health(request: Request) -> Response:
    """200 while the server can take requests; 503 saying why when it cannot (the engine is
    gone, or admission is full). HEAD answers the same status without a body."""
    service = service_of(request)
    reason = service.unavailable_reason()
    status = 200 if reason is None else 503
    if request.method == "HEAD":
        return Response(status_code=status)
    if reason is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503,
                        headers={"Retry-After": str(service.config.retry_after_s)})


@router.get("/health_generate")
async def health_generate(request: Request) -> dict[str, Any]:
    """Generate one token end to end; 503 when the engine cannot within the timeout."""
    service = service_of(request)
    group = service.engine.prepare(EngineRequest(
        input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)))
    try:
        (result,) = await asyncio.wait_for(service.generate("health_generate", group),
                                           _HEALTH_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError) as e:
        raise ApiError(503, f"engine cannot generate: {e!r}") from e
    reason = result.finish_reason
    if reason is None or reason.type == "abort":
        raise ApiError(503, f"engine cannot generate: {reason}")
    return {"status": "ok", "output_ids": result.output_ids}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    service = service_of(request)
    info = service.engine.model_info
    return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
            "served_model_name": service.model_name, "is_generation": True,
            "context_length": info.context_len, "vocab_size": info.vocab_size,
            "dtype": info.dtype}


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    service = service_of(request)
    server = dataclasses.asdict(service.config)
    server["api_key"] = None if server["api_key"] is None else "<set>"  # never echo the secret
    stats = await asyncio.to_thread(service.engine.stats)
    return {**dataclasses.asdict(service.engine.config), **server, "version": VERSION,
            "internal_states": [{**stats, "admitted_requests": service.admission.admitted}]}


@router.post("/flush_cache")
async def flush_cache(request: Request) -> JSONResponse:
    """Drop the radix cache; refused (400) while requests are in flight, as SGLang does."""
    flushed = await asyncio.to_thread(service_of(request).engine.flush_cache)
    if not flushed:
        raise ApiError(400, "cache not flushed: requests are in flight; retry when idle")
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/open_session")
async def open_session(body: OpenSessionRequest, request: Request) -> JSONResponse:
    """SGLang's /open_session: returns the session's id (a JSON string). Requests that carry
    session_params={"id": it} keep their context pinned in the radix cache until /close_session
    or --session-idle-timeout-s. Each API key's sessions are its own."""
    caller = caller_of(request)
    sid = body.session_id or uuid.uuid4().hex
    await asyncio.to_thread(service_of(request).engine.open_session, caller.session_id(sid))
    return JSONResponse(sid)


@router.post("/close_session")
async def close_session(body: CloseSessionRequest, request: Request) -> dict[str, Any]:
    """Release a session's pins; an unknown id (or another key's) is a 404."""
    sid = caller_of(request).session_id(body.session_id)
    if not await asyncio.to_thread(service_of(request).engine.close_session, sid):
        raise ApiError(404, f"no open session {body.session_id!r}")
    return {"success": True}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> dict[str, Any]:
    """Abort a request by rid (a finished or unknown rid is a no-op, as aborts race finishing;
    so is another API key's request)."""
    service_of(request).engine.abort(body.rid, tenant=caller_of(request).name)
    return {"success": True}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    service = service_of(request)
    stats = await asyncio.to_thread(service.engine.stats)
    service.metrics.refresh(stats, service.admission.admitted)
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)
