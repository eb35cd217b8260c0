"""Constrained decoding with xgrammar: constraints compiled once per tokenizer (cached, on a small
thread pool), one GrammarMatcher per request, and the token bitmask applied to the logits each step.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.request import Req
from forklm.runtime.sampling_params import Constraint

# Compiled grammars kept, least recently used dropped first. A compiled JSON schema with its
# token-mask cache takes roughly 0.1-1 MB for a 49k vocabulary.
GRAMMAR_CACHE_SIZE = 128
# Typical regexes and schemas compile in 1-10 ms on this CPU; two workers keep one slow grammar
# (a large EBNF) from holding up everyone else's.
COMPILE_THREADS = 2
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; callers want the reason.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarBackend:
    """xgrammar for one tokenizer: compiles constraints (deduplicated and cached by Constraint,
    on a thread pool) and masks logits with the requests' matchers.

    compile(), compile_all() and attach() may be called from any thread; mask_logits() only from
    the engine thread (it reuses one bitmask buffer). A matcher is used by the engine thread only.
    """

    def __init__(self, make_tokenizer_info: Callable[[], xgr.TokenizerInfo],
                 tokenizer: Any = None, jump_forward: bool = False):
        assert tokenizer is not None or not jump_forward, "jump-forward tokenizes forced text"
        # Built on first use: reading a 49k vocabulary takes ~0.15 s that unconstrained engines
        # should not pay.
        self._make_info = make_tokenizer_info
        self._tokenizer = tokenizer
        self.jump_forward = jump_forward
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[Constraint, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="forklm-grammar")
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown on demand

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                      jump_forward: bool = False) -> GrammarBackend:
        """vocab_size is the model's logits width (it may exceed the tokenizer's length); the
        stop tokens are the ones a finished grammar allows (the model's EOS ids)."""
        stops = sorted(stop_token_ids) or None  # None: xgrammar takes the tokenizer's EOS
        return cls(lambda: xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops), tokenizer, jump_forward)

    # -- compiling (any thread) ----------------------------------------------------------------
    def compile(self, constraint: Constraint) -> Future:
        """Future of the CompiledGrammar; it holds an InvalidArgumentError carrying xgrammar's
        reason when the constraint does not compile (failures are not cached)."""
        with self._lock:
            fut = self._cache.get(constraint)
            if fut is not None:
                self._cache.move_to_end(constraint)
                return fut
            fut = self._pool.submit(self._compile, constraint)
            self._cache[constraint] = fut
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f: self._forget_failure(constraint, f))
        return fut

    def compile_all(self, reqs: Sequence[Req]) -> list[Future]:
        """Start compiling every distinct constraint of reqs; cache hits are finished futures."""
        constraints = {r.sampling_params.constraint for r in reqs} - {None}
        return [self.compile(c) for c in constraints if c is not None]

    def attach(self, reqs: Sequence[Req]) -> None:
        """Give each constrained req its own matcher, waiting for compilation (start it with
        compile_all first to overlap it); raises the first constraint's InvalidArgumentError."""
        for req in reqs:
            constraint = req.sampling_params.constraint
            if constraint is not None:
                req.grammar = xgr.GrammarMatcher(self.compile(constraint).result())

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_failure(self, constraint: Constraint, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            with self._lock:
                if self._cache.get(constraint) is fut:
                    del self._cache[constraint]

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                # Our cache is the one cache: xgrammar's own would keep every grammar forever.
                self._compiler = xgr.GrammarCompiler(self._make_info(), max_threads=COMPILE_THREADS,
                                                     cache_enabled=False)
            return self._compiler

    def _compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind, spec = constraint
        try:
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "json_schema":
                # Compact JSON (", " and ": " separators): free whitespace lets a small model loop
                # on newlines until max_new_tokens.
                return compiler.compile_json_schema(spec, any_whitespace=False)
            if kind == "ebnf":
                return compiler.compile_grammar(spec)
            if kind == "structural_tag":
                return compiler.compile_structural_tag(structural_tag_format(spec))
            assert kind == "choices", kind
            return compiler.compile_grammar(choices_ebnf(json.loads(spec)))
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _LOG_PREFIX.sub("", str(e)).strip()
            shown = spec if len(spec) <= 80 else spec[:77] + "..."
            raise InvalidArgumentError(kind, shown, f"xgrammar cannot compile it: {reason}") from e

    # -- masking (engine thread) ---------------------------------------------------------------
    def mask_logits(self, logits: torch.Tensor,
                    matchers: Sequence[xgr.GrammarMatcher | None]) -> None:
        """Set logits[i, t] = -inf for every token t that matchers[i] does not allow next; rows
        whose matcher is None are untouched. logits: [B, V] with V the model's vocab size."""
        rows = [(i, m) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self._bitmask_rows(len(matchers), logits.shape[1])
        # fill returns False when every token is allowed: that row needs no masking.
        masked = [i for i, m in rows if m.fill_next_token_bitmask(bitmask, i)]
        if masked:
            bitmask = bitmask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                            indices=masked)

    def _bitmask_rows(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """The reused bitmask buffer with at least num_rows rows (reallocated only to grow)."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)  # [rows, ceil(V/32)]
        return self._bitmask

    # -- jump-forward (engine thread) ----------------------------------------------------------
    def jump_forward_ids(self, matcher: xgr.GrammarMatcher, last_token_id: int) -> list[int]:
        """Tokens of the text the grammar forces after last_token_id (just accepted), to append
        without sampling; the matcher is left as it was.

        Tokenization at the edges is where this can differ from sampling token by token: the
        forced text is tokenized together with the last token's text, and nothing is returned
        when they would merge into another first token; the last forced token is left to the
        model, since it might merge with the text that follows.

        Off by default (EngineConfig.enable_jump_forward). On a batch of 32 JSON-schema requests
        it cuts the steps by about a third, but it changes greedy outputs: the canonical split of
        forced text (` {"`) can differ from the one the model picks under the mask (` {`, `"`),
        and in bf16 the catch-up step's rounding differs from decode steps'.
        """
        forced = matcher.find_jump_forward_string()
        if not forced:
            return []
        assert self._tokenizer is not None
        last_text = self._tokenizer.decode([last_token_id])
        ids = self._tokenizer.encode(last_text + forced, add_special_tokens=False)
        if not ids or ids[0] != last_token_id:
            return []
        ids = ids[1:-1]
        num_accepted = 0
        for token_id in ids:  # a check only: rolled back below
            if not matcher.accept_token(token_id):
                break
            num_accepted += 1
        if num_accepted:
            matcher.rollback(num_accepted)
        return ids[:num_accepted]


def choices_ebnf(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are valid EBNF
    string literals in xgrammar's dialect)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def structural_tag_format(spec: str) -> str:
    """xgrammar's structural tag JSON for `spec`. SGLang's shape ({"structures": [{begin,
    schema, end}], "triggers": [...]}) becomes a triggered_tags format: free text until a
    trigger, then a structure whose begin starts with it, JSON valid under its schema, its end,
    and free text again; xgrammar's own shape ({"format": ...}) is kept."""
    obj = json.loads(spec)
    if "format" in obj:
        return spec
    tags = [{"type": "tag", "begin": s["begin"], "end": s["end"],
             "content": {"type": "json_schema", "json_schema": s.get("schema", {})}}
            for s in obj["structures"]]
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": obj["triggers"], "tags": tags}})
