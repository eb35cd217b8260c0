"""POST /v1/responses bodies as pydantic models: the top level rejects unknown fields (a typo is a
400); input items ignore keys they do not use, since clients echo back whole output items (id,
status, annotations). Unsupported features are named in their 400 instead of silently dropped."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from forklm.server.protocol import (
    MAX_IMAGE_URL_CHARS,
    CacheSalt,
    ImagePart,
    ImageUrl,
    JsonSchema,
    Metadata,
    Priority,
    TextPart,
    UnicodeChecked,
)

# Bounds a client controls, checked before any work proportional to them.
MAX_INPUT_ITEMS = 1024  # one request's input items
MAX_CONVERSATION_ITEMS = 4096  # input plus the items carried over by previous_response_id
MAX_TOOLS = 128  # OpenAI's own limit on tools per request
MAX_TEXT_CHARS = 8 * 1024 * 1024  # one text field (the body limit bounds their sum, 8 MiB)
_Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
_Id = Annotated[str, Field(min_length=1, max_length=256)]
_FUNCTION_NAME = r"^[A-Za-z0-9_-]{1,64}$"
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ContentPart(_Lenient):
    """A text part (input_text, output_text, refusal) or an input_image (for a vision-language
    model: a data URL, or a remote URL the server allows); files and audio are a 400."""

    type: str
    text: _Text | None = None
    refusal: _Text | None = None
    image_url: str | None = Field(default=None, max_length=MAX_IMAGE_URL_CHARS)

    @model_validator(mode="after")
    def _known_only(self) -> ContentPart:
        if self.type not in (*_TEXT_PARTS, "input_image"):
            raise ValueError(f"content part type {self.type!r} is not supported: this server "
                             f"takes {', '.join(_TEXT_PARTS)} and input_image")
        if self.type == "input_image" and not self.image_url:
            raise ValueError("an input_image part needs image_url (file_id is not supported)")
        return self

    @property
    def plain(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def _joined(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.plain for p in content)


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[ContentPart], Field(max_length=MAX_INPUT_ITEMS)] | _Text

    @property
    def text(self) -> str:
        return _joined(self.content)

    def chat_content(self) -> str | list[TextPart | ImagePart]:
        """The chat layer's content: the text, or with images its text and image parts."""
        if isinstance(self.content, str) or all(p.type != "input_image" for p in self.content):
            return self.text
        return [ImagePart(type="image_url", image_url=ImageUrl(url=p.image_url or ""))
                if p.type == "input_image" else TextPart(type="text", text=p.plain)
                for p in self.content]


class FunctionCallItem(_Lenient):
    """A call the model made (echoed back by the client for the tool round trip)."""

    type: Literal["function_call"]
    call_id: _Id
    name: str = Field(pattern=_FUNCTION_NAME)
    arguments: _Text


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: _Id
    output: Annotated[list[ContentPart], Field(max_length=MAX_INPUT_ITEMS)] | _Text

    @property
    def text(self) -> str:
        return _joined(self.output)


class ReasoningPart(_Lenient):
    type: str
    text: _Text = ""


class ReasoningItem(_Lenient):
    """A reasoning item (this server's own output, echoed back): kept in the conversation but
    not rendered, as chat templates drop earlier turns' reasoning. Needs a reasoning parser."""

    type: Literal["reasoning"]
    content: Annotated[list[ReasoningPart], Field(max_length=MAX_INPUT_ITEMS)] | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.content or ())


class _RejectedItem(_Lenient):
    """Item types the server cannot honour: a clear 400 rather than a guess."""

    type: str

    @model_validator(mode="after")
    def _reject(self) -> _RejectedItem:
        raise ValueError(f"input item type {self.type!r} is not supported: use message, "
                         "function_call, function_call_output or reasoning items")


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_tag(value: Any) -> str | None:
    """An item's type; None for what is no item at all (a number, a list), which pydantic
    then rejects as such."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
    elif isinstance(value, BaseModel):
        kind = getattr(value, "type", None)
    else:
        return None
    return kind if kind in _ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")] | Annotated[_RejectedItem, Tag("other")],
    Discriminator(_item_tag)]
Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Strict):
    """The Responses API's flat function tool; built-in tools (web_search, ...) are a 400."""

    type: Literal["function"]
    name: str = Field(pattern=_FUNCTION_NAME)
    description: _Text | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return _function_typed(value, "tool", "only function tools (built-in tools such as "
                               "web_search run on OpenAI's side)")


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        return _function_typed(value, "tool_choice", "give none, auto, required or "
                               "{'type': 'function', 'name': ...}")


class TextFormat(_Strict):
    """text.format: the Responses API's flat shape of response_format."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: _Text | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; nothing to tune here


class ReasoningConfig(_Strict):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no obfuscation padding is sent either way


class ResponsesRequest(_Strict, UnicodeChecked):
    model: str
    input: Annotated[list[InputItem], Field(max_length=MAX_INPUT_ITEMS)] | _Text
    instructions: _Text | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    previous_response_id: _Id | None = None
    store: bool = True
    metadata: Metadata | None = None
    include: list[str] | None = Field(default=None, max_length=16)
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    background: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)  # counts built-in tools only
    # Accepted and ignored: they steer OpenAI's billing, caching and routing.
    user: str | None = Field(default=None, max_length=512)
    safety_identifier: str | None = Field(default=None, max_length=512)
    prompt_cache_key: str | None = Field(default=None, max_length=512)
    cache_salt: CacheSalt = None
    priority: Priority = None
    prompt_cache_retention: str | None = Field(default=None, max_length=32)
    service_tier: str | None = Field(default=None, max_length=32)
    # Known but not served here: a 400 naming the field when set.
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None


def _function_typed(value: Any, what: str, hint: str) -> Any:
    """`value` when it is a function-typed object, else the error naming its type."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "function":
        raise ValueError(f"{what} type {kind!r} is not supported: {hint}")
    return value
