"""Graph <-> JSON dicts, strictly validated (a graph from the network is untrusted data). Errors
name the path of the bad field, e.g. `nodes[2].branches[1][0].op`."""

from __future__ import annotations

import dataclasses
import json
import keyword
from collections.abc import Callable
from typing import Any

from forklm.frontend_dsl import ir
from forklm.frontend_dsl.defaults import DTYPE_RULES
from forklm.frontend_dsl.ir import value_chars
from forklm.frontend_dsl.limits import BuildBudget
from forklm.parsers.reasoning import REASONING_PARSERS
from forklm.runtime.engine.engine_request import LOGPROB_OPTIONS
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams

DTYPES = tuple(DTYPE_RULES)
_MISSING = object()
_BLOCK = "list[Node]"  # a field of this type is a nested block
_BRANCHES = "list[list[Node]]"  # a fork's branches, one block per `size`


# -- to dict -----------------------------------------------------------------------------------
def node_to_dict(node: ir.Node) -> dict[str, Any]:
    """The node as JSON values, field by field; InvalidArgumentError for a select whose
    choices_method is an object (JSON names only the built-ins)."""
    out: dict[str, Any] = {"op": node.op, "id": node.id}
    for f in dataclasses.fields(node):
        if f.name != "id":
            out[f.name] = _encode(node, f, getattr(node, f.name))
    return out


def _encode(node: ir.Node, f: dataclasses.Field[Any], value: Any) -> Any:
    if f.type == _BLOCK:
        return [node_to_dict(n) for n in value]
    if f.type == _BRANCHES:
        return [[node_to_dict(n) for n in branch] for branch in value]
    if isinstance(value, ir.LogprobOptions):
        return value.to_dict()
    if f.name == "choices_method" and not isinstance(value, str):
        raise _bad("choices_method", value, f"select {getattr(node, 'name', None)!r} has a "
                   f"custom choices method; a graph can name only {ir.CHOICES_METHODS}")
    return value


def graph_to_dict(graph: ir.Graph) -> dict[str, Any]:
    return {"format": ir.FORMAT, "name": graph.name, "args": list(graph.args),
            "arg_defaults": dict(graph.arg_defaults),
            "nodes": [node_to_dict(n) for n in graph.nodes]}


# -- from dict (validated) ---------------------------------------------------------------------
def _bad(path: str, value: Any, why: str) -> InvalidArgumentError:
    return InvalidArgumentError(path, value, why)


