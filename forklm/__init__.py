"""forklm: a structured-generation program runtime for LLMs.

Public API re-exports live here; the engine is in forklm.runtime, the language in forklm.frontend_dsl.
"""

from __future__ import annotations

import os

# OpenMP threads that spin while idle make the engine ~15x slower when another process (or the
# HTTP server's threads) share the cores; this must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from forklm.frontend_dsl import (  # noqa: E402
    Backend,
    EngineBackend,
    ProgramState,
    assistant,
    assistant_begin,
    assistant_end,
    function,
    gen,
    gen_int,
    gen_string,
    greedy_token_selection,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    token_length_normalized,
    unconditional_likelihood_normalized,
    user,
    user_begin,
    user_end,
)
from forklm.runtime.config import EngineConfig  # noqa: E402
from forklm.runtime.engine import Engine  # noqa: E402
from forklm.runtime.errors import (  # noqa: E402
    EngineShutdownError,
    ForkLMError,
    InvalidArgumentError,
    ModelNotFoundError,
)
from forklm.runtime.sampling import SamplingParams  # noqa: E402

__all__ = [
    "Backend",
    "Engine",
    "EngineBackend",
    "ProgramState",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
    "EngineConfig",
    "EngineShutdownError",
    "ForkLMError",
    "InvalidArgumentError",
    "ModelNotFoundError",
    "SamplingParams",
]
