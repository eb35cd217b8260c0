"""POST /v1/messages and /v1/messages/count_tokens bodies (Anthropic's Messages API) as pydantic
models. The top level rejects unknown fields (a typo is a 400); content blocks ignore keys they
do not use, since clients echo back whole response blocks. Images, documents and server tools
are a 400 naming them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from forklm.runtime.sampling.params import MAX_STOP_STRINGS
from forklm.server.protocol import MAX_TOOLS, CacheSalt, JsonSchema, Priority, UnicodeChecked

# Bounds a client controls, checked before any work proportional to them.
MAX_MESSAGES = 4096
MAX_BLOCKS = 1024  # content blocks of one message, of `system`, of one tool result
_Id = Annotated[str, Field(min_length=1, max_length=256)]
_TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextBlock(_Lenient):
    """A text block (`cache_control` and `citations` are ignored)."""

    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    """A call the model made, echoed back by the client for the tool round trip."""

    type: Literal["tool_use"]
    id: _Id
    name: str = Field(pattern=_TOOL_NAME)
    input: dict[str, Any]


class ImageSource(_Lenient):
    type: Literal["base64", "url"]
    media_type: str | None = Field(default=None, max_length=64)  # base64's: image/png, ...
    data: str | None = None  # base64 (the request body's size bounds it)
    url: str | None = Field(default=None, max_length=8192)

    @property
    def as_url(self) -> str:
        """The image as an image_url part's URL: a data URL, or the remote URL."""
        if self.type == "url":
            return self.url or ""
        return f"data:{self.media_type or 'image/png'};base64,{self.data or ''}"


class ImageBlock(_Lenient):
    """An image for a vision-language model (the chat layer decodes and bounds it)."""

    type: Literal["image"]
    source: ImageSource


class ThinkingBlock(_Lenient):
    """Reasoning the model did (this server's own output, echoed back): not rendered, as chat
    templates drop earlier turns' reasoning."""

    type: Literal["thinking", "redacted_thinking"]


def supported_blocks(*known: str) -> Any:
    """A before-validator of a content field: a list's blocks must be of the `known` types, or
    the 400 names the block, not every branch of the union."""

    def check(content: Any) -> Any:
        for i, block in enumerate(content if isinstance(content, list) else ()):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            if kind not in known:
                raise ValueError(f"block {i}: content block type {kind!r} is not supported "
                                 f"here (this takes {', '.join(known)} blocks)")
        return content

    return BeforeValidator(check)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: _Id
    content: Annotated[str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)],
                       supported_blocks("text")] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else joined(self.content)


_BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")
Block = Annotated[TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


def joined(blocks: list[Any]) -> str:
    """Text blocks as one text: one per line."""
    return "\n".join(b.text for b in blocks)


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: Annotated[str | Annotated[list[Block], Field(max_length=MAX_BLOCKS)],
                       supported_blocks(*_BLOCK_TYPES)]


class Tool(_Lenient):
    """A client tool; server tools (web_search_..., bash_..., typed by version) are a 400."""

    name: str = Field(pattern=_TOOL_NAME)
    description: str | None = None
    input_schema: JsonSchema
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is not supported: only client tools "
                             "(server tools run on Anthropic's side)")
        return value


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is given with type 'tool', and only then")
        return self


class ThinkingConfig(_Strict):
    """Steers templates that read `enable_thinking`; budget_tokens is not enforced (the reply's
    thinking counts against max_tokens, as Anthropic's does)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: JsonSchema = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = Field(default=None, max_length=512)


class CountTokensRequest(_Strict, UnicodeChecked):
    """A conversation: what /v1/messages/count_tokens counts and /v1/messages answers."""

    model: str
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Annotated[str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None,
                      supported_blocks("text")] = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # accepted: the radix cache reuses prefixes


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)  # Anthropic's range
    top_p: float | None = None
    top_k: int | None = None
    # Accepted and ignored: they steer Anthropic's billing and routing.
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = Field(default=None, max_length=64)
    # forklm's (as on the other endpoints): the cache namespace and the scheduling priority.
    cache_salt: CacheSalt = None
    priority: Priority = None
