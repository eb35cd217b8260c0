"""The expression nodes a program appends to its state (`s += node`); api.py builds them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# dtype -> (regex, extra stop strings), as SGLang's RuntimeEndpoint rewrites `gen(dtype=...)`.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_RULES: dict[Any, tuple[str, list[str]]] = {
    int: (REGEX_INT, [" ", "\n"]),
    float: (REGEX_FLOAT, [" ", "\n"]),
    str: (REGEX_STR, []),
    bool: (REGEX_BOOL, []),
}
DTYPE_RULES.update({t.__name__: rule for t, rule in list(DTYPE_RULES.items())})

# Request options of a gen that are not SamplingParams fields (they shape the engine call).
LOGPROB_OPTIONS = ("return_logprob", "logprob_start_len", "top_logprobs_num")


class Expr:
    """Base of the nodes: `a + b` (either side may be a str) is an ExprList, as in SGLang."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, other])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([other, self])


@dataclass(frozen=True)
class Gen(Expr):
    """Generate a continuation of the state's text; `sampling` holds SamplingParams-named overrides
    (only the fields the program set; the rest inherit the run's defaults)."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprob_options: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None


@dataclass(frozen=True)
class Select(Expr):
    """Append the best of `choices` as scored by `choices_method` (greedy only)."""

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: Callable[..., Any]


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(frozen=True)
class VarScopeEnd(Expr):
    name: str


@dataclass(frozen=True)
class SetVar(Expr):
    """`s[name] = value`, ordered with the program's other appends."""

    name: str
    value: Any


@dataclass(frozen=True)
class ExprList(Expr):
    """Several nodes appended in order (what `user("...")` returns)."""

    exprs: list[Any]




def flatten(expr: Any) -> list[Any]:
    """Nodes in append order; a str stays a str. Raises ValueError for what cannot be appended."""
    if expr is None:
        raise ValueError("Tried to append None to state.")
    if isinstance(expr, ExprList):
        return [node for e in expr.exprs for node in flatten(e)]
    if isinstance(expr, (str, Expr)):
        return [expr]
    raise ValueError(f"cannot append {type(expr).__name__} {expr!r} to a program state; "
                     "append a str or a gen/select/role expression")

