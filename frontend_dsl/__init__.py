"""The forklm program language: SGLang's frontend API over forklm backends."""

from typing import TYPE_CHECKING, Any

from forklm.frontend_dsl.api import (
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    get_server_info,
    select,
    separate_reasoning,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from forklm.frontend_dsl.backends import (
    Backend,
    BackendError,
    EngineBackend,
    OpenAI,
    RuntimeEndpoint,
)
from forklm.frontend_dsl.choices import (
    ChoicesDecision,
    ChoicesSamplingMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from forklm.frontend_dsl.defaults import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from forklm.frontend_dsl.global_config import __version__ as __version__
from forklm.frontend_dsl.global_config import global_config
from forklm.frontend_dsl.interpreter import GraphProgram
from forklm.frontend_dsl.ir import Graph, ProgramLimitError, ProgramLimits
from forklm.frontend_dsl.program import Program
from forklm.frontend_dsl.program_file import load_program_file, run_program_file
from forklm.frontend_dsl.state import ProgramState, ProgramStateGroup
from forklm.frontend_dsl.textual import ProgramSyntaxError, parse_program
from forklm.frontend_dsl.tracer import TraceError

__all__ = [
    "REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR", "Backend", "BackendError",
    "ChoicesDecision", "ChoicesSamplingMethod", "EngineBackend", "Graph", "GraphProgram", "OpenAI",
    "Program", "ProgramLimitError", "ProgramLimits", "ProgramState", "ProgramSyntaxError",
    "ProgramStateGroup", "Runtime", "RuntimeEndpoint", "TraceError", "assistant",
    "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int", "gen_string",
    "get_default_backend", "get_server_info", "global_config", "greedy_token_selection",
    "load_program_file", "parse_program", "run_program_file", "select", "separate_reasoning",
    "set_default_backend", "system", "system_begin", "system_end", "token_length_normalized",
    "unconditional_likelihood_normalized", "user", "user_begin", "user_end",
]

if TYPE_CHECKING:
    from forklm.server.local_runtime import Runtime


def __getattr__(name: str) -> Any:
    """`Runtime` (a local server process) loads with the server on first use."""
    if name != "Runtime":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from forklm.frontend_dsl import backends

    runtime = backends.Runtime
    globals()[name] = runtime
    return runtime
