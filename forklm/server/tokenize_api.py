"""Token counting and templates (SGLang's and vLLM's /tokenize and /detokenize), and SGLang's
/concate_and_append_request, which its frontend calls to join forks."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from fastapi import APIRouter, Request

from forklm.runtime.engine.intake import encode_prompt
from forklm.runtime.errors import InvalidArgumentError
from forklm.server.native_api import service_of
from forklm.server.openai_api import chat_prompt
from forklm.server.protocol import (
    ChatCompletionRequest,
    ConcatAppendRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from forklm.server.tools import plan_tools

router = APIRouter()


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    """The token ids the engine would run: a prompt as /generate encodes it (add_special_tokens:
    its BOS), or messages rendered as /v1/chat/completions renders them (tools included), so a
    client can count a conversation's tokens or preview its template. A batch of prompts gives
    a list per field."""
    service = service_of(request)
    context_len = service.engine.model_info.context_len
    if body.messages is not None:
        chat = ChatCompletionRequest(
            model=body.model or "default", messages=body.messages, tools=body.tools,
            chat_template_kwargs=body.chat_template_kwargs,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message)
        prompt = await chat_prompt(service, chat, plan_tools(chat, service))
        ids = prompt.input_ids
        if ids is None:
            ids = await asyncio.to_thread(_encode, service, prompt.text, True)
        return {"tokens": ids, "count": len(ids), "max_model_len": context_len,
                "prompt": prompt.text}
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt or []
    for text in prompts:
        service.check_text_size("prompt", len(text))
    encoded = await asyncio.to_thread(
        lambda: [_encode(service, text, body.add_special_tokens) for text in prompts])
    if isinstance(body.prompt, str):
        return {"tokens": encoded[0], "count": len(encoded[0]), "max_model_len": context_len}
    return {"tokens": encoded, "count": [len(ids) for ids in encoded],
            "max_model_len": context_len}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    """The text of token ids (a list, or a batch of lists)."""
    service = service_of(request)
    single = not (body.tokens and isinstance(body.tokens[0], list))
    batch = cast(list[list[int]], [body.tokens] if single else body.tokens)
    vocab = service.engine.model_info.vocab_size
    for ids in batch:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgumentError("tokens", bad, f"token ids must be in [0, {vocab})")
    tokenizer = service.engine.tokenizer
    texts = await asyncio.to_thread(lambda: [
        tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens) for ids in batch])
    return {"text": texts[0] if single else texts}


@router.post("/concate_and_append_request")
async def concate_and_append(body: ConcatAppendRequest) -> dict[str, Any]:
    """Accepted: forklm needs no KV splicing here. The frontend's next request carries the
    joined text, and the radix cache serves the forks' shared prefix from their KV."""
    return {"success": True, "message": f"{len(body.src_rids)} fork(s) joined into "
            f"{body.dst_rid!r}: the next request's prefix comes from the radix cache"}


def _encode(service: Any, text: str, special: bool) -> list[int]:
    tokenizer = service.engine.tokenizer
    if not special:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return encode_prompt(tokenizer, text, service.engine.parts.intake.bos_token_id)
