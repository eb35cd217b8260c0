"""A Responses API request as the chat completion request it asks for: input items (with the
history that previous_response_id carries) as chat messages, flat function tools as chat tools,
text.format as response_format. The conversation is bounded before it is converted."""

from __future__ import annotations

from typing import Any, cast

from pydantic import TypeAdapter, ValidationError

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from forklm.server.responses_protocol import (
    MAX_CONVERSATION_ITEMS,
    MAX_TEXT_CHARS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    Item,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
from forklm.server.responses_store import conversation_chars

_ITEM: TypeAdapter[Any] = TypeAdapter(InputItem)


def input_items(body: ResponsesRequest) -> tuple[Item, ...]:
    if isinstance(body.input, str):
        return (MessageItem(role="user", content=body.input),)
    return cast(tuple[Item, ...], tuple(body.input))  # a rejected item type never validates


def item_of(output_item: dict[str, Any]) -> Item:
    """An output item as the input item a later turn sees (what the store keeps)."""
    return cast(Item, _ITEM.validate_python(output_item))


def to_chat_request(body: ResponsesRequest, items: tuple[Item, ...]) -> ChatCompletionRequest:
    """The chat completion request of a response whose conversation is `items`."""
    if not items:
        raise InvalidArgumentError("input", [], "needs at least one item")
    if len(items) > MAX_CONVERSATION_ITEMS:
        raise InvalidArgumentError("input", f"<{len(items)} items>", "with previous_response_id "
                                   f"the conversation is over {MAX_CONVERSATION_ITEMS} items")
    if conversation_chars(items) > MAX_TEXT_CHARS:
        raise InvalidArgumentError("input", f"<{len(items)} items>", "with previous_response_id "
                                   f"the conversation is over {MAX_TEXT_CHARS} characters")
    messages = to_messages(body.instructions, items)
    if not messages:
        raise InvalidArgumentError("input", f"<{len(items)} items>", "has nothing to answer: "
                                   "reasoning items alone are not rendered")
    try:
        return ChatCompletionRequest(
            model=body.model, messages=messages,
            tools=[_chat_tool(t) for t in body.tools] if body.tools else None,
            tool_choice=_chat_tool_choice(body), parallel_tool_calls=body.parallel_tool_calls,
            max_completion_tokens=body.max_output_tokens, temperature=body.temperature,
            top_p=body.top_p, cache_salt=body.cache_salt, priority=body.priority,
            # text.format shapes a text reply; a forced call is none (OpenAI takes both)
            response_format=None if _forces_call(body) else _response_format(body))
    except ValidationError as e:  # a check of the chat layer that the Responses one lacks
        first = e.errors()[0]
        raise InvalidArgumentError(".".join(map(str, first["loc"])) or "input",
                                   first.get("input"), first["msg"]) from e


def to_messages(instructions: str | None, items: tuple[Item, ...]) -> list[ChatMessage]:
    """Items as chat messages: consecutive function_call items (parallel calls) join one
    assistant message, after any text the assistant said just before them. Reasoning items are
    not rendered (chat templates drop earlier turns' reasoning)."""
    messages = [ChatMessage(role="system", content=instructions)] if instructions else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.chat_content()))
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, ToolCall(id=item.call_id, function=FunctionCall(
                name=item.name, arguments=item.arguments)))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=item.text))
        else:
            assert isinstance(item, ReasoningItem), item
    return messages


def _add_call(messages: list[ChatMessage], call: ToolCall) -> None:
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or ()), call]})
    else:
        messages.append(ChatMessage(role="assistant", tool_calls=[call]))


def _chat_tool(tool: FunctionTool) -> Tool:
    return Tool(function=FunctionDef(name=tool.name, description=tool.description,
                                     parameters=tool.parameters, strict=tool.strict))


def _chat_tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return NamedToolChoice(function=NamedFunction(name=choice.name))


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type != "json_schema":
        return None if fmt is None else ResponseFormat(type=fmt.type)
    if fmt.schema_ is None:
        raise InvalidArgumentError("text.format.schema", None, "type json_schema needs a schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
        name=fmt.name or "response", description=fmt.description, schema=fmt.schema_,
        strict=fmt.strict))


def _forces_call(body: ResponsesRequest) -> bool:
    return body.tool_choice is not None and body.tool_choice not in ("none", "auto")
