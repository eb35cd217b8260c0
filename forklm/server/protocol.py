"""Request bodies as pydantic models. Unknown request fields are rejected (extra="forbid"), so a
typo is a 400 naming the field instead of a silently ignored option; inside chat messages unknown
keys are ignored, as OpenAI does (its SDK echoes `refusal`, `annotations`, ... back). Value ranges
are checked once, by SamplingParams; only the server-side counts and sizes are bounded here."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from forklm.runtime.engine.intake import MAX_TOP_LOGPROBS_NUM as MAX_TOP_LOGPROBS
from forklm.runtime.sampling.params import MAX_N
from forklm.server.chat_template import RESERVED_TEMPLATE_KWARGS

# Per-request fan-out (n, top logprobs) is bounded by the runtime's limits, which every entry
# point shares; here they become part of the OpenAPI schema.
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
MAX_IMAGE_URL_CHARS = 32 * 1024 * 1024  # a data URL; the body limit bounds it first
# One prompt's images as /generate takes them (the intake bounds the count).
ImageData = Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)] | list[
    Annotated[str, Field(max_length=MAX_IMAGE_URL_CHARS)]]
# A LoRA adapter's name as a request gives it (bounded like every string a request controls).
AdapterName = Annotated[str, Field(min_length=1, max_length=256)]
# vLLM's cache_salt: cached prefixes are shared only among requests with the same salt.
CacheSalt = Annotated[str | None, Field(min_length=1, max_length=1024)]
# SGLang's priority (with --enable-priority-scheduling; larger first by default).
Priority = Annotated[int | None, Field(ge=-(2**31 - 1), le=2**31 - 1)]


# JSON's "\ud800" escape parses to a lone surrogate: a str with no UTF-8 form, on which the
# tokenizer and the response encoder fail. Surrogate pairs parse to one character and pass.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_SCALARS = frozenset({int, float, bool, type(None)})
_REF_KEYS = ("$ref", "$dynamicRef", "$recursiveRef")
# Token ids: a JSON `true` is no token id (pydantic's lax int would take it as 1).
TokenIds = list[StrictInt]


def lone_surrogate_path(data: Any) -> str | None:
    """The dotted path of a string (a value or a key) in parsed JSON `data` that holds a lone
    surrogate, else None. Lists of numbers are skipped at C speed (input_ids can be millions)."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _LONE_SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                sub = f"{path}.{_printable(key)}" if path else _printable(key)
                if isinstance(key, str) and not key.isascii() and _LONE_SURROGATE.search(key):
                    return sub
                stack.append((item, sub))
        elif isinstance(value, list) and not _SCALARS.issuperset(map(type, value)):
            stack.extend((item, f"{path}.{i}" if path else str(i)) for i, item in enumerate(value))
    return None


