"""Tool calling and reasoning for /v1/chat/completions (and the Responses API built on it).

- "none" (or no tools): plain chat.
- "required" / a named function: the output is constrained by a JSON schema, so the arguments
  always parse and validate: for a named function, the schema is the function's `parameters`
  (the whole reply is the arguments); for "required", `{"name": <one tool>, "arguments": <its
  parameters>}` (one anyOf branch per tool, so each name goes with its own argument schema).
- "auto": the model calls tools in its own format (`parser`: --tool-call-parser, or detected from
  the chat template), its arguments constrained by the tool's schema once it opens a call
  (`structural_tag`: JSON arguments, or Qwen3-Coder's and GLM's XML parameters in xgrammar's XML
  styles; the pythonic format has no constraint); without a parser it is told, in a system
  message, to reply with a bare JSON object `{"name": ..., "arguments": {...}}`, and a reply that
  is exactly such an object naming a known tool becomes a call.

A reply is read by a ReplyStream (`plan.reader(opened)`), streamed or whole: reasoning (with a
reasoning parser), content and tool-call pieces, as they can be emitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from forklm.parsers.calls import (
    CallStream,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    assemble,
)
from forklm.parsers.generic import (
    ArgumentsStream,
    GenericJsonStream,
    PlainStream,
    RequiredStream,
)
from forklm.parsers.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from forklm.parsers.tool_calls import detect_tool_call_parser, get_tool_call_parser
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.checks import MAX_STRUCTURES
from forklm.server.protocol import ChatCompletionRequest, Tool

if TYPE_CHECKING:
    from forklm.server.generation import GenerationService

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
# Whitespace runs in constrained arguments: ", " and ": " fit, but a small model cannot loop on
# newlines until max_tokens (the schema path compiles compact JSON for the same reason).
_MAX_WHITESPACE = 1


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: tuple[Tool, ...] = ()
    named: str | None = None
    parser: ToolCallParser | None = None  # the model's own call format ("auto" only)
    reasoning: ReasoningParser | None = None  # None: no reasoning parser, or not separated
    parallel: bool = True  # False: only a reply's first call is kept
    opened: bool = False  # the prompt ends inside `<think>` (see with_prompt)
    names: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(t.function.name for t in self.tools))

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the replies must keep special tokens in their text: the markers of the
        call format ("auto") or of the reasoning format (gpt-oss's harmony channels)."""
        calls = self.parser if self.mode == "auto" else None
        return any(p is not None and p.special_tokens_in_text for p in (calls, self.reasoning))

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must satisfy (None for "none" and "auto")."""
        if self.mode == "named":
            return _parameters(self._tool(self.named))
        if self.mode != "required":
            return None
        branches = [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]},
            "arguments": _parameters(t)}, "required": ["name", "arguments"],
            "additionalProperties": False} for t in self.tools]
        return branches[0] if len(branches) == 1 else {"anyOf": branches}

    def structural_tag(self) -> dict[str, Any] | None:
        """For "auto" in a model's format: free text until the model writes the format's
        trigger, then one tool's call with arguments valid by its schema (xgrammar's triggered
        tags; at most one call when parallel is off). None for a format without tags."""
        if self.mode != "auto" or self.parser is None or not self.parser.triggers:
            return None
        parser = self.parser
        tags = [tag for t in self.tools
                for tag in parser.tags(t.function.name, self._arguments_format(t))]
        if not tags or len(tags) > MAX_STRUCTURES:
            return None
        return {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": list(parser.triggers), "tags": tags,
            "stop_after_first": not self.parallel}}

    def _arguments_format(self, tool: Tool) -> dict[str, Any]:
        assert self.parser is not None
        fmt = {"type": "json_schema", "json_schema": _parameters(tool),
               "max_whitespace_cnt": _MAX_WHITESPACE}
        if self.parser.args_style != "json":
            fmt["style"] = self.parser.args_style
        return fmt

    def system_prompt(self) -> str:
        """Tool descriptions for a template that does not render tools; the call format is
        spelled out for "auto" (the parser's format, else a bare JSON object)."""
        specs = [{"name": t.function.name, "description": t.function.description or "",
                  "parameters": _parameters(t)} for t in self.tools]
        text = "You can call these tools:\n" + json.dumps(specs, indent=1)
        if self.mode == "auto" and self.parser is not None:
            text += (f"\nTo call a tool, reply with {self.parser.call_example()}; "
                     "otherwise answer normally.")
        elif self.mode == "auto":
            text += ('\nTo call a tool, reply with only a JSON object '
                     '{"name": <tool name>, "arguments": {...}}; otherwise answer normally.')
        return text

    def with_prompt(self, prompt: str) -> ToolPlan:
        """The plan for replies to `prompt` (a template may open `<think>` for the model)."""
        return replace(self, opened=self.reasoning is not None and self.reasoning.opens_in(prompt))

    def reader(self) -> ReplyStream:
        """A reader of one reply."""
        reasoning = self.reasoning.stream(self.opened) if self.reasoning else None
        return ReplyStream(self, reasoning, self._call_stream())

    def _call_stream(self) -> CallStream:
        if self.mode == "none":
            return PlainStream()
        if self.mode == "named":
            assert self.named is not None
            return ArgumentsStream(self.named)
        if self.mode == "required":
            return RequiredStream(self.names)
        if self.parser is not None:
            return self.parser.stream({t.function.name: _parameters(t) for t in self.tools})
        return GenericJsonStream(self.names)

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.function.name == name)


