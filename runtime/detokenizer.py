"""Incremental detokenization: stream stable text per step, never a broken UTF-8 character, and find
stop strings across token boundaries without ever emitting text that is later trimmed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from forklm.runtime.stop_regex import StopRegexSearch

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

    Stop strings and stop regexes (runtime/stop_regex.py) are searched only in the text not yet
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
        assert all(stop), "stop strings must be non-empty (SamplingParams checks this)"
        self._tokenizer = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            # Honoured by slow tokenizers; fast ones ignore it.
            "spaces_between_special_tokens": spaces_between_special_tokens,
            "clean_up_tokenization_spaces": False,
        }
        self._stop = tuple(stop)
        self._no_stop_trim = no_stop_trim
        # Every proper prefix of a stop string: a text suffix in this set must be held back.
        self._stop_prefixes = {s[:i] for s in self._stop for i in range(1, len(s))}
        self._max_prefix_len = max((len(s) - 1 for s in self._stop), default=0)
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
        match = self._find_stop(buf)
        if found is not None and (match is None or (found.end, found.start) < match[:2]):
            match = (found.end, found.start, found.pattern)
        if match is not None:
            end, start, stop = match
            self.finished = True
            self._pending = ""
            return self._push(buf[: end if self._no_stop_trim else start], stop)
        held = 0 if final else max(self._held_suffix_len(buf), regex_hold)
        self._pending = buf[len(buf) - held:] if held else ""
        return self._push(buf[: len(buf) - held], None)

    def _push(self, delta: str, stop: str | None) -> DetokenizeStep:
        if delta:
            self._pieces.append(delta)
            self._tail = (self._tail + delta)[-_TAIL_LEN:]
        return DetokenizeStep(delta, stop)

    def _find_stop(self, buf: str) -> tuple[int, int, str] | None:
        """(end, start, stop) of the stop string match ending first in `buf`, the longest on a
        tie."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                best = key if best is None or key < best else best
        return best

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that a stop string starts with."""
        for n in range(min(len(buf), self._max_prefix_len), 0, -1):
            if buf[-n:] in self._stop_prefixes:
                return n
        return 0
