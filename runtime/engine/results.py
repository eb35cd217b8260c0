"""GenerateOutput: one request's result, or one stream chunk of it, as it travels up from the engine;
`to_dict()` turns it into SGLang's shape (text, output_ids, meta_info) at the edge that speaks it."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forklm.runtime.scheduling.request import FinishReason, Req

Pair = tuple[Any, int]  # (logprob, token_id); the prompt's first token has logprob None


@dataclass(frozen=True)
class TokenLogprobs:
    """A request's logprobs, without token text: chosen tokens' (logprob, token_id), and per
    position the top (logprob, token_id) list when top_logprobs_num was asked for (else None)."""

    input_token: list[Pair]
    output_token: list[Pair]
    input_top: list[list[Pair]] | None
    output_top: list[list[Pair]] | None

    @classmethod
    def of(cls, req: Req, start: int = 0, end: int | None = None,
           with_input: bool = True) -> TokenLogprobs:
        """req's logprobs: the output's [start:end] (a stream chunk's), the prompt's unless not
        with_input (empty lists then)."""
        tops = bool(req.top_logprobs_num)
        inputs = req.input_token_logprobs if with_input else []
        return cls([(lp, tid) for lp, tid in inputs],
                   [(lp, tid) for lp, tid in req.output_token_logprobs[start:end]],
                   list(req.input_top_logprobs if with_input else []) if tops else None,
                   list(req.output_top_logprobs[start:end]) if tops else None)

    def __add__(self, later: TokenLogprobs) -> TokenLogprobs:
        """Two consecutive stream chunks' logprobs as one (the prompt's from whichever has them)."""
        tops = (self.input_top is not None and later.input_top is not None
                and self.output_top is not None and later.output_top is not None)
        return TokenLogprobs(self.input_token or later.input_token,
                             self.output_token + later.output_token,
                             (self.input_top or later.input_top) if tops else None,
                             self.output_top + later.output_top if tops else None)  # type: ignore[operator]

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> TokenLogprobs | None:
        """to_meta's inverse (a server's meta_info read back; entries' text is dropped, the
        same tokenizer decodes it again); None when meta has no logprobs."""
        if "output_token_logprobs" not in meta:
            return None
        tops = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
        return cls(_pairs(meta.get("input_token_logprobs") or []),
                   _pairs(meta["output_token_logprobs"]),
                   None if tops[0] is None else [_pairs(t) for t in tops[0]],
                   None if tops[1] is None else [_pairs(t) for t in tops[1]])

    def to_meta(self, tokenizer: Any = None) -> dict[str, Any]:
        """SGLang's meta_info keys: [logprob, token_id, text] entries; text is decoded only with
        a tokenizer, else None."""
        meta: dict[str, Any] = {"input_token_logprobs": token_entries(self.input_token, tokenizer),
                                "output_token_logprobs": token_entries(self.output_token, tokenizer)}
        if self.input_top is not None and self.output_top is not None:
            meta["input_top_logprobs"] = [token_entries(t, tokenizer) for t in self.input_top]
            meta["output_top_logprobs"] = [token_entries(t, tokenizer) for t in self.output_top]
        return meta


@dataclass(frozen=True)
class GenerateOutput:
    """A result (final) or a stream chunk (text and output_ids are the increments; finish_reason
    only on a request's last chunk; logprobs: a result's all, a chunk's those of its own tokens
    and, on the first, the prompt's). `index`: its place among the call's results."""

    rid: str
    index: int
    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int  # so far
    cached_tokens: int
    logprobs: TokenLogprobs | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector (not normalized)

    @classmethod
    def of(cls, req: Req, text: str, output_ids: list[int] | None = None,
           final: bool = True) -> GenerateOutput:
        """req's result with `text` (a chunk: its increments `text` and `output_ids`)."""
        return cls(
            rid=req.rid, index=req.index, text=text,
            output_ids=list(req.output_ids) if output_ids is None else output_ids,
            finish_reason=req.finish_reason if final else None,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            logprobs=TokenLogprobs.of(req) if final and req.return_logprob else None,
            embedding=req.embedding() if final else None)

    @classmethod
    def from_json(cls, result: dict[str, Any], index: int = 0) -> GenerateOutput:
        """to_dict's inverse: a /generate result (or a chunk) read back from a server."""
        from forklm.runtime.scheduling.request import FinishReason  # (torch) only when used

        meta = result["meta_info"]
        reason = meta.get("finish_reason")
        return cls(
            rid=meta["id"], index=result.get("index", index), text=result["text"],
            output_ids=list(result["output_ids"]),
            finish_reason=None if reason is None else FinishReason.from_dict(reason),
            prompt_tokens=meta["prompt_tokens"], completion_tokens=meta["completion_tokens"],
            cached_tokens=meta["cached_tokens"], logprobs=TokenLogprobs.from_meta(meta),
            embedding=result.get("embedding"))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def aborted(self) -> bool:
        return self.finish_reason is not None and self.finish_reason.type == "abort"

    def to_dict(self, tokenizer: Any = None, with_index: bool = False) -> dict[str, Any]:
        """SGLang's result (or chunk) dict; logprob entries carry token text only when a
        tokenizer is given; `index` is included when asked (chunks of a call with several)."""
        out: dict[str, Any] = {"text": self.text, "output_ids": self.output_ids,
                               "meta_info": self.meta_info(tokenizer)}
        if with_index:
            out["index"] = self.index
        if self.embedding is not None:
            out["embedding"] = self.embedding
        return out

    def meta_info(self, tokenizer: Any = None) -> dict[str, Any]:
        """SGLang's meta_info of this result (see to_dict)."""
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason.to_dict() if self.finish_reason else None,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if self.logprobs is not None:
            meta.update(self.logprobs.to_meta(tokenizer))
        return meta


def join_chunks(chunks: Sequence[GenerateOutput]) -> GenerateOutput:
    """One request's stream chunks as its result: the texts, ids and logprobs joined, the rest
    from the last chunk (which carries the final counts and finish reason)."""
    last = chunks[-1]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    logprobs = functools.reduce(operator.add, parts) if parts else None
    return GenerateOutput(
        rid=last.rid, index=last.index, text="".join(c.text for c in chunks),
        output_ids=[t for c in chunks for t in c.output_ids], finish_reason=last.finish_reason,
        prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens, logprobs=logprobs, embedding=last.embedding)


def token_entries(pairs: Sequence[Pair], tokenizer: Any = None) -> list[list[Any]]:
    """[logprob, token_id, text] per pair; text is None without a tokenizer."""
    if tokenizer is None:
        return [[lp, tid, None] for lp, tid in pairs]
    return [[lp, tid, tokenizer.decode([tid])] for lp, tid in pairs]


def _pairs(entries: Sequence[Sequence[Any]]) -> list[Pair]:
    return [(entry[0], int(entry[1])) for entry in entries]
