"""Call streams for forklm's own formats, used where no model format applies: a forced named
tool (the whole reply is its arguments), "auto" with the generic JSON tool prompt (content or a
call, streamed as soon as the reply's start tells which) and no tools at all. Each fulfils
calls.CallStream, as each model format's stream does."""

from __future__ import annotations

import json
from typing import Any

from forklm.parsers.calls import StreamDelta, ToolCallDelta, new_call_id
from forklm.parsers.tool_calls import JsonParser, ToolCallStream

_HEAD = '{"name": "'  # how a "required" call starts (its schema compiles compact JSON)


class PlainStream:
    """No tools: every piece is content."""

    def __init__(self) -> None:
        self.complete: list[bool] = []

    def feed(self, text: str) -> StreamDelta:
        return StreamDelta(text, [])

    def finish(self) -> StreamDelta:
        return StreamDelta("", [])


class ArgumentsStream:
    """A named tool forced: the whole reply is its arguments (a JSON schema constrains it)."""

    def __init__(self, name: str):
        self.name, self.text, self.complete = name, "", [False]

    def feed(self, text: str) -> StreamDelta:
        first = not self.text and bool(text)
        self.text += text
        if first:
            return StreamDelta("", [ToolCallDelta(0, new_call_id(), self.name, text)])
        return StreamDelta("", [ToolCallDelta(0, None, None, text)] if text else [])

    def finish(self) -> StreamDelta:
        self.complete = [json_object(self.text) is not None]
        if not self.text:  # nothing generated (max_tokens 0): still the forced call
            return StreamDelta("", [ToolCallDelta(0, new_call_id(), self.name, "")])
        return StreamDelta("", [])


class GenericJsonStream:
    """"auto" with the generic prompt: the reply is a call when it is exactly one JSON object
    `{"name": <a tool in names>, "arguments": {...}}`, else content. Streamed as it is decided:
    a reply that does not open with `{` (or a ```json fence) is content from its first
    character; one that opens
    with `{"name": "<a tool>", "arguments": ` is that call, its arguments streamed as the model
    writes them (closing braces held back until more text shows they are not the object's
    end). Any other object is held to the end and read whole, as before the reply was streamed.
    A call whose text turns out not to be one JSON object ends with complete=False."""

    def __init__(self, names: frozenset[str]):
        self.names, self.text, self.complete = names, "", list[bool]()
        self.mode = "undecided"  # then "content", "call" (args from args_start) or "held"
        self.args_start = self.args_sent = 0

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        if self.mode == "undecided":
            return self._decide()
        if self.mode == "content":
            return StreamDelta(text, [])
        if self.mode == "call":
            return self._arguments(self.text.rstrip("} \t\r\n"))
        return StreamDelta("", [])

    def finish(self) -> StreamDelta:
        if self.mode == "content":
            return StreamDelta("", [])
        if self.mode == "call":
            obj = json_object(self.text)
            valid = (obj is not None and obj.get("name") in self.names
                     and isinstance(obj.get("arguments"), dict))
            self.complete = [valid]
            tail = self.text.rstrip()
            return self._arguments(tail[:-1].rstrip() if valid else tail)
        obj = json_object(self.text)
        if (obj is None or obj.get("name") not in self.names
                or not isinstance(obj.get("arguments"), dict)):
            return StreamDelta(self.text, [])
        self.complete = [True]
        args = json.dumps(obj["arguments"], ensure_ascii=False)
        return StreamDelta("", [ToolCallDelta(0, new_call_id(), obj["name"], args)])

    def _decide(self) -> StreamDelta:
        head = self.text.lstrip()
        if not head:
            return StreamDelta("", [])
        if "```".startswith(head[:3]):  # a ```json fence may hold the call: read it whole
            line = head[3:].split("\n", 1)
            if len(head) < 3 or (len(line) == 1 and len(head) < 16):
                return StreamDelta("", [])  # the fence's language is not known yet
            if line[0].strip() in ("", "json"):
                self.mode = "held"
                return StreamDelta("", [])
        if not head.startswith("{"):
            self.mode = "content"
            return StreamDelta(self.text, [])
        state, name, end = call_head(self.text)
        if state == "partial" and len(self.text) <= _HEAD_SCAN_LIMIT:
            return StreamDelta("", [])
        if state != "call" or name not in self.names:
            self.mode = "held"
            return StreamDelta("", [])
        self.mode, self.args_start = "call", end
        self.args_sent = end
        first = ToolCallDelta(0, new_call_id(), name, "")
        rest = self._arguments(self.text.rstrip("} \t\r\n"))
        return StreamDelta("", [first, *rest.calls])

    def _arguments(self, upto: str) -> StreamDelta:
        """The arguments' text from what was sent to the end of `upto` (a prefix of text)."""
        end = max(len(upto), self.args_sent)
        piece, self.args_sent = self.text[self.args_sent:end], end
        return StreamDelta("", [ToolCallDelta(0, None, None, piece)] if piece else [])


