"""SGLang's /v1/score: how likely each label token is to come next after query + item. Each
(item, label) pair is a prompt ending in the label, prefilled only (max_new_tokens 0): its last
prompt logprob is the label's; the radix cache shares the query and item between the labels."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import torch
from fastapi import APIRouter, Request

from forklm.runtime.engine.engine_request import EngineRequest, LogprobOptions
from forklm.runtime.engine.intake import RequestGroup, encode_prompt
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams
from forklm.server import openai_convert as conv
from forklm.server.errors import ApiError
from forklm.server.generation import GenerationService, tenancy
from forklm.server.native_api import service_of
from forklm.server.protocol import ScoreRequest
from forklm.server.tenants import caller_of

router = APIRouter()


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
    service = service_of(request)
    if body.model is not None:
        conv.check_model(service, body)
    for text in [body.query, *body.items]:
        if isinstance(text, str):
            service.check_text_size("items", len(text) + len(body.query))
    # Tokenizing grows with the request: a worker thread, never the event loop.
    group, prompt_lens = await asyncio.to_thread(_prepare, service, body, tenancy(
        caller_of(request), body))
    results = await service.generate("score", group, request)
    num_labels = len(body.label_token_ids)
    scores = []
    for i in range(len(body.items)):
        label_logprobs = []
        for result in results[i * num_labels : (i + 1) * num_labels]:
            if result.logprobs is None or not result.logprobs.input_token:  # aborted
                reason = result.finish_reason.message if result.finish_reason else None
                raise ApiError(500, f"item {i} was not scored: {reason}")
            label_logprobs.append(result.logprobs.input_token[-1][0])
        scores.append(torch.softmax(torch.tensor(label_logprobs), dim=0).tolist()
                      if body.apply_softmax else [math.exp(lp) for lp in label_logprobs])
    num_tokens = sum(prompt_lens)
    return {"object": "scoring", "scores": scores, "model": body.model or service.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def _prepare(service: GenerationService, body: ScoreRequest, tenant: dict[str, Any]
             ) -> tuple[RequestGroup, list[int]]:
    """The engine call: item-major, one prompt per label; and each item's prompt length."""
    engine = service.engine
    vocab = engine.model_info.vocab_size
    bad = [t for t in body.label_token_ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError("label_token_ids", bad[0], f"token ids must be in [0, {vocab})")
    prompts = [_prompt_ids(service, body, item) for item in body.items]
    if not all(prompts):  # a label needs a token before it to be scored after
        raise InvalidArgumentError("items", "", "query + item is empty: nothing to score a label "
                                   "after")
    # Logprobs from the shortest prompt's end: every prompt's last one is its label's.
    start = min(len(ids) for ids in prompts)
    request = EngineRequest(
        input_ids=[[*ids, label] for ids in prompts for label in body.label_token_ids],
        sampling_params=SamplingParams(max_new_tokens=0),
        logprobs=LogprobOptions(return_logprob=True, logprob_start_len=start,
                                return_text_in_logprobs=False), **tenant)
    return engine.prepare(request), [len(ids) for ids in prompts]


def _prompt_ids(service: GenerationService, body: ScoreRequest, item: str | list[int]
                ) -> list[int]:
    first, second = (item, body.query) if body.item_first else (body.query, item)
    if isinstance(first, str) and isinstance(second, str):
        engine = service.engine
        return encode_prompt(engine.tokenizer, first + second, engine.parts.intake.bos_token_id)
    assert isinstance(first, list) and isinstance(second, list), "checked by ScoreRequest"
    return [*first, *second]
