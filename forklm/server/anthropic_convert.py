"""An Anthropic Messages request as the chat completion request it asks for: `system` and the
messages as chat messages (tool_use blocks as tool calls, tool_result blocks as tool messages),
tools and tool_choice as chat's, a final assistant message as a prefill the reply continues."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ValidationError

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.anthropic_protocol import (
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    joined,
)
from forklm.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    ImagePart,
    ImageUrl,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    Tool,
    ToolCall,
)

_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def to_chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request of a Messages request (or of a count_tokens one, which has
    no sampling fields)."""
    try:
        messages = to_messages(body.system, body.messages)
    except ValidationError as e:  # a message the chat layer's models refuse
        first = e.errors()[0]
        raise InvalidArgumentError("messages", first.get("input"), first["msg"]) from e
    prefill = messages[-1].role == "assistant"  # Anthropic continues a final assistant turn
    if prefill and messages[-1].tool_calls:
        raise InvalidArgumentError("messages", f"<{len(messages)} messages>", "end with a "
                                   "tool_use: send its tool_result in a user message")
    choice = body.tool_choice
    fields: dict[str, Any] = dict(
        model=body.model, messages=messages, tool_choice=_chat_tool_choice(body),
        tools=[_chat_tool(t) for t in body.tools] if body.tools else None,
        parallel_tool_calls=False if choice and choice.disable_parallel_tool_use else None,
        response_format=_response_format(body), chat_template_kwargs=_template_kwargs(body),
        add_generation_prompt=not prefill, continue_final_message=prefill)
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p,
                      top_k=body.top_k, stop=body.stop_sequences, cache_salt=body.cache_salt,
                      priority=body.priority)
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:  # a check of the chat layer that the Anthropic one lacks
        first = e.errors()[0]
        raise InvalidArgumentError(".".join(map(str, first["loc"])) or "messages",
                                   first.get("input"), first["msg"]) from e


def to_messages(system: str | list[TextBlock] | None,
                messages: list[Message]) -> list[ChatMessage]:
    chat = [ChatMessage(role="system", content=system if isinstance(system, str)
                        else joined(system))] if system else []
    for i, message in enumerate(messages):
        if isinstance(message.content, str):
            chat.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            chat.append(_assistant_turn(message.content, i))
        else:
            chat.extend(_user_turns(message.role, message.content, i))
    return chat


def _assistant_turn(blocks: list[Any], i: int) -> ChatMessage:
    """Text and tool_use blocks as one assistant message; thinking blocks are not rendered."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block)
        elif isinstance(block, ToolUseBlock):
            calls.append(ToolCall(id=block.id, function=FunctionCall(
                name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
        elif not isinstance(block, ThinkingBlock):
            _misplaced(block, i, j, "assistant")
    return ChatMessage(role="assistant", content=joined(texts), tool_calls=calls or None)


def _user_turns(role: Literal["user", "system"], blocks: list[Any], i: int) -> list[ChatMessage]:
    """Text (and a user's image) blocks as user (or system) messages, each tool_result as a tool
    message, in order."""
    turns: list[ChatMessage] = []
    texts: list[TextBlock | ImageBlock] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock) or (isinstance(block, ImageBlock) and role == "user"):
            texts.append(block)
        elif isinstance(block, ToolResultBlock) and role == "user":
            if texts:
                turns.append(ChatMessage(role=role, content=_user_content(texts)))
                texts = []
            # Templates know no error flag: the model reads it in the text.
            text = f"Error: {block.text}" if block.is_error else block.text
            turns.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=text))
        elif not isinstance(block, ThinkingBlock):
            _misplaced(block, i, j, role)
    if texts or not turns:
        turns.append(ChatMessage(role=role, content=_user_content(texts)))
    return turns


def _user_content(blocks: list[TextBlock | ImageBlock]) -> Any:
    """The text (one block per line), or with images the chat layer's text and image parts."""
    if not any(isinstance(b, ImageBlock) for b in blocks):
        return joined(blocks)
    return [ImagePart(type="image_url", image_url=ImageUrl(url=b.source.as_url))
            if isinstance(b, ImageBlock) else TextPart(type="text", text=b.text) for b in blocks]


def _misplaced(block: Any, i: int, j: int, role: str) -> None:
    raise InvalidArgumentError(f"messages.{i}.content.{j}", block.type,
                               f"is not allowed in a {role} message")


def _chat_tool(tool: Any) -> Tool:
    return Tool(function=FunctionDef(name=tool.name, description=tool.description,
                                     parameters=tool.input_schema))


def _chat_tool_choice(body: CountTokensRequest) -> Any:
    choice: ToolChoice | None = body.tool_choice
    if choice is None or (not body.tools and choice.type in ("auto", "none")):
        return None  # chat refuses a tool_choice without tools; these two mean no call anyway
    if choice.type == "tool":
        assert choice.name is not None  # ToolChoice checks it
        return NamedToolChoice(function=NamedFunction(name=choice.name))
    return _CHOICES[choice.type]


def _template_kwargs(body: CountTokensRequest) -> dict[str, Any] | None:
    """`thinking` as the switch Qwen3-style templates read (others ignore it)."""
    return None if body.thinking is None else {"enable_thinking": body.thinking.type != "disabled"}


def _response_format(body: CountTokensRequest) -> ResponseFormat | None:
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name="output", schema=fmt.schema_))
