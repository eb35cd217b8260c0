"""The Responses API's output shapes: the response object, output items, and the typed stream
events (response.created ... response.completed, each with its sequence_number) as the `openai`
client's types in openai/types/responses/ define them. One OutputBuilder reads a reply for both
the streamed and the whole response, so the two always agree."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from forklm.parsers.tool_calls import ToolCallDelta
from forklm.runtime.engine.results import GenerateOutput
from forklm.server.responses_protocol import ResponsesRequest
from forklm.server.tools import ReplyDelta, ReplyStream

Output = list[dict[str, Any]]
Event = dict[str, Any]
TERMINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                   "failed": "response.failed"}


@dataclass(frozen=True)
class ResponseHead:
    """A response's identity and the request fields every response object repeats."""

    id: str
    created_at: int
    echo: dict[str, Any]

    @classmethod
    def of(cls, body: ResponsesRequest, response_id: str, created_at: int) -> ResponseHead:
        fmt = body.text.format if body.text else None
        choice = body.tool_choice
        return cls(response_id, created_at, {
            "model": body.model, "instructions": body.instructions,
            "tools": [t.model_dump() for t in body.tools or ()],
            "tool_choice": choice.model_dump() if choice and not isinstance(choice, str)
            else choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                     else {"type": "text"}},
            "temperature": body.temperature, "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id, "store": body.store,
            "metadata": body.metadata or {}, "user": body.user, "truncation": "disabled",
            "reasoning": {"effort": None, "summary": None}, "background": False})

    def response(self, output: Output, final: GenerateOutput | None) -> dict[str, Any]:
        """The response object; `final` is the reply's result (None while in progress)."""
        status = response_status(final)
        reason = final.finish_reason if final else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "output": output, **self.echo,
                "incomplete_details": {"reason": "max_output_tokens"}
                if status == "incomplete" else None,
                "error": {"code": "server_error", "message": reason.message or "aborted"}
                if status == "failed" and reason else None,
                "usage": _usage(final) if final else None}


def response_status(final: GenerateOutput | None) -> str:
    reason = final.finish_reason if final else None
    if reason is None:
        return "in_progress"
    return {"length": "incomplete", "abort": "failed"}.get(reason.type, "completed")


def _usage(final: GenerateOutput) -> dict[str, Any]:
    return {"input_tokens": final.prompt_tokens, "output_tokens": final.completion_tokens,
            "total_tokens": final.prompt_tokens + final.completion_tokens,
            "input_tokens_details": {"cached_tokens": final.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class Sequencer:
    """Builds events, numbering them in the order they are sent."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, kind: str, **fields: Any) -> Event:
        self.next += 1
        return {"type": kind, "sequence_number": self.next - 1, **fields}


class OutputBuilder:
    """Reads one reply (text pieces through the plan's ReplyStream) into output items: a
    reasoning item, a message, function calls, in the order the reply opens them; feed() and
    finish() return the stream events of what they added. Items stay open until the reply ends.
    Whitespace before anything else is held, so a call after a newline makes no empty message."""

    def __init__(self, reader: ReplyStream, seq: Sequencer):
        self.reader, self.seq = reader, seq
        self.output: Output = []
        self._texts: list[list[str]] = []  # by output index: its text or arguments pieces
        self._reasoning: int | None = None  # output index of the reasoning item
        self._message: int | None = None
        self._calls: dict[int, int] = {}  # call index in the reply -> output index
        self._call_at: dict[int, int] = {}  # output index -> call index
        self._space = ""

    def feed(self, text: str) -> list[Event]:
        return self._apply(self.reader.feed(text))

    def finish(self, final: GenerateOutput) -> list[Event]:
        """The rest of the reply, then every item closed (`output` is final after this)."""
        events = self._apply(self.reader.finish())
        if not self.output:  # an empty (or all-space) reply is still one message
            events += self._content("", force=True)
        cut = response_status(final) == "incomplete"
        complete = self.reader.complete
        for index, item in enumerate(self.output):
            text = "".join(self._texts[index])
            if item["type"] == "function_call":
                call = self._call_at[index]
                events += self._call_closed(index, text, call < len(complete) and complete[call])
            else:
                events += self._part_closed(index, text, "incomplete" if cut else "completed")
        return events

    def _apply(self, delta: ReplyDelta) -> list[Event]:
        events = self._reasoning_text(delta.reasoning) if delta.reasoning else []
        if delta.content:
            events += self._content(delta.content)
        for piece in delta.calls:
            events += self._call_piece(piece)
        return events

    def _open(self, item: dict[str, Any]) -> tuple[int, list[Event]]:
        index = len(self.output)
        self.output.append(item)
        self._texts.append([])
        return index, [self.seq("response.output_item.added", output_index=index,
                                item=dict(item))]

    def _reasoning_text(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._reasoning is None:
            self._reasoning, events = self._open(
                {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                 "content": [], "status": "in_progress"})
            events.append(self._part_event("added", self._reasoning, _reasoning_part("")))
        return events + self._text_delta(self._reasoning, "response.reasoning_text.delta", text)

    def _content(self, text: str, force: bool = False) -> list[Event]:
        events: list[Event] = []
        if self._message is None:
            text, self._space = self._space + text, ""
            if not text.strip() and not force:
                self._space = text
                return []
            self._message, events = self._open(
                {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                 "status": "in_progress", "content": []})
            events.append(self._part_event("added", self._message, _text_part("")))
        if not text:
            return events
        return events + self._text_delta(self._message, "response.output_text.delta", text,
                                         logprobs=[])

    def _call_piece(self, piece: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.index not in self._calls:
            index, events = self._open(
                {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                 "call_id": piece.id or "", "name": piece.name or "", "arguments": ""})
            self._calls[piece.index], self._call_at[index] = index, piece.index
        index = self._calls[piece.index]
        if not piece.arguments:
            return events
        self._texts[index].append(piece.arguments)
        return events + [self.seq("response.function_call_arguments.delta",
                                  item_id=self.output[index]["id"], output_index=index,
                                  delta=piece.arguments)]

    def _text_delta(self, index: int, kind: str, text: str, **extra: Any) -> list[Event]:
        self._texts[index].append(text)
        return [self.seq(kind, item_id=self.output[index]["id"], output_index=index,
                         content_index=0, delta=text, **extra)]

    def _part_event(self, verb: str, index: int, part: dict[str, Any]) -> Event:
        return self.seq(f"response.content_part.{verb}", item_id=self.output[index]["id"],
                        output_index=index, content_index=0, part=part)

    def _part_closed(self, index: int, text: str, status: str) -> list[Event]:
        item = self.output[index]
        is_message = item["type"] == "message"
        part = _text_part(text) if is_message else _reasoning_part(text)
        done = self.seq("response.output_text.done" if is_message
                        else "response.reasoning_text.done", item_id=item["id"],
                        output_index=index, content_index=0, text=text,
                        **({"logprobs": []} if is_message else {}))
        item.update(content=[part], status=status)
        return [done, self._part_event("done", index, part), self._item_done(index)]

    def _call_closed(self, index: int, arguments: str, complete: bool) -> list[Event]:
        item = self.output[index]
        item.update(arguments=arguments, status="completed" if complete else "incomplete")
        return [self.seq("response.function_call_arguments.done", item_id=item["id"],
                         output_index=index, arguments=arguments), self._item_done(index)]

    def _item_done(self, index: int) -> Event:
        return self.seq("response.output_item.done", output_index=index,
                        item=dict(self.output[index]))


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}
