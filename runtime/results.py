"""Result dicts in SGLang's shape: text, output_ids, meta_info (finish reason, token counts,
logprobs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from forklm.runtime.request import Req


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
