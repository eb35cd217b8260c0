"""The in-process Engine as a program backend (the embedded default)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from jinja2 import TemplateError

from forklm.frontend_dsl.backends.base import Backend, BackendError, ChatTurn, GenResult
from forklm.frontend_dsl.backends.session_client import SessionClient
from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from forklm.frontend_dsl.global_config import __version__
from forklm.runtime.engine.client import EngineClient
from forklm.runtime.engine.engine import Engine
from forklm.runtime.sampling.params import SamplingParams

# Scoring only: prefill with prompt logprobs, no new token.
_SCORE_PARAMS = SamplingParams(max_new_tokens=0, temperature=0.0)
_SENTINEL = "\x00forklm-role-content\x00"
_SYSTEM_SENTINEL = "\x00forklm-system-content\x00"


class EngineBackend(Backend):
    """Runs gens and selects on an `Engine` in this process; the chat template is the engine
    tokenizer's own. `EngineBackend()` builds an Engine on the default model."""

    def __init__(self, engine: EngineClient | None = None, **engine_config: Any):
        self.engine: EngineClient = engine if engine is not None else Engine(**engine_config)
        self.tokenizer = self.engine.tokenizer
        self._default_system = self._find_default_system()

    def generate(self, prompt: str, sampling_params: SamplingParams,
                 logprob_options: dict[str, Any],
                 on_text: Callable[[str], None] | None = None) -> GenResult:
        """One engine request; with `on_text` it streams, and each chunk's new text is passed on
        as the engine decodes it (the pieces concatenate to the result's text)."""
        if on_text is None or sampling_params.n != 1:  # n > 1 samples come back whole, as a list
            return _gen_result(self.engine.generate(
                prompt=prompt, sampling_params=sampling_params, **logprob_options))
        pieces: list[str] = []
        last: dict[str, Any] | None = None
        for chunk in self.engine.generate(prompt=prompt, sampling_params=sampling_params,
                                          stream=True, **logprob_options):
            last = _pass_on(chunk, pieces, on_text)
        return _streamed_result(pieces, last)

    async def agenerate_turn(self, prompt: str, turn: ChatTurn, sampling_params: SamplingParams,
                             logprob_options: dict[str, Any],
                             on_text: Callable[[str], None] | None = None) -> GenResult:
        """generate on the engine's async API (the caller's event loop, no thread)."""
        agenerate = getattr(self.engine, "async_generate", None)
        if agenerate is None:  # an engine client without one: the blocking call on a thread
            return await super().agenerate_turn(prompt, turn, sampling_params, logprob_options,
                                                on_text)
        if on_text is None or sampling_params.n != 1:
            return _gen_result(await agenerate(
                prompt=prompt, sampling_params=sampling_params, **logprob_options))
        pieces: list[str] = []
        last: dict[str, Any] | None = None
        async for chunk in await agenerate(prompt=prompt, sampling_params=sampling_params,
                                           stream=True, **logprob_options):
            last = _pass_on(chunk, pieces, on_text)
        return _streamed_result(pieces, last)

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """One engine call scores every choice: prompt + choice is tokenized as a whole (so a choice
        that merges with the prompt's last token is scored on the merged token) and each choice's
        logprobs are those of the tokens after its common prefix with the prompt's tokenization.
        The shared prompt prefix is computed once and reused through the radix cache."""
        scoring = _Scoring(self, prompt, choices, choices_method)
        outs = self.engine.generate(**scoring.request())
        unconditional = None
        if scoring.needs_unconditional:
            unconditional = self.engine.generate(**scoring.unconditional_request(outs))
        return scoring.decide(outs, unconditional)

    async def aselect(self, prompt: str, choices: list[str],
                      choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """select on the engine's async API."""
        agenerate = getattr(self.engine, "async_generate", None)
        if agenerate is None:
            return await super().aselect(prompt, choices, choices_method)
        scoring = _Scoring(self, prompt, choices, choices_method)
        outs = await agenerate(**scoring.request())
        unconditional = None
        if scoring.needs_unconditional:
            unconditional = await agenerate(**scoring.unconditional_request(outs))
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
        self.engine.generate(prompt=prompt, sampling_params=_SCORE_PARAMS)

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

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []


class _Scoring:
    """A select's scoring on the engine, split around its (one or two) engine calls so the blocking
    and async selects share it: `request()` scores prompt + each choice; with a method that
    needs them, `unconditional_request(outs)` scores each choice's tokens alone; `decide`."""

    def __init__(self, backend: EngineBackend, prompt: str, choices: list[str],
                 method: ChoicesSamplingMethod):
        self.choices, self.method = choices, method
        prefix_ids = backend._encode(prompt)
        self.full_ids = [backend._encode(prompt + c) for c in choices]
        self.starts = [min(max(_common_len(prefix_ids, ids), 1), len(ids) - 1)
                       for ids in self.full_ids]
        self.start = min(self.starts)
        self.needs_unconditional = method.requires_unconditional_logprobs

    def request(self) -> dict[str, Any]:
        return dict(input_ids=self.full_ids, sampling_params=_SCORE_PARAMS, return_logprob=True,
                    logprob_start_len=self.start)

    def _input_logprobs(self, outs: list[dict[str, Any]]) -> list[list[list[Any]]]:
        for out in outs:
            _raise_if_aborted(out)
        return [out["meta_info"]["input_token_logprobs"][s - self.start:]
                for out, s in zip(outs, self.starts)]

    def unconditional_request(self, outs: list[dict[str, Any]]) -> dict[str, Any]:
        """Each choice's scored tokens on their own (no prompt); their first logprob is None."""
        ids = [[e[1] for e in entries if e[0] is not None]
               for entries in self._input_logprobs(outs)]
        return dict(input_ids=ids, sampling_params=_SCORE_PARAMS, return_logprob=True,
                    logprob_start_len=0)

    def decide(self, outs: list[dict[str, Any]],
               unconditional: list[dict[str, Any]] | None) -> ChoicesDecision:
        input_lps = self._input_logprobs(outs)
        return self.method(
            choices=self.choices,
            normalized_prompt_logprobs=[mean_logprob(e) for e in input_lps],
            input_token_logprobs=input_lps,
            output_token_logprobs=[out["meta_info"]["output_token_logprobs"] for out in outs],
            unconditional_token_logprobs=None if unconditional is None else [
                out["meta_info"]["input_token_logprobs"] for out in unconditional])


def _gen_result(out: Any) -> GenResult:
    """An engine result (a list of samples when n > 1) as a GenResult; an abort raises."""
    if isinstance(out, list):
        for sample in out:
            _raise_if_aborted(sample)
        return GenResult(out[0]["text"], out[0]["meta_info"],
                         [(o["text"], o["meta_info"]) for o in out])
    _raise_if_aborted(out)
    return GenResult(out["text"], out["meta_info"])


def _pass_on(chunk: dict[str, Any], pieces: list[str], on_text: Callable[[str], None]
             ) -> dict[str, Any]:
    if chunk["text"]:
        pieces.append(chunk["text"])
        on_text(chunk["text"])
    return chunk


def _streamed_result(pieces: list[str], last: dict[str, Any] | None) -> GenResult:
    assert last is not None, "an engine stream ends with a final chunk"
    _raise_if_aborted(last)
    return GenResult("".join(pieces), last["meta_info"])  # the last chunk has the full meta


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _raise_if_aborted(out: dict[str, Any]) -> None:
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"request {out['meta_info'].get('id')} aborted: {reason.get('message')}")
