"""gpt-oss's harmony format: a reply is messages, each a header (`<|channel|>analysis`, `final`,
`commentary`, maybe ` to=functions.NAME` and `<|constrain|>json`), `<|message|>`, its text, and
`<|end|>`, `<|call|>` or `<|return|>`; `<|start|>assistant` opens the next. A message to a
recipient is a tool call, its text the JSON arguments:
`<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "UTC"}<|call|>`
(or ` to=functions.get_time<|channel|>commentary json<|message|>...` after `<|start|>assistant`).

Two readers: the `gpt-oss` reasoning parser (HarmonyReasoningStream: the analysis channel is
reasoning, other messages' text is content, a call passes on whole, markers and all) and the
`gpt-oss` tool-call parser (HarmonyCallStream: calls, with every other message's text and text
outside messages as content). A header that never reaches `<|message|>`, or a call whose text
does not start with `{`, is content as written.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from forklm.parsers.calls import Schemas, ToolCallParser, tag
from forklm.parsers.markup import MAX_HEADER_LEN, JsonArguments, MarkerReader, MarkupStream
from forklm.parsers.reasoning import ReasoningDelta

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
STARTS = ("<|start|>", "<|channel|>")  # a header begins with either
_RECIPIENT = re.compile(r"\bto=(?:functions\.)?([^\s<]+)")


class GptOssParser(ToolCallParser):
    name = "gpt-oss"
    special_tokens_in_text = True
    triggers = ("<|channel|>commentary to=functions.", " to=functions.")

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        # No end: <|call|> is a stop token, which the model writes once the arguments close.
        return [tag(begin, args, "") for begin in (
            f"<|channel|>commentary to=functions.{tool_name} <|constrain|>json{MESSAGE}",
            f" to=functions.{tool_name}<|channel|>commentary json{MESSAGE}",
            f" to=functions.{tool_name}<|channel|>commentary <|constrain|>json{MESSAGE}")]

    def call_example(self) -> str:
        return ("<|start|>assistant<|channel|>commentary to=functions.<tool name> "
                "<|constrain|>json<|message|>{...}<|call|>")

    def stream(self, schemas: Schemas | None = None) -> HarmonyCallStream:
        return HarmonyCallStream()


class HarmonyReader(MarkerReader):
    """Reads harmony messages as they stream: `on_header` gets a message's header (to its
    `<|message|>`), `on_text` its text, `on_end` its end marker, `on_outside` text outside
    messages (a header that never reaches `<|message|>` included). The reply starts inside the
    header the prompt's `<|start|>assistant` opened, so it may start with its recipient."""

    state: Callable[[], bool]

    def __init__(self) -> None:
        super().__init__()
        self.state = self._start
        self.header = ""

    def on_header(self, header: str) -> None: ...

    def on_text(self, text: str) -> None: ...

    def on_end(self, marker: str) -> None: ...

    def on_outside(self, text: str) -> None: ...

    def _start(self) -> bool:
        head = self.text.lstrip()
        if not self.ended and "to=".startswith(head):
            return False
        self.state = self._header if head.startswith("to=") else self._between
        return True

    def _between(self) -> bool:
        text, marker = self.until(*STARTS, *ENDS)
        self.on_outside(text)
        if marker in STARTS:
            self.header, self.state = marker or "", self._header
        return marker is not None

    def _header(self) -> bool:
        text, marker = self.until(MESSAGE, *ENDS, keep=True)
        self.header += text
        if marker is None and len(self.header) <= MAX_HEADER_LEN:
            return False  # more to come (once ended: a message cut off, dropped)
        if marker != MESSAGE:
            self.on_outside(self.header)
            self.state = self._between
            return True
        self.text = self.text[len(MESSAGE):]
        self.on_header(self.header + MESSAGE)
        self.state = self._body
        return True

    def _body(self) -> bool:
        text, marker = self.until(*ENDS, *STARTS, keep=True)
        self.on_text(text)
        if marker is None:
            return False
        if marker in ENDS:
            self.text = self.text[len(marker):]
            self.on_end(marker)
        self.state = self._between
        return True


class HarmonyCallStream(HarmonyReader, MarkupStream):
    """Calls; every other message's text, and text outside messages, is content."""

    def __init__(self) -> None:
        super().__init__()
        self.name: str | None = None  # the current message's recipient (None: no call)
        self.raw = ""  # a call's text until its arguments start: content if they are no JSON
        self.args = JsonArguments()

    def on_outside(self, text: str) -> None:
        self.emit(text)

    def on_header(self, header: str) -> None:
        recipient = _RECIPIENT.search(header)
        self.name, self.raw = (recipient[1] if recipient else None), header

    def on_text(self, text: str) -> None:
        if self.name is None:
            self.emit(text)
            return
        if self.raw:  # the arguments have not started
            start = text.lstrip()
            if not start:
                self.raw += text
                return
            if not start.startswith("{"):
                self.emit(self.raw + text)
                self.name = None
                return
            self.open_call(self.name)
            self.raw, self.args, text = "", JsonArguments(), start
        self.add_arguments(self.args.push(text))
        if self.args.closed:
            self.close_call()


class HarmonyReasoningStream(HarmonyReader):
    """A ReasoningStream: the analysis channel's text is reasoning, other messages' text is
    content, and a call passes into the content as written, for the tool-call parser."""

    def __init__(self) -> None:
        super().__init__()
        self.target = "content"  # where the current message's text goes: or reasoning, call
        self.reasoning = self.content = ""

    def feed(self, text: str) -> ReasoningDelta:
        self.text += text
        return self._run()

    def finish(self) -> ReasoningDelta:
        self.ended = True
        return self._run()

    def _run(self) -> ReasoningDelta:
        while self.state():
            pass
        out = ReasoningDelta(self.reasoning, self.content)
        self.reasoning = self.content = ""
        return out

    def on_outside(self, text: str) -> None:
        self.content += text

    def on_header(self, header: str) -> None:
        self.target = ("call" if _RECIPIENT.search(header) else
                       "reasoning" if "<|channel|>analysis" in header else "content")
        if self.target == "call":
            self.content += header

    def on_text(self, text: str) -> None:
        if self.target == "reasoning":
            self.reasoning += text
        else:
            self.content += text

    def on_end(self, marker: str) -> None:
        if self.target == "call":
            self.content += marker
