"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (with tools).
A request's prompts and its n samples are one engine call; choice i is the call's result i
(prompt-major), streamed or not."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from forklm.runtime.engine.engine_request import EngineRequest, LogprobOptions
from forklm.runtime.engine.intake import NO_IMAGES, RequestGroup
from forklm.runtime.engine.results import GenerateOutput
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams
from forklm.server import openai_convert as conv
from forklm.server.chat_template import (
    ChatPrompt,
    load_chat_template,
    render_chat_prompt,
    template_kwargs,
)
from forklm.server.errors import sse_frames
from forklm.server.generation import ChunkStream, GenerationService, tenancy
from forklm.server.image_inputs import chat_image_urls, decode_chat_images, image_limits
from forklm.server.native_api import service_of
from forklm.server.protocol import ChatCompletionRequest, CompletionRequest
from forklm.server.tenants import Caller, caller_of
from forklm.server.tools import ReplyDelta, ToolPlan, plan_tools, whole_calls

router = APIRouter(prefix="/v1")
# A request's own constraints, which a tool plan must not override
CONSTRAINTS = ("regex", "ebnf", "json_schema", "structural_tag")
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    service = service_of(request)
    context_len = service.engine.model_info.context_len
    base = {"id": service.model_name, "object": "model", "created": 0, "owned_by": "forklm",
            "root": service.engine.config.model_path, "max_model_len": context_len}
    # LoRA adapters as models of their own (vLLM's listing): `parent` is the base model.
    adapters = [{"id": name, "object": "model", "created": 0, "owned_by": "forklm",
                 "root": folder, "parent": service.model_name, "max_model_len": context_len}
                for name, folder in service.engine.lora_adapters().items()]
    return {"object": "list", "data": [base, *adapters]}


# -- /v1/completions ---------------------------------------------------------------------------
@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    service = service_of(request)
    conv.check_model(service, body)
    if body.suffix:
        raise InvalidArgumentError("suffix", body.suffix, "is not supported")
    if body.echo and body.stream:
        raise InvalidArgumentError("echo", True, "is not supported with stream")
    if body.prompt_logprobs is not None and body.stream:
        raise InvalidArgumentError("prompt_logprobs", body.prompt_logprobs,
                                   "is not supported with stream")
    if body.best_of not in (None, body.n):
        raise InvalidArgumentError("best_of", body.best_of, "only best_of == n is supported")
    max_tokens = body.max_tokens if body.max_tokens is not None else _COMPLETION_DEFAULT_MAX_TOKENS
    for text in [body.prompt] if isinstance(body.prompt, str) else body.prompt:
        if isinstance(text, str):
            service.check_text_size("prompt", len(text))
    # Tokenizing grows with the prompt: a worker thread, never the event loop.
    top = conv.completion_top_logprobs(body)
    group = await asyncio.to_thread(_prepare, service, body, caller_of(request), body.prompt,
                                    conv.sampling_dict(body, max_tokens), top,
                                    body.prompt_logprobs is not None)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": body.model}
    if body.stream:
        chunks = await service.open_stream("completions", group)
        return _sse(_completion_events(chunks, head, body, len(group), service.engine.tokenizer))
    results = await service.generate("completions", group, request)
    tokenizer = service.engine.tokenizer
    choices = []
    for i, r in enumerate(results):
        echo = _prompt_text(group.prompts[group.prompt_index(i)], tokenizer) if body.echo else ""
        choice = {"index": i, "text": echo + r.text,
                  "logprobs": None if body.logprobs is None else conv.completion_logprobs(
                      r, tokenizer, len(echo)),
                  "finish_reason": conv.finish_reason(r), "matched_stop": conv.matched_stop(r)}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = conv.prompt_logprobs(r, tokenizer, body.prompt_logprobs)
        choices.append(choice)
    return {**head, "choices": choices, "usage": conv.usage(results, body.n)}


def _prompt_text(prompt: Any, tokenizer: Any) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


async def _completion_events(chunks: ChunkStream, head: dict[str, Any], body: CompletionRequest,
                             num: int, tokenizer: Any) -> AsyncGenerator[dict, None]:
    finals: list[GenerateOutput] = []
    async for chunk in chunks:
        yield {**head, "choices": [{
            "index": chunk.index, "text": chunk.text,
            "logprobs": conv.completion_logprobs(chunk, tokenizer, 0),
            "finish_reason": conv.finish_reason(chunk), "matched_stop": conv.matched_stop(chunk)}]}
        if chunk.finished:
            finals.append(chunk)
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": conv.usage(_in_order(finals, num), body.n)}


