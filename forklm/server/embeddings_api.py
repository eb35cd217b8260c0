"""OpenAI's /v1/embeddings for decoder models: each input's prompt is prefilled once and its
final-normed hidden states pooled (ModelInfo.pooling: last token, mean or first), then
truncated to `dimensions` and L2-normalized here, as sentence-transformers and Qwen3-Embedding do."""

from __future__ import annotations

import asyncio
import base64
import uuid
from typing import Any

import torch
from fastapi import APIRouter, Request

from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.engine.results import GenerateOutput
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams
from forklm.server import openai_convert as conv
from forklm.server.errors import ApiError
from forklm.server.generation import tenancy
from forklm.server.native_api import service_of
from forklm.server.protocol import EmbeddingRequest, RerankRequest
from forklm.server.tenants import caller_of

router = APIRouter(prefix="/v1")


@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
    service = service_of(request)
    conv.check_model(service, body)
    inputs = [body.input] if isinstance(body.input, str) else body.input
    for text in inputs:
        if isinstance(text, str):
            service.check_text_size("input", len(text))
    engine_request = EngineRequest(
        body.input, sampling_params=SamplingParams(max_new_tokens=0),
        pooling=service.engine.model_info.pooling, **tenancy(caller_of(request), body))
    # Tokenizing grows with the input: a worker thread, never the event loop.
    group = await asyncio.to_thread(service.engine.prepare, engine_request)
    results = await service.generate("embeddings", group, request)
    data = await asyncio.to_thread(_data, results, body)
    num_tokens = sum(r.prompt_tokens for r in results)
    return {"object": "list", "data": data, "model": body.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
    """Documents by relevance to the query: the cosine similarity of their embeddings (the
    model as a bi-encoder, pooled as /v1/embeddings pools), highest first, top_n of them."""
    service = service_of(request)
    if body.model is not None:
        conv.check_model(service, body)
    texts = [body.query, *body.documents]
    for name, text in zip(["query"] + ["documents"] * len(body.documents), texts):
        service.check_text_size(name, len(text))
    engine_request = EngineRequest(
        texts, sampling_params=SamplingParams(max_new_tokens=0),
        pooling=service.engine.model_info.pooling, **tenancy(caller_of(request), body))
    group = await asyncio.to_thread(service.engine.prepare, engine_request)
    results = await service.generate("rerank", group, request)

    def ranked() -> list[dict[str, Any]]:
        query, *docs = [finished_vector(_pooled(r, i), None) for i, r in enumerate(results)]
        scores = [float(query @ doc) for doc in docs]
        order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n]
        return [{"index": i, "relevance_score": scores[i],
                 **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                for i in order]

    num_tokens = sum(r.prompt_tokens for r in results)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": body.model or service.model_name,
            "results": await asyncio.to_thread(ranked), "usage": {"total_tokens": num_tokens}}


def _pooled(result: GenerateOutput, i: int) -> list[float]:
    if result.embedding is None:  # aborted (an engine error, a shutdown)
        reason = result.finish_reason.message if result.finish_reason else None
        raise ApiError(500, f"input {i} was not embedded: {reason}")
    return result.embedding


def _data(results: list[GenerateOutput], body: EmbeddingRequest) -> list[dict[str, Any]]:
    data = []
    for i, result in enumerate(results):
        vector = finished_vector(_pooled(result, i), body.dimensions)
        data.append({"object": "embedding", "index": i,
                     "embedding": encoded(vector, body.encoding_format)})
    return data


def finished_vector(pooled: list[float], dimensions: int | None) -> torch.Tensor:
    """The pooled vector cut to its first `dimensions` values (Matryoshka), then L2-normalized
    (so cosine similarity is a dot product)."""
    if dimensions is not None and dimensions > len(pooled):
        raise InvalidArgumentError("dimensions", dimensions,
                                   f"must be at most the model's hidden size {len(pooled)}")
    vector = torch.tensor(pooled, dtype=torch.float32)[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0)


def encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a JSON float list, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
