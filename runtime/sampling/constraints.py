"""Constrained decoding with xgrammar: constraints compiled once per tokenizer (cached, under a time
budget on CompilePool's threads), one GrammarMatcher per request, and the token bitmask applied to
the logits each step."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from forklm.runtime.errors import GrammarCompileTimeoutError, InvalidArgumentError
from forklm.runtime.sampling.checks import shorten
from forklm.runtime.sampling.grammar_pool import CompileJob, CompilePool

if TYPE_CHECKING:
    import xgrammar as xgr

    from forklm.runtime.sampling.params import Constraint
    from forklm.runtime.scheduling.request import Req

# Compiled grammars kept, least recently used dropped first. A compiled JSON schema with its
# token-mask cache takes roughly 0.1-1 MB for a 49k vocabulary.
GRAMMAR_CACHE_SIZE = 128
# xgrammar's own threads for one compile (it splits the token-mask cache's work among them).
XGRAMMAR_THREADS = 2
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; callers want the reason.
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarBackend:
    """xgrammar for one tokenizer: compiles constraints (deduplicated and cached by Constraint,
    on a CompilePool under a budget of compile_timeout_s) and masks logits with the requests'
    matchers.

    compile(), compile_all() and attach() may be called from any thread; mask_logits() only from
    the engine thread (it reuses one bitmask buffer). A matcher is used by the engine thread only.
    """

    def __init__(self, make_tokenizer_info: Callable[[], xgr.TokenizerInfo],
                 tokenizer: Any = None, jump_forward: bool = False,
                 compile_timeout_s: float = 10.0):
        assert tokenizer is not None or not jump_forward, "jump-forward tokenizes forced text"
        # Built on first use: reading a 49k vocabulary takes ~0.15 s that unconstrained engines
        # should not pay.
        self._make_info = make_tokenizer_info
        self._tokenizer = tokenizer
        self.jump_forward = jump_forward
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        # A compile that overran its budget stays here while it runs (a resubmitted constraint
        # fails at once instead of starting another), and its late result is kept.
        self._cache: OrderedDict[Constraint, CompileJob] = OrderedDict()
        self._pool = CompilePool(compile_timeout_s)
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown on demand

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                      jump_forward: bool = False,
                      compile_timeout_s: float = 10.0) -> GrammarBackend:
        """vocab_size is the model's logits width (it may exceed the tokenizer's length); the
        stop tokens are the ones a finished grammar allows (the model's EOS ids)."""
        stops = sorted(stop_token_ids) or None  # None: xgrammar takes the tokenizer's EOS
        return cls(lambda: _xgrammar().TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops), tokenizer, jump_forward,
            compile_timeout_s)

    # -- compiling (any thread) ----------------------------------------------------------------
    def compile(self, constraint: Constraint) -> Future:
        """Future of the CompiledGrammar, shared by every caller (never cancel it); it holds an
        InvalidArgumentError carrying xgrammar's reason when the constraint does not compile,
        or a GrammarCompileTimeoutError when compiling it overran the budget (failures are not
        cached, except while an overrunning compile still runs)."""
        return self._join(constraint).future

    def compile_all(self, reqs: Sequence[Req]) -> dict[Constraint, Future]:
        """Start compiling every distinct constraint of reqs; each gets a future of its own that
        follows the shared compile (a cache hit is a finished one). Cancelling one says that the
        caller left: a compile no one else awaits is then dropped before it starts, or frees its
        place in the pool while it runs on (its result is still cached)."""
        constraints = {r.sampling_params.constraint for r in reqs} - {None}
        return {c: self._follow(self._join(c)) for c in constraints if c is not None}

    def attach(self, reqs: Sequence[Req], compiling: dict[Constraint, Future]) -> None:
        """Give each constrained req its own matcher from compile_all's futures, waiting for
        them (await them first to wait elsewhere); raises the first constraint's error."""
        for req in reqs:
            constraint = req.sampling_params.constraint
            if constraint is not None:
                req.grammar = _xgrammar().GrammarMatcher(compiling[constraint].result())

    def close(self) -> None:
        self._pool.close()

    def _join(self, constraint: Constraint) -> CompileJob:
        """The cached or running job of constraint, one more waiter on it; or a new one."""
        with self._lock:
            job = self._cache.get(constraint)
            if job is not None and self._pool.join(job):
                self._cache.move_to_end(constraint)
                return job
            job = self._pool.submit(lambda: self._compile(constraint),
                                    lambda started: self._timeout_error(constraint, started))
            self._cache[constraint] = job
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        job.outcome.add_done_callback(lambda f: self._settled(constraint, job, f))
        return job

    def _follow(self, job: CompileJob) -> Future:
        """A future of the caller's own with job's result; cancelling it leaves the job."""
        mine: Future = Future()

        def copy(shared: Future) -> None:
            if shared.cancelled():
                mine.cancel()
            elif mine.set_running_or_notify_cancel():  # False: the caller already left
                error = shared.exception()
                if error is not None:
                    mine.set_exception(error)
                else:
                    mine.set_result(shared.result())

        mine.add_done_callback(lambda f: self._pool.leave(job) if f.cancelled() else None)
        job.future.add_done_callback(copy)
        return mine

    def _settled(self, constraint: Constraint, job: CompileJob, outcome: Future) -> None:
        """The compile itself ended (or was dropped): forget failures, keep a late success."""
        expired = job.expired  # set before the compile left the pool's running set, or never
        with self._lock:
            if self._cache.get(constraint) is not job:
                return
            if outcome.cancelled() or outcome.exception() is not None:
                del self._cache[constraint]
            elif expired:  # done after its budget (its waiters got the error): keep the result
                self._cache[constraint] = CompileJob.finished(outcome.result())

    def _timeout_error(self, constraint: Constraint, started: bool) -> Exception:
        budget = self._pool.timeout_s
        why = (f"took longer than the {budget:g} s budget to compile (EngineConfig."
               "grammar_compile_timeout_s); simplify it" if started else
               f"was not compiled within the {budget:g} s budget (grammar_compile_timeout_s): "
               f"all {self._pool.max_threads} compile threads were busy; retry later")
        return GrammarCompileTimeoutError(constraint.kind, shorten(constraint.spec), why)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                # Our cache is the one cache: xgrammar's own would keep every grammar forever.
                self._compiler = _xgrammar().GrammarCompiler(
                    self._make_info(), max_threads=XGRAMMAR_THREADS, cache_enabled=False)
            return self._compiler

    def warm_up(self) -> None:
        """Import xgrammar and read the vocabulary now (0.2-0.5 s of GIL-held work), so
        the first constrained request does not pay for it: a server calls this on a background
        thread once it is loaded."""
        self._get_compiler()

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
            raise InvalidArgumentError(kind, shorten(spec),
                                       f"xgrammar cannot compile it: {reason}") from e

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
            _xgrammar().apply_token_bitmask_inplace(logits, bitmask,
                                                    vocab_size=logits.shape[1], indices=masked)

    def _bitmask_rows(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """The reused bitmask buffer with at least num_rows rows (reallocated only to grow)."""
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            # [rows, ceil(V / 32)]
            self._bitmask = _xgrammar().allocate_token_bitmask(num_rows, vocab_size)
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


def _xgrammar() -> Any:
    """The xgrammar module, imported on first use: its import (0.1 s once torch and transformers
    are loaded) is kept off the engine's start-up path."""
    import xgrammar

    return xgrammar


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