# -- /v1/chat/completions ----------------------------------------------------------------------
@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    service = service_of(request)
    conv.check_model(service, body)
    if body.top_logprobs and not body.logprobs:
        raise InvalidArgumentError("top_logprobs", body.top_logprobs, "needs logprobs=true")
    group, plan = await prepare_chat(service, body, plan_tools(body, service),
                                     caller_of(request))
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.model}
    if body.stream:
        chunks = await service.open_stream("chat", group)
        chunk_head = {**head, "object": "chat.completion.chunk"}
        return _sse(_chat_events(chunks, chunk_head, body, plan, len(group),
                                 service.engine.tokenizer))
    results = await service.generate("chat", group, request)
    choices = [{"index": i, **_chat_choice(r.text, r, plan, service.engine.tokenizer)}
               for i, r in enumerate(results)]
    return {**head, "choices": choices, "usage": conv.usage(results, body.n)}


async def prepare_chat(service: GenerationService, body: ChatCompletionRequest,
                       plan: ToolPlan, caller: Caller) -> tuple[RequestGroup, ToolPlan]:
    """The engine call of a chat request (also the Responses API's) and the plan that reads its
    replies. Bounding, rendering and tokenizing the text run in a worker thread (all grow with
    the request)."""
    if not service.engine.reads_images and chat_image_urls(body.messages):
        raise InvalidArgumentError("messages", "<image parts>", NO_IMAGES)
    prompt = await chat_prompt(service, body, plan)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = conv.sampling_dict(body, max_tokens if max_tokens is not None
                                else service.engine.model_info.context_len)
    _add_tool_constraint(params, plan)
    top = (body.top_logprobs or 0) if body.logprobs else None
    engine_prompt = prompt.text if prompt.input_ids is None else prompt.input_ids
    group = await asyncio.to_thread(_prepare, service, body, caller, engine_prompt, params, top,
                                    images=True)
    return group, plan.with_prompt(prompt.text)


def _chat_chars(body: ChatCompletionRequest) -> int:
    """The characters of the conversation's text: contents and tool-call arguments."""
    total = 0
    for m in body.messages:
        content = m.content
        total += len(content) if isinstance(content, str) else sum(
            len(part.text) for part in content or () if part.type == "text")
        total += sum(len(c.function.arguments) for c in m.tool_calls or ())
    return total


def _tools_chars(plan: ToolPlan) -> int:
    """The characters of the tools' text the prompt renders: names, descriptions, schemas."""
    return sum(len(t.function.name) + len(t.function.description or "")
               + len(json.dumps(t.function.parameters or {})) for t in plan.tools)


async def chat_prompt(service: GenerationService, body: ChatCompletionRequest,
                       plan: ToolPlan) -> ChatPrompt:
    """The request's prompt, built in a worker thread (the work grows with the request); control
    tokens typed into it stay text unless the server allows them."""

    def render() -> ChatPrompt:
        num_chars = _chat_chars(body)
        service.check_text_size("messages", num_chars)
        if plan.active:
            service.check_text_size("tools", num_chars + _tools_chars(plan))
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan.active else None
        return render_chat_prompt(
            service.engine.tokenizer, messages, tools,
            template_kwargs(body.chat_template_kwargs, body.reasoning_effort),
            add_generation_prompt=body.add_generation_prompt,
            chat_template=load_chat_template(service.config.chat_template),
            tool_prompt=plan.system_prompt() if plan.active else None, guard=service.guard,
            continue_final_message=body.continue_final_message)

    return await run_in_threadpool(render)


def _add_tool_constraint(params: dict[str, Any], plan: ToolPlan) -> None:
    """A forced call: a JSON schema on the whole reply. "auto" in a model's format: each call the
    model opens is constrained by its tool's schema (a structural tag, unless the request has
    its own constraint). Replies whose call or reasoning markers are special tokens keep them
    in their text."""
    if plan.keeps_special_tokens:
        params.setdefault("skip_special_tokens", False)
    if plan.mode == "auto" and plan.parser is not None:
        tag = plan.structural_tag()
        if tag is not None and not any(k in params for k in CONSTRAINTS):
            params["structural_tag"] = tag
        return
    schema = plan.schema()
    if schema is None:
        return
    taken = [k for k in CONSTRAINTS if k in params]
    if taken:
        raise InvalidArgumentError("tool_choice", plan.mode, f"a forced tool call cannot be "
                                   f"combined with {taken[0]} (or response_format)")
    params["json_schema"] = schema


