"""POST /v1/responses, OpenAI's Responses API. The request becomes a chat completion request at
the edge (responses_convert), so prompt, sampling, tool plan, parsers and admission are chat's;
only the output shapes are the Responses API's (responses_output). `previous_response_id`
reads a bounded in-memory store (responses_store)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from forklm.runtime.errors import InvalidArgumentError
from forklm.server import openai_convert as conv
from forklm.server.errors import ApiError, error_body
from forklm.server.generation import ChunkStream
from forklm.server.native_api import service_of
from forklm.server.openai_api import prepare_chat
from forklm.server.responses_convert import input_items, item_of, to_chat_request
from forklm.server.responses_output import (
    TERMINAL_EVENTS,
    Event,
    Output,
    OutputBuilder,
    ResponseHead,
    Sequencer,
    response_status,
)
from forklm.server.responses_protocol import Item, ReasoningItem, ResponsesRequest
from forklm.server.responses_store import ResponseStore, conversation_chars
from forklm.server.tenants import caller_of
from forklm.server.tools import plan_tools

router = APIRouter(prefix="/v1")


@router.post("/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    service, store = service_of(request), store_of(request.app)
    check_supported(body)
    caller = caller_of(request)
    history = _history(store, body.previous_response_id, caller.name)
    if history is None:
        return _previous_not_found(body.previous_response_id)
    items = history + input_items(body)
    service.check_text_size("input", conversation_chars(items) + len(body.instructions or ""))
    chat = to_chat_request(body, items)
    conv.check_model(service, chat)
    plan = plan_tools(chat, service)
    if plan.reasoning is None and any(isinstance(i, ReasoningItem) for i in items):
        raise InvalidArgumentError("input", "reasoning", "reasoning items need a server "
                                   "started with --reasoning-parser")
    group, plan = await prepare_chat(service, chat, plan, caller)
    head = ResponseHead.of(body, f"resp_{uuid.uuid4().hex}", int(time.time()))
    builder = OutputBuilder(plan.reader(), Sequencer())

    def remember(output: Output) -> None:
        if body.store:
            store.put(head.id, items + _items_of(output), caller.name)

    if body.stream:
        chunks = await service.open_stream("responses", group)
        events = _events(head, chunks, builder, remember)
        return StreamingResponse(_frames(events, builder.seq), media_type="text/event-stream")
    [result] = await service.generate("responses", group, request)
    builder.feed(result.text)
    builder.finish(result)
    if response_status(result) != "failed":
        remember(builder.output)
    return head.response(builder.output, result)


def store_of(app: Any) -> ResponseStore:
    """The app's store, made on first use (create_app knows nothing of it)."""
    store = getattr(app.state, "response_store", None)
    if store is None:
        store = app.state.response_store = ResponseStore()
    return store


def check_supported(body: ResponsesRequest) -> None:
    """A 400 naming each feature that is set but that this server cannot honour."""
    unsupported = {"conversation": body.conversation, "prompt": body.prompt,
                   "context_management": body.context_management,
                   "background": body.background or None,
                   "include": body.include or None, "top_logprobs": body.top_logprobs or None}
    for name, value in unsupported.items():
        if value is not None:
            raise InvalidArgumentError(name, value, "is not supported by this server")
    if body.truncation == "auto":
        raise InvalidArgumentError("truncation", "auto", "is not supported: a conversation "
                                   "longer than the context is an error, not truncated")
    if body.reasoning is not None and (body.reasoning.effort or body.reasoning.summary):
        raise InvalidArgumentError("reasoning", body.reasoning.model_dump(exclude_none=True),
                                   "is not supported: use chat_template_kwargs on "
                                   "/v1/chat/completions to steer a template's reasoning")


def _history(store: ResponseStore, previous_id: str | None,
             owner: str) -> tuple[Item, ...] | None:
    """The stored conversation `previous_id` continues; None when there is none, or when
    another API key stored it (answered as not found: ids are not shared between keys)."""
    if previous_id is None:
        return ()
    entry = store.get(previous_id)
    return None if entry is None or entry.owner != owner else entry.conversation


def _previous_not_found(previous_id: str | None) -> JSONResponse:
    """OpenAI's answer to an unknown (never stored, or evicted) previous_response_id."""
    body = error_body(400, f"Previous response with id {previous_id!r} not found.",
                      "previous_response_id")
    body["error"]["code"] = "previous_response_not_found"
    return JSONResponse(body, status_code=400)


def _items_of(output: Output) -> tuple[Item, ...]:
    """The output as the input items a later turn sees."""
    return tuple(item_of(o) for o in output)


async def _events(head: ResponseHead, chunks: ChunkStream, builder: OutputBuilder,
                  remember: Callable[[Output], None]) -> AsyncGenerator[Event, None]:
    """A streamed response's events: text and call arguments stream as the reply's parsers
    release them (held back only while a piece may still open a tool call)."""
    seq = builder.seq
    try:
        yield seq("response.created", response=head.response([], None))
        yield seq("response.in_progress", response=head.response([], None))
        final = None
        async for chunk in chunks:
            for event in builder.feed(chunk.text):
                yield event
            final = chunk if chunk.finished else final
        assert final is not None, "a stream ends with its finished chunk"
        for event in builder.finish(final):
            yield event
        status = response_status(final)
        if status != "failed":
            remember(builder.output)  # before the terminal event: a client may follow up at once
        yield seq(TERMINAL_EVENTS[status], response=head.response(builder.output, final))
    finally:
        await chunks.aclose()


async def _frames(events: AsyncGenerator[Event, None], seq: Sequencer) -> AsyncIterator[bytes]:
    """Events as SSE frames (`event:` names the type, as OpenAI sends them). An error after the
    first frame is an `error` event; however the stream ends, the generation is closed."""
    try:
        async for event in events:
            yield _frame(event)
    except Exception as e:  # headers are sent: report in-band
        yield _frame(_error_event(seq, e))
    finally:
        await events.aclose()


def _error_event(seq: Sequencer, exc: BaseException) -> Event:
    if isinstance(exc, InvalidArgumentError):
        return seq("error", code="invalid_request_error", message=str(exc), param=exc.name)
    if isinstance(exc, ApiError):
        return seq("error", code=str(exc.status), message=exc.message, param=exc.param)
    return seq("error", code="server_error", message=f"internal error: {exc!r}", param=None)


def _frame(event: Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
