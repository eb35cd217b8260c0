"""The in-process Engine as a program backend (the embedded default)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jinja2 import TemplateError

from forklm.frontend_dsl.backends.base import Backend, BackendError, GenResult
from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from forklm.frontend_dsl.global_config import __version__
from forklm.runtime.engine import Engine
from forklm.runtime.engine_client import EngineClient
from forklm.runtime.sampling_params import SamplingParams

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
            out = self.engine.generate(prompt=prompt, sampling_params=sampling_params,
                                       **logprob_options)
            if isinstance(out, list):  # n > 1
                for sample in out:
                    _raise_if_aborted(sample)
                return GenResult(out[0]["text"], out[0]["meta_info"],
                                 [(o["text"], o["meta_info"]) for o in out])
            _raise_if_aborted(out)
            return GenResult(out["text"], out["meta_info"])
        pieces: list[str] = []
        last: dict[str, Any] | None = None
        for chunk in self.engine.generate(prompt=prompt, sampling_params=sampling_params,
                                          stream=True, **logprob_options):
            if chunk["text"]:
                pieces.append(chunk["text"])
                on_text(chunk["text"])
            last = chunk
        assert last is not None, "an engine stream ends with a final chunk"
        _raise_if_aborted(last)
        return GenResult("".join(pieces), last["meta_info"])  # the last chunk has the full meta

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """One engine call scores every choice: prompt + choice is tokenized as a whole (so a choice
        that merges with the prompt's last token is scored on the merged token) and each choice's
        logprobs are those of the tokens after its common prefix with the prompt's tokenization.
        The shared prompt prefix is computed once and reused through the radix cache."""
        prefix_ids = self._encode(prompt)
        full_ids = [self._encode(prompt + c) for c in choices]
        starts = [min(max(_common_len(prefix_ids, ids), 1), len(ids) - 1) for ids in full_ids]
        start = min(starts)
        outs = self.engine.generate(input_ids=full_ids, sampling_params=_SCORE_PARAMS,
                                    return_logprob=True, logprob_start_len=start)
        for out in outs:
            _raise_if_aborted(out)
        input_lps = [out["meta_info"]["input_token_logprobs"][s - start:]
                     for out, s in zip(outs, starts)]
        unconditional = None
        if choices_method.requires_unconditional_logprobs:
            unconditional = self._unconditional(input_lps)
        return choices_method(
            choices=choices, normalized_prompt_logprobs=[mean_logprob(e) for e in input_lps],
            input_token_logprobs=input_lps,
            output_token_logprobs=[out["meta_info"]["output_token_logprobs"] for out in outs],
            unconditional_token_logprobs=unconditional)

    def _unconditional(self, input_lps: list[list[list[Any]]]) -> list[list[list[Any]]]:
        """Each choice's scored tokens on their own (no prompt); the first logprob is None."""
        ids = [[e[1] for e in entries if e[0] is not None] for entries in input_lps]
        outs = self.engine.generate(input_ids=ids, sampling_params=_SCORE_PARAMS,
                                    return_logprob=True, logprob_start_len=0)
        return [out["meta_info"]["input_token_logprobs"] for out in outs]

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


def _common_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _raise_if_aborted(out: dict[str, Any]) -> None:
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") == "abort":
        raise BackendError(f"request {out['meta_info'].get('id')} aborted: {reason.get('message')}")
