"""stop_regex: regexes searched in a request's output text as it grows. Patterns are compiled once
(cached); each step searches only the text not yet streamed, whose length is bounded, so the work
per token stays constant and a whole request's is linear in its output.

The `regex` package (a transformers dependency) is used for its partial matches: a text suffix that
could still grow into a match is held back from the stream, so the text trimmed at a match is never
text the caller has already seen.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import regex

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.checks import shorten, str_list

logger = logging.getLogger(__name__)

MAX_STOP_REGEXES = 16
MAX_STOP_REGEX_LEN = 512  # characters of one pattern
# Characters held back while they may start a match; a match longer than this is not seen. It
# bounds both the stream's delay and the text each step searches.
MAX_MATCH_LEN = 1024
# Emitted characters shown to each search for lookbehind, \b and ^ (never part of a match).
_CONTEXT_LEN = 64
# A pathological pattern (catastrophic backtracking) gives up after this long, per step.
_SEARCH_TIMEOUT_S = 0.05


def normalize_stop_regex(value: object) -> list[str] | None:
    """A str or list of str -> the list ([] -> None), each pattern bounded and compiled."""
    items = str_list(value, "stop_regex", MAX_STOP_REGEXES, "patterns")
    if items is None:
        return None
    for pattern in items:
        _check_pattern(pattern)
    return items or None


def _check_pattern(pattern: str) -> None:
    shown = shorten(pattern)
    if not pattern or len(pattern) > MAX_STOP_REGEX_LEN:
        raise InvalidArgumentError("stop_regex", shown,
                                   f"each pattern must have 1..{MAX_STOP_REGEX_LEN} characters")
    try:
        compiled = compile_pattern(pattern)
    except regex.error as e:
        raise InvalidArgumentError("stop_regex", shown, f"not a valid regex: {e}") from e
    if compiled.search("") is not None:
        raise InvalidArgumentError("stop_regex", shown, "must not match the empty string")


@functools.lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> regex.Pattern:
    return regex.compile(pattern)


class RegexMatch(NamedTuple):
    pattern: str  # as given: SGLang reports it as finish_reason.matched
    start: int
    end: int


class StopRegexSearch:
    """The stop regexes of one request; stateless between calls (the caller keeps the text)."""

    def __init__(self, patterns: Sequence[str]):
        self._patterns = [(p, compile_pattern(p)) for p in patterns]

    def __bool__(self) -> bool:
        return bool(self._patterns)

    def search(self, context: str, buf: str) -> tuple[RegexMatch | None, int]:
        """(the complete match in `buf` ending first, or None; how many trailing characters of
        `buf` may still start one, at most MAX_MATCH_LEN). `context` is emitted text just before
        `buf`: it is seen by lookbehind but no match starts in it."""
        ctx = context[-_CONTEXT_LEN:]
        text, pos = ctx + buf, len(ctx)
        best: RegexMatch | None = None
        hold = 0
        for pattern, compiled in self._patterns:
            try:
                m = compiled.search(text, pos, partial=True, timeout=_SEARCH_TIMEOUT_S)
            except TimeoutError:
                logger.warning("stop_regex %r timed out on %d characters", pattern, len(buf))
                continue
            if m is None:
                continue
            start, end = m.start() - pos, m.end() - pos
            if m.partial:
                hold = max(hold, len(buf) - start)
            elif end > start and (best is None or (end, start) < (best.end, best.start)):
                best = RegexMatch(pattern, start, end)
        return best, min(hold, MAX_MATCH_LEN)
