"""Chat prompts: OpenAI-shaped messages (and tools) rendered to text by the model's chat template,
or by the `--chat-template` override. A template that renders tools gets them and the tool turns in
its own shape; for one that does not, the caller's generic tool prompt leads as a system message."""

from __future__ import annotations

import functools
import json
import pathlib
import re
from typing import Any

from forklm.runtime.errors import InvalidArgumentError

# apply_chat_template's own parameters (and the names the template reads the conversation from):
# chat_template_kwargs must not reach them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})
_TOOLS_VAR = re.compile(r"\btools\b")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                chat_template: str | None = None, tool_prompt: str | None = None) -> str:
    """The prompt text of OpenAI-shaped `messages` (validated: content is a string, None or text
    parts) and OpenAI-shaped `tools`. `chat_template` overrides the tokenizer's template;
    `tool_prompt` is the generic tool prompt used only when the template does not render tools.
    A template that rejects the conversation is an InvalidArgumentError on `messages`.
    CPU work proportional to the conversation: call it off the event loop."""
    native = renders_tools(tokenizer, chat_template, bool(tools))
    turns = [_native_turn(m) if native else _plain_turn(m) for m in messages]
    if tool_prompt is not None and not native:
        turns.insert(0, {"role": "system", "content": tool_prompt})
    extra: dict[str, Any] = {"tools": tools} if native and tools else {}
    try:
        return tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **extra, **(template_kwargs or {}))
    except Exception as e:  # a template that rejects the conversation (roles, order)
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>",
                                   f"the chat template rejects them: {e}") from e


def renders_tools(tokenizer: Any, chat_template: str | None = None,
                  with_tools: bool = True) -> bool:
    """Whether the template (the override, else the tokenizer's) renders `tools` itself."""
    source = chat_template if chat_template is not None else tokenizer.chat_template
    if isinstance(source, dict):  # named templates: transformers takes "tool_use" for tools
        source = source.get("tool_use" if with_tools else "default") or source.get("default")
    return isinstance(source, str) and _TOOLS_VAR.search(source) is not None


def template_kwargs(chat_template_kwargs: dict[str, Any] | None,
                    reasoning_effort: str | None) -> dict[str, Any]:
    """The extra template variables of a request; its own chat_template_kwargs win."""
    kwargs = {} if reasoning_effort is None else {"reasoning_effort": reasoning_effort}
    return {**kwargs, **(chat_template_kwargs or {})}


@functools.lru_cache(maxsize=8)
def load_chat_template(value: str | None) -> str | None:
    """A `--chat-template` value: a Jinja template string as it is, else the file it names."""
    if value is None or is_template_text(value):
        return value
    return pathlib.Path(value).read_text(encoding="utf-8")


def is_template_text(value: str) -> bool:
    """Whether a `--chat-template` value is the template itself (not a file path)."""
    return "{{" in value or "{%" in value


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)


def _plain_turn(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a template without tools: role and text only; earlier tool calls are shown
    as the JSON objects the generic tool prompt asks for."""
    content = _text(m.get("content"))
    if m.get("tool_calls") and not content:
        content = "\n".join(json.dumps({"name": c["function"]["name"],
                                        "arguments": _arguments(c["function"]["arguments"])},
                                       ensure_ascii=False) for c in m["tool_calls"])
    return {"role": _role(m["role"]), "content": content}


def _native_turn(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a template that renders tools (Qwen/Hermes, Llama 3.x, Mistral shapes):
    tool-call arguments as objects, since such templates `tojson` them."""
    turn: dict[str, Any] = {"role": _role(m["role"]), "content": _text(m.get("content"))}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            turn[key] = m[key]
    if m.get("tool_calls"):
        turn["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {
            "name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
            for c in m["tool_calls"]]
    return turn


def _arguments(arguments: str) -> Any:
    """A call's arguments parsed; text that is no JSON stays as it was (the model wrote it)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _role(role: str) -> str:
    return "system" if role == "developer" else role  # few templates know "developer"
