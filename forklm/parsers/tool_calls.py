"""Tool-call formats whose calls are JSON objects, the registry of every format and its
detection from a chat template.

Formats (SGLang's names): `hermes` `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
(Qwen2.5, Qwen3, Hermes, SmolLM3), `llama3` `{"name": ..., "parameters": ...}` with an optional
`<|python_tag|>`, `;` between calls, `mistral` `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`,
and `json`: bare `{"name": ..., "arguments": ...}` objects from the first character (forklm's own,
for tool_choice "required"). Content is the text before the first call; text between and after
calls is dropped. The other formats live beside this module: tagged_json.py (deepseekv3,
deepseekv31, kimi_k2), harmony.py (gpt-oss), xml_calls.py (qwen3_coder, glm45), pythonic.py.

A ToolCallStream reads text incrementally: `feed(text_delta)` returns what can be emitted so far
(content, then ToolCallDelta pieces: a call's first piece has its id and name, later pieces
append to its arguments) and `finish()` flushes the rest. Text that may be the start of a tag is
held back, never emitted as content. Arguments are the JSON text the model wrote for them; a
call cut off before its end comes back with `complete=False` and its partial arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from forklm.parsers.calls import (
    JsonNesting,
    ParsedReply,
    Schemas,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    assemble,
    held_prefix_len,
    merged,
    new_call_id,
    tag,
)
from forklm.parsers.harmony import GptOssParser
from forklm.parsers.pythonic import PythonicParser
from forklm.parsers.tagged_json import DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser
from forklm.parsers.xml_calls import Glm45Parser, Qwen3CoderParser
from forklm.runtime.errors import InvalidArgumentError

__all__ = ["ParsedReply", "StreamDelta", "ToolCall", "ToolCallDelta", "ToolCallParser",
           "assemble", "held_prefix_len", "new_call_id"]

# `{"name": "<name>", "arguments": ` (or "parameters") as a prefix of a call object.
_NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                         r'\s*:\s*')
_NAME_SCAN_LIMIT = 512  # a call whose name prefix is not seen by then is parsed whole at its end


class JsonObjectParser(ToolCallParser):
    """A format of JSON call objects: `opener` starts the calls (None: no tag), `bare_start`
    lets a reply that starts with `{` be calls. `forms` are the ways a call is written, as
    (trigger, text before the call object, text after its arguments)."""

    opener: str | None = None
    bare_start = False
    args_key = "arguments"
    forms: tuple[tuple[str, str, str], ...] = (('{"name": ', "", "}"),)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.triggers = tuple(trigger for trigger, _, _ in cls.forms)

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        head = f'{{"name": {json.dumps(tool_name)}, "{self.args_key}": '
        return [tag(before + head, args, end) for _, before, end in self.forms]

    def stream(self, schemas: Schemas | None = None) -> ToolCallStream:
        return ToolCallStream(self)


class HermesParser(JsonObjectParser):
    name = "hermes"
    opener = "<tool_call>"
    forms = (("<tool_call>", "<tool_call>\n", "}\n</tool_call>"),)


class Llama3Parser(JsonObjectParser):
    name = "llama3"
    opener = "<|python_tag|>"
    bare_start = True
    special_tokens_in_text = True
    args_key = "parameters"
    # Llama 3.1+ writes JSON calls bare; <|python_tag|> is optional.
    forms = (("<|python_tag|>", "<|python_tag|>", "}"), ('{"name": ', "", "}"))


class MistralParser(JsonObjectParser):
    name = "mistral"
    opener = "[TOOL_CALLS]"
    special_tokens_in_text = True
    forms = (("[TOOL_CALLS]", "[TOOL_CALLS] [", "}]"),)


class JsonParser(JsonObjectParser):
    name = "json"
    bare_start = True


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (
    HermesParser, Llama3Parser, MistralParser, JsonParser, Qwen3CoderParser, PythonicParser,
    GptOssParser, DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser, Glm45Parser)}

# (what a chat template's source holds, the format it teaches), first match wins: the
# formats that also write <tool_call> (Qwen3-Coder, GLM) come before hermes.
_TEMPLATE_MARKERS = (
    (re.compile(r"<function=.*<parameter=", re.DOTALL), "qwen3_coder"),
    (re.compile(re.escape("<arg_key>")), "glm45"),
    (re.compile(r"<｜tool▁calls▁begin｜>.*```json", re.DOTALL), "deepseekv3"),
    (re.compile("<｜tool▁calls▁begin｜>"), "deepseekv31"),
    (re.compile(re.escape("<|tool_calls_section_begin|>")), "kimi_k2"),
    (re.compile(re.escape("<|channel|>")), "gpt-oss"),
    (re.compile(r"\[func_name\d*\("), "pythonic"),  # the instruction Llama 3.2/4 templates give
    (re.compile(re.escape("<tool_call>")), "hermes"),
    (re.compile(re.escape("[TOOL_CALLS]")), "mistral"),
    (re.compile(re.escape("<|python_tag|>")), "llama3"),
    (re.compile('"parameters"'), "llama3"),
)


def get_tool_call_parser(name: str, field: str = "tool_call_parser") -> ToolCallParser:
    if name not in TOOL_CALL_PARSERS:
        raise InvalidArgumentError(field, name, "expected one of " + ", ".join(TOOL_CALL_PARSERS))
    return TOOL_CALL_PARSERS[name]()


def detect_tool_call_parser(template: str | None) -> str | None:
    """The format a chat template's source teaches the model, or None when it names none."""
    if not template:
        return None
    return next((name for marker, name in _TEMPLATE_MARKERS if marker.search(template)), None)


class _Call:
    """One call object being read: its text from `{`, JSON nesting state, the arguments span."""

    def __init__(self) -> None:
        self.text, self.json = "", JsonNesting()
        self.name: str | None = None
        self.args_started = self.args_done = False
        self.held_ws = ""  # whitespace inside the arguments, emitted once more follows

    def push(self, ch: str) -> str:
        """Add one character; returns the part of the arguments it completes."""
        in_value = self.name is not None and not self.args_done
        top_level_delim = not self.json.in_string and self.json.depth == 1 and ch in ",}"
        self.json.push(ch)
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
        if ch.isspace() and not self.json.in_string and (self.json.depth == 1
                                                      or not self.args_started):
            if self.args_started:
                self.held_ws += ch
            return ""
        self.args_started = True
        out, self.held_ws = self.held_ws + ch, ""
        return out

    @property
    def closed(self) -> bool:
        return self.json.depth == 0 and bool(self.text)


class ToolCallStream:
    """Incremental reading of one reply in `parser`'s format (see the module docstring).
    `complete[i]` tells whether call i was closed; it is final after finish()."""

    def __init__(self, parser: JsonObjectParser):
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
        return StreamDelta(content, merged(calls))

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
