"""Reasoning parsers: a reply's reasoning split from its content.

`qwen3` and `glm45`: the reply reasons only when it opens with `<think>` (or the prompt already
opened it); `deepseek-r1`: the reply reasons from its first character (its template opens
`<think>` in the prompt; a leading `<think>` is skipped), and a reply that never closes it is all
reasoning; `kimi`: as qwen3 with Kimi's `◁think▷...◁/think▷`; `gpt-oss`: harmony channels, the
analysis channel is reasoning and the final channel content (harmony.py).

`parser.stream(opened)` gives a ReasoningStream: `feed(text_delta)` returns the ReasoningDelta
(reasoning, content) that can be emitted so far, holding back text that may be the start of a tag
and whitespace at the edges; `finish()` flushes the rest. `parser.parse(text, opened)` is one
feed plus finish. `opened` says the prompt ended inside an open think tag (`opens_in`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from forklm.parsers.calls import held_prefix_len
from forklm.runtime.errors import InvalidArgumentError

THINK, END_THINK = "<think>", "</think>"


class ReasoningDelta(NamedTuple):
    reasoning: str
    content: str


class ReasoningStream(Protocol):
    def feed(self, text: str) -> ReasoningDelta: ...

    def finish(self) -> ReasoningDelta: ...


class ReasoningParser:
    """`special_tokens_in_text`: the format's markers are special tokens that the text must
    keep (skip_special_tokens=False)."""

    name = ""
    starts_in_reasoning = False  # the model reasons without writing its think tag itself
    think, end_think = THINK, END_THINK
    special_tokens_in_text = False

    def stream(self, opened: bool = False) -> ReasoningStream:
        return ThinkStream(opened or self.starts_in_reasoning, self.think, self.end_think)

    def opens_in(self, prompt: str) -> bool:
        """Whether a rendered prompt ends inside the think tag (a template opened it)."""
        return prompt.rstrip().endswith(self.think)

    def parse(self, text: str, opened: bool = False) -> ReasoningDelta:
        stream = self.stream(opened)
        a, b = stream.feed(text), stream.finish()
        return ReasoningDelta(a.reasoning + b.reasoning, a.content + b.content)


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek-r1"
    starts_in_reasoning = True


class Glm45Parser(ReasoningParser):
    name = "glm45"


class KimiParser(ReasoningParser):
    name = "kimi"
    think, end_think = "◁think▷", "◁/think▷"


class GptOssParser(ReasoningParser):
    name = "gpt-oss"
    special_tokens_in_text = True

    def stream(self, opened: bool = False) -> ReasoningStream:
        from forklm.parsers.harmony import HarmonyReasoningStream  # harmony imports this module

        return HarmonyReasoningStream()

    def opens_in(self, prompt: str) -> bool:
        return False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3Parser, DeepSeekR1Parser, Glm45Parser, KimiParser, GptOssParser)}


def get_reasoning_parser(name: str, field: str = "reasoning_parser") -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise InvalidArgumentError(field, name, "expected one of " + ", ".join(REASONING_PARSERS))
    return REASONING_PARSERS[name]()


class ThinkStream:
    """A reply with a think tag. States: "start" (the tag may still come), "reasoning",
    "content" (for good)."""

    def __init__(self, in_reasoning: bool, think: str = THINK, end_think: str = END_THINK):
        self.think, self.end_think = think, end_think
        self.state = "reasoning" if in_reasoning else "start"
        self.started = False  # the reasoning (then the content) has had non-space text
        self.pending = ""

    def feed(self, text: str) -> ReasoningDelta:
        self.pending += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                if not self._read_start():
                    break
            elif self.state == "reasoning":
                piece, more = self._read_reasoning()
                reasoning += piece
                if not more:
                    break
            else:
                content += self._read_content()
                break
        return ReasoningDelta(reasoning, content)

    def finish(self) -> ReasoningDelta:
        if self.state == "reasoning":
            text, self.pending = self.pending, ""
            return ReasoningDelta(text.strip().removeprefix(self.think).strip(), "")
        self.state = "content"  # a reply that stopped before telling: its text is content
        return ReasoningDelta("", self._read_content())

    def _read_start(self) -> bool:
        """Decide between reasoning and content once the text tells; False: not yet."""
        head = self.pending.lstrip()
        if self.think.startswith(head):
            return False  # empty or a prefix of <think>
        if head.startswith(self.think):
            self.state = "reasoning"
        else:
            self.state, self.pending = "content", head
        return True

    def _read_reasoning(self) -> tuple[str, bool]:
        if not self.started:  # drop leading space and the reply's own <think>
            head = self.pending.lstrip()
            if self.think.startswith(head):
                return "", False
            self.pending = head.removeprefix(self.think).lstrip()
            if not self.pending:
                return "", False
            self.started = True
        at = self.pending.find(self.end_think)
        if at >= 0:
            piece = self.pending[:at].rstrip()
            self.pending = self.pending[at + len(self.end_think):]
            self.state, self.started = "content", False
            return piece, True
        keep = held_prefix_len(self.pending, self.end_think)
        ready_len = len(self.pending[:len(self.pending) - keep].rstrip())
        piece, self.pending = self.pending[:ready_len], self.pending[ready_len:]
        return piece, False

    def _read_content(self) -> str:
        """Content after the reasoning, less its leading whitespace."""
        text, self.pending = self.pending, ""
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        return text
