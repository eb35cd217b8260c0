"""EngineRequest: one generate call as it travels inside forklm (DSL backends, the server, the
program runner, a server's HTTP client), typed. SGLang's keyword call becomes one at the edge that
takes it (`EngineRequest.from_call`), and one goes back out as a /generate body (`to_json`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams

# A prompt: text, token ids, or (a batch) a list of either.
Prompt = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class LogprobOptions:
    """What a call asks back about token probabilities (SGLang's names); checked by the intake.
    None is "not set", so a DSL gen's options overlay its run's: the engine's defaults are no
    logprobs, the output's only (from logprob_start_len -1), no top lists, entries with text."""

    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None  # False: entries' text is None, never decoded

    @property
    def with_text(self) -> bool:
        return self.return_text_in_logprobs is not False

    def to_dict(self) -> dict[str, Any]:
        """The options that are set."""
        return {k: getattr(self, k) for k in LOGPROB_OPTIONS if getattr(self, k) is not None}

    def overlay(self, other: LogprobOptions) -> LogprobOptions:
        """These options with those set in `other` taking precedence."""
        return LogprobOptions(**{**self.to_dict(), **other.to_dict()})


LOGPROB_OPTIONS = tuple(f.name for f in dataclasses.fields(LogprobOptions))


@dataclass(frozen=True)
class EngineRequest:
    """What to generate: exactly one of `prompt` (text, ids, or a batch of either) or `input_ids`
    (ids or a batch); sampling parameters (one for all prompts, or one per prompt); logprob
    options; result ids (a str, or one per prompt); the open session (if any) that pins what
    each request ends with. The intake (Engine.prepare) validates the rest and tokenizes."""

    prompt: Prompt | None = None
    input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None
    sampling_params: SamplingParams | tuple[SamplingParams, ...] = field(
        default_factory=SamplingParams)
    logprobs: LogprobOptions = field(default_factory=LogprobOptions)
    rid: str | Sequence[str] | None = None
    session_id: str | None = None
    # vLLM's cache_salt: cached prefixes are shared only with requests of the same salt.
    cache_salt: str | None = None
    # SGLang's priority (used when EngineConfig.enable_priority_scheduling is on).
    priority: int | None = None
    # Who sent it (the server sets an API key's name): the scheduler interleaves tenants.
    tenant: str | None = None
    # An embedding request: its prompts' hidden states pooled so ("last", "mean", "cls"; see
    # EngineConfig.pooling) into GenerateOutput.embedding, nothing generated (max_new_tokens 0).
    pooling: str | None = None
    # SGLang's lora_path: the name of a loaded LoRA adapter (EngineConfig.lora_paths,
    # Engine.load_lora_adapter), or one per prompt (None: the base model).
    lora_path: str | Sequence[str | None] | None = None
    # SGLang's image_data, for a vision-language model: a single prompt's image or list of images,
    # or (a batch) one such entry per prompt. An image is a data URL, base64 text, bytes, a PIL
    # image, a local path (the Python API's), or one the server already decoded
    # (runtime/multimodal/images.py); its prompt holds one image placeholder per image.
    image_data: Any = None

    @classmethod
    def from_call(cls, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                  return_logprob: bool = False, logprob_start_len: int | None = None,
                  top_logprobs_num: int | None = None, rid: Any = None,
                  return_text_in_logprobs: bool = True, session_params: Any = None,
                  priority: int | None = None, cache_salt: str | None = None,
                  lora_path: Any = None, image_data: Any = None) -> EngineRequest:
        """SGLang's generate() keywords as a request; `sampling_params` is a SamplingParams, a
        dict, None (defaults) or a list of those (one per prompt). Raises InvalidArgumentError
        naming a bad sampling parameter or session_params."""
        params: SamplingParams | tuple[SamplingParams, ...]
        if isinstance(sampling_params, list):
            params = tuple(SamplingParams.coerce(p) for p in sampling_params)
        else:
            params = SamplingParams.coerce(sampling_params)
        logprobs = LogprobOptions(return_logprob, logprob_start_len, top_logprobs_num,
                                  return_text_in_logprobs)
        return cls(prompt, input_ids, params, logprobs, rid, session_of(session_params),
                   cache_salt, priority, lora_path=lora_path, image_data=image_data)

    def with_session(self, session_id: str | None) -> EngineRequest:
        return dataclasses.replace(self, session_id=session_id)

    def to_json(self) -> dict[str, Any]:
        """This request as a /generate body (a forklm or SGLang server applies the same
        defaults, so only what differs from them is sent)."""
        body: dict[str, Any] = ({"text": _jsonable(self.prompt)} if self.prompt is not None
                                else {"input_ids": _jsonable(self.input_ids)})
        params = self.sampling_params
        body["sampling_params"] = (_params_json(params) if isinstance(params, SamplingParams)
                                   else [_params_json(p) for p in params])
        options = self.logprobs
        if options.return_logprob:
            body.update(return_logprob=True, return_text_in_logprobs=options.with_text)
            for name in ("logprob_start_len", "top_logprobs_num"):
                if getattr(options, name) is not None:
                    body[name] = getattr(options, name)
        if self.rid is not None:
            body["rid"] = _jsonable(self.rid)
        if self.session_id is not None:
            body["session_params"] = {"id": self.session_id}
        for name in ("cache_salt", "priority", "pooling"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.lora_path is not None:
            body["lora_path"] = _jsonable(self.lora_path)
        return body


def _params_json(params: SamplingParams) -> dict[str, Any]:
    """The fields that differ from the defaults."""
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)
            if getattr(params, f.name) != f.default}


def session_of(session_params: Any) -> str | None:
    """The session id of SGLang's session_params ({"id": ...}). forklm's sessions pin prefixes
    and every request sends its whole prompt, so SGLang's continuation fields (rid, offset,
    replace, drop_previous_output) are refused rather than ignored."""
    if session_params is None:
        return None
    if not isinstance(session_params, Mapping):
        raise InvalidArgumentError("session_params", session_params, 'expected {"id": ...}')
    sid = session_params.get("id")
    if not isinstance(sid, str) or not sid:
        raise InvalidArgumentError("session_params.id", sid, "expected an open session's id")
    for key, value in session_params.items():
        if key != "id" and value not in (None, False):
            raise InvalidArgumentError(
                f"session_params.{key}", value, "not supported: a session here pins the prefix "
                "its requests end with; send the whole prompt and the radix cache reuses it")
    return sid


def _jsonable(value: Any) -> Any:
    """Sequences (tuples included) as lists, for the JSON body."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        return value
    return [_jsonable(v) for v in value]
