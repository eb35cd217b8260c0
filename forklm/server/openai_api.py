"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions (with tools).
A request's prompts and its n samples are one engine call; choice i is the call's result i
(prompt-major), streamed or not."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.intake import RequestGroup
from forklm.runtime.results import GenerateOutput
from forklm.server import openai_convert as conv
from forklm.server.errors import sse_frames
from forklm.server.generation import ChunkStream, GenerationService
from forklm.server.native_api import service_of
from forklm.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from forklm.server.tools import ToolPlan, plan_tools

router = APIRouter(prefix="/v1")
_COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    service = service_of(request)
    return {"object": "list", "data": [{
        "id": service.model_name, "object": "model", "created": 0, "owned_by": "forklm",
        "root": service.engine.config.model_path,
        "max_model_len": service.engine.model_info.context_len}]}


# -- /v1/completions ---------------------------------------------------------------------------
@router.post("/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Any:
    service = service_of(request)
    conv.check_model(service, body)
    if body.suffix:
        raise InvalidArgumentError("suffix", body.suffix, "is not supported")
    if body.echo and body.stream:
        raise InvalidArgumentError("echo", True, "is not supported with stream")
    if body.best_of not in (None, body.n):
        raise InvalidArgumentError("best_of", body.best_of, "only best_of == n is supported")
    max_tokens = body.max_tokens if body.max_tokens is not None else _COMPLETION_DEFAULT_MAX_TOKENS
    group = _prepare(service, body, body.prompt, conv.sampling_dict(body, max_tokens),
                     body.logprobs)
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
        choices.append({"index": i, "text": echo + r.text,
                        "logprobs": conv.completion_logprobs(r, tokenizer, len(echo)),
                        "finish_reason": conv.finish_reason(r),
                        "matched_stop": conv.matched_stop(r)})
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
    plan = plan_tools(body)
    prompt = _chat_prompt(service.engine.tokenizer, body.messages, plan)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = conv.sampling_dict(body, max_tokens if max_tokens is not None
                                else service.engine.model_info.context_len)
    _add_tool_constraint(params, plan)
    top = (body.top_logprobs or 0) if body.logprobs else None
    group = _prepare(service, body, prompt, params, top)
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


def _chat_prompt(tokenizer: Any, messages: list[ChatMessage], plan: ToolPlan) -> str:
    turns = [_turn(m) for m in messages]
    if plan.active:
        turns.insert(0, {"role": "system", "content": plan.system_prompt()})
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that rejects the conversation (roles, order)
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>",
                                   f"the chat template rejects them: {e}") from e


def _turn(m: ChatMessage) -> dict[str, str]:
    content = m.content if isinstance(m.content, str) else "".join(
        p.text for p in m.content or ())
    if m.tool_calls and not content:  # the model sees its earlier calls in the format it uses
        content = "\n".join(f'{{"name": "{c.function.name}", "arguments": '
                            f'{c.function.arguments}}}' for c in m.tool_calls)
    role = "system" if m.role == "developer" else m.role
    return {"role": role, "content": content}


def _add_tool_constraint(params: dict[str, Any], plan: ToolPlan) -> None:
    schema = plan.schema()
    if schema is None:
        return
    taken = [k for k in ("regex", "ebnf", "json_schema") if k in params]
    if taken:
        raise InvalidArgumentError("tool_choice", plan.mode, f"a forced tool call cannot be "
                                   f"combined with {taken[0]} (or response_format)")
    params["json_schema"] = schema


def _chat_choice(text: str, final: GenerateOutput, plan: ToolPlan,
                 tokenizer: Any) -> dict[str, Any]:
    """A reply's whole `text` as a choice; `final` is its result (or its last chunk)."""
    calls = plan.parse(text) if plan.active else None
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else text}
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "logprobs": conv.chat_logprobs(final, tokenizer),
            "finish_reason": "tool_calls" if calls else conv.finish_reason(final),
            "matched_stop": conv.matched_stop(final)}


async def _chat_events(chunks: ChunkStream, head: dict[str, Any], body: ChatCompletionRequest,
                       plan: ToolPlan, num: int, tokenizer: Any) -> AsyncGenerator[dict, None]:
    """Content streams as it comes; with tools active a reply is held until it finishes,
    since only the whole text tells whether it is a tool call."""
    finals: list[GenerateOutput] = []
    texts = [""] * num
    for i in range(num):
        yield {**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}
    async for chunk in chunks:
        i = chunk.index
        texts[i] += chunk.text
        if chunk.finished:
            finals.append(chunk)
        if plan.active and not chunk.finished:
            continue
        if plan.active:
            choice = _chat_choice(texts[i], chunk, plan, tokenizer)
            delta = {k: v for k, v in choice["message"].items() if k != "role"}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": 0, **c} for c in delta["tool_calls"]]
            reason = choice["finish_reason"]
        else:
            delta, reason = {"content": chunk.text}, conv.finish_reason(chunk)
        yield {**head, "choices": [{"index": i, "delta": delta, "finish_reason": reason,
                                    "logprobs": conv.chat_logprobs(chunk, tokenizer),
                                    "matched_stop": conv.matched_stop(chunk)}]}
    if body.stream_options and body.stream_options.include_usage:
        yield {**head, "choices": [], "usage": conv.usage(_in_order(finals, num), body.n)}


# -- shared ------------------------------------------------------------------------------------
def _prepare(service: GenerationService, body: Any, prompt: Any, params: dict[str, Any],
             top_logprobs: int | None) -> RequestGroup:
    """The engine call of a request: its prompt(s), n samples each, logprobs when asked."""
    return service.engine.prepare(
        prompt=prompt, sampling_params={**params, "n": body.n},
        return_logprob=top_logprobs is not None, top_logprobs_num=top_logprobs or 0,
        rid=body.rid)


def _in_order(finals: list[GenerateOutput], num: int) -> list[GenerateOutput]:
    """Every result's final chunk, by index (a stream ends only when all have finished)."""
    assert len(finals) == num, (len(finals), num)
    return sorted(finals, key=lambda out: out.index)


def _sse(events: AsyncGenerator[dict, None]) -> StreamingResponse:
    return StreamingResponse(sse_frames(events), media_type="text/event-stream")
