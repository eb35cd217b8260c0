"""The Backend interface: what the program executor needs from a model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from forklm.frontend_dsl.choices import ChoicesDecision, ChoicesSamplingMethod
from forklm.runtime.engine.engine_request import LogprobOptions
from forklm.runtime.errors import ForkLMError
from forklm.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from forklm.frontend_dsl.ir import Graph
    from forklm.frontend_dsl.state import ProgramState


# What a streaming backend calls per piece of output text: on_text(piece), or, for a chunk that
# carries logprobs, on_text(piece, chunk_meta_info) (that chunk's tokens' entries; piece may be "").
OnText = Callable[..., None]


class BackendError(ForkLMError, RuntimeError):
    """A backend call failed (e.g. the engine aborted the request); the message says why."""


class GenResult(NamedTuple):
    """A gen's output: `text` continues the program (with n > 1, the first sample's);
    `samples` holds every sample's (text, meta_info) when n > 1."""

    text: str
    meta_info: dict[str, Any]
    samples: list[tuple[str, dict[str, Any]]] | None = None


class ChatTurn(NamedTuple):
    """The chat a gen continues, as messages: those closed so far, the open role (None outside a
    role) and what the program appended in it before the gen."""

    messages: list[dict[str, str]]
    role: str | None
    content: str


class Backend:
    """A model the program executor calls. Methods are called from many threads at once (one per
    program state) and must be thread-safe; each blocks until its result is ready. The `a...`
    twins serve async programs (one event loop, no thread per program)."""

    def generate(self, prompt: str, sampling_params: SamplingParams,
                 logprob_options: LogprobOptions,
                 on_text: OnText | None = None) -> GenResult:
        """Continue `prompt`, with the logprobs `logprob_options` asks for (meta_info holds them
        in SGLang's shape). With `on_text`, each new piece of output text is passed to it as soon as
        it is decoded (see OnText)."""
        raise NotImplementedError(f"{type(self).__name__}.generate")

    def generate_turn(self, prompt: str, turn: ChatTurn, sampling_params: SamplingParams,
                      logprob_options: LogprobOptions,
                      on_text: OnText | None = None) -> GenResult:
        """generate, also given the chat that `prompt` renders; what the executor calls. A backend
        that sends messages rather than text (an OpenAI chat model) overrides it; the default
        continues the text."""
        return self.generate(prompt, sampling_params, logprob_options, on_text=on_text)

    def select(self, prompt: str, choices: list[str],
               choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """Score every choice as a continuation of `prompt` and let `choices_method` decide."""
        raise NotImplementedError(f"{type(self).__name__}.select")

    # Async programs await these on their event loop. A backend with a native async client
    # overrides them; the defaults run the blocking call on the loop's default thread pool.
    async def agenerate_turn(self, prompt: str, turn: ChatTurn, sampling_params: SamplingParams,
                             logprob_options: LogprobOptions,
                             on_text: OnText | None = None) -> GenResult:
        """generate_turn, awaited; `on_text` (if given) may be called from another thread."""
        return await asyncio.to_thread(self.generate_turn, prompt, turn, sampling_params,
                                       logprob_options, on_text)

    async def aselect(self, prompt: str, choices: list[str],
                      choices_method: ChoicesSamplingMethod) -> ChoicesDecision:
        """select, awaited."""
        return await asyncio.to_thread(self.select, prompt, choices, choices_method)

    def with_session(self) -> tuple[Backend, Callable[[], None]] | None:
        """For one program run: a view of this backend whose calls share one engine session (the
        context each gen ends with stays pinned while the program goes on), and the function
        that releases it. None when this backend has no sessions."""
        return None

    def role_prefix_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        """The chat template's text before and after a `role` message that follows `history`."""
        raise NotImplementedError(f"{type(self).__name__}.role_prefix_suffix")

    def default_system_prompt(self) -> str | None:
        """The system prompt the chat template adds when a chat has none (None: it adds none)."""
        return None

    def cache_prefix(self, prompt: str) -> None:
        """Prefill `prompt` into the backend's prefix cache (a hint; no output)."""
        raise NotImplementedError(f"{type(self).__name__}.cache_prefix")

    def flush_cache(self) -> bool:
        """Drop the prefix cache; False when refused (requests are in flight)."""
        raise NotImplementedError(f"{type(self).__name__} has no prefix cache to flush")

    def get_server_info(self) -> dict[str, Any]:
        """The configuration and live state of what serves this backend (SGLang's shape)."""
        raise NotImplementedError(f"{type(self).__name__}.get_server_info")

    def abort(self, rid: str) -> None:
        """Abort an in-flight request by id."""
        raise NotImplementedError(f"{type(self).__name__}.abort")

    def run_program_batch(self, graph: Graph, batch_arguments: list[dict[str, Any]],
                          defaults: dict[str, Any]) -> list[ProgramState] | None:
        """Run a traced program once per item where the model lives (one round trip for the whole
        batch); returns finished states in input order, or None when this backend cannot, in which
        case the caller runs the items itself."""
        return None