def _chat_choice(text: str, final: GenerateOutput, plan: ToolPlan,
                 tokenizer: Any) -> dict[str, Any]:
    """A reply's whole `text` as a choice; `final` is its result (or its last chunk)."""
    reader = plan.reader()
    reply = reader.read(text)
    calls = whole_calls(reply, reader.complete)
    # No text beside calls or reasoning is null content, as OpenAI's replies have it.
    empty = None if calls or reply.reasoning else reply.content
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or empty}
    if plan.reasoning is not None:
        message["reasoning_content"] = reply.reasoning or None
    if calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}} for c in calls]
    return {"message": message, "logprobs": conv.chat_logprobs(final, tokenizer),
            "finish_reason": _chat_finish_reason(bool(calls), final),
            "matched_stop": conv.matched_stop(final)}


def _chat_finish_reason(called: bool, final: GenerateOutput) -> str | None:
    """A reply with calls ends in "tool_calls", but a call cut off by max_tokens is "length"."""
    reason = conv.finish_reason(final)
    return "tool_calls" if called and reason == "stop" else reason


async def _chat_events(chunks: ChunkStream, head: dict[str, Any], body: ChatCompletionRequest,
                       plan: ToolPlan, num: int, tokenizer: Any) -> AsyncGenerator[dict, None]:
    """Each reply is read as it comes: reasoning, content and tool-call pieces stream as soon as
    they are known (text that may start a tag waits for the next chunk)."""
    finals: list[GenerateOutput] = []
    readers = [plan.reader() for _ in range(num)]
    called = [False] * num
    for i in range(num):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    async for chunk in chunks:
        i = chunk.index
        delta = readers[i].feed(chunk.text)
        if chunk.finished:
            finals.append(chunk)
            delta = delta.then(readers[i].finish())
        called[i] = called[i] or bool(delta.calls)
        reason = _chat_finish_reason(called[i], chunk) if chunk.finished else None
        fields, logprobs = _delta_fields(delta), conv.chat_logprobs(chunk, tokenizer)
        if fields or reason is not None or logprobs is not None:
            yield {**head, "choices": [{"index": i, "delta": fields, "finish_reason": reason,
                                        "logprobs": logprobs,
                                        "matched_stop": conv.matched_stop(chunk)}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": conv.usage(_in_order(finals, num), body.n)}


def _delta_fields(delta: ReplyDelta) -> dict[str, Any]:
    """A chunk's delta in OpenAI's shape: a call's first piece has its id and name."""
    fields: dict[str, Any] = {}
    if delta.reasoning:
        fields["reasoning_content"] = delta.reasoning
    if delta.content:
        fields["content"] = delta.content
    if delta.calls:
        fields["tool_calls"] = [
            {"index": c.index, "function": {"arguments": c.arguments}} if c.id is None else
            {"index": c.index, "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in delta.calls]
    return fields


# -- shared ------------------------------------------------------------------------------------
def _prepare(service: GenerationService, body: Any, caller: Caller, prompt: Any,
             params: dict[str, Any], top_logprobs: int | None,
             prompt_logprobs: bool = False, images: bool = False) -> RequestGroup:
    """The engine call of a request: its prompt(s), n samples each, logprobs when asked (the
    prompt's too with `prompt_logprobs`); with `images`, a chat's image parts, decoded here."""
    image_data = (decode_chat_images(body.messages, image_limits(service.config))
                  if images else None)
    logprobs = LogprobOptions(return_logprob=top_logprobs is not None,
                              logprob_start_len=0 if prompt_logprobs else None,
                              top_logprobs_num=top_logprobs or 0)
    return service.engine.prepare(EngineRequest(
        prompt, sampling_params=SamplingParams.from_dict({**params, "n": body.n}),
        logprobs=logprobs, rid=body.rid, lora_path=conv.model_adapter(service, body.model),
        image_data=image_data, **tenancy(caller, body)))


def _in_order(finals: list[GenerateOutput], num: int) -> list[GenerateOutput]:
    """Every result's final chunk, by index (a stream ends only when all have finished)."""
    assert len(finals) == num, (len(finals), num)
    return sorted(finals, key=lambda out: out.index)


def _sse(events: AsyncGenerator[dict, None]) -> StreamingResponse:
    return StreamingResponse(sse_frames(events), media_type="text/event-stream")
