"""The program language's nodes (what gen, select and the roles build and a program state runs)
and request graphs: a program as data, as tracing and the textual syntax both produce it.

Each node class carries what every concern needs of it: its one-line label (the text dump and
DOT), its nested blocks, and what it costs (the limits); the JSON codec reads its fields. A graph
read from JSON or text never runs Python (its selects name built-in choices methods); only an
in-process select may hold a method object, which the JSON codec refuses. `to_text()` is the
golden-file dump, `to_json()`/`from_json()` the wire form, `to_dot()` a Graphviz view.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from forklm.frontend_dsl.choices import BUILTIN_METHODS, ChoicesSamplingMethod, builtin_name
from forklm.frontend_dsl.expr import Expr
from forklm.runtime.engine.engine_request import LogprobOptions  # a gen's own, over its run's
from forklm.runtime.errors import InvalidArgumentError

JOIN_MODES = ("gather_variable", "concate_and_append")
CHOICES_METHODS = tuple(BUILTIN_METHODS)
ROLES = ("system", "user", "assistant")
SET_SOURCES = ("literal", "arg", "var")
DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default: what a gen without max_tokens may use
FORMAT = "forklm.graph/1"
MAX_VALUE_DEPTH = 64  # nested lists/objects in a JSON value (a set value, an argument, a schema)


class ProgramLimitError(InvalidArgumentError):
    """A graph asks for more than the ProgramLimits allow; `.name` is the limit's field name."""


def quote(v: Any) -> str:
    """A value as the text dump writes it (JSON, keys sorted)."""
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


def value_chars(value: Any, name: str, max_depth: int = MAX_VALUE_DEPTH) -> int:
    """Characters of the strings in a JSON-like value (keys included), walked without recursion;
    InvalidArgumentError naming `name` if lists/objects nest deeper than `max_depth` (deeper
    values would overflow the stack of whatever encodes, prints or copies them later)."""
    total, stack = 0, [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple, dict)):
            if depth >= max_depth:
                raise InvalidArgumentError(name, "...", f"lists/objects are nested deeper than "
                                           f"{max_depth}")
            items = list(v.items()) if isinstance(v, dict) else v
            stack.extend((item, depth + 1) for item in items)
    return total


@dataclass
class Node(Expr):
    """Base of the nodes; `id` is the node's position in a pre-order walk (see Graph). A field
    typed `list[Node]` is a nested block, `list[list[Node]]` a fork's branches."""

    op: ClassVar[str] = ""
    # A program appends it (`s += node`); the others are structure: arguments and reads the
    # interpreter resolves, blocks it walks, forks and joins a state's fork() and join() queue.
    appendable: ClassVar[bool] = True
    exclusive_blocks: ClassVar[bool] = False  # at most one of its blocks runs (an if)
    id: int = field(default=-1, kw_only=True)

    def label(self) -> str:
        """The node as `op(args)`, without id or blocks (the text dump and DOT)."""
        return self.op

    def blocks(self) -> list[list[Node]]:
        """The nested node lists, in execution (and numbering) order."""
        return []

    def titled_blocks(self) -> list[tuple[str, list[Node]]]:
        """The blocks the text dump lists, each under its title ("" = indented, untitled)."""
        return []

    def produced_names(self) -> list[str]:
        """Every variable the node sets when it runs."""
        return []

    @property
    def iterations(self) -> int:
        """How many times its blocks may run each time the node runs."""
        return 1

    def chars(self) -> int:
        """Characters of text, choices and values it holds (max_text_chars)."""
        return 0

    def requests(self, default_n: int) -> int:
        """Engine requests it has in flight at once (max_parallel_requests)."""
        return 0

    def total_requests(self, default_n: int) -> int:
        """Engine requests it issues in all (max_requests)."""
        return self.requests(default_n)

    def tokens(self, default_max_new_tokens: int, default_n: int) -> int:
        """Tokens it may generate (max_total_tokens)."""
        return 0

    def bad_reference(self, args: list[str], forks: dict[int, Fork]) -> tuple[str, Any, str] | None:
        """(field, value, why) when it names an argument or fork branch the graph lacks."""
        return None


@dataclass
class Text(Node):
    op: ClassVar[str] = "text"
    text: str

    def label(self) -> str:
        return f"text({quote(self.text)})"

    def chars(self) -> int:
        return len(self.text)


