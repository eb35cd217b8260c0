"""Reading text whose structure is marked by tags or special tokens, as it streams in: a
MarkerReader finds the next marker, holding back text that may be the start of one; a
MarkupStream turns a format's state machine over it into a CallStream."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from typing import Any

from forklm.parsers.calls import (
    JsonNesting,
    StreamDelta,
    ToolCallDelta,
    held_prefix_len,
    merged,
    new_call_id,
)

# A call's header (its name and what leads to its arguments) longer than this is no call.
MAX_HEADER_LEN = 512


class MarkerReader:
    """`text`: received and not yet read; `ended`: no more will come (finish)."""

    def __init__(self) -> None:
        self.text = ""
        self.ended = False

    def until(self, *markers: str, keep: bool = False) -> tuple[str, str | None]:
        """The text before the first of `markers` and that marker, both consumed (the marker
        stays unread with `keep`); while none has come, the text that cannot be the start of
        one (all of it once ended) and None."""
        hits = [(at, -len(m), m) for m in markers if (at := self.text.find(m)) >= 0]
        if hits:
            at, _, marker = min(hits)  # the first; at one position, the longest
            before, self.text = self.text[:at], self.text[at + (0 if keep else len(marker)):]
            return before, marker
        held = 0 if self.ended else max(held_prefix_len(self.text, m) for m in markers)
        ready, self.text = self.text[:len(self.text) - held], self.text[len(self.text) - held:]
        return ready, None


class MarkupStream(MarkerReader):
    """A CallStream run by `state`, the method that reads what the current state expects:
    it returns False when it needs more text (once ended, when it has read what it can).
    States emit through `emit`, `open_call`, `add_arguments` and `close_call`."""

    state: Callable[[], bool]

    def __init__(self) -> None:
        super().__init__()
        self.complete: list[bool] = []
        self.ids: list[str] = []
        self.content, self.pieces = "", list[ToolCallDelta]()  # this feed's output
        self.space = ""  # trailing whitespace of the content, emitted once more text follows

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        return self._run()

    def finish(self) -> StreamDelta:
        self.ended = True
        return self._run()

    def _run(self) -> StreamDelta:
        while self.state():
            pass
        out = StreamDelta(self.content, merged(self.pieces))
        self.content, self.pieces = "", []
        return out

    def read_content(self, *openers: str) -> str | None:
        """Emit the content before the first of `openers` (less its trailing whitespace) and
        return that opener; None while none has come."""
        text, opener = self.until(*openers)
        text = self.space + text
        ready = text if self.ended and opener is None else text.rstrip()
        self.space = "" if opener else text[len(ready):]
        self.emit(ready)
        return opener

    def emit(self, content: str) -> None:
        self.content += content

    def open_call(self, name: str, call_id: str | None = None) -> None:
        self.ids.append(call_id or new_call_id())
        self.complete.append(False)
        self.pieces.append(ToolCallDelta(len(self.ids) - 1, self.ids[-1], name, ""))

    def add_arguments(self, piece: str) -> None:
        if piece:
            self.pieces.append(ToolCallDelta(len(self.ids) - 1, None, None, piece))

    def close_call(self) -> None:
        self.complete[-1] = True


class JsonArguments:
    """A call's JSON arguments read piece by piece, from their `{` to the `}` that closes it;
    text after that is not part of them."""

    def __init__(self) -> None:
        self.nesting = JsonNesting()
        self.closed = False

    def push(self, text: str) -> str:
        """The part of `text` that belongs to the arguments."""
        used = 0
        for ch in text:
            if self.closed:
                break
            self.nesting.push(ch)
            used += 1
            self.closed = self.nesting.depth == 0
        return text[:used]


def json_argument(key: str, value: Any, first: bool) -> str:
    """One parameter as a piece of a JSON object's text: `{"key": value` or `, "key": value`."""
    return ("{" if first else ", ") + json.dumps(key) + ": " + json.dumps(value,
                                                                           ensure_ascii=False)


def literal_value(text: str) -> Any:
    """A value written as a Python or JSON literal (`True`, `'a'`, `[1, 2]`, `null`), when it
    is one that JSON can hold; ValueError otherwise."""
    for read in (ast.literal_eval, json.loads):
        try:
            value = read(text)
            json.dumps(value, allow_nan=False)
            return value
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    raise ValueError(f"not a literal: {text[:40]!r}")
