"""OpenAI request -> engine call, and engine result -> OpenAI pieces (logprobs, usage, reasons)."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from forklm.runtime.engine.results import GenerateOutput, token_entries
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import OPENAI_NAMES, SamplingParams
from forklm.server.errors import ApiError
from forklm.server.generation import GenerationService, finite
from forklm.server.protocol import _SamplingFields

# OpenAI name -> SamplingParams name, for every request field that is a sampling parameter (a new
# one passes through once protocol.py declares it); max_tokens and n are the caller's.
_PASS_THROUGH = {OPENAI_NAMES.get(f.name, f.name): f.name for f in dataclasses.fields(SamplingParams)
                 if OPENAI_NAMES.get(f.name, f.name) in _SamplingFields.model_fields
                 and f.name not in ("max_new_tokens", "n")}


class _NamesAModel(Protocol):
    @property
    def model(self) -> str | None: ...


def check_model(service: GenerationService, body: _NamesAModel) -> None:
    """The served name, the model path and "default" (a name for whatever is served) all work,
    and so does a loaded LoRA adapter's name, alone or as "<served name>:<adapter>"."""
    model_adapter(service, body.model)


def model_adapter(service: GenerationService, model: str | None) -> str | None:
    """The LoRA adapter `model` names (vLLM's convention: the adapter's name is a model), None
    for the base model; a name that is neither is a 404."""
    names = {service.model_name, service.engine.config.model_path, "default"}
    if model in names:
        return None
    adapters = service.engine.lora_adapters()
    base, sep, adapter = (model or "").rpartition(":")
    if model in adapters:
        return model
    if sep and base in names and adapter in adapters:
        return adapter
    served = ", ".join(repr(n) for n in [service.model_name, *sorted(adapters)])
    raise ApiError(404, f"model {model!r} does not exist; this server serves {served}", "model")


def sampling_dict(body: _SamplingFields, max_new_tokens: int) -> dict[str, Any]:
    """The SamplingParams dict of the request, but for n (the caller adds it)."""
    if body.custom_logit_processor is not None:
        raise InvalidArgumentError("custom_logit_processor", "<given>",
                                   "is not supported: forklm runs no custom logit processors")
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens}
    for name, target in _PASS_THROUGH.items():
        value = getattr(body, name)
        if value is not None:
            params[target] = value
    fmt = body.response_format
    if fmt is not None and fmt.type == "structural_tag":
        taken = [k for k in ("regex", "ebnf", "json_schema") if k in params]
        if taken:
            raise InvalidArgumentError("response_format", "structural_tag",
                                       f"conflicts with {taken[0]}; give one")
        params["structural_tag"] = fmt.model_dump(exclude_none=True, exclude={"json_schema"})
        return params
    schema = _response_format_schema(body)
    if schema is not None:
        if "json_schema" in params:
            raise InvalidArgumentError("response_format", body.response_format,
                                       "conflicts with json_schema; give one")
        params["json_schema"] = schema
    return params


def _response_format_schema(body: _SamplingFields) -> dict[str, Any] | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidArgumentError("response_format.json_schema", None,
                                   "type json_schema needs json_schema.schema")
    return fmt.json_schema.schema_


def finish_reason(out: GenerateOutput) -> str | None:
    return None if out.finish_reason is None else out.finish_reason.type


def matched_stop(out: GenerateOutput) -> str | int | None:
    return None if out.finish_reason is None else out.finish_reason.matched


def usage(results: list[GenerateOutput], n: int) -> dict[str, Any]:
    """Prompt and cached tokens count each prompt once (its first sample); completions all."""
    firsts = results[::n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)}}


def completion_logprobs(out: GenerateOutput, tokenizer: Any,
                        text_offset: int) -> dict[str, Any] | None:
    """The legacy completions shape: tokens, token_logprobs, top_logprobs, text_offset."""
    if out.logprobs is None:
        return None
    entries = token_entries(out.logprobs.output_token, tokenizer)
    tops = out.logprobs.output_top
    offsets, pos = [], text_offset
    for _, _, text in entries:
        offsets.append(pos)
        pos += len(text)
    return {"tokens": [t for _, _, t in entries],
            "token_logprobs": [finite(lp) for lp, _, _ in entries],
            "top_logprobs": [{t: finite(lp) for lp, _, t in token_entries(top, tokenizer)}
                             for top in tops] if tops else None,
            "text_offset": offsets}


def completion_top_logprobs(body: Any) -> int | None:
    """The engine's top_logprobs_num for a completion (None: no logprobs at all). `logprobs` and
    vLLM's `prompt_logprobs` share it, so when both ask for alternatives they must agree."""
    if body.prompt_logprobs and body.logprobs not in (None, body.prompt_logprobs):
        raise InvalidArgumentError("prompt_logprobs", body.prompt_logprobs,
                                   f"must equal logprobs ({body.logprobs}) when it asks for top "
                                   "alternatives")
    asked = [n for n in (body.logprobs, body.prompt_logprobs) if n is not None]
    return max(asked) if asked else None


def prompt_logprobs(out: GenerateOutput, tokenizer: Any, top: int) -> list[Any]:
    """vLLM's prompt_logprobs shape: per prompt token, null for the first, else {token_id:
    {logprob, rank, decoded_token}} holding the prompt's token and `top` alternatives."""
    if out.logprobs is None:
        return []
    tops = out.logprobs.input_top or [[] for _ in out.logprobs.input_token]
    positions: list[Any] = []
    for (lp, tid, text), alternatives in zip(token_entries(out.logprobs.input_token, tokenizer),
                                             tops):
        if lp is None:
            positions.append(None)
            continue
        ranked = token_entries(alternatives, tokenizer)[:top]
        entry = {str(t): {"logprob": finite(a), "rank": r + 1, "decoded_token": txt}
                 for r, (a, t, txt) in enumerate(ranked)}
        rank = next((r + 1 for r, (_, t, _) in enumerate(ranked) if t == tid), None)
        entry[str(tid)] = {"logprob": finite(lp), "rank": rank, "decoded_token": text}
        positions.append(entry)
    return positions


def chat_logprobs(out: GenerateOutput, tokenizer: Any) -> dict[str, Any] | None:
    """The chat shape: content = [{token, logprob, bytes, top_logprobs: [...]}]."""
    if out.logprobs is None:
        return None
    entries = token_entries(out.logprobs.output_token, tokenizer)
    tops = out.logprobs.output_top or [[] for _ in entries]
    return {"content": [{**_token(lp, text), "top_logprobs": [
        _token(a, b) for a, _, b in token_entries(top, tokenizer)]}
        for (lp, _, text), top in zip(entries, tops, strict=True)]}


def _token(logprob: float, text: str) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}
