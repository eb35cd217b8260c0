"""The in-process Engine as a program backend (the embedded default)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from jinja2 import TemplateError

from forklm.frontend_dsl.backends.base import (
    Backend,
    BackendError,
    ChatTurn,
    GenResult,
    OnText,
)
from forklm.frontend_dsl.backends.session_client import SessionClient
from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from forklm.frontend_dsl.global_config import __version__
from forklm.runtime.engine.client import EngineClient
from forklm.runtime.engine.engine import Engine
from forklm.runtime.engine.engine_request import EngineRequest, LogprobOptions
from forklm.runtime.engine.intake import encode_prompt, prompt_bos
from forklm.runtime.engine.results import (
    GenerateOutput,
    TokenLogprobs,
    join_chunks,
    token_entries,
)
from forklm.runtime.sampling.params import SamplingParams

# Scoring only: prefill with prompt logprobs, no new token.
_SCORE_PARAMS = SamplingParams(max_new_tokens=0, temperature=0.0)
_SENTINEL = "\x00forklm-role-content\x00"
_SYSTEM_SENTINEL = "\x00forklm-system-content\x00"


class EngineBackend(Backend):
    """Runs gens and selects on an `Engine` in this process; the chat template is the engine
    tokenizer's own. `EngineBackend()` builds an Engine on the default model.
    `lora_path`: a LoRA adapter loaded in the engine that every gen and select of the programs
    run on this backend goes through (None: the base model)."""

    def __init__(self, engine: EngineClient | None = None, *, lora_path: str | None = None,
                 **engine_config: Any):
        self.engine: EngineClient = engine if engine is not None else Engine(**engine_config)
        self.lora_path = lora_path
        self.tokenizer = self.engine.tokenizer
        self._bos = prompt_bos(self.tokenizer)
        self._default_system = self._find_default_system()

    def generate(self, prompt: str, sampling_params: SamplingParams,
                 logprob_options: LogprobOptions,
                 on_text: OnText | None = None) -> GenResult:
        """One engine request; with `on_text` it streams, and each chunk's new text is passed on
        as the engine decodes it (the pieces concatenate to the result's text)."""
        request = self._request(prompt, sampling_params=sampling_params, logprobs=logprob_options)
        if on_text is None or sampling_params.n != 1:  # n > 1 samples come back whole
            return self._gen_result(request, self.engine.generate_outputs(request))
        chunks = self.engine.stream_outputs(request)
        return self._gen_result(request, [_streamed(chunks, on_text, self._meta_tokenizer(request))])

    async def agenerate_turn(self, prompt: str, turn: ChatTurn, sampling_params: SamplingParams,
                             logprob_options: LogprobOptions,
                             on_text: OnText | None = None) -> GenResult:
        """generate on the engine's async API (the caller's event loop, no thread)."""
        request = self._request(prompt, sampling_params=sampling_params, logprobs=logprob_options)
        if on_text is None or sampling_params.n != 1:
            return self._gen_result(request,
                                    await self.engine.async_generate_outputs(request))
        chunks = await self.engine.async_stream_outputs(request)
        return self._gen_result(
            request, [await _astreamed(chunks, on_text, self._meta_tokenizer(request))])

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """One engine call scores every choice: prompt + choice is tokenized as a whole (so a choice
        that merges with the prompt's last token is scored on the merged token) and each choice's
        logprobs are those of the tokens after its common prefix with the prompt's tokenization.
        The shared prompt prefix is computed once and reused through the radix cache."""
        scoring = _Scoring(self, prompt, choices, choices_method)
        outs = self.engine.generate_outputs(scoring.request())
        unconditional = None
        if scoring.needs_unconditional:
            unconditional = self.engine.generate_outputs(scoring.unconditional_request(outs))
        return scoring.decide(outs, unconditional)

    async def aselect(self, prompt: str, choices: list[str],
                      choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """select on the engine's async API."""
        scoring = _Scoring(self, prompt, choices, choices_method)
        outs = await self.engine.async_generate_outputs(scoring.request())
        unconditional = None
        if scoring.needs_unconditional:
            unconditional = await self.engine.async_generate_outputs(
                scoring.unconditional_request(outs))
        return scoring.decide(outs, unconditional)

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        """Render history + [role: sentinel] with the tokenizer's template and cut at the sentinel;
        the prefix is what the new message adds after the rendered history (with an empty history
        it includes a template's default system prompt)."""
        before = self._render(history) if history else ""
        rendered = self._render([*history, {"role": role, "content": _SENTINEL}])
        head, _, suffix = rendered.partition(_SENTINEL)
        prefix = head[len(before):] if head.startswith(before) else head
        return prefix, suffix

    def default_system_prompt(self) -> str | None:
        """The system message the template injects into a chat that has none (SmolLM2's "You are
        a helpful AI assistant named SmolLM, ..."), or None."""
        return self._default_system

    def _find_default_system(self) -> str | None:
        """Render a user turn with and without an explicit system message; what the template put
        in the system slot without one is its default."""
        user = {"role": "user", "content": _SENTINEL}
        try:
            explicit = self._render([{"role": "system", "content": _SYSTEM_SENTINEL}, user])
        except (TemplateError, ValueError):  # no template, or one that rejects system messages
            return None
        head, _, tail = explicit.partition(_SYSTEM_SENTINEL)
        implied = self._render([user])
        if len(implied) <= len(head) + len(tail) or not (
                implied.startswith(head) and implied.endswith(tail)):
            return None
        content = implied[len(head):len(implied) - len(tail)]
        return content if content.strip() else None

    def with_session(self) -> tuple[Backend, Callable[[], None]] | None:
        """A copy of this backend on a SessionClient of its engine (an engine client without
        sessions, like the server's program runner, which has its own: None)."""
        if not (hasattr(self.engine, "open_session") and hasattr(self.engine, "close_session")):
            return None
        client = SessionClient(self.engine)
        view = copy.copy(self)
        view.engine = client
        return view, client.close

    def cache_prefix(self, prompt: str) -> None:
        self.engine.generate_outputs(self._request(prompt, sampling_params=_SCORE_PARAMS))

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def flush_cache(self) -> bool:
        """The engine's own flush: False (nothing dropped) while requests are in flight."""
        return self._own_engine("flush_cache").flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        """The engine's config, the package version and its live stats (`internal_states`), as a
        server's /get_server_info gives them."""
        engine = self._own_engine("get_server_info")
        return {**dataclasses.asdict(engine.config), "version": __version__,
                "internal_states": [engine.stats()]}

    def _own_engine(self, what: str) -> Engine:
        if not isinstance(self.engine, Engine):
            raise BackendError(f"{what} needs an in-process Engine; this backend runs on "
                               f"{type(self.engine).__name__}")
        return self.engine

    def _gen_result(self, request: EngineRequest, outs: list[GenerateOutput]) -> GenResult:
        """The engine's results (one, or the n samples) as a GenResult, with SGLang's meta_info
        (what state.get_meta_info gives); an abort raises."""
        for out in outs:
            _raise_if_aborted(out)
        tokenizer = self._meta_tokenizer(request)
        samples = [(out.text, out.meta_info(tokenizer)) for out in outs]
        return GenResult(*samples[0], samples if len(samples) > 1 else None)

    def _request(self, prompt: Any = None, **fields: Any) -> EngineRequest:
        """An engine request of this backend (through its adapter, if it has one)."""
        return EngineRequest(prompt, lora_path=self.lora_path, **fields)

    def _meta_tokenizer(self, request: EngineRequest) -> Any:
        """What decodes logprob entries' text: the tokenizer when the request asks for it."""
        return self.tokenizer if request.logprobs.with_text else None

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        """A program's text as the engine encodes a text prompt (its tokenizer's BOS first,
        once), so a select scores the tokens its gens are given."""
        return encode_prompt(self.tokenizer, text, self._bos) if text else []


class _Scoring:
    """A select's scoring on the engine, split around its (one or two) engine calls so the blocking
    and async selects share it: `request()` scores prompt + each choice; with a method that
    needs them, `unconditional_request(outs)` scores each choice's tokens alone; `decide`."""

    def __init__(self, backend: EngineBackend, prompt: str, choices: list[str],
                 method: ChoicesSamplingMethod):
        self.choices, self.method, self.tokenizer = choices, method, backend.tokenizer
        self.backend = backend
        prefix_ids = backend._encode(prompt)
        self.full_ids = [backend._encode(prompt + c) for c in choices]
        self.starts = [min(max(_common_len(prefix_ids, ids), 1), len(ids) - 1)
                       for ids in self.full_ids]
        self.start = min(self.starts)
        self.needs_unconditional = method.requires_unconditional_logprobs

    def request(self) -> EngineRequest:
        return self.backend._request(input_ids=self.full_ids, sampling_params=_SCORE_PARAMS,
                             logprobs=LogprobOptions(True, self.start))

    def _input_logprobs(self, outs: list[GenerateOutput]) -> list[list[list[Any]]]:
        """Each choice's scored tokens' [logprob, token_id, text] entries."""
        for out in outs:
            _raise_if_aborted(out)
        return [token_entries(_logprobs(out).input_token[s - self.start:], self.tokenizer)
                for out, s in zip(outs, self.starts)]

    def unconditional_request(self, outs: list[GenerateOutput]) -> EngineRequest:
        """Each choice's scored tokens on their own (no prompt); their first logprob is None."""
        ids = [[tid for lp, tid in _logprobs(out).input_token[s - self.start:] if lp is not None]
               for out, s in zip(outs, self.starts)]
        return self.backend._request(input_ids=ids, sampling_params=_SCORE_PARAMS,
                             logprobs=LogprobOptions(True, 0))

    def decide(self, outs: list[GenerateOutput],
               unconditional: list[GenerateOutput] | None) -> ChoicesDecision:
        input_lps = self._input_logprobs(outs)
        return self.method(
            choices=self.choices,
            normalized_prompt_logprobs=[mean_logprob(e) for e in input_lps],
            input_token_logprobs=input_lps,
            output_token_logprobs=[token_entries(_logprobs(out).output_token, self.tokenizer)
                                   for out in outs],
            unconditional_token_logprobs=None if unconditional is None else [
                token_entries(_logprobs(out).input_token, self.tokenizer)
                for out in unconditional])


def _streamed(chunks: Iterator[GenerateOutput], on_text: OnText, tokenizer: Any
              ) -> GenerateOutput:
    """A stream's chunks joined into its result, each new piece of text passed on (with the
    chunk's meta_info when it carries logprobs)."""
    parts = []
    for chunk in chunks:
        _pass_on(chunk, on_text, tokenizer)
        parts.append(chunk)
    assert parts and parts[-1].finished, "an engine stream ends with a final chunk"
    return join_chunks(parts)


async def _astreamed(chunks: AsyncIterator[GenerateOutput], on_text: OnText, tokenizer: Any
                     ) -> GenerateOutput:
    parts = []
    async for chunk in chunks:
        _pass_on(chunk, on_text, tokenizer)
        parts.append(chunk)
    assert parts and parts[-1].finished, "an engine stream ends with a final chunk"
    return join_chunks(parts)


def _pass_on(chunk: GenerateOutput, on_text: OnText, tokenizer: Any) -> None:
    if chunk.logprobs is not None:
        on_text(chunk.text, chunk.meta_info(tokenizer))
    elif chunk.text:
        on_text(chunk.text)


def _logprobs(out: GenerateOutput) -> TokenLogprobs:
    assert out.logprobs is not None, "a scoring request asks for logprobs"
    return out.logprobs


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _raise_if_aborted(out: GenerateOutput) -> None:
    if out.aborted:
        message = out.finish_reason.message if out.finish_reason else None
        raise BackendError(f"request {out.rid} aborted: {message}")