def plan_tools(body: ChatCompletionRequest, service: GenerationService | None = None) -> ToolPlan:
    """Check tools/tool_choice and decide how this request calls tools; with the `service`, the
    server's tool-call and reasoning parsers apply."""
    choice = body.tool_choice
    tools = tuple(body.tools or ())
    parser, reasoning = _parsers(service, body)
    parallel = body.parallel_tool_calls is not False
    if not tools:
        if choice not in (None, "none"):
            raise InvalidArgumentError("tool_choice", _shown(choice), "needs a non-empty tools")
        return ToolPlan("none", reasoning=reasoning)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("tools", names, "tool names must be unique")
    if choice is None or isinstance(choice, str):
        mode = choice or "auto"
        return ToolPlan(mode, tools, parser=parser if mode == "auto" else None,
                        reasoning=reasoning, parallel=parallel)
    if choice.function.name not in names:
        raise InvalidArgumentError("tool_choice", choice.function.name,
                                   f"names no tool in tools ({', '.join(names)})")
    return ToolPlan("named", tools, choice.function.name, reasoning=reasoning)


def _parsers(service: GenerationService | None,
             body: ChatCompletionRequest) -> tuple[ToolCallParser | None, ReasoningParser | None]:
    if service is None:
        return None, None
    config = service.config
    name = config.tool_call_parser or detect_tool_call_parser(_template_source(service))
    reasoning = None
    if config.reasoning_parser and getattr(body, "separate_reasoning", True) \
            and not _constrained_whole(body):
        reasoning = get_reasoning_parser(config.reasoning_parser)
    return (get_tool_call_parser(name) if name else None), reasoning


def _constrained_whole(body: ChatCompletionRequest) -> bool:
    """Whether a grammar shapes the reply from its first token (no room to reason first)."""
    fmt = body.response_format
    return (body.tool_choice not in (None, "auto", "none") or body.regex is not None
            or body.ebnf is not None or body.json_schema is not None
            or (fmt is not None and fmt.type != "text"))


def _template_source(service: GenerationService) -> str | None:
    from forklm.server import chat_template  # the --chat-template override, when there is one

    override = chat_template.load_chat_template(getattr(service.config, "chat_template", None))
    source = override or service.engine.tokenizer.chat_template
    if isinstance(source, dict):  # named templates: the one transformers takes for tools
        source = source.get("tool_use") or source.get("default")
    return source if isinstance(source, str) else None


class ReplyDelta(NamedTuple):
    reasoning: str
    content: str
    calls: list[ToolCallDelta]

    def then(self, other: ReplyDelta) -> ReplyDelta:
        """This delta followed by `other`, as one."""
        return ReplyDelta(self.reasoning + other.reasoning, self.content + other.content,
                          self.calls + other.calls)


def whole_calls(delta: ReplyDelta, complete: list[bool]) -> list[ToolCall]:
    """The calls a whole reply's delta spells (`complete`: ReplyStream.complete)."""
    return assemble([StreamDelta("", delta.calls)], complete).calls


class ReplyStream:
    """One reply read as it is generated: `feed(text_delta)` and `finish()` return ReplyDeltas;
    `complete[i]` (final after finish) tells whether call i was closed before the text ended.
    Reasoning is split off first; the calls are read from the rest."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningStream | None, calls: CallStream):
        self.plan, self.reasoning, self.calls = plan, reasoning, calls

    @property
    def complete(self) -> list[bool]:
        return self.calls.complete[:None if self.plan.parallel else 1]

    def feed(self, text: str) -> ReplyDelta:
        if self.reasoning is None:
            return self._kept("", self.calls.feed(text))
        r = self.reasoning.feed(text)
        return self._kept(r.reasoning, self.calls.feed(r.content))

    def finish(self) -> ReplyDelta:
        if self.reasoning is None:
            return self._kept("", self.calls.finish())
        r = self.reasoning.finish()
        return (self._kept(r.reasoning, self.calls.feed(r.content))
                .then(self._kept("", self.calls.finish())))

    def read(self, text: str) -> ReplyDelta:
        """A whole reply: one feed and the finish."""
        return self.feed(text).then(self.finish())

    def _kept(self, reasoning: str, delta: StreamDelta) -> ReplyDelta:
        calls = delta.calls if self.plan.parallel else [c for c in delta.calls if c.index == 0]
        return ReplyDelta(reasoning, delta.content, calls)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def _shown(choice: Any) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()
