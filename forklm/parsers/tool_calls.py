"""Tool-call parsers: the calls a model writes in its own format, found in its text.

Formats (SGLang's names): `hermes` `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
(Qwen2.5, Qwen3, Hermes, SmolLM3), `llama3` `{"name": ..., "parameters": ...}` with an optional
`<|python_tag|>`, `;` between calls, `mistral` `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`,
and `json`: bare `{"name": ..., "arguments": ...}` objects from the first character (forklm's own,
for tool_choice "required"). Content is the text before the first call; text between and after
calls is dropped.

Every parser reads text incrementally: `parser.stream()` gives a ToolCallStream whose
`feed(text_delta)` returns what can be emitted so far (content, then ToolCallDelta pieces: a
call's first piece has its id and name, later pieces append to its arguments) and whose
`finish()` flushes the rest. Text that may be the start of a tag is held back, never emitted as
content. `parser.parse(text)` is exactly one feed plus finish, so a streamed reply reassembles
(`assemble`) to the non-streamed result. Arguments are the JSON text the model wrote for them; a
call cut off before its end comes back with `complete=False` and its partial arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from forklm.runtime.errors import InvalidArgumentError

# `{"name": "<name>", "arguments": ` (or "parameters") as a prefix of a call object.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                         r'\s*:\s*')
_NAME_SCAN_LIMIT = 512  # a call whose name prefix is not seen by then is parsed whole at its end


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # the call's position in the reply: 0, 1, ...
    id: str | None  # set on the call's first piece only
    name: str | None  # set on the call's first piece only
    arguments: str  # the next piece of the arguments' JSON text (may be "")


class StreamDelta(NamedTuple):
    content: str
    calls: list[ToolCallDelta]


class ToolCall(NamedTuple):
    id: str
    name: str
    arguments: str
    complete: bool  # False: the text ended inside the call (max_tokens)


class ParsedReply(NamedTuple):
    content: str
    calls: list[ToolCall]


def assemble(deltas: list[StreamDelta], complete: list[bool]) -> ParsedReply:
    """The reply that a sequence of stream deltas spells (`complete`: ToolCallStream.complete)."""
    content, heads, args = "", dict[int, ToolCallDelta](), dict[int, str]()
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            heads.setdefault(piece.index, piece)
            args[piece.index] = args.get(piece.index, "") + piece.arguments
    calls = [ToolCall(heads[i].id or "", heads[i].name or "", args[i], complete[i])
             for i in sorted(heads)]
    return ParsedReply(content, calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """A format: `opener` starts the calls (None: no tag), `bare_start` lets a reply that starts
    with `{` be calls, `special_tokens_in_text` says the opener is a special token that the text
    must keep (skip_special_tokens=False). `forms` are the ways a call is written, as (trigger,
    text before the call object, text after its arguments): `triggers` and `structures` give
    the structural-tag constraint of a tool's call once the model writes a trigger."""

    name = ""
    opener: str | None = None
    bare_start = False
    special_tokens_in_text = False
    args_key = "arguments"
    forms: tuple[tuple[str, str, str], ...] = (('{"name": ', "", "}"),)

    @property
    def triggers(self) -> list[str]:
        return [trigger for trigger, _, _ in self.forms]

    def structures(self, tool_name: str, schema: dict[str, Any]) -> list[dict[str, Any]]:
        """One {begin, schema, end} per form: the call's text up to its arguments, and after."""
        head = f'{{"name": {json.dumps(tool_name)}, "{self.args_key}": '
        return [{"begin": before + head, "schema": schema, "end": end}
                for _, before, end in self.forms]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def parse(self, text: str) -> ParsedReply:
        stream = self.stream()
        deltas = [stream.feed(text), stream.finish()]
        return assemble(deltas, stream.complete)


class HermesParser(ToolCallParser):
    name = "hermes"
    opener = "<tool_call>"
    forms = (("<tool_call>", "<tool_call>\n", "}\n</tool_call>"),)


class Llama3Parser(ToolCallParser):
    name = "llama3"
    opener = "<|python_tag|>"
    bare_start = True
    special_tokens_in_text = True
    args_key = "parameters"
    # Llama 3.1+ writes JSON calls bare; <|python_tag|> is optional.
    forms = (("<|python_tag|>", "<|python_tag|>", "}"), ('{"name": ', "", "}"))


class MistralParser(ToolCallParser):
    name = "mistral"
    opener = "[TOOL_CALLS]"
    special_tokens_in_text = True
    forms = (("[TOOL_CALLS]", "[TOOL_CALLS] [", "}]"),)


class JsonParser(ToolCallParser):
    name = "json"
    bare_start = True


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    p.name: p for p in (HermesParser, Llama3Parser, MistralParser, JsonParser)}


def get_tool_call_parser(name: str, field: str = "tool_call_parser") -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise InvalidArgumentError(field, name, "expected one of " + ", ".join(TOOL_CALL_PARSERS))
    return TOOL_CALL_PARSERS[name]()


def detect_tool_call_parser(template: str | None) -> str | None:
    """The format a chat template's source teaches the model, or None when it names none."""
    if not template:
        return None
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                         ("<|python_tag|>", "llama3"), ('"parameters"', "llama3")):
        if marker in template:
            return name
    return None