def _printable(key: Any) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class UnicodeChecked(BaseModel):
    """A whole request body: every string in it must be valid Unicode, checked before any field
    (a 400 naming the field, where the tokenizer would fail with a 500)."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate_path(data)
        if path is not None:
            raise PydanticCustomError(
                "lone_surrogate", "holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                "outside a pair), which is not Unicode text", {"param": path})
        return data


def external_ref(schema: Any) -> str | None:
    """The first `$ref` anywhere in a JSON schema that points outside it ("file://...",
    "http://..."), else None. Only local refs ("#/$defs/x") are resolved, and a server must not
    fetch what a client names, so such a ref is refused rather than silently ignored."""
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if key in _REF_KEYS and isinstance(item, str) and not item.startswith("#"):
                    return item
                stack.append(item)
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, (dict, list)))
    return None


def local_refs_only(schema: Any) -> Any:
    """A schema (a dict, or its JSON text) unchanged; a ValueError if it has an external $ref.
    Text that is not JSON passes: the engine reports it when it compiles the schema."""
    parsed = schema
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError:
            return schema
    ref = external_ref(parsed)
    if ref is not None:
        raise ValueError(f"$ref {ref[:200]!r} points outside the schema: only local refs "
                         "('#/...') are resolved")
    return schema


JsonSchema = Annotated[dict[str, Any], AfterValidator(local_refs_only)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Request(_Strict, UnicodeChecked):
    """A top-level request body."""


class _Lenient(BaseModel):
    """A part of a chat message: keys it does not know are dropped, not rejected."""

    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Request):
    """SGLang's /generate body: text or input_ids, one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    stream: bool = False
    # {"id": <an /open_session id>}: the requests' final sequences stay pinned for the session
    session_params: dict[str, Any] | None = None
    cache_salt: CacheSalt = None
    priority: Priority = None
    # A loaded LoRA adapter's name (the server's --lora-paths, /load_lora_adapter), or one per
    # prompt; null: the base model.
    lora_path: AdapterName | list[AdapterName | None] | None = None
    # SGLang fields forklm cannot honour: accepted at their defaults (null/false), a 400 naming
    # them otherwise (native_api.UNSUPPORTED_FIELDS).
    custom_logit_processor: str | list[str | None] | None = None
    return_hidden_states: bool | list[bool] = False
    # A vision-language model's images (SGLang's image_data): for one prompt an image or a list
    # of them; for a batch one such entry (or null) per prompt. Data URLs or base64 text.
    image_data: ImageData | list[ImageData | None] | None = None
    log_metrics: bool = True  # forklm always records metrics
    # With the server's --reasoning-parser: `text` is the reply's content, `reasoning_text` its
    # <think> part.
    separate_reasoning: bool = False

    @field_validator("sampling_params")
    @classmethod
    def _local_schema_refs(cls, params: Any) -> Any:
        for one in params if isinstance(params, list) else [params] if params else []:
            for key in ("json_schema", "structural_tag"):
                if one.get(key) is not None:
                    try:
                        local_refs_only(one[key])
                    except ValueError as e:
                        raise ValueError(f"{key}: {e}") from e
        return params


class SeparateReasoningRequest(_Request):
    """SGLang's /separate_reasoning body: a finished reply, split by a reasoning parser (the
    server's --reasoning-parser unless one is named)."""

    text: str
    reasoning_parser: str | None = None


class AbortRequest(_Request):
    rid: str = Field(min_length=1)


class ConcatAppendRequest(_Request):
    """SGLang's frontend joins forks with concate_and_append by naming their executors' ids; its
    next request carries the joined text, which the radix cache serves from the forks' KV."""

    src_rids: list[Annotated[str, Field(max_length=256)]] = Field(max_length=MAX_N * 64)
    dst_rid: str = Field(max_length=256)




class OpenSessionRequest(_Request):
    """SGLang's /open_session body. capacity_of_str_len sizes SGLang's session buffer; forklm's
    sessions pin radix-cache prefixes instead, bounded by --session-pinned-fraction."""

    session_id: str | None = Field(default=None, min_length=1, max_length=256)
    capacity_of_str_len: int | None = Field(default=None, ge=0)


class CloseSessionRequest(_Request):
    session_id: str = Field(min_length=1, max_length=256)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = False  # obfuscation pads against side channels; nothing to pad


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # SGLang's structural_tag response format: tagged regions ({begin, schema, end}) the reply
    # may open after one of the triggers, or xgrammar's `format` object; checked by the engine.
    structures: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    triggers: list[str] | None = Field(default=None, max_length=MAX_TOOLS)
    format: dict[str, Any] | None = None


class _SamplingFields(_Request):
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
    stop_token_ids: TokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_regex: str | list[str] | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Annotated[str | dict[str, Any], AfterValidator(local_refs_only)] | None = None
    custom_params: dict[str, Any] | None = None
    custom_logit_processor: str | None = None  # a 400 when set: forklm runs none
    rid: str | None = None
    cache_salt: CacheSalt = None
    priority: Priority = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's extra: each prompt token's logprob (with this many top alternatives), per choice
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)