# A head longer than this that is still undecided is held and read whole at the end.
_HEAD_SCAN_LIMIT = 512
_NAME_KEY, _ARGS_KEYS = '"name"', ('"arguments"', '"parameters"')


def call_head(text: str) -> tuple[str, str | None, int]:
    """Whether `text` opens a JSON call `{"name": "<name>", "arguments": `: ("call", name, the
    index where the arguments' value starts), ("partial", None, 0) while it may still, or
    ("no", None, 0)."""
    pos = _skip_space(text, 0)
    for literal in ("{", _NAME_KEY, ":", '"'):
        pos = _skip_space(text, pos)
        state, pos = _expect(text, pos, literal)
        if state != "ok":
            return state, None, 0
    name_end = pos
    while name_end < len(text) and text[name_end] != '"':
        name_end += 2 if text[name_end] == "\\" else 1
    if name_end >= len(text):
        return "partial", None, 0
    name = text[pos:name_end]
    pos = _skip_space(text, name_end + 1)
    state, pos = _expect(text, pos, ",")
    if state != "ok":
        return state, None, 0
    pos = _skip_space(text, pos)
    states = [_expect(text, pos, key) for key in _ARGS_KEYS]
    ok = [p for st, p in states if st == "ok"]
    if not ok:
        return ("partial" if any(st == "partial" for st, _ in states) else "no"), None, 0
    pos = _skip_space(text, ok[0])
    state, pos = _expect(text, pos, ":")
    if state != "ok":
        return state, None, 0
    pos = _skip_space(text, pos)
    if pos >= len(text):
        return "partial", None, 0
    try:
        return "call", json.loads(f'"{name}"'), pos
    except ValueError:
        return "no", None, 0


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _expect(text: str, pos: int, literal: str) -> tuple[str, int]:
    """("ok", the index after `literal` at pos), ("partial", pos) when text ends inside it, or
    ("no", pos)."""
    part = text[pos:pos + len(literal)]
    if part == literal:
        return "ok", pos + len(literal)
    return ("partial" if literal.startswith(part) else "no"), pos


class RequiredStream:
    """tool_choice "required": a bare JSON call (JsonParser), and a reply cut off before its
    name was complete is still the call of the one tool whose name it can only be."""

    def __init__(self, names: frozenset[str]):
        self.names, self.text = names, ""
        self.inner: ToolCallStream = JsonParser().stream()
        self.complete = self.inner.complete  # the same list, filled by the inner stream

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        return self.inner.feed(text)

    def finish(self) -> StreamDelta:
        delta = self.inner.finish()
        text = self.text.strip()
        if self.inner.ids or not (_HEAD.startswith(text) or text.startswith(_HEAD)):
            return delta
        typed, *closed = text[len(_HEAD):].split('"', 1)  # the name so far ("" before it)
        names = [n for n in self.names if (n == typed if closed else n.startswith(typed))]
        if len(names) != 1:
            return delta
        self.inner.complete.append(False)
        return StreamDelta("", [ToolCallDelta(0, new_call_id(), names[0], "")])


def json_object(text: str) -> dict[str, Any] | None:
    """The reply as one JSON object; a ```json fence around it (a common habit) is allowed."""
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = text[3:-3].removeprefix("json").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
