"""Tracing: run a Python program on a recording state to get its request graph, with no model.

Arguments not given to `trace()` are placeholders: appending one (also inside an f-string, where
it formats to a marker that is split back out) records an `arg` node. `s[name]` of a generated
value is a placeholder too: appending it records a `read`; formatting it, comparing it or
branching on it raises TraceError, because then the program's text or control flow depends on
what the model generates and no fixed graph describes it.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import re
import secrets
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from forklm.frontend_dsl import ir
from forklm.frontend_dsl.expr import Expr, flatten
from forklm.frontend_dsl.ir_codec import node_to_dict
from forklm.frontend_dsl.state import BranchGroup, ChatBlocks, check_fork
from forklm.runtime.errors import ForkLMError, InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams

if TYPE_CHECKING:
    from forklm.frontend_dsl.program import Program

class TraceError(ForkLMError, TypeError):
    """The program cannot be turned into a graph (its control flow or text depends on a value that
    exists only at run time); run it directly instead."""


class _Placeholder(Expr):
    """A value that exists only at run time; any use but appending it raises TraceError."""

    def __init__(self, name: str, why: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_why", why)

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise TraceError(f"{self._why}: the program's control flow depends on it, so it cannot "
                         "be traced")

    __bool__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse  # type: ignore
    __iter__ = __len__ = __contains__ = __getitem__ = __int__ = __float__ = _refuse  # type: ignore
    __index__ = __call__ = _refuse  # type: ignore
    __hash__ = object.__hash__

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._refuse()


class ArgRef(_Placeholder):
    """A program argument not given to trace(); formats to a marker inside strings."""

    def __init__(self, name: str, marker: str):
        super().__init__(name, f"argument {name!r} is a placeholder while tracing")
        object.__setattr__(self, "marker", marker)

    def __str__(self) -> str:
        return self.marker  # type: ignore[attr-defined, no-any-return]

    def __repr__(self) -> str:
        raise TraceError(f"repr() of argument {self._name!r} while tracing; only plain {{arg}} "
                         "interpolation can be traced")

    def __format__(self, spec: str) -> str:
        if spec:
            raise TraceError(f"argument {self._name!r} is formatted with {spec!r} while tracing; "
                             "only plain {arg} interpolation can be traced")
        return str(self)


class VarRef(_Placeholder):
    """`s[name]` of a value generated at run time, read from the state at `state` (a path)."""

    def __init__(self, name: str, state: list[int]):
        super().__init__(name, f"the value of {name!r} is generated at run time")
        object.__setattr__(self, "state", state)

    def _no_format(self, *_: Any) -> str:
        raise TraceError(f"the value of {self._name!r} is generated at run time; append "
                         f"s[{self._name!r}] instead of formatting it into a string")

    __str__ = __format__ = __repr__ = _no_format  # type: ignore


class _Trace:
    """What one trace shares: the argument markers and node ids."""

    def __init__(self, awaited_reads: bool = False) -> None:
        self.awaited_reads = awaited_reads  # an async program: its reads are awaited
        self.nonce = secrets.token_hex(4)
        self.ids = itertools.count()
        self.marker_re = re.compile(f"\x00{self.nonce}:([^\x00]*)\x00")
        self.joined: set[int] = set()

    def marker(self, name: str) -> str:
        return f"\x00{self.nonce}:{name}\x00"

    def node(self, node: ir.Node) -> ir.Node:
        node.id = next(self.ids)
        return node

    def read(self, value: Any) -> Any:
        """What a read of the state returns: the value, or one an async program can await."""
        return _Ready(value) if self.awaited_reads else value


class _Ready:
    """An awaitable that is done at once (an async program's read while tracing)."""

    def __init__(self, value: Any):
        self.value = value

    def __await__(self) -> Iterator[Any]:
        return self.value  # type: ignore[no-any-return]
        yield  # a generator that returns at once: awaiting it never suspends


def split_markers(text: str, marker_re: re.Pattern[str]) -> list[ir.Node]:
    """A string with argument markers -> alternating text and arg nodes."""
    parts = marker_re.split(text)  # [text, arg, text, arg, ..., text]
    return [ir.Text(p) if i % 2 == 0 else ir.Arg(p) for i, p in enumerate(parts) if p or i % 2]


class TracerState(ChatBlocks):
    """Stands in for ProgramState while tracing: records nodes instead of running them."""

    def __init__(self, trace: _Trace, path: list[int], known: dict[str, Any] | None = None):
        self._trace, self._path = trace, path
        self.nodes: list[ir.Node] = []
        self._known = dict(known or {})  # variables set to literals: readable while tracing
        self._produced: set[str] = set()  # what a join turns into lists on the parent

    def __iadd__(self, expr: Any) -> TracerState:
        if self._path and self._path[0] in self._trace.joined:
            raise TraceError("appending to a fork branch after its join() cannot be traced")
        for item in flatten(expr):
            for node in self._convert(item):
                self.nodes.append(self._trace.node(node))
        return self

    def _convert(self, item: Any) -> list[ir.Node]:
        if isinstance(item, str):
            return split_markers(item, self._trace.marker_re)
        if isinstance(item, ArgRef):
            return [ir.Arg(item._name)]
        if isinstance(item, VarRef):
            return [ir.Read(item._name, None if item.state == self._path else item.state)]
        if isinstance(item, ir.SetVar):
            return [self._set_node(item.name, item.value)]
        return [self._record(item)]

    def _record(self, node: Any) -> ir.Node:
        """A copy of the appended node for the graph (the program may append one node twice);
        TraceError if a graph cannot hold it."""
        if not isinstance(node, ir.Node) or not node.appendable:
            raise TraceError(f"cannot put {node!r} in a graph")
        if isinstance(node, ir.Gen):
            self._check_no_markers(node.sampling)
            SamplingParams.from_dict(node.sampling)  # invalid settings fail here, not at run time
        try:
            node_to_dict(node)
        except InvalidArgumentError as e:  # e.g. a custom choices_method, which JSON cannot name
            raise TraceError(str(e)) from e
        for name in node.produced_names():
            self._known.pop(name, None)
            self._produced.add(name)
        return copy.deepcopy(node)

    def _check_no_markers(self, value: Any) -> None:
        if self._trace.marker_re.search(json.dumps(value, default=str)):
            raise TraceError("a gen's settings depend on a program argument; this cannot be traced")

    def _set_node(self, name: str, value: Any) -> ir.Node:
        self._known.pop(name, None)
        self._produced.add(name)
        if isinstance(value, ArgRef):
            return ir.SetVar(name, value._name, "arg")
        if isinstance(value, VarRef):
            return ir.SetVar(name, value._name, "var", None if value.state == self._path
                             else value.state)
        self._check_no_markers(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise TraceError(f"s[{name!r}] is set to {type(value).__name__}, not a JSON value; "
                             "a graph cannot hold it") from e
        self._known[name] = value
        return ir.SetVar(name, value)

    # -- the ProgramState surface --------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        if name in self._known:
            return self._trace.read(self._known[name])
        return self._trace.read(VarRef(name, self._path))

    get_var = __getitem__

    def __setitem__(self, name: str, value: Any) -> None:
        self += ir.SetVar(name, value)

    set_var = __setitem__

    def _run_time_only(self, what: str) -> Any:
        raise TraceError(f"s.{what} exists only at run time; a program that uses it while running "
                         "cannot be traced")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return self._run_time_only(attr)  # e.g. text_async_iter: exists only at run time

    def __contains__(self, name: str) -> bool:
        return self._run_time_only("__contains__")  # type: ignore[no-any-return]

    def get_meta_info(self, name: str) -> Any:
        return self._run_time_only("get_meta_info()")

    def text(self) -> str:
        return self._run_time_only("text()")  # type: ignore[no-any-return]

    def messages(self) -> list[dict[str, str]]:
        return self._run_time_only("messages()")  # type: ignore[no-any-return]

    def variables(self) -> dict[Any, Any]:
        return self._run_time_only("variables()")  # type: ignore[no-any-return]

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        return self._run_time_only("text_iter()")  # type: ignore[no-any-return]

    def sync(self) -> Any:
        """Nothing runs while tracing, so there is nothing to wait for."""
        return self._trace.read(None)

    def error(self) -> Any:
        return self._trace.read(None)

    def _append_node(self, expr: Any) -> None:
        self.__iadd__(expr)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TracerGroup:
        check_fork(size, position_ids_offset)
        node = self._trace.node(ir.Fork(size, []))
        assert isinstance(node, ir.Fork)
        children = [TracerState(self._trace, [node.id, i], self._known) for i in range(size)]
        node.branches = [child.nodes for child in children]
        self.nodes.append(node)
        return TracerGroup(children, self, node.id)



class TracerGroup(BranchGroup["TracerState"]):
    """What `s.fork(n)` returns while tracing."""

    def __init__(self, states: list[TracerState], parent: TracerState, fork_id: int):
        self.states, self.parent, self.fork_id = states, parent, fork_id

    def join(self, mode: str = "gather_variable") -> Any:
        self._check_mode(mode)
        self.parent._trace.joined.add(self.fork_id)
        self.parent.nodes.append(self.parent._trace.node(ir.Join(self.fork_id, mode)))
        for state in self.states:  # what a branch set is now a (run-time) list on the parent
            for name in state._produced:
                self.parent._known.pop(name, None)
                self.parent._produced.add(name)
        return self.parent._trace.read(None)


def trace_program(program: Program, arguments: dict[str, Any],
                  prefix_only: bool = False) -> ir.Graph:
    """The graph of `program`; arguments not in `arguments` become the graph's arguments. With
    `prefix_only`, a program that cannot be traced to its end gives the graph of what it
    appended before the step that cannot be traced (what `Program.cache` needs)."""
    name = program.func.__name__
    params = list(program.signature.parameters.values())[1:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TraceError(f"{name} takes *{p.name}; only named arguments can be traced")
    given = {**program.bind_arguments, **arguments}
    unknown = sorted(set(given) - set(program.arg_names))
    if unknown:
        raise InvalidArgumentError(unknown[0], given[unknown[0]],
                                   f"not an argument of {name} {program.arg_names}")
    trace = _Trace(awaited_reads=program.is_async)
    values, args, defaults = dict(given), [], {}
    for p in params:
        if p.name in given:
            continue
        values[p.name] = ArgRef(p.name, trace.marker(p.name))
        args.append(p.name)
        if p.default is not inspect.Parameter.empty:
            defaults[p.name] = _json_default(name, p.name, p.default)
    root = TracerState(trace, [])
    try:
        body = program.func(root, **values)
        if program.is_async:
            _run_to_end(body)
    except TraceError:
        if not prefix_only:
            raise
    return ir.Graph(name, args, root.nodes, defaults).normalized()


def _run_to_end(body: Any) -> None:
    """Run an async program's body while tracing: its awaited reads return at once, so it never
    suspends; one that does awaits something else, which no graph can describe."""
    try:
        body.send(None)
    except StopIteration:
        return
    body.close()
    raise TraceError("the program awaits something other than its state's reads; it cannot be "
                     "traced")


def _json_default(program: str, arg: str, value: Any) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise TraceError(f"{program}: the default of {arg!r} is not a JSON value") from e
    return value
