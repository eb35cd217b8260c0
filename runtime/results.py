"""Request intake (validation, tokenization, one Req per sample) and result dicts in SGLang's shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from forklm.runtime.detokenizer import IncrementalDetokenizer
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.request import Req
from forklm.runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from forklm.runtime.engine import Engine


def request_inputs(engine: Engine, prompt: Any, input_ids: Any, sampling_params: Any,
                   return_logprob: bool, logprob_start_len: int | None,
                   top_logprobs_num: int | None, rid: Any,
                   stream: bool = False) -> tuple[list[Req], bool]:
    """Validate and tokenize a generate() call into Reqs (n per prompt, prompt-major order).
    Raises InvalidArgumentError naming the bad argument; nothing is submitted then."""
    prompts, single = _normalize_prompts(engine, prompt, input_ids)
    params_list = _normalize_params(sampling_params, len(prompts))
    rids = _normalize_rids(rid, len(prompts))
    top_n = _check_int("top_logprobs_num", top_logprobs_num or 0, 0)
    start = -1 if logprob_start_len is None else _check_int("logprob_start_len", logprob_start_len, -1)
    reqs = []
    for ids, params, rid_i in zip(prompts, params_list, rids):
        _check_prompt(engine, ids, params)
        if start >= len(ids):
            raise InvalidArgumentError("logprob_start_len", start,
                                       f"must be < the prompt length ({len(ids)} tokens)")
        base_rid = rid_i or engine.new_rid()  # samples of one prompt: base-0, base-1, ...
        for k in range(params.n):
            seed = None if params.seed is None else params.seed + k
            reqs.append(Req(
                rid=base_rid + (f"-{k}" if params.n > 1 else ""),
                origin_input_ids=list(ids), sampling_params=params,
                detokenizer=IncrementalDetokenizer(
                    engine.tokenizer, params.stop or (), params.skip_special_tokens,
                    params.spaces_between_special_tokens, params.no_stop_trim),
                eos_token_ids=engine.parts.eos_token_ids, sink=_unset_sink,
                generator=engine.new_generator(seed), return_logprob=bool(return_logprob),
                logprob_start_len=start if return_logprob else -1,
                top_logprobs_num=top_n if return_logprob else 0,
                max_total_len=engine.parts.context_len,
            ))
    if stream and len(reqs) != 1:
        raise InvalidArgumentError("stream", stream, "streaming takes a single prompt with n=1")
    return reqs, single and params_list[0].n == 1


def _unset_sink(out: Any) -> None:
    raise AssertionError("request submitted without a sink")


def _normalize_prompts(engine: Engine, prompt: Any, input_ids: Any) -> tuple[list[list[int]], bool]:
    if (prompt is None) == (input_ids is None):
        raise InvalidArgumentError("prompt", prompt, "give exactly one of prompt or input_ids")
    if prompt is not None:
        if isinstance(prompt, str):
            return [_encode(engine, prompt, "prompt")], True
        if isinstance(prompt, Sequence) and prompt and all(isinstance(p, int) for p in prompt):
            return [_check_ids(engine, list(prompt), "prompt")], True
        if isinstance(prompt, Sequence) and prompt and all(isinstance(p, str) for p in prompt):
            return [_encode(engine, p, "prompt") for p in prompt], False
        raise InvalidArgumentError("prompt", prompt, "expected a str, a list of str or a token-id list")
    if isinstance(input_ids, Sequence) and input_ids and all(isinstance(t, int) for t in input_ids):
        return [_check_ids(engine, list(input_ids), "input_ids")], True
    if isinstance(input_ids, Sequence) and input_ids and all(isinstance(t, Sequence) for t in input_ids):
        return [_check_ids(engine, list(ids), "input_ids") for ids in input_ids], False
    raise InvalidArgumentError("input_ids", input_ids, "expected a non-empty token-id list or a list of them")


def _encode(engine: Engine, text: str, name: str) -> list[int]:
    if not text:
        raise InvalidArgumentError(name, text, "the prompt is empty")
    return engine.tokenizer.encode(text, add_special_tokens=False)


def _check_ids(engine: Engine, ids: list[int], name: str) -> list[int]:
    vocab = engine.parts.vocab_size
    if not ids:
        raise InvalidArgumentError(name, ids, "the prompt is empty")
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidArgumentError(name, bad[0], f"token ids must be ints in [0, {vocab})")
    return ids


def _check_prompt(engine: Engine, ids: list[int], params: SamplingParams) -> None:
    context, capacity = engine.parts.context_len, engine.parts.kv.allocator.capacity
    if len(ids) >= context:
        raise InvalidArgumentError("prompt", f"<{len(ids)} tokens>",
                                   f"longer than the model's context_length {context} "
                                   "(one position must stay free to generate)")
    if len(ids) + 1 > capacity:
        raise InvalidArgumentError("prompt", f"<{len(ids)} tokens>",
                                   f"does not fit the KV cache (max_total_tokens={capacity})")
    vocab = engine.parts.vocab_size
    for t in params.stop_token_ids or ():
        if not 0 <= t < vocab:
            raise InvalidArgumentError("stop_token_ids", t, f"must be in [0, {vocab})")


def _normalize_params(sampling_params: Any, num: int) -> list[SamplingParams]:
    if isinstance(sampling_params, list):
        if len(sampling_params) != num:
            raise InvalidArgumentError("sampling_params", f"<list of {len(sampling_params)}>",
                                       f"need one per prompt ({num})")
        return [SamplingParams.coerce(p) for p in sampling_params]
    return [SamplingParams.coerce(sampling_params)] * num


def _normalize_rids(rid: Any, num: int) -> list[str | None]:
    if rid is None:
        return [None] * num
    rids = [rid] if isinstance(rid, str) else list(rid)
    if len(rids) != num or not all(isinstance(r, str) and r for r in rids):
        raise InvalidArgumentError("rid", rid, f"need {num} non-empty string id(s)")
    return rids


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(name, value, f"must be an int >= {minimum}")
    return value


def build_result(req: Req, text: str, tokenizer: Any, output_ids: list[int] | None = None,
                 final: bool = True) -> dict[str, Any]:
    """A result (or stream chunk) dict: text, output_ids, meta_info, in SGLang's shape."""
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason.to_dict() if final and req.finish_reason else None,
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
    }
    if req.return_logprob and final:
        meta["input_token_logprobs"] = _with_text(req.input_token_logprobs, tokenizer)
        meta["output_token_logprobs"] = _with_text(req.output_token_logprobs, tokenizer)
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = [_with_text(t, tokenizer) for t in req.input_top_logprobs]
            meta["output_top_logprobs"] = [_with_text(t, tokenizer) for t in req.output_top_logprobs]
    ids = list(req.output_ids) if output_ids is None else output_ids
    return {"text": text, "output_ids": ids, "meta_info": meta}


def _with_text(entries: Sequence[Sequence[Any]], tokenizer: Any) -> list[list[Any]]:
    return [[lp, tid, tokenizer.decode([tid])] for lp, tid in entries]