def held_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Call:
    """One call object being read: its text from `{`, JSON nesting state, the arguments span."""

    def __init__(self) -> None:
        self.text, self.depth = "", 0
        self.in_string = self.escaped = False
        self.name: str | None = None
        self.args_started = self.args_done = False
        self.held_ws = ""  # whitespace inside the arguments, emitted once more follows

    def push(self, ch: str) -> str:
        """Add one character; returns the part of the arguments it completes."""
        in_value = self.name is not None and not self.args_done
        top_level_delim = not self.in_string and self.depth == 1 and ch in ",}"
        self._track(ch)
        self.text += ch
        if self.name is None:
            if len(self.text) <= _NAME_SCAN_LIMIT and (m := _NAME_FIRST.fullmatch(self.text)):
                self.name = json.loads(f'"{m.group(1)}"')
            return ""
        if not in_value:
            return ""
        if top_level_delim:
            self.args_done = True
            return ""
        if ch.isspace() and not self.in_string and (self.depth == 1 or not self.args_started):
            if self.args_started:
                self.held_ws += ch
            return ""
        self.args_started = True
        out, self.held_ws = self.held_ws + ch, ""
        return out

    @property
    def closed(self) -> bool:
        return self.depth == 0 and bool(self.text)

    def _track(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1


class ToolCallStream:
    """Incremental reading of one reply in `parser`'s format (see the module docstring).
    `complete[i]` tells whether call i was closed; it is final after finish()."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.pending = ""  # content not yet emitted (held back: a possible tag or whitespace)
        self.in_calls = False
        self.tentative = False  # calls entered on a bare `{`: content again if it is no call
        self.raw = ""  # the text since a tentative start, which is content if it is no call
        self.seen_text = False
        self.call: _Call | None = None
        self.ids: list[str] = []
        self.complete: list[bool] = []

    def feed(self, text: str) -> StreamDelta:
        calls: list[ToolCallDelta] = []
        if self.tentative:
            self.raw += text
        if self.in_calls:
            self._read_calls(text, calls)
        else:
            self.pending += text
        content = ""
        while not self.in_calls and self.pending:
            piece, rest = self._read_content()
            content += piece
            if rest is None:
                break
            self._read_calls(rest, calls)
        return StreamDelta(content, _merged(calls))

    def finish(self) -> StreamDelta:
        if self.in_calls and self.tentative:  # a bare reply that never named a tool: content
            self.in_calls, self.pending = False, self.raw
        self.call = None
        content, self.pending = ("", "") if self.in_calls else (self.pending, "")
        return StreamDelta(content, [])

    def _read_content(self) -> tuple[str, str | None]:
        """The content that can be emitted now, and the text after an opener (None: none)."""
        opener = self.parser.opener
        if self.parser.bare_start and not self.seen_text:
            head = self.pending.lstrip()
            if head.startswith("{"):
                self.in_calls = self.tentative = True
                self.raw, rest, self.pending = self.pending, self.pending, ""
                return "", rest
            if not head:
                return "", None
        at = self.pending.find(opener) if opener else -1
        if at >= 0:
            content, rest = self.pending[:at].rstrip(), self.pending[at + len(opener or ""):]
            self.pending, self.in_calls = "", True
            return content, rest
        keep = held_prefix_len(self.pending, opener) if opener else 0
        ready_len = len(self.pending[:len(self.pending) - keep].rstrip())
        content, self.pending = self.pending[:ready_len], self.pending[ready_len:]
        self.seen_text = self.seen_text or bool(content)
        return content, None

    def _read_calls(self, text: str, out: list[ToolCallDelta]) -> None:
        for ch in text:
            if self.call is None:
                if ch != "{":
                    continue  # separators between calls: whitespace, `,;[]`, closing tags
                self.call = _Call()
            self._push(self.call, ch, out)
            if not self.in_calls:  # reverted to content: the text is in self.pending
                return

    def _push(self, call: _Call, ch: str, out: list[ToolCallDelta]) -> None:
        had_name = call.name is not None
        piece = call.push(ch)
        if call.name is not None and not had_name:
            self._open(call.name, "", out)
        if piece:
            out.append(ToolCallDelta(len(self.ids) - 1, None, None, piece))
        if not call.closed:
            return
        self.call = None
        if call.name is not None:
            self.complete[-1] = True
        elif not self._read_whole(call.text, out) and self.tentative:
            self.in_calls = self.tentative = False
            self.seen_text, self.pending, self.raw = True, self.raw, ""

    def _open(self, name: str, arguments: str, out: list[ToolCallDelta]) -> None:
        self.ids.append(new_call_id())
        self.complete.append(False)
        self.tentative, self.raw = False, ""
        out.append(ToolCallDelta(len(self.ids) - 1, self.ids[-1], name, arguments))

    def _read_whole(self, text: str, out: list[ToolCallDelta]) -> bool:
        """A closed object whose name did not come first: a call if it has a name and args."""
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return False
        args = obj.get("arguments", obj.get("parameters"))
        if not isinstance(args, dict):
            return False
        self._open(obj["name"], json.dumps(args, ensure_ascii=False), out)
        self.complete[-1] = True
        return True


def _merged(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument pieces of one call joined into one."""
    out: list[ToolCallDelta] = []
    for p in pieces:
        if out and out[-1].index == p.index and p.id is None:
            out[-1] = replace(out[-1], arguments=out[-1].arguments + p.arguments)
        else:
            out.append(p)
    return out
