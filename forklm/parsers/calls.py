"""What every tool-call format shares: the pieces a stream emits (ToolCallDelta, StreamDelta),
the calls they spell (ToolCall, ParsedReply, `assemble`), the CallStream protocol and the
ToolCallParser base that each format (tool_calls.py and its sibling modules) fills in."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

# Tool name -> its `parameters` JSON schema, for formats whose argument values are text.
Schemas = Mapping[str, dict[str, Any]]


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


class CallStream(Protocol):
    """Reads one reply's calls: feed(text_delta) and finish() return what can be emitted;
    complete[i] (final after finish) says whether call i was closed before the text ended."""

    complete: list[bool]

    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta: ...


def assemble(deltas: list[StreamDelta], complete: list[bool]) -> ParsedReply:
    """The reply that a sequence of stream deltas spells (`complete`: CallStream.complete)."""
    content, heads, args = "", dict[int, ToolCallDelta](), dict[int, str]()
    for delta in deltas:
        content += delta.content
        for piece in delta.calls:
            heads.setdefault(piece.index, piece)
            args[piece.index] = args.get(piece.index, "") + piece.arguments
    calls = [ToolCall(heads[i].id or "", heads[i].name or "", args[i], complete[i])
             for i in sorted(heads)]
    return ParsedReply(content, calls)


def merged(pieces: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument pieces of one call joined into one."""
    out: list[ToolCallDelta] = []
    for p in pieces:
        if out and out[-1].index == p.index and p.id is None:
            out[-1] = replace(out[-1], arguments=out[-1].arguments + p.arguments)
        else:
            out.append(p)
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix_len(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """A model's call format. `stream(schemas)` reads one reply as it comes (a CallStream;
    `schemas` lets formats whose values are text type them); `parse` is one feed plus finish,
    so a streamed reply reassembles (`assemble`) to the whole one.

    For the "auto" constraint, `tags(tool_name, args)` are xgrammar tags of one tool's call,
    one per way the format writes it: a begin that starts with one of `triggers`, `args` (the
    arguments' format, read in `args_style`) and an end; a format without tags is not
    constrained. `special_tokens_in_text`: the format's markers are special tokens that the
    text must keep (skip_special_tokens=False)."""

    name = ""
    special_tokens_in_text = False
    args_style = "json"  # or one of xgrammar's XML styles ("qwen_xml", "glm_xml")
    triggers: tuple[str, ...] = ()

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        return []

    def call_example(self) -> str:
        """How a call is written, for a system prompt that teaches the format."""
        tag = self.tags("<tool name>", {})[0]
        return f"{tag['begin']}{{...}}{tag['end']}"

    def stream(self, schemas: Schemas | None = None) -> CallStream:
        raise NotImplementedError

    def parse(self, text: str, schemas: Schemas | None = None) -> ParsedReply:
        stream = self.stream(schemas)
        deltas = [stream.feed(text), stream.finish()]
        return assemble(deltas, stream.complete)


def tag(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


class JsonNesting:
    """Where a JSON text is so far: inside a string or not, how deep in objects and arrays."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False

    def push(self, ch: str) -> None:
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
