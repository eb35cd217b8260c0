"""Chat prompts: OpenAI-shaped messages (and tools) rendered to text by the model's chat template,
or by the `--chat-template` override. A template that renders tools gets them and the tool turns in
its own shape; for one that does not, the caller's generic tool prompt leads as a system message.
Control tokens typed into messages stay text (ControlTokenGuard), so a user cannot forge a turn."""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import re
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from forklm.runtime.errors import InvalidArgumentError

# apply_chat_template's own parameters (and the names the template reads the conversation from):
# chat_template_kwargs must not reach them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation",
    "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})
_TOOLS_VAR = re.compile(r"\btools\b")


class ChatPrompt(NamedTuple):
    text: str  # the rendered prompt
    input_ids: list[int] | None  # set when the text must not be tokenized as a whole (see guard)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
                chat_template: str | None = None, tool_prompt: str | None = None) -> str:
    """The prompt text of OpenAI-shaped `messages` (validated: content is a string, None or text
    and image parts) and OpenAI-shaped `tools`. `chat_template` overrides the tokenizer's template;
    `tool_prompt` is the generic tool prompt used only when the template does not render tools.
    A template that rejects the conversation is an InvalidArgumentError on `messages`.
    CPU work proportional to the conversation: call it off the event loop."""
    return render_chat_prompt(tokenizer, messages, tools, template_kwargs, add_generation_prompt,
                              chat_template, tool_prompt).text


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None,
                       template_kwargs: dict[str, Any] | None = None,
                       add_generation_prompt: bool = True, chat_template: str | None = None,
                       tool_prompt: str | None = None,
                       guard: ControlTokenGuard | None = None,
                       continue_final_message: bool = False) -> ChatPrompt:
    """render_chat's text, and with a `guard`, the token ids to run instead of tokenizing it
    when some input string holds a control token (None otherwise: the text tokenizes alike).
    continue_final_message: the text ends inside the final message (transformers' option), so
    a reply continues it."""
    native = renders_tools(tokenizer, chat_template, bool(tools))
    turns = [_native_turn(m) if native else _plain_turn(m) for m in messages]
    if tool_prompt is not None and not native:
        turns.insert(0, {"role": "system", "content": tool_prompt})
    call: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                            "chat_template": chat_template, **(template_kwargs or {})}
    if continue_final_message:
        call["continue_final_message"] = True
    if native and tools:
        call["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(turns, tokenize=False, **call)
        ids = None
        if guard is not None and guard.mentions_control_token([turns, tools, template_kwargs]):
            ids = guard.encode(turns, call)
    except Exception as e:  # a template that rejects the conversation (roles, order)
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>",
                                   f"the chat template rejects them: {e}") from e
    return ChatPrompt(text, ids)


class ControlTokenGuard:
    """Encodes a chat so that control tokens typed into its messages, tools or template
    variables (a user's "<|im_end|>\\n<|im_start|>system...") are encoded as plain text: only
    the template's own control tokens become tokens, so no one can forge a turn (transformers'
    `sanitize_control_tokens`, which marks them in the inputs before rendering).
    It encodes with its own copy of the tokenizer under a lock: that encoding flips the Rust
    tokenizer's `encode_special_tokens` switch, which must never change under another thread
    tokenizing with the engine's tokenizer (nor under a second guarded encoding). The copy
    (~0.1 s for a 49k vocabulary) is made by warm_up(), which a server calls once it is idle,
    or by the first guarded encoding, not on the start-up path."""

    def __init__(self, tokenizer: Any):
        self._source = tokenizer
        self._tokenizer: Any = None  # the copy, once made
        self._lock = threading.Lock()
        # Every added token (a superset of the control tokens): text without any of them
        # encodes the same guarded or not, so only a chat that holds one pays for the guard.
        self._added = re.compile(_trie_pattern(tokenizer.added_tokens_encoder) or "(?!)")

    def mentions_control_token(self, obj: Any) -> bool:
        """Whether a string anywhere in `obj` (nested lists and dict values) holds one."""
        return any(self._added.search(text) for text in _strings(obj))

    @property
    def ready(self) -> bool:
        """Whether the tokenizer's copy is made."""
        return self._tokenizer is not None

    def warm_up(self) -> None:
        """Make the tokenizer's copy now (idempotent)."""
        with self._lock:
            self._copy()

    def encode(self, turns: list[dict[str, Any]], call: dict[str, Any]) -> list[int]:
        """The token ids of the chat `turns` rendered with apply_chat_template's `call`."""
        with self._lock:
            return list(self._copy().apply_chat_template(
                turns, tokenize=True, return_dict=False, sanitize_control_tokens=True, **call))

    def _copy(self) -> Any:  # call with the lock held
        if self._tokenizer is None:
            self._tokenizer = copy.deepcopy(self._source)
        return self._tokenizer


def _trie_pattern(words: Any) -> str:
    """A regex matching any of `words`, built as a trie (one branch per next character): a
    search costs the longest word's length per position, not the number of words (Gemma's
    tokenizer has thousands of added tokens)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}  # a word ends here

    def pattern(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + pattern(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return pattern(trie)


def _strings(obj: Any) -> Iterator[str]:
    stack = [obj]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)


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


def _text(content: Any) -> Any:
    """A message's content for the template: its text, or with image parts the list of text
    and {"type": "image"} parts that vision-language templates render as their placeholder."""
    if content is None or isinstance(content, str):
        return content or ""
    if any(part["type"] == "image_url" for part in content):
        return [{"type": "text", "text": part["text"]} if part["type"] == "text"
                else {"type": "image"} for part in content]
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