@dataclass
class Arg(Node):
    """Append the program argument `name` (as str)."""

    op: ClassVar[str] = "arg"
    appendable: ClassVar[bool] = False
    name: str

    def label(self) -> str:
        return f"arg({self.name})"

    def bad_reference(self, args: list[str], forks: dict[int, Fork]) -> tuple[str, Any, str] | None:
        if self.name not in args:
            return "name", self.name, f"not an argument of the graph {args}"
        return None


@dataclass
class Gen(Node):
    """Generate a continuation into variable `name`. `sampling` holds SamplingParams-named
    overrides (only those the program set; the rest inherit the run's defaults); `dtype` (int,
    float, str, bool by name) constrains the text with a regex and stop strings. With `n` > 1 the
    variable is the list of samples (the text continues with the first). `separate_reasoning`
    names a reasoning parser (`sgl.separate_reasoning`): the `<think>` part of the output goes to
    variable `{name}_reasoning_content`, only the rest to `name` and the text."""

    op: ClassVar[str] = "gen"
    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprob_options: LogprobOptions = field(default_factory=LogprobOptions)
    dtype: str | None = None
    separate_reasoning: str | None = None

    def label(self) -> str:
        opts = {**self.sampling, **self.logprob_options.to_dict()}
        parts = [quote(self.name)] + [f"{k}={quote(opts[k])}" for k in sorted(opts)]
        if self.dtype:
            parts.append(f"dtype={self.dtype}")
        if self.separate_reasoning:
            parts.append(f"separate_reasoning={self.separate_reasoning}")
        return f"gen({', '.join(parts)})"

    def produced_names(self) -> list[str]:
        if self.name is None:
            return []
        if self.separate_reasoning is not None:
            return [self.name, reasoning_name(self.name)]
        return [self.name]

    def chars(self) -> int:  # stop strings, regex, schema
        return value_chars(self.sampling, f"gen {self.name}")

    def requests(self, default_n: int) -> int:
        return int(self.sampling.get("n", default_n))

    def tokens(self, default_max_new_tokens: int, default_n: int) -> int:
        return self.requests(default_n) * int(
            self.sampling.get("max_new_tokens", default_max_new_tokens))


@dataclass
class Select(Node):
    """Append the best of `choices` as `choices_method` ranks them (greedy only): a built-in's
    name, or any other ChoicesSamplingMethod object (a built-in object is kept as its name)."""

    op: ClassVar[str] = "select"
    name: str | None
    choices: list[str]
    temperature: float = 0.0
    choices_method: str | ChoicesSamplingMethod = "token_length_normalized"

    def __post_init__(self) -> None:
        self.choices_method = builtin_name(self.choices_method) or self.choices_method

    def label(self) -> str:
        method = ("" if self.choices_method == "token_length_normalized"
                  else f", method={self.choices_method}")  # a custom method object: its repr
        return f"select({quote(self.name)}, choices={quote(self.choices)}{method})"

    def produced_names(self) -> list[str]:
        return [] if self.name is None else [self.name]

    def chars(self) -> int:
        return sum(len(c) for c in self.choices)

    def requests(self, default_n: int) -> int:
        return len(self.choices)

    def total_requests(self, default_n: int) -> int:
        """A method that rescores without the prompt scores every choice twice."""
        method = (BUILTIN_METHODS.get(self.choices_method)
                  if isinstance(self.choices_method, str) else None)
        rescored = method is not None and method.requires_unconditional_logprobs
        return len(self.choices) * (2 if rescored else 1)


@dataclass
class RoleBegin(Node):
    op: ClassVar[str] = "role_begin"
    role: str

    def label(self) -> str:
        return f"role_begin({self.role})"


@dataclass
class RoleEnd(Node):
    op: ClassVar[str] = "role_end"
    role: str

    def label(self) -> str:
        return f"role_end({self.role})"


@dataclass
class ScopeBegin(Node):
    """`with s.var_scope(name):` begins: what is appended until ScopeEnd becomes variable `name`."""

    op: ClassVar[str] = "scope_begin"
    name: str

    def label(self) -> str:
        return f"scope_begin({quote(self.name)})"


@dataclass
class ScopeEnd(Node):
    op: ClassVar[str] = "scope_end"
    name: str

    def label(self) -> str:
        return f"scope_end({quote(self.name)})"

    def produced_names(self) -> list[str]:
        return [self.name]


