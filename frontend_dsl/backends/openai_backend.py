"""OpenAI: SGLang's `sgl.OpenAI` backend, programs over any OpenAI-compatible server.

Chat models get each gen as one /chat/completions call whose messages are the program's chat so
far (a gen must open the assistant's reply); completion models get the program's text on
/completions. The program's own text renders roles with a plain template (`USER:` ...), as
SGLang's does. What the API cannot express raises at the gen, naming the argument.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

from forklm.frontend_dsl.backends.base import (
    Backend,
    BackendError,
    ChatTurn,
    GenResult,
    OnText,
)
from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from forklm.runtime.engine.engine_request import LogprobOptions
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import OPENAI_NAMES, SamplingParams

# Models served only on /completions (SGLang's list, and OpenAI's other completion models).
COMPLETION_MODELS = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002")
_ROLES = {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")}
# SamplingParams fields OpenAI's API has (mapped in _request), those no OpenAI-style server takes,
# and the rest: sent as extras (SGLang's and vLLM's names) when they differ from the default; a
# server that does not know one refuses the request.
_NATIVE = ("max_new_tokens", "temperature", "top_p", "frequency_penalty", "presence_penalty",
           "seed", "n", "stop", "logit_bias", "json_schema")
_REFUSED = ("choices", "structural_tag", "custom_params", "stream_interval")
_EXTRAS = {f.name: OPENAI_NAMES.get(f.name, f.name) for f in dataclasses.fields(SamplingParams)
           if f.name not in _NATIVE + _REFUSED}
_DEFAULTS = SamplingParams()


class OpenAI(Backend):
    """`OpenAI(model_name, is_chat_model=None, *, base_url=None, api_key=None, **client_kwargs)`
    (SGLang's positional order; client_kwargs go to `openai.OpenAI`).

    `is_chat_model` defaults to True except for OpenAI's completion models. gen sends
    max_tokens, temperature, top_p, penalties, stop, n, seed and logit_bias; regex, ebnf,
    stop_regex and the other non-OpenAI knobs as extra body fields (forklm, SGLang and vLLM
    servers read them); a JSON schema as `response_format` (chat) or `json_schema`
    (completions). select scores each choice with the prompt's logprobs from /completions
    (vLLM's `prompt_logprobs` extra, which forklm's server has too), so it needs a completion
    model and such a server; otherwise it raises BackendError saying so."""

    def __init__(self, model_name: str, is_chat_model: bool | None = None,
                 chat_template: Any = None, is_azure: bool = False, *,
                 base_url: str | None = None, api_key: str | None = None,
                 **client_kwargs: Any):
        import openai

        if chat_template is not None:
            raise InvalidArgumentError("chat_template", chat_template, (
                "is not supported: the program's text renders roles as USER:/ASSISTANT: lines, "
                "and a chat model gets the messages, which its server templates"))
        if is_azure:
            raise InvalidArgumentError("is_azure", is_azure, "Azure OpenAI is not supported")

        self.model_name = model_name
        self.is_chat_model = (model_name not in COMPLETION_MODELS if is_chat_model is None
                              else is_chat_model)
        key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"  # local servers need none
        self.client = openai.OpenAI(base_url=base_url, api_key=key, **client_kwargs)
        self._api_error = openai.APIError

    # -- Backend -------------------------------------------------------------------------------
    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        return _ROLES[role]

    def generate(self, prompt: str, sampling_params: SamplingParams,
                 logprob_options: LogprobOptions,
                 on_text: OnText | None = None) -> GenResult:
        """A completion model's gen: the program's text is the prompt."""
        if self.is_chat_model:
            raise BackendError("a chat model's gen needs the chat (generate_turn)")
        kwargs, text_in_logprobs = self._request(sampling_params, logprob_options, chat=False)
        return self._call(self.client.completions.create, {"prompt": prompt, **kwargs},
                          on_text, chat=False, text_in_logprobs=text_in_logprobs)

    def generate_turn(self, prompt: str, turn: ChatTurn, sampling_params: SamplingParams,
                      logprob_options: LogprobOptions,
                      on_text: OnText | None = None) -> GenResult:
        """A chat model's gen is the assistant's whole reply to the messages so far."""
        if not self.is_chat_model:
            return self.generate(prompt, sampling_params, logprob_options, on_text)
        if turn.role != "assistant" or turn.content.strip():
            where = "outside any role" if turn.role is None else (
                f"in a {turn.role} message" if turn.role != "assistant"
                else f"after {turn.content!r} in the assistant message")
            raise InvalidArgumentError("gen", None, (
                f"for OpenAI chat models a gen must come right after sgl.assistant: the API "
                f"generates a whole assistant reply, and this gen is {where}"))
        kwargs, text_in_logprobs = self._request(sampling_params, logprob_options, chat=True)
        return self._call(self.client.chat.completions.create,
                          {"messages": turn.messages, **kwargs}, on_text, chat=True,
                          text_in_logprobs=text_in_logprobs)

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score each choice's tokens (those ending past the prompt) from the prompt logprobs of
        one /completions call over every `prompt + choice`."""
        if self.is_chat_model:
            raise BackendError(
                f"select on {self.model_name!r} needs the prompt's token logprobs, which the chat "
                "completions API does not give; use OpenAI(..., is_chat_model=False) with a "
                "server whose /completions returns them (vLLM's prompt_logprobs; forklm's does)")
        scored = self._score([prompt + c for c in choices], [len(c) for c in choices])
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            texts = ["".join(e[2] for e in entries) for entries in scored]
            alone = self._score(texts, [len(t) for t in texts])
            if [len(a) for a in alone] != [len(s) for s in scored]:
                raise BackendError(f"{choices_method!r} needs each choice's tokens scored alone, "
                                   "and this server tokenizes them differently without the prompt")
            unconditional = alone
        return choices_method(
            choices=choices, normalized_prompt_logprobs=[mean_logprob(e) for e in scored],
            input_token_logprobs=scored, output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=unconditional)

    # -- requests ------------------------------------------------------------------------------
    def _request(self, params: SamplingParams, logprob_options: LogprobOptions,
                 chat: bool) -> tuple[dict[str, Any], bool | None]:
        """The API keywords of one gen and, when it asks for logprobs, whether their entries keep
        the token text (else None); InvalidArgumentError for what the API cannot carry."""
        for name in _REFUSED:
            if getattr(params, name) != getattr(_DEFAULTS, name):
                raise InvalidArgumentError(name, getattr(params, name),
                                           "cannot be sent over the OpenAI API")
        kwargs: dict[str, Any] = {"model": self.model_name, "max_tokens": params.max_new_tokens,
                                  "temperature": params.temperature}
        for name in ("top_p", "frequency_penalty", "presence_penalty", "seed"):
            if getattr(params, name) != getattr(_DEFAULTS, name):
                kwargs[name] = getattr(params, name)
        if params.n != 1:
            kwargs["n"] = params.n
        if params.stop:
            kwargs["stop"] = list(params.stop)
        if params.logit_bias:
            kwargs["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
        extra = {key: getattr(params, name) for name, key in _EXTRAS.items()
                 if getattr(params, name) != getattr(_DEFAULTS, name)}
        if params.json_schema is not None:
            schema = (json.loads(params.json_schema) if isinstance(params.json_schema, str)
                      else dict(params.json_schema))
            if chat:
                kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "schema", "schema": schema}}
            else:
                extra["json_schema"] = json.dumps(schema)
        if extra:
            kwargs["extra_body"] = extra
        kwargs.update(_logprob_request(logprob_options, chat))
        text_in_logprobs = None
        if "logprobs" in kwargs:
            text_in_logprobs = logprob_options.with_text
        return kwargs, text_in_logprobs

    def _call(self, create: Callable[..., Any], kwargs: dict[str, Any],
              on_text: OnText | None, chat: bool,
              text_in_logprobs: bool | None) -> GenResult:
        """One API call; streamed into `on_text` when it yields one text (n = 1, no logprobs)."""
        streams = on_text is not None and kwargs.get("n", 1) == 1 and text_in_logprobs is None
        try:
            if streams:
                assert on_text is not None
                return self._stream(create(stream=True, stream_options={"include_usage": True},
                                           **kwargs), on_text, chat)
            return _result(create(**kwargs), chat, text_in_logprobs)
        except self._api_error as e:
            raise BackendError(f"{self.model_name} refused the request: {e}") from e

    def _stream(self, chunks: Any, on_text: OnText, chat: bool) -> GenResult:
        pieces: list[str] = []
        meta: dict[str, Any] = {"finish_reason": None}
        for chunk in chunks:
            meta["id"] = chunk.id
            if chunk.usage is not None:
                meta.update(_usage(chunk.usage))
            for choice in chunk.choices:
                piece = (choice.delta.content if chat else choice.text) or ""
                if piece:
                    pieces.append(piece)
                    on_text(piece)
                if choice.finish_reason:
                    meta["finish_reason"] = {"type": choice.finish_reason}
        return GenResult("".join(pieces), meta)

    def _score(self, prompts: list[str], choice_lens: list[int]) -> list[list[list[Any]]]:
        """Per prompt, the [logprob, token_id, text] of its last tokens, those that cover its
        last `choice_len` characters (a token that merges the prompt's end with the choice's
        start counts), from vLLM's `prompt_logprobs` extra."""
        try:
            reply = self.client.completions.create(
                model=self.model_name, prompt=prompts, max_tokens=1, temperature=0,
                extra_body={"prompt_logprobs": 0})
        except self._api_error as e:
            raise BackendError(f"select needs prompt logprobs (/completions with vLLM's "
                               f"prompt_logprobs); {self.model_name} refused: {e}") from e
        out = []
        for choice, choice_len in zip(sorted(reply.choices, key=lambda c: c.index), choice_lens):
            positions = (choice.model_extra or {}).get("prompt_logprobs")
            if not positions:
                raise BackendError(f"{self.model_name}'s server gave no prompt_logprobs, so "
                                   "select cannot score choices on it")
            out.append(_last_tokens(positions, choice_len))
        return out