def _str(path: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _bad(path, v, "must be a string")
    return v


def _name(path: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise _bad(path, v, "must be a non-empty string")
    return v


def _pos_int(path: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise _bad(path, v, "must be an int >= 1")
    return v


def _one_of(options: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(path: str, v: Any) -> str:
        if v not in options:
            raise _bad(path, v, f"must be one of {list(options)}")
        return str(v)
    return check


def _sampling(path: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(path, v, "must be an object of SamplingParams fields")
    value_chars(v, path)  # a schema nested past the stack is refused before anything recurses
    try:
        SamplingParams.from_dict(v)
    except (InvalidArgumentError, TypeError, ValueError) as e:
        raise _bad(path, v, f"invalid sampling parameters: {e}") from e
    return dict(v)


def _logprob_options(path: str, v: Any) -> ir.LogprobOptions:
    if not isinstance(v, dict) or any(k not in LOGPROB_OPTIONS for k in v):
        raise _bad(path, v, f"must be an object with keys among {list(LOGPROB_OPTIONS)}")
    return ir.LogprobOptions(**v)


def _choices(path: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
        raise _bad(path, v, "must be a non-empty list of strings")
    return list(v)


def _temperature(path: str, v: Any) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1e-5:
        raise _bad(path, v, "select supports greedy (0) only")
    return float(v)


def _state(path: str, v: Any) -> list[int] | None:
    ok = v is None or (isinstance(v, list) and len(v) in (0, 2)
                       and all(isinstance(x, int) and x >= 0 for x in v))
    if not ok:
        raise _bad(path, v, "must be null, [] (the root) or [fork_id, branch]")
    return v


def _json_value(path: str, v: Any) -> Any:
    value_chars(v, path)  # bounded depth first: json.dumps recurses
    try:
        json.dumps(v)
    except (TypeError, ValueError) as e:
        raise _bad(path, v, "must be a JSON value") from e
    return v


def _fork_ref(path: str, v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _bad(path, v, "must be the id of a fork node")
    return v


def _nodes(path: str, v: Any, budget: BuildBudget, depth: int) -> list[ir.Node]:
    budget.check_depth(depth)
    if not isinstance(v, list):
        raise _bad(path, v, "must be a list of nodes")
    return [node_from_dict(f"{path}[{i}]", d, budget, depth) for i, d in enumerate(v)]


def _branches(path: str, v: Any, size: int, budget: BuildBudget, depth: int
              ) -> list[list[ir.Node]]:
    if not isinstance(v, list):
        raise _bad(path, v, "must be a list of node lists (one per branch)")
    budget.check_fork(size, path.rsplit(".", 1)[0])
    if len(v) != size:
        raise _bad(path, len(v), f"a fork of size {size} needs {size} branches")
    return [_nodes(f"{path}[{i}]", b, budget, depth) for i, b in enumerate(v)]


# Each node field's check, by field name; a field typed `X | None` also takes null.
_FIELDS: dict[str, Callable[[str, Any], Any]] = {
    "name": _name, "text": _str, "sampling": _sampling, "logprob_options": _logprob_options,
    "dtype": _one_of(DTYPES), "separate_reasoning": _one_of(tuple(REASONING_PARSERS)),
    "choices": _choices, "temperature": _temperature,
    "choices_method": _one_of(ir.CHOICES_METHODS), "role": _one_of(ir.ROLES),
    "state": _state, "value": _json_value, "source": _one_of(ir.SET_SOURCES),
    "size": _pos_int, "count": _pos_int, "fork": _fork_ref,
    "mode": _one_of(ir.JOIN_MODES), "var": _name, "equals": _str,
}


def node_from_dict(path: str, d: Any, budget: BuildBudget | None = None,
                   depth: int = 0) -> ir.Node:
    """One node (its blocks at `depth` + 1), counted against `budget` as it is decoded."""
    budget = budget or BuildBudget()
    if not isinstance(d, dict):
        raise _bad(path, d, "must be a node object")
    cls = ir.NODE_TYPES.get(d.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise _bad(f"{path}.op", d.get("op"), f"unknown node op; known: {sorted(ir.NODE_TYPES)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(d) - set(fields) - {"op"}
    if unknown:
        raise _bad(f"{path}.{sorted(unknown)[0]}", d[sorted(unknown)[0]],
                   f"not a field of a {cls.op} node")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        value = d.get(name, _MISSING)
        if value is _MISSING:
            has_default = (f.default is not dataclasses.MISSING
                           or f.default_factory is not dataclasses.MISSING)
            if name == "id" or has_default:
                continue
            raise _bad(f"{path}.{name}", None, f"missing in a {cls.op} node")
        if name == "id":
            kwargs[name] = value if isinstance(value, int) else -1
        elif f.type not in (_BLOCK, _BRANCHES):  # blocks: once the node's own fields are valid
            nullable = value is None and "None" in str(f.type)
            kwargs[name] = None if nullable else _FIELDS[name](f"{path}.{name}", value)
    for name, f in fields.items():
        if f.type == _BRANCHES:
            kwargs[name] = _branches(f"{path}.{name}", d.get(name), kwargs["size"], budget,
                                     depth + 1)
        elif f.type == _BLOCK and name in d:
            kwargs[name] = _nodes(f"{path}.{name}", d[name], budget, depth + 1)
    node = cls(**kwargs)
    budget.add(node)
    return node


def graph_from_dict(d: Any, limits: ir.ProgramLimits | None = None) -> ir.Graph:
    """A validated graph; its nodes are counted against `limits` as they are decoded."""
    if not isinstance(d, dict):
        raise _bad("graph", d, "must be a JSON object")
    if d.get("format", ir.FORMAT) != ir.FORMAT:
        raise _bad("format", d.get("format"), f"expected {ir.FORMAT!r}")
    unknown = set(d) - {"format", "name", "args", "arg_defaults", "nodes"}
    if unknown:
        raise _bad(sorted(unknown)[0], d[sorted(unknown)[0]], "not a field of a graph")
    name = _name("name", d.get("name"))
    args = d.get("args", [])
    if not isinstance(args, list) or not all(_is_arg_name(a) for a in args):
        raise _bad("args", args, "must be a list of distinct identifiers (not Python keywords)")
    if len(set(args)) != len(args):
        raise _bad("args", args, "has a repeated argument name")
    defaults = d.get("arg_defaults", {})
    if not isinstance(defaults, dict) or not set(defaults) <= set(args):
        raise _bad("arg_defaults", defaults, "must map some of `args` to default values")
    value_chars(defaults, "arg_defaults")
    nodes = _nodes("nodes", d.get("nodes"), BuildBudget(limits), depth=0)
    graph = ir.Graph(name, list(args), nodes, dict(defaults))
    check_references(graph)
    return graph


def _is_arg_name(a: Any) -> bool:
    return isinstance(a, str) and a.isidentifier() and not keyword.iskeyword(a)


def check_references(graph: ir.Graph) -> None:
    """Ids are unique; arguments, fork ids and breaks refer to something that exists."""
    forks = {n.id: n for n in ir.walk(graph.nodes) if isinstance(n, ir.Fork)}
    seen: set[int] = set()
    for node in ir.walk(graph.nodes):
        if node.id in seen or node.id < 0:
            raise _bad(f"node %{node.id} ({node.op}).id", node.id, "node ids must be unique and "
                       ">= 0 (Graph.normalized() numbers them)")
        seen.add(node.id)
        bad = node.bad_reference(graph.args, forks)
        if bad is not None:
            field, value, why = bad
            raise _bad(f"node %{node.id} ({node.op}).{field}", value, why)
    _check_breaks(graph.nodes, in_loop=False)


def _check_breaks(nodes: list[ir.Node], in_loop: bool) -> None:
    for node in nodes:
        if isinstance(node, ir.Break) and not in_loop:
            raise _bad(f"node %{node.id} (break)", None, "break outside a repeat block")
        for block in node.blocks():
            _check_breaks(block, isinstance(node, ir.Repeat) or (
                in_loop and not isinstance(node, ir.Fork)))
