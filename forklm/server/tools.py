"""Tool calling for /v1/chat/completions.

- "none" (or no tools): plain chat.
- "required" / a named function: the output is constrained by a JSON schema, so the arguments
  always parse and validate: for a named function, the schema is the function's `parameters`;
  for "required", `{"name": <one tool>, "arguments": <its parameters>}` (one anyOf branch per
  tool, so each name goes with its own argument schema).
- "auto": the model is told, in a system message, how to call a tool (a bare JSON object
  `{"name": ..., "arguments": {...}}`); the reply becomes a tool call when it is exactly such an
  object naming a known tool, and plain content otherwise.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.protocol import ChatCompletionRequest, Tool

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: tuple[Tool, ...] = ()
    named: str | None = None

    @property
    def active(self) -> bool:
        return self.mode != "none"

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

    def system_prompt(self) -> str:
        """Tool descriptions for the model; the JSON call format is spelled out for "auto"."""
        specs = [{"name": t.function.name, "description": t.function.description or "",
                  "parameters": _parameters(t)} for t in self.tools]
        text = "You can call these tools:\n" + json.dumps(specs, indent=1)
        if self.mode == "auto":
            text += ('\nTo call a tool, reply with only a JSON object '
                     '{"name": <tool name>, "arguments": {...}}; otherwise answer normally.')
        return text

    def parse(self, text: str) -> list[dict[str, Any]] | None:
        """The tool calls in a finished reply, in the OpenAI shape, or None when it has none."""
        if self.mode == "named":
            assert self.named is not None
            return [_call(self.named, text)] if _json_object(text) is not None else None
        obj = _json_object(text)
        names = {t.function.name for t in self.tools}
        if (self.mode in ("required", "auto") and obj is not None and obj.get("name") in names
                and isinstance(obj.get("arguments"), dict)):
            return [_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))]
        return None

    def _tool(self, name: str | None) -> Tool:
        return next(t for t in self.tools if t.function.name == name)


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """Check tools/tool_choice and decide how this request calls tools."""
    choice = body.tool_choice
    tools = tuple(body.tools or ())
    if not tools:
        if choice not in (None, "none"):
            raise InvalidArgumentError("tool_choice", _shown(choice), "needs a non-empty tools")
        return ToolPlan("none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidArgumentError("tools", names, "tool names must be unique")
    if choice is None or isinstance(choice, str):
        return ToolPlan(choice or "auto", tools)
    if choice.function.name not in names:
        raise InvalidArgumentError("tool_choice", choice.function.name,
                                   f"names no tool in tools ({', '.join(names)})")
    return ToolPlan("named", tools, choice.function.name)


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _ANY_OBJECT


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _json_object(text: str) -> dict[str, Any] | None:
    """The reply as one JSON object; a ```json fence around it (a common habit) is allowed."""
    text = text.strip()
    if text.startswith("```") and text.endswith("```") and len(text) >= 6:
        text = text[3:-3].removeprefix("json").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _shown(choice: Any) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()
