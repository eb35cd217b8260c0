"""Request bodies as pydantic models. Unknown request fields are rejected (extra="forbid"), so a
typo is a 400 naming the field instead of a silently ignored option; inside chat messages unknown
keys are ignored, as OpenAI does (its SDK echoes `refusal`, `annotations`, ... back). Value ranges
are checked once, by SamplingParams; only the server-side counts and sizes are bounded here."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from forklm.server.chat_template import RESERVED_TEMPLATE_KWARGS

# Bounds on per-request fan-out; beyond them one request could monopolize the engine.
MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128  # OpenAI's limit
# OpenAI's documented metadata limits: 16 pairs, keys up to 64 characters, values up to 512.
MAX_METADATA_KEYS, MAX_METADATA_KEY_LEN, MAX_METADATA_VALUE_LEN = 16, 64, 512


def _bounded_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_LEN or len(value) > MAX_METADATA_VALUE_LEN:
            raise ValueError(f"keys are at most {MAX_METADATA_KEY_LEN} characters and "
                             f"values at most {MAX_METADATA_VALUE_LEN} (key {key[:64]!r})")
    return metadata


# A request's `metadata` (chat completions and responses), within OpenAI's limits.
Metadata = Annotated[dict[str, str], AfterValidator(_bounded_metadata)]
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_KWARGS_CHARS = 64 * 1024  # of their JSON; they are template switches, not data
_Count = Field(default=None, ge=0)
_Id = Field(default=None, max_length=512)  # user, prompt_cache_key, safety_identifier


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Lenient(BaseModel):
    """A part of a chat message: keys it does not know are dropped, not rejected."""

    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Strict):
    """SGLang's /generate body: text or input_ids, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    # SGLang fields forklm cannot honour: accepted at their defaults (null/false), a 400 naming
    # them otherwise (native_api.UNSUPPORTED_FIELDS).
    custom_logit_processor: str | list[str | None] | None = None
    return_hidden_states: bool | list[bool] = False
    lora_path: str | list[str | None] | None = None
    image_data: Any = None
    log_metrics: bool = True  # forklm always records metrics
    # With the server's --reasoning-parser: `text` is the reply's content, `reasoning_text` its
    # <think> part.
    separate_reasoning: bool = False


class SeparateReasoningRequest(_Strict):
    """SGLang's /separate_reasoning body: a finished reply, split by a reasoning parser (the
    server's --reasoning-parser unless one is named)."""

    text: str
    reasoning_parser: str | None = None


class AbortRequest(_Strict):
    rid: str = Field(min_length=1)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # obfuscation pads against side channels; nothing to pad


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's plus SGLang's extras)."""

    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    max_tokens: int | None = _Count
    temperature: float | None = Field(default=None, ge=0, le=2)  # OpenAI's range
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = _Id
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # SGLang extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = _Count
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_regex: str | list[str] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    custom_params: dict[str, Any] | None = None
    custom_logit_processor: str | None = None  # a 400 when set: forklm runs none
    rid: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class TextPart(_Lenient):
    """A text part of a message's content (`cache_control` and the like are ignored)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """Name the unsupported part (an image, audio), not the union's every branch."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}; this server reads "
                                 "only 'text' parts")
        return content


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _Count
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted as OpenAI does; they change nothing here (no stored completions, one tier, text).
    store: bool | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = _Id  # the radix cache finds shared prefixes by itself
    safety_identifier: str | None = _Id
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[str] | None = Field(default=None, max_length=2)
    # Template variables: reasoning_effort as OpenAI names it, anything else by SGLang's field.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True  # SGLang's: reasoning in its own field (with a parser)

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, modalities: list[str] | None) -> list[str] | None:
        if modalities is not None and modalities != ["text"]:
            raise ValueError(f"only ['text'] is supported (this server generates text), "
                             f"got {modalities}")
        return modalities

    @field_validator("chat_template_kwargs")
    @classmethod
    def _bounded_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        if kwargs is None:
            return None
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} keys, got {len(kwargs)}")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(f"{reserved[0]!r} is a parameter of the template call, not a "
                             "template variable")
        if len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_CHARS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters of JSON")
        return kwargs
