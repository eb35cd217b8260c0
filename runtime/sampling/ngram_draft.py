"""Prompt-lookup (n-gram) drafting for speculative decoding (SGLang's NGRAM algorithm, per
request): the tokens that followed the latest earlier occurrence of the sequence's longest suffix
become the draft the next forward verifies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forklm.runtime.config import EngineConfig
    from forklm.runtime.scheduling.request import Req

# Earlier occurrences of the last two tokens tried per lookup, most recent first: bounds a step's
# work (a frequent pair such as '", "' in JSON can occur thousands of times).
MAX_CANDIDATES = 256


@dataclass
class NgramIndex:
    """Incremental index of one token sequence: where each bigram and token ended before.

    `extend` appends tokens (amortized O(1) each); `propose` costs O(MAX_CANDIDATES * max_n) at
    most. Only positions p <= len - 2 are indexed, so every match has a continuation."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    _bigram_ends: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # ascending
    _last_end: dict[int, int] = field(default_factory=dict)  # token -> its latest position
    _num_indexed: int = 0  # positions below this are in the tables

    def extend(self, new_ids: list[int]) -> None:
        self.tokens.extend(new_ids)
        toks = self.tokens
        for p in range(self._num_indexed, len(toks) - 1):
            self._last_end[toks[p]] = p
            if p >= 1:
                self._bigram_ends.setdefault((toks[p - 1], toks[p]), []).append(p)
        self._num_indexed = max(self._num_indexed, len(toks) - 1)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the longest
        suffix of length in [min_n, max_n]; [] when no such suffix occurred before."""
        end, match_len = self._best_match()
        if end is None or match_len < self.min_n or max_tokens <= 0:
            return []
        return self.tokens[end + 1 : end + 1 + max_tokens]

    def _best_match(self) -> tuple[int | None, int]:
        """(end position, length) of the longest earlier match of the suffix (latest on ties)."""
        toks, last = self.tokens, len(self.tokens) - 1
        if last < 1:
            return None, 0
        best_end, best_len = None, 0
        for p in reversed(self._bigram_ends.get((toks[last - 1], toks[last]), [])[-MAX_CANDIDATES:]):
            n = self._match_len(p, last)
            if n > best_len:
                best_end, best_len = p, n
            if n >= self.max_n:
                break
        if best_end is None and toks[last] in self._last_end:
            best_end, best_len = self._last_end[toks[last]], 1
        return best_end, best_len

    def _match_len(self, p: int, last: int) -> int:
        """How many tokens (at most max_n) the sequences ending at p and at last share."""
        toks, n = self.tokens, 0
        while n < self.max_n and p - n >= 0 and toks[p - n] == toks[last - n]:
            n += 1
        return n


class NgramDrafter:
    """Chooses each decoding request's draft. Requests that are not drafted decode normally:
    constrained ones (their mask depends on every accepted token) and those with tokens a
    jump-forward appended (they catch up first)."""

    def __init__(self, config: EngineConfig):
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.min_n = config.speculative_ngram_min_match_window_size
        self.max_n = config.speculative_ngram_max_match_window_size

    def propose(self, req: Req) -> list[int]:
        limit = self._max_draft_len(req)
        if limit <= 0 or req.grammar is not None or req.num_uncomputed != 1:
            return []
        index = self._index(req)
        return index.propose(limit)

    def _max_draft_len(self, req: Req) -> int:
        """Drafts never outrun the request: one token is always sampled after them, so at most
        remaining - 1 (new tokens) and max_total_len - fill_len - 1 (context)."""
        room = req.remaining_new_tokens() - 1
        if req.max_total_len:
            room = min(room, req.max_total_len - req.fill_len - 1)
        return min(self.num_draft_tokens, room)

    def _index(self, req: Req) -> NgramIndex:
        """req's index, brought up to date with the tokens it gained since the last lookup."""
        if req.draft_index is None:
            req.draft_index = NgramIndex(self.min_n, self.max_n)
        index = req.draft_index
        if len(index.tokens) < req.fill_len:
            index.extend(req.fill_slice(len(index.tokens), req.fill_len))
        return index
