"""POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens. The request becomes
a chat completion request at the edge (anthropic_convert), so prompt, sampling, tool plan,
parsers, tenancy and admission are chat's; only the output shapes are Anthropic's
(anthropic_output). Errors under /v1/messages take Anthropic's shape (errors.error_body_at)."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from forklm.runtime.engine.intake import encode_prompt
from forklm.runtime.errors import InvalidArgumentError
from forklm.server import openai_convert as conv
from forklm.server.anthropic_convert import to_chat_request
from forklm.server.anthropic_output import BlockBuilder, Event, MessageHead, usage
from forklm.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from forklm.server.errors import ApiError, anthropic_error_body
from forklm.server.generation import ChunkStream
from forklm.server.native_api import service_of
from forklm.server.openai_api import chat_prompt, prepare_chat
from forklm.server.tenants import caller_of
from forklm.server.tools import plan_tools

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")


@router.post("/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Any:
    service = service_of(request)
    chat = await asyncio.to_thread(to_chat_request, body)  # grows with the conversation
    conv.check_model(service, chat)
    group, plan = await prepare_chat(service, chat, plan_tools(chat, service),
                                     caller_of(request))
    head = MessageHead(f"msg_{uuid.uuid4().hex}", body.model, tuple(body.stop_sequences or ()))
    builder = BlockBuilder(plan.reader())
    if body.stream:
        chunks = await service.open_stream("messages", group)
        return StreamingResponse(_frames(_events(head, chunks, builder)),
                                 media_type="text/event-stream")
    [result] = await service.generate("messages", group, request)
    builder.feed(result.text)
    builder.finish()
    return head.message(builder.blocks, result, builder.called, usage(result))


@router.post("/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The prompt's tokens as /v1/messages renders and tokenizes the same conversation (tools and
    the tool prompt included): its usage's input plus cache read tokens."""
    service = service_of(request)
    chat = await asyncio.to_thread(to_chat_request, body)  # grows with the conversation
    conv.check_model(service, chat)
    prompt = await chat_prompt(service, chat, plan_tools(chat, service))
    if prompt.input_ids is not None:
        return {"input_tokens": len(prompt.input_ids)}
    bos = service.engine.parts.intake.bos_token_id
    ids = await asyncio.to_thread(encode_prompt, service.engine.tokenizer, prompt.text, bos)
    return {"input_tokens": len(ids)}


async def _events(head: MessageHead, chunks: ChunkStream,
                  builder: BlockBuilder) -> AsyncGenerator[Event, None]:
    """A streamed message's events in Anthropic's order: message_start, each block's start,
    deltas and stop, message_delta (stop reason, usage), message_stop."""
    try:
        started, final = False, None
        async for chunk in chunks:
            if not started:  # the prompt's counts are known from the first chunk
                started = True
                yield {"type": "message_start", "message": head.message(
                    [], None, False, usage(chunk, output_tokens=0))}
            events = builder.feed(chunk.text)
            if chunk.finished:
                final = chunk
                events += builder.finish()
            for event in events:
                yield event
        assert final is not None, "a stream ends with its finished chunk"
        reason, sequence = head.stop_reason(final, builder.called)
        yield {"type": "message_delta", "delta": {"stop_reason": reason,
                                                  "stop_sequence": sequence},
               "usage": usage(final)}
        yield {"type": "message_stop"}
    finally:
        await chunks.aclose()


async def _frames(events: AsyncGenerator[Event, None]) -> AsyncIterator[bytes]:
    """Events as SSE frames (`event:` names the type; the client reads nothing without it). An
    error after the first frame is an `error` event; however the stream ends, the generation is
    closed."""
    try:
        async for event in events:
            yield _frame(event)
    except Exception as e:  # headers are sent: report in-band
        yield _frame(_error_event(e))
    finally:
        await events.aclose()


def _error_event(exc: Exception) -> Event:
    if isinstance(exc, InvalidArgumentError):
        return anthropic_error_body(400, str(exc))
    if isinstance(exc, ApiError):
        return anthropic_error_body(exc.status, exc.message)
    logger.exception("error in a /v1/messages stream")
    return anthropic_error_body(500, f"internal error: {type(exc).__name__}")


def _frame(event: Event) -> bytes:
    data = json.dumps(event, ensure_ascii=False)
    return f"event: {event['type']}\ndata: {data}\n\n".encode()
