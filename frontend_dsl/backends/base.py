"""The Backend interface: what the program executor needs from a model."""

from __future__ import annotations

from typing import Any, NamedTuple

from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod
from forklm.runtime.errors import ForkLMError
from forklm.runtime.sampling import SamplingParams


class BackendError(ForkLMError, RuntimeError):
    """A backend call failed (e.g. the engine aborted the request); the message says why."""


class GenResult(NamedTuple):
    text: str
    meta_info: dict[str, Any]


class Backend:
    """A model the program executor calls. Methods are called from many threads at once (one per
    program state) and must be thread-safe; each blocks until its result is ready."""

    def generate(self, prompt: str, sampling_params: SamplingParams,
                 logprob_options: dict[str, Any]) -> GenResult:
        """Continue `prompt`; logprob_options holds return_logprob/logprob_start_len/top_logprobs_num."""
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score every choice as a continuation of `prompt` and let `choices_method` decide."""
        raise NotImplementedError(f"{type(self).__name__}.select")

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        """The chat template's text before and after a `role` message that follows `history`."""
        raise NotImplementedError(f"{type(self).__name__}.role_prefix_suffix")

    def cache_prefix(self, prompt: str) -> None:
        """Prefill `prompt` into the backend's prefix cache (a hint; no output)."""
        raise NotImplementedError(f"{type(self).__name__}.cache_prefix")

    def abort(self, rid: str) -> None:
        """Abort an in-flight request by id."""
        raise NotImplementedError(f"{type(self).__name__}.abort")