@dataclass
class Read(Node):
    """Append the value of variable `name` (waits until it exists). `state` names whose variable:
    None = this state, [] = the root state, [fork_id, branch] = a branch of that fork."""

    op: ClassVar[str] = "read"
    appendable: ClassVar[bool] = False
    name: str
    state: list[int] | None = None

    def label(self) -> str:
        return f"read({quote(self.name)}{_state_label(self.state)})"

    def bad_reference(self, args: list[str], forks: dict[int, Fork]) -> tuple[str, Any, str] | None:
        return _bad_state(self.state, forks)


@dataclass
class SetVar(Node):
    """`s[name] = value`: a JSON literal, or the argument / variable (of `state`) named by value."""

    op: ClassVar[str] = "set"
    name: str
    value: Any
    source: str = "literal"
    state: list[int] | None = None

    def label(self) -> str:
        src = "" if self.source == "literal" else f"{self.source}="
        return f"set({quote(self.name)}, {src}{quote(self.value)}{_state_label(self.state)})"

    def produced_names(self) -> list[str]:
        return [self.name]

    def chars(self) -> int:
        return value_chars(self.value, f"set {self.name}")

    def bad_reference(self, args: list[str], forks: dict[int, Fork]) -> tuple[str, Any, str] | None:
        if self.source == "arg" and self.value not in args:
            return "value", self.value, f"not an argument of the graph {args}"
        return _bad_state(self.state, forks)


@dataclass
class Fork(Node):
    """`s.fork(size)`: branch i runs `branches[i]` on its own copy of the state."""

    op: ClassVar[str] = "fork"
    appendable: ClassVar[bool] = False
    size: int
    branches: list[list[Node]]

    def label(self) -> str:
        return f"fork({self.size})"

    def blocks(self) -> list[list[Node]]:
        return self.branches

    def titled_blocks(self) -> list[tuple[str, list[Node]]]:
        return [(f"branch {i}:", branch) for i, branch in enumerate(self.branches)]


@dataclass
class Join(Node):
    op: ClassVar[str] = "join"
    appendable: ClassVar[bool] = False
    fork: int
    mode: str = "gather_variable"

    def label(self) -> str:
        mode = "" if self.mode == "gather_variable" else f", mode={quote(self.mode)}"
        return f"join(%{self.fork}{mode})"

    def bad_reference(self, args: list[str], forks: dict[int, Fork]) -> tuple[str, Any, str] | None:
        return None if self.fork in forks else ("fork", self.fork, "no fork node has this id")


@dataclass
class If(Node):
    """Run `then` when variable `var` (read when reached) equals `equals`, else `orelse`."""

    op: ClassVar[str] = "if"
    appendable: ClassVar[bool] = False
    exclusive_blocks: ClassVar[bool] = True
    var: str
    equals: str
    then: list[Node] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)

    def label(self) -> str:
        return f"if({self.var} == {quote(self.equals)})"

    def blocks(self) -> list[list[Node]]:
        return [self.then, self.orelse]

    def titled_blocks(self) -> list[tuple[str, list[Node]]]:
        return [("then:", self.then)] + ([("else:", self.orelse)] if self.orelse else [])


@dataclass
class Repeat(Node):
    """Run `body` up to `count` times; a Break inside it (not inside a fork) ends the loop."""

    op: ClassVar[str] = "repeat"
    appendable: ClassVar[bool] = False
    count: int
    body: list[Node] = field(default_factory=list)

    def label(self) -> str:
        return f"repeat({self.count})"

    def blocks(self) -> list[list[Node]]:
        return [self.body]

    def titled_blocks(self) -> list[tuple[str, list[Node]]]:
        return [("", self.body)]

    @property
    def iterations(self) -> int:
        return self.count


@dataclass
class Break(Node):
    op: ClassVar[str] = "break"
    appendable: ClassVar[bool] = False


NODE_TYPES: dict[str, type[Node]] = {t.op: t for t in (
    Text, Arg, Gen, Select, RoleBegin, RoleEnd, ScopeBegin, ScopeEnd, Read, SetVar, Fork, Join,
    If, Repeat, Break)}


def _state_label(state: list[int] | None) -> str:
    if state is None:
        return ""
    return ", of=root" if not state else f", of=%{state[0]}[{state[1]}]"


def _bad_state(state: list[int] | None, forks: dict[int, Fork]) -> tuple[str, Any, str] | None:
    if state and (state[0] not in forks or state[1] >= forks[state[0]].size):
        return "state", state, "no such fork branch"
    return None


