"""Call streams for forklm's own formats, used where no model format applies: a forced named
tool (the whole reply is its arguments), "auto" with the generic JSON tool prompt (held until the
reply ends, since only the whole text tells whether it is a call) and no tools at all. Each
fulfils calls.CallStream, as each model format's stream does."""

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


class HeldJsonStream:
    """"auto" with the generic prompt: the reply is a call when it is exactly one JSON object
    `{"name": <a tool in names>, "arguments": {...}}`, else content."""

    def __init__(self, names: frozenset[str]):
        self.names, self.text, self.complete = names, "", list[bool]()

    def feed(self, text: str) -> StreamDelta:
        self.text += text
        return StreamDelta("", [])

    def finish(self) -> StreamDelta:
        obj = json_object(self.text)
        if (obj is None or obj.get("name") not in self.names
                or not isinstance(obj.get("arguments"), dict)):
            return StreamDelta(self.text, [])
        self.complete = [True]
        args = json.dumps(obj["arguments"], ensure_ascii=False)
        return StreamDelta("", [ToolCallDelta(0, new_call_id(), obj["name"], args)])


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
