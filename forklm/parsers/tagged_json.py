"""Formats whose calls are JSON arguments between special tokens, in one section of calls:

- `deepseekv3` (DeepSeek V3, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>
  NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`
- `deepseekv31` (DeepSeek V3.1, V3.2-Exp): `...<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...`
- `kimi_k2` (Kimi K2): `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>`; the model's
  own `functions.NAME:0` is the call's id (Kimi's template writes it back in later turns).

Content is the text before the section (or before a first call written without it); text
between calls and after the section is dropped. Arguments stream as the model writes them. A
call whose header does not read as the format's (a name, then `{`) is content, as written.
"""

from __future__ import annotations

import re
from typing import Any

from forklm.parsers.calls import Schemas, ToolCallParser, tag
from forklm.parsers.markup import MAX_HEADER_LEN, JsonArguments, MarkupStream


class SectionFormat(ToolCallParser):
    """`header`: what comes between `call_begin` and the arguments' `{` (group `name`, and
    `id` when the model writes the call's id)."""

    section_begin = section_end = call_begin = call_end = ""
    header: re.Pattern[str]
    special_tokens_in_text = True

    def stream(self, schemas: Schemas | None = None) -> SectionStream:
        return SectionStream(self)

    def call_example(self) -> str:
        return self.section_begin + super().call_example() + self.section_end


class DeepSeekV3Parser(SectionFormat):
    name = "deepseekv3"
    section_begin, section_end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    header = re.compile(r"\s*function<｜tool▁sep｜>(?P<name>[^\s<]+)\s*```json\s*")
    triggers = (call_begin,)

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        begin = f"{self.call_begin}function<｜tool▁sep｜>{tool_name}\n```json\n"
        return [tag(begin, args, "\n```" + self.call_end)]


class DeepSeekV31Parser(DeepSeekV3Parser):
    name = "deepseekv31"
    header = re.compile(r"\s*(?P<name>[^\s<]+)\s*<｜tool▁sep｜>\s*")

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        return [tag(f"{self.call_begin}{tool_name}<｜tool▁sep｜>", args, self.call_end)]


class KimiK2Parser(SectionFormat):
    name = "kimi_k2"
    section_begin, section_end = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_begin, call_end = "<|tool_call_begin|>", "<|tool_call_end|>"
    header = re.compile(r"\s*(?P<id>(?:functions\.)?(?P<name>[^\s:<]+):\d+)\s*"
                        r"<\|tool_call_argument_begin\|>\s*")
    triggers = (call_begin,)

    def tags(self, tool_name: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        # The call's number (its index in the conversation) comes between name and arguments.
        content = {"type": "sequence", "elements": [
            {"type": "regex", "pattern": "[0-9]+"},
            {"type": "const_string", "value": "<|tool_call_argument_begin|>"}, args]}
        return [tag(f"{self.call_begin}functions.{tool_name}:", content, self.call_end)]

    def call_example(self) -> str:
        return (f"{self.section_begin}{self.call_begin}functions.<tool name>:0"
                f"<|tool_call_argument_begin|>{{...}}{self.call_end}{self.section_end}")


class SectionStream(MarkupStream):
    def __init__(self, fmt: SectionFormat):
        super().__init__()
        self.fmt = fmt
        self.state = self._content
        self.raw = ""  # the current call's text while its header is read
        self.args = JsonArguments()

    def _content(self) -> bool:
        opener = self.read_content(self.fmt.section_begin, self.fmt.call_begin)
        if opener == self.fmt.call_begin:
            self.raw, self.state = opener, self._header
        elif opener is not None:
            self.state = self._between
        return opener is not None

    def _between(self) -> bool:
        """Between calls: text here is dropped."""
        _, marker = self.until(self.fmt.call_begin, self.fmt.section_end)
        if marker == self.fmt.call_begin:
            self.raw, self.state = marker, self._header
        elif marker is not None:
            self.state = self._after
        return marker is not None

    def _header(self) -> bool:
        text, marker = self.until("{", self.fmt.call_end, keep=True)
        self.raw += text
        if marker is None:
            if len(self.raw) <= MAX_HEADER_LEN:
                return False  # more to come (once ended: a call cut off, dropped)
            marker = ""
        head = self.fmt.header.fullmatch(self.raw[len(self.fmt.call_begin):])
        if marker == "{" and head is not None:
            self.open_call(head["name"], head.groupdict().get("id"))
            self.args, self.state = JsonArguments(), self._arguments
        else:
            self.emit(self.raw)
            self.state = self._malformed
        return True

    def _arguments(self) -> bool:
        text, end = self.until(self.fmt.call_end)
        self.add_arguments(self.args.push(text))
        if self.args.closed:
            self.close_call()
        if end is not None:
            self.state = self._between
        return end is not None

    def _malformed(self) -> bool:
        """A call that does not read: its text, to its end, is content."""
        text, end = self.until(self.fmt.call_end)
        self.emit(text + (end or ""))
        if end is not None:
            self.state = self._between
        return end is not None

    def _after(self) -> bool:
        self.text = ""
        return False

