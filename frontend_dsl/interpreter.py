"""GraphProgram: runs a request graph on the same executor as Python programs.

The graph's nodes are walked by a program body that appends to the ProgramState `s`, so run,
run_batch, the async twins, streaming and run defaults behave exactly as for `@function`
programs. `if` and `repeat` are decided at run time (reading `s[var]` waits for the value).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

from forklm.frontend_dsl import ir
from forklm.frontend_dsl.defaults import RunDefaults
from forklm.frontend_dsl.ir_codec import check_references
from forklm.frontend_dsl.program import IGNORED_RUN_OPTIONS, Program
from forklm.frontend_dsl.state import ProgramState, ProgramStateGroup
from forklm.runtime.errors import InvalidArgumentError


class _Run:
    """One execution of a graph: the argument values and the fork groups made so far."""

    def __init__(self, arguments: dict[str, Any]):
        self.args = arguments
        self.root: ProgramState | None = None
        self.groups: dict[int, ProgramStateGroup] = {}

    def block(self, nodes: list[ir.Node], s: ProgramState) -> bool:
        """Run `nodes` on `s` in order until a break is reached; then True (the enclosing repeat
        stops)."""
        return any(_STEPS.get(type(node), _Run._append)(self, node, s) for node in nodes)

    # -- the steps (see _STEPS); each returns True when a break ends the enclosing loop --------
    def _append(self, node: ir.Node, s: ProgramState) -> bool:
        s += node
        return False

    def _arg(self, node: ir.Arg, s: ProgramState) -> bool:
        s += str(self.args[node.name])
        return False

    def _read(self, node: ir.Read, s: ProgramState) -> bool:
        s += self.state(node.state, s)[node.name]
        return False

    def _set(self, node: ir.SetVar, s: ProgramState) -> bool:
        """A state sets values: an argument or variable named by the node is read first."""
        if node.source == "arg":
            node = ir.SetVar(node.name, self.args[node.value])
        elif node.source == "var":
            node = ir.SetVar(node.name, self.state(node.state, s)[node.value])
        s += node
        return False

    def _if(self, node: ir.If, s: ProgramState) -> bool:
        return self.block(node.then if s[node.var] == node.equals else node.orelse, s)

    def _repeat(self, node: ir.Repeat, s: ProgramState) -> bool:
        for _ in range(node.count):
            if self.block(node.body, s):
                break
        return False

    def _fork(self, node: ir.Fork, s: ProgramState) -> bool:
        group = s.fork(node.size)
        self.groups[node.id] = group
        for branch, state in zip(node.branches, group):
            self.block(branch, state)
        return False

    def _join(self, node: ir.Join, s: ProgramState) -> bool:
        self.group(node.fork).join(node.mode)
        return False

    def state(self, path: list[int] | None, s: ProgramState) -> ProgramState:
        if path is None:
            return s
        if not path:
            assert self.root is not None
            return self.root
        return self.group(path[0])[path[1]]

    def group(self, fork_id: int) -> ProgramStateGroup:
        if fork_id not in self.groups:
            raise InvalidArgumentError("fork", fork_id, "used before that fork node ran")
        return self.groups[fork_id]


# How the interpreter runs each node kind that a state does not simply append.
_STEPS: dict[type, Callable[[_Run, Any, ProgramState], bool]] = {
    ir.Arg: _Run._arg, ir.Read: _Run._read, ir.SetVar: _Run._set, ir.Break: lambda *_: True,
    ir.If: _Run._if, ir.Repeat: _Run._repeat, ir.Fork: _Run._fork, ir.Join: _Run._join,
}


class GraphProgram(Program):
    """A request graph as a runnable program: `GraphProgram(graph).run(question="...")`.
    Missing or unknown arguments raise InvalidArgumentError naming them."""

    def __init__(self, graph: ir.Graph, bind_arguments: dict[str, Any] | None = None):
        check_references(graph)
        self.graph = graph
        super().__init__(_make_body(graph), None, bind_arguments)

    def bind(self, **kwargs: Any) -> GraphProgram:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise InvalidArgumentError(unknown[0], kwargs[unknown[0]], f"not an argument of "
                                       f"program {self.graph.name} {self.arg_names}")
        return GraphProgram(self.graph, {**self.bind_arguments, **kwargs})

    def trace(self, **arguments: Any) -> ir.Graph:
        """The graph, with the bound arguments and those given here baked in as constants."""
        return bake_arguments(self.graph, {**self.bind_arguments, **arguments})

    def _prefix_graph(self) -> ir.Graph:
        return self.trace()

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> tuple[inspect.BoundArguments, RunDefaults]:
        known = set(self.arg_names) | RunDefaults.NAMES | IGNORED_RUN_OPTIONS
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise InvalidArgumentError(unknown[0], kwargs[unknown[0]], (
                f"neither an argument of program {self.graph.name} {self.arg_names} nor a run "
                "default (a SamplingParams field or logprob option)"))
        if len(args) > len(self.arg_names):
            raise InvalidArgumentError("args", args, f"program {self.graph.name} takes "
                                       f"{len(self.arg_names)} arguments {self.arg_names}")
        given = set(self.arg_names[:len(args)]) | set(kwargs) | set(self.bind_arguments)
        missing = [a for a in self.arg_names if a not in given and a not in self.graph.arg_defaults]
        if missing:
            raise InvalidArgumentError(missing[0], None, f"missing argument of program "
                                       f"{self.graph.name} {self.arg_names}")
        return super()._split(args, kwargs)


def bake_arguments(graph: ir.Graph, values: dict[str, Any]) -> ir.Graph:
    """A copy of `graph` in which the arguments in `values` are constants (as Program.trace)."""
    unknown = sorted(set(values) - set(graph.args))
    if unknown:
        raise InvalidArgumentError(unknown[0], values[unknown[0]],
                                   f"not an argument of program {graph.name} {graph.args}")
    if not values:
        return graph
    baked = copy.deepcopy(graph)

    def replace(nodes: list[ir.Node]) -> None:
        for i, node in enumerate(nodes):
            if isinstance(node, ir.Arg) and node.name in values:
                nodes[i] = ir.Text(str(values[node.name]), id=node.id)
            elif isinstance(node, ir.SetVar) and node.source == "arg" and node.value in values:
                nodes[i] = ir.SetVar(node.name, values[node.value], id=node.id)
            for block in node.blocks():
                replace(block)

    replace(baked.nodes)
    baked.args = [a for a in graph.args if a not in values]
    baked.arg_defaults = {k: v for k, v in graph.arg_defaults.items() if k not in values}
    return baked.normalized()


def _make_body(graph: ir.Graph) -> Any:
    """A `def body(s, <graph args>)` whose signature Program binds arguments against."""

    def body(s: ProgramState, *args: Any, **kwargs: Any) -> None:
        run = _Run({**graph.arg_defaults, **dict(zip(graph.args, args)), **kwargs})
        run.root = s
        run.block(graph.nodes, s)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("__forklm_state", kind)] + [
        inspect.Parameter(a, kind, default=graph.arg_defaults.get(a, inspect.Parameter.empty))
        for a in graph.args]
    try:
        body.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    except ValueError as e:  # a default before a required argument, a bad name
        raise InvalidArgumentError("args", graph.args, f"not a valid argument list: {e}") from e
    body.__name__ = graph.name
    return body
