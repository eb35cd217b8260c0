"""What a program state accepts: `s += expr` takes a str, a node (ir.py) or an ExprList of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Expr:
    """What a program state accepts (`s += expr`): `a + b` (either side may be a str) is an
    ExprList, as in SGLang."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, other])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([other, self])


@dataclass(frozen=True)
class ExprList(Expr):
    """Several expressions appended in order (what `user("...")` returns)."""

    exprs: list[Any]


def flatten(expr: Any) -> list[Any]:
    """Nodes in append order; a str stays a str. Raises ValueError for what cannot be appended."""
    if isinstance(expr, ExprList):
        return [node for e in expr.exprs for node in flatten(e)]
    if isinstance(expr, (str, Expr)):
        return [expr]
    raise cannot_append(expr)


def cannot_append(expr: Any) -> ValueError:
    if expr is None:
        return ValueError("Tried to append None to state.")
    return ValueError(f"cannot append {type(expr).__name__} {expr!r} to a program state; "
                      "append a str or a gen/select/role expression")
