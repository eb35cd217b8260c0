"""Anthropic's Messages output: the message object, its content blocks (thinking, text, tool_use),
stop reasons, usage, and the stream events (content_block_start/_delta/_stop) as the `anthropic`
client's types define them. One BlockBuilder reads a reply for both the streamed and the whole
message, so the two always agree."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from forklm.parsers.tool_calls import ToolCallDelta
from forklm.runtime.engine.results import GenerateOutput
from forklm.server.errors import ApiError
from forklm.server.tools import ReplyDelta, ReplyStream

Event = dict[str, Any]
Block = dict[str, Any]


@dataclass(frozen=True)
class MessageHead:
    """A message's identity and what its stop reason is read against."""

    id: str
    model: str
    stop_sequences: tuple[str, ...]

    def message(self, content: list[Block], final: GenerateOutput | None, called: bool,
                usage: dict[str, int]) -> dict[str, Any]:
        """The message object; `final` is the reply's result (None while it streams)."""
        reason, sequence = (None, None) if final is None else self.stop_reason(final, called)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage}

    def stop_reason(self, final: GenerateOutput, called: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence): a call cut off by max_tokens is "max_tokens"; a stop
        string the request did not ask for (a template's) ends the turn."""
        reason = final.finish_reason
        assert reason is not None, "the final chunk has the finish reason"
        if reason.type == "abort":  # Anthropic has no such stop: the request failed
            raise ApiError(500, f"the generation was aborted: {reason.message or 'no reason'}")
        if reason.type == "length":
            return "max_tokens", None
        if called:
            return "tool_use", None
        if isinstance(reason.matched, str) and reason.matched in self.stop_sequences:
            return "stop_sequence", reason.matched
        return "end_turn", None


def usage(out: GenerateOutput, output_tokens: int | None = None) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's tokens the cache did not serve (the
    prompt is input + cache read + cache creation, the last 0 here)."""
    return {"input_tokens": out.prompt_tokens - out.cached_tokens,
            "output_tokens": out.completion_tokens if output_tokens is None else output_tokens,
            "cache_read_input_tokens": out.cached_tokens, "cache_creation_input_tokens": 0}


class BlockBuilder:
    """Reads one reply (text pieces through the plan's ReplyStream) into content blocks in the
    order the reply opens them; feed() and finish() return the stream events of what they added.
    One block is open at a time, as Anthropic streams them. Whitespace before a text block is
    held, so a call after a newline makes no text block of its own."""

    def __init__(self, reader: ReplyStream):
        self.reader = reader
        self.blocks: list[Block] = []
        self._open: str | None = None  # "thinking", "text" or "tool_use:<call index>"
        self._arguments: dict[int, list[str]] = {}  # block index -> its input's JSON pieces
        self._space = ""

    @property
    def called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def feed(self, text: str) -> list[Event]:
        return self._apply(self.reader.feed(text))

    def finish(self) -> list[Event]:
        """The rest of the reply, then the open block closed (`blocks` is final after this).
        A reply with no block at all is one text block (its whitespace, or empty)."""
        events = self._apply(self.reader.finish())
        if not self.blocks:
            events += self._text("", force=True)
        events += self._close()
        for index, pieces in self._arguments.items():
            self.blocks[index]["input"] = _input("".join(pieces))
        return events

    def _apply(self, delta: ReplyDelta) -> list[Event]:
        events = self._thinking(delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self._text(delta.content)
        for piece in delta.calls:
            events += self._call(piece)
        return events

    def _thinking(self, text: str) -> list[Event]:
        events = [] if self._open == "thinking" else self._start(
            "thinking", {"type": "thinking", "thinking": "", "signature": ""})
        self.blocks[-1]["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def _text(self, text: str, force: bool = False) -> list[Event]:
        events: list[Event] = []
        if self._open != "text":
            text, self._space = self._space + text, ""
            if not text.strip() and not force:
                self._space = text
                return []
            events = self._start("text", {"type": "text", "text": ""})
        if not text:
            return events
        self.blocks[-1]["text"] += text
        return events + [self._delta({"type": "text_delta", "text": text})]

    def _call(self, piece: ToolCallDelta) -> list[Event]:
        key = f"tool_use:{piece.index}"
        events: list[Event] = []
        if self._open != key:
            events = self._start(key, {"type": "tool_use", "id": piece.id or _tool_use_id(),
                                       "name": piece.name or "", "input": {}})
            self._arguments[len(self.blocks) - 1] = []
        if not piece.arguments:
            return events
        self._arguments[len(self.blocks) - 1].append(piece.arguments)
        return events + [self._delta({"type": "input_json_delta",
                                      "partial_json": piece.arguments})]

    def _start(self, key: str, block: Block) -> list[Event]:
        events = self._close()
        if key != "text":
            self._space = ""  # whitespace before a thinking or tool_use block is no text
        self.blocks.append(block)
        self._open = key
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1,
                          "content_block": dict(block)}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _input(arguments: str) -> dict[str, Any]:
    """A call's input object; arguments cut off (max_tokens) or not an object give {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"
