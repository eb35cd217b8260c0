"""What a request graph may ask of a server, bounded before anything runs: `BuildBudget` while a
graph is built (parsed from text, decoded from JSON), `check_limits` once it exists."""

from __future__ import annotations

from collections.abc import Callable

from forklm.frontend_dsl.ir import (
    Fork,
    Graph,
    Join,
    Node,
    ProgramLimitError,
    ProgramLimits,
    Select,
)

MAX_INT_DIGITS = 18  # an int literal in program text: anything longer is no count or size


class BuildBudget:
    """What a graph under construction holds so far. The builder reports each node as it makes
    it (and each fork's size and each block's depth before expanding them), so a limit is
    refused as soon as it is passed: the work and memory spent stay proportional to the limits,
    never to what the request asks for (a fork's branches are copies; nested forks multiply)."""

    def __init__(self, limits: ProgramLimits | None = None):
        self.limits = limits or ProgramLimits()
        self.num_nodes = 0
        self.num_chars = 0

    def add(self, node: Node) -> Node:
        """Count `node` (its text, choices, set value); raise at the first limit passed."""
        self.num_nodes += 1
        if self.num_nodes > self.limits.max_nodes:
            raise ProgramLimitError("max_nodes", self.num_nodes, f"the graph has more than "
                                    f"{self.limits.max_nodes} nodes (fork branches are copies: "
                                    "nested forks multiply)")
        if isinstance(node, Fork):
            self.check_fork(node.size, f"fork %{node.id}")
        if isinstance(node, Select) and len(node.choices) > self.limits.max_choices:
            raise ProgramLimitError("max_choices", len(node.choices), f"select {node.name!r} has "
                                    f"more than {self.limits.max_choices} choices")
        self.add_chars(node.chars())
        return node

    def add_chars(self, num: int) -> None:
        self.num_chars += num
        if self.num_chars > self.limits.max_text_chars:
            raise ProgramLimitError("max_text_chars", self.num_chars, f"the graph holds more than "
                                    f"{self.limits.max_text_chars} characters of text, choices "
                                    "and values (fork branches are copies)")

    def check_fork(self, size: int, where: str = "a fork") -> None:
        """Before a fork's branches are built."""
        if size > self.limits.max_fork_size:
            raise ProgramLimitError("max_fork_size", size, f"{where} is larger than "
                                    f"{self.limits.max_fork_size}")

    def check_depth(self, depth: int) -> None:
        """Before the block at nesting `depth` (1 = inside one block node) is built."""
        if depth > self.limits.max_depth:
            raise ProgramLimitError("max_depth", depth, f"blocks are nested deeper than "
                                    f"{self.limits.max_depth}")


def check_limits(graph: Graph, limits: ProgramLimits, default_max_new_tokens: int,
                 default_n: int = 1) -> None:
    """Raise ProgramLimitError (named after the limit field) at the first limit exceeded; a gen
    without its own max_new_tokens / n counts the run's defaults."""
    budget = BuildBudget(limits)
    _count(graph.nodes, budget, depth=0)
    repeats = _max_iterations(graph.nodes)
    if repeats > limits.max_repeat:
        raise ProgramLimitError("max_repeat", repeats, f"a loop body may run more than "
                                f"{limits.max_repeat} times (nested repeats multiply)")
    num_requests = _total_requests(graph.nodes, default_n)
    if num_requests > limits.max_requests:
        raise ProgramLimitError("max_requests", num_requests, f"the program may issue more than "
                                f"{limits.max_requests} engine requests (gen n samples and select "
                                "choices, times fork branches and repeats)")
    peak = max_in_flight(graph, default_n)
    if peak > limits.max_parallel_requests:
        raise ProgramLimitError("max_parallel_requests", peak, f"the program may have more than "
                                f"{limits.max_parallel_requests} engine requests in flight at "
                                "once (gen n samples, select choices, fork branches)")
    total = _total_tokens(graph.nodes, default_max_new_tokens, default_n)
    if total > limits.max_total_tokens:
        raise ProgramLimitError("max_total_tokens", total, f"the gens may generate more than "
                                f"{limits.max_total_tokens} tokens in all (max_tokens x n)")


def max_in_flight(graph: Graph, default_n: int = 1) -> int:
    """The most engine requests one run of `graph` may have in flight at once (at least 1)."""
    return max(_in_flight(graph.nodes, default_n)[0], 1)


def _count(nodes: list[Node], budget: BuildBudget, depth: int) -> None:
    budget.check_depth(depth)
    for node in nodes:
        budget.add(node)
        for block in node.blocks():
            _count(block, budget, depth + 1)


def _over_blocks(node: Node, measure: Callable[[list[Node]], int]) -> int:
    """`measure` of a node's blocks: the largest when only one of them runs, else their sum."""
    values = [measure(block) for block in node.blocks()]
    return (max(values, default=0) if node.exclusive_blocks else sum(values))


def _total_requests(nodes: list[Node], default_n: int) -> int:
    return sum(node.iterations * (node.total_requests(default_n) + _over_blocks(
        node, lambda block: _total_requests(block, default_n))) for node in nodes)


def _total_tokens(nodes: list[Node], default: int, default_n: int) -> int:
    """Upper bound on generated tokens (fork branches are listed one by one already)."""
    return sum(node.iterations * (node.tokens(default, default_n) + _over_blocks(
        node, lambda block: _total_tokens(block, default, default_n))) for node in nodes)


def _max_iterations(nodes: list[Node]) -> int:
    """How many times the most repeated node may run (the product of its enclosing counts)."""
    return max([1, *(node.iterations * _max_iterations(block)
                     for node in nodes for block in node.blocks())])


def _in_flight(nodes: list[Node], default_n: int) -> tuple[int, int]:
    """(peak, left): the most engine requests `nodes` may have in flight at once, and how many
    may still be when the block's own nodes are done (branches of forks it did not join). A
    fork's branches run beside each other and beside their parent until a join waits for them."""
    peak = running = 0
    open_forks: dict[int, tuple[int, int]] = {}  # fork id -> (its peak, what its branches leave)
    for node in nodes:
        if isinstance(node, Fork):
            spans = [_in_flight(branch, default_n) for branch in node.branches]
            width = sum(p for p, _ in spans)
            open_forks[node.id] = (width, sum(left for _, left in spans))
            peak, running = max(peak, running + width), running + width
        elif isinstance(node, Join) and node.fork in open_forks:
            width, left = open_forks.pop(node.fork)
            running += left - width
        elif node.blocks():  # each iteration may leave unjoined branches running
            body_peak, left = _blocks_in_flight(node, default_n)
            peak = max(peak, running + body_peak + (node.iterations - 1) * left)
            running += node.iterations * left
        else:  # a gen or select runs after the state's earlier nodes: they add to `running`
            peak = max(peak, running + node.requests(default_n))
    return peak, running


def _blocks_in_flight(node: Node, default_n: int) -> tuple[int, int]:
    """(peak, left) of one run of a block node's blocks, run one after another or, for an
    if, the larger of its alternatives."""
    if not node.exclusive_blocks:
        return _in_flight([n for block in node.blocks() for n in block], default_n)
    spans = [_in_flight(block, default_n) for block in node.blocks()]
    return max(p for p, _ in spans), max(left for _, left in spans)