def _last_tokens(positions: list[Any], num_chars: int) -> list[list[Any]]:
    """The entries of the last prompt tokens whose text covers the last `num_chars` characters
    (walking back: a token is in while the text after it is shorter than that)."""
    entries: list[list[Any]] = []
    after = 0
    for position in reversed(positions):
        if after >= num_chars:
            break
        if position is None:  # the first token: no logprob, no text
            entries.append([None, None, ""])
            break
        if len(position) != 1:
            raise BackendError(f"expected the prompt token alone at each position, got "
                               f"{len(position)} entries")
        (token_id, info), = position.items()
        entries.append([info["logprob"], int(token_id), info["decoded_token"]])
        after += len(info["decoded_token"] or "")
    return entries[::-1]


def _logprob_request(options: LogprobOptions, chat: bool) -> dict[str, Any]:
    if options.logprob_start_len not in (None, -1):
        raise InvalidArgumentError("logprob_start_len", options.logprob_start_len,
                                   "prompt logprobs of a gen are not available over the OpenAI API")
    if not options.return_logprob:
        return {}
    top = options.top_logprobs_num or 0
    if chat:
        return {"logprobs": True, **({"top_logprobs": top} if top else {})}
    return {"logprobs": top}


def _result(reply: Any, chat: bool, text_in_logprobs: bool | None) -> GenResult:
    """A non-streamed reply as the text (each sample's with n > 1) and SGLang-shaped meta_info;
    text_in_logprobs: None = no logprobs asked, else whether entries keep their token text."""
    usage = _usage(reply.usage) if reply.usage is not None else {}
    samples = []
    for choice in sorted(reply.choices, key=lambda c: c.index):
        text = (choice.message.content if chat else choice.text) or ""
        meta = {"id": reply.id, "finish_reason": {"type": choice.finish_reason}, **usage}
        if text_in_logprobs is not None:
            meta.update(_logprob_meta(choice.logprobs, chat, text_in_logprobs))
        samples.append((text, meta))
    if not samples:
        raise BackendError(f"reply {reply.id} has no choices")
    return GenResult(samples[0][0], samples[0][1], samples if len(samples) > 1 else None)


def _logprob_meta(lp: Any, chat: bool, with_text: bool) -> dict[str, Any]:
    """output_token_logprobs (and output_top_logprobs) as [logprob, None, text] entries (the API
    gives token text, not ids; text None unless `with_text`)."""
    if lp is None:
        return {"output_token_logprobs": []}

    def entry(logprob: float, token: str) -> list[Any]:
        return [logprob, None, token if with_text else None]

    if chat:
        content = lp.content or []
        return {"output_token_logprobs": [entry(t.logprob, t.token) for t in content],
                "output_top_logprobs": [[entry(a.logprob, a.token) for a in t.top_logprobs]
                                        for t in content]}
    tops = lp.top_logprobs or []
    return {"output_token_logprobs": [entry(v, t) for t, v in zip(lp.tokens, lp.token_logprobs)],
            "output_top_logprobs": [[entry(v, t) for t, v in (top or {}).items()]
                                    for top in tops]}


def _usage(usage: Any) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens}
