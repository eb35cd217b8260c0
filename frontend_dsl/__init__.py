"""The forklm program language: SGLang's frontend API over forklm backends.

Its names load on first use (PEP 562): a server that imports one module of the language (its
program endpoint's) does not load the HTTP client, the OpenAI backend and the program-file
parser with it (~50 ms of `forklm serve`'s start-up)."""

import importlib
from typing import TYPE_CHECKING, Any

# Eager: the name is also its module's, which an import of that module would leave here.
from forklm.frontend_dsl.global_config import __version__ as __version__
from forklm.frontend_dsl.global_config import global_config

# module -> the public names it defines
_MODULES = {
    "api": ("assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen",
            "gen_int", "gen_string", "get_default_backend", "get_server_info", "select",
            "separate_reasoning", "set_default_backend", "system", "system_begin", "system_end",
            "user", "user_begin", "user_end"),
    "backends": ("Backend", "BackendError", "EngineBackend", "OpenAI", "Runtime",
                 "RuntimeEndpoint"),
    "choices": ("ChoicesDecision", "ChoicesSamplingMethod", "greedy_token_selection",
                "token_length_normalized", "unconditional_likelihood_normalized"),
    "defaults": ("REGEX_BOOL", "REGEX_FLOAT", "REGEX_INT", "REGEX_STR"),
    "interpreter": ("GraphProgram",),
    "ir": ("Graph", "ProgramLimitError", "ProgramLimits"),
    "program": ("Program",),
    "program_file": ("load_program_file", "run_program_file"),
    "state": ("ProgramState", "ProgramStateGroup"),
    "textual": ("ProgramSyntaxError", "parse_program"),
    "tracer": ("TraceError",),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

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

if TYPE_CHECKING:  # what __getattr__ gives, for type checkers
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
    from forklm.frontend_dsl.interpreter import GraphProgram
    from forklm.frontend_dsl.ir import Graph, ProgramLimitError, ProgramLimits
    from forklm.frontend_dsl.program import Program
    from forklm.frontend_dsl.program_file import load_program_file, run_program_file
    from forklm.frontend_dsl.state import ProgramState, ProgramStateGroup
    from forklm.frontend_dsl.textual import ProgramSyntaxError, parse_program
    from forklm.frontend_dsl.tracer import TraceError
    from forklm.server.local_runtime import Runtime


def __getattr__(name: str) -> Any:
    """A public name, from its module on first use (`Runtime`, a local server process, from
    the server's modules)."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
