"""Req: one generation request's state as it moves waiting -> running -> finished."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.kvcache.namespaces import namespaced

if TYPE_CHECKING:
    import xgrammar

    from forklm.runtime.engine.detokenizer import IncrementalDetokenizer
    from forklm.runtime.lora.adapter import LoraWeights
    from forklm.runtime.multimodal.vision import MultimodalPrompt
    from forklm.runtime.sampling.ngram_draft import NgramIndex
    from forklm.runtime.sampling.params import SamplingParams

_arrival = itertools.count()


@dataclass
class FinishReason:
    """SGLang's finish_reason shape: stop (matched str or token id), length, or abort."""

    type: str
    matched: str | int | None = None
    length: int | None = None
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.type == "abort":
            return {"type": "abort", "message": self.message}
        return {"type": "stop", "matched": self.matched}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FinishReason:
        """to_dict's inverse (a server's JSON read back)."""
        return cls(d["type"], d.get("matched"), d.get("length"), d.get("message"))


@dataclass
class ReqOutput:
    """One event sent to the caller: new text/tokens, and the final meta once finished."""

    rid: str
    delta_text: str
    delta_ids: list[int]
    finished: bool
    req: Req
    num_output: int = 0  # the request's output tokens once this event's are in (set on sending)


@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    sink: Callable[[ReqOutput], None]
    generator: torch.Generator | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only (SGLang's default)
    top_logprobs_num: int = 0
    max_total_len: int = 0  # the context length: generation stops (length) when reached
    index: int = 0  # position among the results of its generate() call (RequestGroup)
    session_id: str | None = None  # an open session whose pin this request's sequence becomes
    # Prefixes are shared only between requests of one namespace (0: the unsalted one; see
    # kvcache/namespaces.py): a client cannot learn from cache hits what another salt sent.
    cache_namespace: int = 0
    # The LoRA adapter this request runs with (None: the base model); held here so that an
    # adapter unloaded or evicted meanwhile stays usable until the request ends.
    lora: LoraWeights | None = None
    # A prompt with images: its image tokens' positions and feature rows (which replace those
    # tokens' embeddings) and the ids the radix cache keys it by (runtime/multimodal/).
    mm: MultimodalPrompt | None = None
    priority: int = 0  # larger runs first when priority scheduling is on (EngineConfig)
    tenant: str = ""  # who sent it (an API key's name): waiting requests interleave by tenant
    arrival: int = field(default_factory=lambda: next(_arrival))

    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # KV state. Slots of fill_ids[:num_computed] live in req_to_token[row]; the first prefix_len of
    # them belong to the radix cache (locked via last_node), the rest to this request.
    row: int | None = None
    prefix_len: int = 0
    num_computed: int = 0
    last_node: Any = None
    cached_tokens: int = 0  # prompt tokens served from the radix cache (first admission)
    num_retractions: int = 0
    # Logprob results, [logprob, token_id] pairs (text is added when the result is built).
    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs_done: bool = False
    # The constraint's matcher, in the state after output_ids (None = unconstrained). Retraction
    # keeps output_ids, so the matcher stays valid across it.
    grammar: xgrammar.GrammarMatcher | None = None
    # Speculative decoding's lookup index over fill_ids (built on the first draft; None = never
    # drafted). It only grows, like fill_ids, so it stays valid across retractions.
    draft_index: NgramIndex | None = None
    # An embedding request: how it pools its prompt's final-normed hidden states (EngineConfig's
    # POOLING_MODES; None: a generation request). It finishes after its prefill; pooled_sum
    # gathers the pooled rows over its prefill chunks ([hidden] fp32; mean: their sum).
    pooling: str | None = None
    pooled_sum: torch.Tensor | None = None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV the request needs: the prompt plus what it generated (after a retraction)."""
        return self.origin_input_ids + self.output_ids if self.output_ids else self.origin_input_ids

    def cache_key(self, end: int | None = None) -> list[int]:
        """fill_ids[:end] (all of them by default, not copied when unsalted) as the radix cache
        keys them: in the request's namespace."""
        if self.mm is not None:  # image tokens keyed by their image's hash
            ids = self.mm.key_ids + self.output_ids
            ids = ids if end is None else ids[:end]
        else:
            ids = self.fill_ids if end is None else self.fill_ids[:end]
        return namespaced(ids, self.cache_namespace)

    @property
    def fill_len(self) -> int:
        """len(fill_ids) without building the list (checked every step)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def fill_slice(self, start: int, end: int) -> list[int]:
        """fill_ids[start:end] without concatenating the whole sequence (the decode hot path)."""
        prompt_len = len(self.origin_input_ids)
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : end - prompt_len]
        return self.fill_ids[start:end]

    @property
    def num_uncomputed(self) -> int:
        """Tokens of fill_ids without KV yet: 1 for a running request, more after a jump-forward."""
        return self.fill_len - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        """Banned while short of min_new_tokens (unless a grammar allows nothing else): EOS even
        with ignore_eos, as in SGLang and transformers, and the stop_token_ids."""
        return sorted(set(self.sampling_params.stop_token_ids or ()) | self.eos_token_ids)

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.input_logprobs_done

    def max_prefix_len(self) -> int:
        """How much of fill_ids may come from the cache: at least one token is always computed, and
        prompt logprobs from logprob_start_len need the hidden state just before that position."""
        limit = self.fill_len - 1
        if self.pooling in ("mean", "cls"):  # they pool every position's (or the first's) state
            return 0
        if self.wants_input_logprobs:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def embedding(self) -> list[float] | None:
        """The pooled prompt vector (not normalized) once the prefill is done; else None."""
        if self.pooling is None or self.pooled_sum is None:
            return None
        pooled = self.pooled_sum / len(self.origin_input_ids) if self.pooling == "mean" \
            else self.pooled_sum
        return pooled.tolist()

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    def tokens_left(self) -> int:
        """Tokens it may still sample: within max_new_tokens and the context length."""
        return min(self.remaining_new_tokens(), self.max_total_len - self.fill_len)
