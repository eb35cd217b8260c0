"""Incremental detokenization: stream stable text per step, never a broken UTF-8 character, and find
stop strings across token boundaries without ever emitting text that is later trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from forklm.runtime.sampling.stop_regex import StopRegexSearch

_REPLACEMENT = "\ufffd"  # what decode yields for an incomplete UTF-8 sequence
_TAIL_LEN = 64  # emitted characters kept for the stop regexes' lookbehind


class DetokenizeStep(NamedTuple):
    delta: str  # new stable text, safe to stream now
    # The stop string (or stop_regex pattern) found; the text is then final (cut before the
    # match, or right after it when no_stop_trim) and the engine finishes the request.
    matched_stop: str | None


class IncrementalDetokenizer:
    """Turns a request's output ids into text, one `add` per engine step and one `flush` at finish.

    Decoding uses the prefix/read-offset window: each step decodes only ids[prefix_offset:] and
    compares with the already-known text of ids[prefix_offset:read_offset], so the cost per token
    does not grow with the output. The window moves forward once its text no longer ends in an
    incomplete character (U+FFFD), which is held back until a later token completes it.

    Stop strings and stop regexes (runtime/sampling/stop_regex.py) are searched only in the text not yet
    emitted (`_pending` + the new delta): a trailing piece of text that is a prefix of some stop
    string, or a partial match of some regex, is held back, so a match can never start inside
    emitted text. When several stops match, the one ending first wins (that is
    the one a character-by-character stream would meet first); on a tie, the longest.

    Decoding always passes clean_up_tokenization_spaces=False: that cleanup rewrites text *before*
    a later token (" ." -> "."), which a stream cannot take back.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, no_stop_trim: bool = False,
                 stop_regex: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            # Honoured by slow tokenizers; fast ones ignore it.
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        self._stops = StopStringMatcher(stop)
        self._no_stop_trim = no_stop_trim
        self._regex = StopRegexSearch(stop_regex)
        self._tail = ""  # the last emitted characters: context for the stop regexes
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are fully emitted or pending
        self._read_offset = 0  # window end at the last slide, a character boundary
        self._window_emitted = 0  # chars of decode(ids[prefix_offset:]) already passed on
        self._pending = ""  # decoded text held back as a possible start of a stop string
        self._pieces: list[str] = []
        self.finished = False

    @property
    def text(self) -> str:
        """All text emitted so far (deltas and flush), i.e. what the user has seen."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_ids: Sequence[int]) -> DetokenizeStep:
        """Take the step's new output ids; return the text now safe to stream."""
        assert not self.finished, "add() after a stop string matched or after flush()"
        self._ids.extend(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """At finish by length/EOS/abort: release everything held back (an incomplete character
        decodes with U+FFFD). Returns "" after a stop string matched, since the text is final."""
        if self.finished:
            return ""
        step = self._emit(self._decode_new(final=True), final=True)
        self.finished = True
        return step.delta

    def _decode_new(self, final: bool) -> str:
        """New decoded text since the last call; an incomplete trailing character is held back
        unless `final`."""
        window = self._decode(self._ids[self._prefix_offset:])
        stable = window if final else window.rstrip(_REPLACEMENT)
        new = stable[self._window_emitted:] if len(stable) > self._window_emitted else ""
        self._window_emitted = max(self._window_emitted, len(stable))
        if not window.endswith(_REPLACEMENT) and len(self._ids) > self._read_offset:
            # The window ends on a character boundary: slide it to start at the old read offset.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            # Decode the new window rather than slice the old one: tokenizers that strip a leading
            # space at the start of a decode would otherwise be off by one character.
            self._window_emitted = len(self._decode(self._ids[self._prefix_offset:]))
        return new

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def _emit(self, new: str, final: bool) -> DetokenizeStep:
        buf = self._pending + new
        found, regex_hold = self._regex.search(self._tail, buf) if self._regex else (None, 0)
        match = self._stops.feed(new)
        if match is not None:  # positions in `new` -> in `buf`
            match = (match[0] + len(self._pending), match[1] + len(self._pending), match[2])
        if found is not None and (match is None or (found.end, found.start) < match[:2]):
            match = (found.end, found.start, found.pattern)
        if match is not None:
            end, start, stop = match
            self.finished = True
            self._pending = ""
            return self._push(buf[: end if self._no_stop_trim else start], stop)
        held = 0 if final else max(self._stops.partial_len, regex_hold)
        self._pending = buf[len(buf) - held:] if held else ""
        return self._push(buf[: len(buf) - held], None)

    def _push(self, delta: str, stop: str | None) -> DetokenizeStep:
        if delta:
            self._pieces.append(delta)
            self._tail = (self._tail + delta)[-_TAIL_LEN:]
        return DetokenizeStep(delta, stop)


class StopStringMatcher:
    """The stop strings of one request, matched as the text grows (Knuth-Morris-Pratt): for each
    stop string, the length of the longest suffix of the text fed so far that it starts with.
    Building costs time and memory linear in the stop strings, feeding linear in the text.
    """

    def __init__(self, stops: Sequence[str]):
        assert all(stops), "stop strings must be non-empty (SamplingParams checks this)"
        self._stops = tuple(stops)
        self._failure = [_failure_function(s) for s in self._stops]
        self._states = [0] * len(self._stops)
        self._first_chars = frozenset(s[0] for s in self._stops)

    @property
    def partial_len(self) -> int:
        """Length of the longest suffix of the text fed that some stop string starts with (text
        that must be held back: it may still become a match)."""
        return max(self._states, default=0)

    def feed(self, text: str) -> tuple[int, int, str] | None:
        """Feed the next text. Returns (end, start, stop) of the first match to end, with end and
        start positions in `text` (start < 0: the match began in text fed before), the longest
        stop on a tie; the matcher is spent then. None if no stop string ends in `text`."""
        if not self._stops or (not any(self._states) and self._first_chars.isdisjoint(text)):
            return None  # the common case: nothing to match, no Python loop over the text
        for pos, char in enumerate(text):
            longest = ""
            for k, stop in enumerate(self._stops):
                state, failure = self._states[k], self._failure[k]
                while state and stop[state] != char:
                    state = failure[state - 1]
                if stop[state] == char:
                    state += 1
                if state == len(stop):
                    longest = stop if len(stop) > len(longest) else longest
                    state = failure[state - 1]
                self._states[k] = state
            if longest:
                return pos + 1, pos + 1 - len(longest), longest
        return None


def _failure_function(s: str) -> list[int]:
    """failure[i]: length of the longest proper prefix of s[: i + 1] that is also its suffix."""
    failure = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = failure[k - 1]
        if s[i] == s[k]:
            k += 1
        failure[i] = k
    return failure