class TextPart(_Lenient):
    """A text part of a message's content (`cache_control` and the like are ignored)."""

    type: Literal["text"]
    text: str


class ImageUrl(_Lenient):
    url: str = Field(max_length=MAX_IMAGE_URL_CHARS)
    detail: str | None = None  # OpenAI's; the model's processor decides the resolution


class ImagePart(_Lenient):
    """An image part: a data URL (or, where the server allows it, a remote URL)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class FunctionCall(_Lenient):
    name: str
    arguments: str


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _known_parts_only(cls, content: Any) -> Any:
        """Name the unsupported part (audio, a file), not the union's every branch."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = (part.get("type") if isinstance(part, dict)
                    else getattr(part, "type", type(part).__name__))
            if kind not in ("text", "image_url"):
                raise ValueError(f"content part {i} has type {kind!r}; this server reads "
                                 "'text' and 'image_url' parts")
        return content


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = None
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
    # vLLM's and SGLang's: the prompt ends with the template's assistant header (a new turn), or
    # with continue_final_message the final (assistant) message is continued where it stops
    # (a prefill: the reply is what follows it).
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _prompt_end(self) -> ChatCompletionRequest:
        check_prompt_end(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self

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


def check_prompt_end(messages: list[ChatMessage] | None, add_generation_prompt: bool,
                     continue_final_message: bool) -> None:
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message needs add_generation_prompt false (the final "
                         "message is continued, no new turn is opened)")
    if continue_final_message and messages and messages[-1].role != "assistant":
        raise ValueError("continue_final_message continues a final assistant message; the "
                         f"last message is {messages[-1].role!r}")


class TokenizeRequest(_Request):
    """SGLang's (and vLLM's) /tokenize: a prompt (or a batch), or chat messages rendered by the
    chat template exactly as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | list[str] | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        check_prompt_end(self.messages, self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: TokenIds | list[TokenIds]
    skip_special_tokens: bool = True


# OpenAI's limit on the inputs of one /v1/embeddings request.
MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings: one input or a batch, as text or token ids. `dimensions` keeps
    the first that many values (Matryoshka-trained models), renormalized."""

    model: str
    input: (str | Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
            | Annotated[TokenIds, Field(min_length=1)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = _Id
    cache_salt: CacheSalt = None
    priority: Priority = None


class RerankRequest(_Request):
    """The rerank API of vLLM, Jina and Cohere: documents ordered by relevance to the query."""

    model: str | None = None
    query: str
    documents: Annotated[list[str], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS - 1)]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    cache_salt: CacheSalt = None
    priority: Priority = None


# /v1/score runs one prompt per (item, label token): both bounded, and their product, which
# is the engine call's size.
MAX_SCORE_ITEMS, MAX_SCORE_LABELS, MAX_SCORE_PROMPTS = 256, 64, 256


class ScoreRequest(_Request):
    """SGLang's /v1/score: the next-token probabilities of `label_token_ids` after query + item
    (item + query with item_first) for each item; softmaxed over the labels with apply_softmax."""

    model: str | None = None
    query: str | Annotated[TokenIds, Field(min_length=1)]
    items: (Annotated[list[str], Field(min_length=1, max_length=MAX_SCORE_ITEMS)]
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_SCORE_ITEMS)])
    label_token_ids: Annotated[TokenIds, Field(min_length=1, max_length=MAX_SCORE_LABELS)]
    apply_softmax: bool = False
    item_first: bool = False
    cache_salt: CacheSalt = None
    priority: Priority = None

    @model_validator(mode="after")
    def _bounded(self) -> ScoreRequest:
        if isinstance(self.query, str) != isinstance(self.items[0], str):
            raise ValueError("query and items must both be text or both token ids")
        if len(self.items) * len(self.label_token_ids) > MAX_SCORE_PROMPTS:
            raise ValueError(f"items x label_token_ids is at most {MAX_SCORE_PROMPTS}")
        return self
