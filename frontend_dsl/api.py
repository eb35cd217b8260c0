"""The language's public functions, with SGLang's names, parameters and positional order."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from forklm.frontend_dsl.choices import ChoicesSamplingMethod, token_length_normalized
from forklm.frontend_dsl.defaults import DTYPE_RULES
from forklm.frontend_dsl.expr import ExprList
from forklm.frontend_dsl.ir import Gen, RoleBegin, RoleEnd, Select
from forklm.frontend_dsl.program import (
    Program,
    as_backend,
    current_default_backend,
    get_default_backend,
    set_default_backend,
)
from forklm.parsers.reasoning import REASONING_PARSERS
from forklm.runtime.engine.engine_request import LOGPROB_OPTIONS, LogprobOptions
from forklm.runtime.errors import InvalidArgumentError

__all__ = [
    "assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int",
    "gen_string", "get_default_backend", "get_server_info", "select", "separate_reasoning",
    "set_default_backend", "system", "system_begin", "system_end", "user", "user_begin",
    "user_end",
]

# gen's argument names that SamplingParams spells differently; every other sampling argument of
# gen is passed to SamplingParams under its own name (regex/json_schema/ebnf included).
_GEN_TO_SAMPLING = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
_NOT_SAMPLING = ("name", "dtype", "choices", "choices_method", *LOGPROB_OPTIONS)
_DTYPES = (int, float, str, bool)  # as types or by name


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None
             ) -> Any:
    """`@function` or `@function(...)`: turn `def prog(s, ...)` into a runnable Program."""
    if func is None:
        return lambda f: Program(f, num_api_spec_tokens)
    return Program(func, num_api_spec_tokens)


def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None, stop_regex: str | list[str] | None = None,
        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
        min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None,
        return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | str | None = None, regex: str | None = None,
        json_schema: str | None = None, ebnf: str | None = None) -> Gen | Select:
    """Generate text into variable `name`. `None` inherits the run's defaults (SamplingParams'
    defaults otherwise: 128 new tokens, temperature 1.0). `n` > 1 makes the variable a list of n
    samples (the text continues with the first); `stop_regex` ends the output at a match.
    `choices` makes it a select; `dtype` (int, float, str, bool) constrains the text with a
    regex and stop strings."""
    args = dict(locals())
    if choices:
        if n not in (None, 1):
            raise InvalidArgumentError("n", n, "a select (gen with choices) picks one choice")
        return select(name, choices, temperature or 0.0,
                      choices_method or token_length_normalized)
    if regex is not None:
        _check_regex(regex)
    if dtype in _DTYPES:
        dtype = dtype.__name__
    if dtype is not None and dtype not in DTYPE_RULES:
        raise InvalidArgumentError("dtype", dtype, "must be int, float, str or bool")
    sampling = {_GEN_TO_SAMPLING.get(k, k): v for k, v in args.items()
                if k not in _NOT_SAMPLING and v is not None}
    options = LogprobOptions(**{k: args[k] for k in LOGPROB_OPTIONS})
    return Gen(name, sampling, options, dtype)


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
            stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
            stop_regex: str | list[str] | None = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            frequency_penalty: float | None = None, presence_penalty: float | None = None,
            ignore_eos: bool | None = None, return_logprob: bool | None = None,
            logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
            return_text_in_logprobs: bool | None = None,
            min_tokens: int | None = None) -> Gen:
    """gen(..., dtype=int): an integer (the variable holds its text)."""
    out = gen(**locals(), dtype=int)
    assert isinstance(out, Gen)
    return out


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None,
               stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
               stop_regex: str | list[str] | None = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               ignore_eos: bool | None = None, return_logprob: bool | None = None,
               logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
               return_text_in_logprobs: bool | None = None,
               min_tokens: int | None = None) -> Gen:
    """gen(..., dtype=str): a double-quoted string of word characters and spaces."""
    out = gen(**locals(), dtype=str)
    assert isinstance(out, Gen)
    return out


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Gen:
    """Wrap a named gen so that its reasoning (`<think>...</think>`, read by the `model_type`
    parser: qwen3 or deepseek-r1) goes to variable `{name}_reasoning_content`; the variable
    `name` and the program's text get only the rest. Streams hold the reasoning back."""
    if not isinstance(expr, Gen):
        raise InvalidArgumentError("expr", expr, "separate_reasoning wraps a gen(...)")
    if expr.name is None:
        raise InvalidArgumentError("expr", expr, "name must be provided: the gen needs a name "
                                   "to name its reasoning variable")
    if model_type not in REASONING_PARSERS:
        raise InvalidArgumentError("model_type", model_type,
                                   "expected one of " + ", ".join(REASONING_PARSERS))
    return dataclasses.replace(expr, separate_reasoning=model_type)


def flush_cache(backend: Any = None) -> bool:
    """Drop the prefix cache of `backend` (default: the default backend; when none exists yet
    there is nothing cached and this returns True). False when refused: requests in flight."""
    if backend is None and current_default_backend() is None:
        return True
    return as_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    """The configuration and live state (`internal_states`) of `backend`'s engine or server
    (default: the default backend)."""
    return as_backend(backend).get_server_info()


def select(name: str | None = None, choices: list[str] | None = None,
           temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod | str = token_length_normalized) -> Select:
    """Append the choice that `choices_method` (a method, or a built-in's name) ranks best,
    scored in one engine call."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidArgumentError("choices", choices, "must be a non-empty list of str")
    if temperature is None:
        temperature = 0.0
    if temperature > 1e-5:
        raise InvalidArgumentError("temperature", temperature, "select supports greedy (0) only")
    return Select(name, list(choices), temperature, choices_method)


def _check_regex(regex: str) -> None:
    try:
        re.compile(regex)
    except re.error as e:
        raise InvalidArgumentError("regex", regex, f"not a valid regular expression: {e}") from e


def _role(role: str, expr: Any) -> ExprList:
    return ExprList([RoleBegin(role), *([] if expr is None else [expr]), RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


# The calls a textual program writes as `KEYWORD NAME key=value...` (program.lark's CALL),
# built with these functions: the same names, defaults and validation as in Python.
TEXT_CALLS: dict[str, Callable[..., Any]] = {"gen": gen, "select": select}
