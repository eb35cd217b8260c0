"""separate_reasoning at run time: a gen's `<think>` part split from its content, as it streams."""

from __future__ import annotations

from forklm.parsers.reasoning import get_reasoning_parser


class ReasoningSplit:
    """A reasoning gen's output split as it streams: `feed` returns the content to append (not
    the reasoning, nor text that may begin a tag), `finish` the rest; `parse` splits a whole
    output into its content and its reasoning."""

    def __init__(self, parser_name: str, prompt: str):
        self.parser = get_reasoning_parser(parser_name, "model_type")
        self.opened = self.parser.opens_in(prompt)  # the template opened the reasoning
        self.stream = self.parser.stream(self.opened)

    def feed(self, text: str) -> str:
        return self.stream.feed(text).content

    def finish(self) -> str:
        return self.stream.finish().content

    def parse(self, text: str) -> tuple[str, str]:
        """One whole output as (content, reasoning)."""
        split = self.parser.parse(text, self.opened)
        return split.content, split.reasoning
