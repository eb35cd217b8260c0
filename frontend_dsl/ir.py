"""The program language's nodes (what gen, select and the roles build and a program state runs)
and request graphs: a program as data, as tracing and the textual syntax both produce it.

A graph read from JSON or text never runs Python (its selects name built-in choices methods);
only an in-process select may hold a method object, which the JSON codec refuses. `to_text()` is
the golden-file dump, `to_json()`/`from_json()` the wire form, `to_dot()` a Graphviz view.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

from forklm.frontend_dsl.choices import BUILTIN_METHODS, ChoicesSamplingMethod, builtin_name
from forklm.frontend_dsl.expr import Expr
from forklm.runtime.errors import InvalidArgumentError

JOIN_MODES = ("gather_variable", "concate_and_append")
CHOICES_METHODS = tuple(BUILTIN_METHODS)
ROLES = ("system", "user", "assistant")
SET_SOURCES = ("literal", "arg", "var")
DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams' default: what a gen without max_tokens may use
FORMAT = "forklm.graph/1"


class ProgramLimitError(InvalidArgumentError):
    """A graph asks for more than the ProgramLimits allow; `.name` is the limit's field name."""


@dataclass(frozen=True)
class LogprobOptions:
    """A gen's logprob request options (SGLang's names); None = not set here, so the run's
    default (then the engine's) applies."""

    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    # Each logprob entry's token text (its third element); None = the engine's default (given).
    return_text_in_logprobs: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """The options that are set."""
        return {k: getattr(self, k) for k in LOGPROB_OPTIONS if getattr(self, k) is not None}

    def overlay(self, other: LogprobOptions) -> LogprobOptions:
        """These options with those set in `other` taking precedence."""
        return LogprobOptions(**{**self.to_dict(), **other.to_dict()})


LOGPROB_OPTIONS = tuple(f.name for f in dataclasses.fields(LogprobOptions))


@dataclass
class Node(Expr):
    """Base of the nodes; `id` is the node's position in a pre-order walk (see Graph)."""

    op: ClassVar[str] = ""
    # A program appends it (`s += node`); the others are structure: arguments and reads the
    # interpreter resolves, blocks it walks, forks and joins a state's fork() and join() queue.
    appendable: ClassVar[bool] = True
    id: int = field(default=-1, kw_only=True)


@dataclass
class Text(Node):
    op: ClassVar[str] = "text"
    text: str


@dataclass
class Arg(Node):
    """Append the program argument `name` (as str)."""

    op: ClassVar[str] = "arg"
    appendable: ClassVar[bool] = False
    name: str


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


@dataclass
class RoleBegin(Node):
    op: ClassVar[str] = "role_begin"
    role: str


@dataclass
class RoleEnd(Node):
    op: ClassVar[str] = "role_end"
    role: str


@dataclass
class ScopeBegin(Node):
    """`with s.var_scope(name):` begins: what is appended until ScopeEnd becomes variable `name`."""

    op: ClassVar[str] = "scope_begin"
    name: str


@dataclass
class ScopeEnd(Node):
    op: ClassVar[str] = "scope_end"
    name: str


@dataclass
class Read(Node):
    """Append the value of variable `name` (waits until it exists). `state` names whose variable:
    None = this state, [] = the root state, [fork_id, branch] = a branch of that fork."""

    op: ClassVar[str] = "read"
    appendable: ClassVar[bool] = False
    name: str
    state: list[int] | None = None


@dataclass
class SetVar(Node):
    """`s[name] = value`: a JSON literal, or the argument / variable (of `state`) named by value."""

    op: ClassVar[str] = "set"
    name: str
    value: Any
    source: str = "literal"
    state: list[int] | None = None


@dataclass
class Fork(Node):
    """`s.fork(size)`: branch i runs `branches[i]` on its own copy of the state."""

    op: ClassVar[str] = "fork"
    appendable: ClassVar[bool] = False
    size: int
    branches: list[list[Node]]


@dataclass
class Join(Node):
    op: ClassVar[str] = "join"
    appendable: ClassVar[bool] = False
    fork: int
    mode: str = "gather_variable"


@dataclass
class If(Node):
    """Run `then` when variable `var` (read when reached) equals `equals`, else `orelse`."""

    op: ClassVar[str] = "if"
    appendable: ClassVar[bool] = False
    var: str
    equals: str
    then: list[Node] = field(default_factory=list)
    orelse: list[Node] = field(default_factory=list)


@dataclass
class Repeat(Node):
    """Run `body` up to `count` times; a Break inside it (not inside a fork) ends the loop."""

    op: ClassVar[str] = "repeat"
    appendable: ClassVar[bool] = False
    count: int
    body: list[Node] = field(default_factory=list)


@dataclass
class Break(Node):
    op: ClassVar[str] = "break"
    appendable: ClassVar[bool] = False


NODE_TYPES: dict[str, type[Node]] = {t.op: t for t in (
    Text, Arg, Gen, Select, RoleBegin, RoleEnd, ScopeBegin, ScopeEnd, Read, SetVar, Fork, Join,
    If, Repeat, Break)}


def produced_name(node: Any) -> str | None:
    """The variable a node sets when it runs (a gen, select, scope end or set), else None."""
    return node.name if isinstance(node, (Gen, Select, ScopeEnd, SetVar)) else None


def produced_names(node: Any) -> list[str]:
    """Every variable a node sets when it runs: a reasoning gen sets two."""
    name = produced_name(node)
    if name is None:
        return []
    if isinstance(node, Gen) and node.separate_reasoning is not None:
        return [name, reasoning_name(name)]
    return [name]


def reasoning_name(name: str) -> str:
    """The variable that holds gen `name`'s reasoning (SGLang's name)."""
    return f"{name}_reasoning_content"


def child_blocks(node: Node) -> list[list[Node]]:
    """The nested node lists of a block node, in execution (and numbering) order."""
    if isinstance(node, Fork):
        return node.branches
    if isinstance(node, If):
        return [node.then, node.orelse]
    if isinstance(node, Repeat):
        return [node.body]
    return []


def walk(nodes: list[Node]) -> list[Node]:
    """Every node, pre-order (a block node before its children)."""
    out: list[Node] = []
    for node in nodes:
        out.append(node)
        for block in child_blocks(node):
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
        for block in child_blocks(node):
            block[:] = _merge_texts(block)
        if isinstance(node, Text):
            if not node.text:
                continue
            if out and isinstance(out[-1], Text):
                out[-1] = Text(out[-1].text + node.text, id=out[-1].id)
                continue
        out.append(node)
    return out