def reasoning_name(name: str) -> str:
    """The variable that holds gen `name`'s reasoning (SGLang's name)."""
    return f"{name}_reasoning_content"


def walk(nodes: list[Node]) -> list[Node]:
    """Every node, pre-order (a block node before its children)."""
    out: list[Node] = []
    for node in nodes:
        out.append(node)
        for block in node.blocks():
            out.extend(walk(block))
    return out


@dataclass(frozen=True)
class ProgramLimits:
    """What one graph may ask of a server; each field names the error when exceeded."""

    max_nodes: int = 2000  # fork branches are copies: nested forks multiply
    max_fork_size: int = 64
    max_repeat: int = 256  # iterations of a loop body, nested repeats multiplied
    max_total_tokens: int = 131_072  # sum over gens of max_tokens x n x fork branches x repeats
    max_depth: int = 32  # nested blocks (fork, if, repeat, roles, scopes)
    max_choices: int = 256  # choices of one select (each is an engine request)
    # Characters of text, choices and set values, fork copies counted: 4 Mi is far beyond what
    # the largest contexts hold, well below what would take the server seconds to tokenize.
    max_text_chars: int = 4 * 1024 * 1024
    # Engine requests one run may issue (gen n, select choices, fork branches, repeats): 64
    # branches x 256 iterations, the largest shape the limits above allow one gen each.
    max_requests: int = 16_384
    # Engine requests one run may have in flight at once (gen n, select choices, fork branches
    # beside each other); a server also admits a batch only when items x this fit its queue.
    max_parallel_requests: int = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f.name, value, "must be an int >= 1")


@dataclass
class Graph:
    """A program as data: `args` are its argument names (those in `arg_defaults` are optional)."""

    name: str
    args: list[str]
    nodes: list[Node]
    arg_defaults: dict[str, Any] = field(default_factory=dict)

    def normalized(self) -> Graph:
        """Adjacent texts merged, empty texts dropped, ids renumbered pre-order (fork references
        follow), so a traced program and its textual twin compare equal."""
        nodes = _merge_texts(self.nodes)
        renumber = {}
        for i, node in enumerate(walk(nodes)):
            renumber[node.id] = i
            node.id = i
        for node in walk(nodes):
            if isinstance(node, Join):
                node.fork = renumber.get(node.fork, node.fork)
            if isinstance(node, (Read, SetVar)) and node.state:
                node.state = [renumber.get(node.state[0], node.state[0]), node.state[1]]
        return Graph(self.name, list(self.args), nodes, dict(self.arg_defaults))

    def to_json(self) -> str:
        from forklm.frontend_dsl.ir_codec import graph_to_dict

        return json.dumps(graph_to_dict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | dict[str, Any], limits: ProgramLimits | None = None) -> Graph:
        """Parse and validate; a malformed graph raises InvalidArgumentError naming the field, a
        graph beyond `limits` (nodes, fork size, depth, text) ProgramLimitError as soon as the
        decoder reaches the excess."""
        from forklm.frontend_dsl.ir_codec import graph_from_dict

        if isinstance(data, str):
            text = data
            try:
                data = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as e:
                raise InvalidArgumentError("graph", text[:80], f"not valid JSON: {e}") from e
        return graph_from_dict(data, limits)

    def to_text(self) -> str:
        from forklm.frontend_dsl.ir_render import graph_to_text

        return graph_to_text(self)

    def to_dot(self) -> str:
        from forklm.frontend_dsl.ir_render import graph_to_dot

        return graph_to_dot(self)

    def check_limits(self, limits: ProgramLimits | None = None,
                     default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                     default_n: int = 1) -> None:
        """Raise ProgramLimitError (named after the limit field) if the graph asks for too much;
        a gen that sets no max_tokens (n) counts `default_max_new_tokens` (`default_n`), the
        run's defaults."""
        from forklm.frontend_dsl.limits import check_limits

        check_limits(self, limits or ProgramLimits(), default_max_new_tokens, default_n)


def _merge_texts(nodes: list[Node]) -> list[Node]:
    out: list[Node] = []
    for node in nodes:
        for block in node.blocks():
            block[:] = _merge_texts(block)
        if isinstance(node, Text):
            if not node.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + node.text, id=out[-1].id)
                continue
        out.append(node)
    return out
