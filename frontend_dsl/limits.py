"""Graph.check_limits: what a request graph may ask of a server, bounded before anything runs."""

from __future__ import annotations

from forklm.frontend_dsl.ir import (
    Fork,
    Gen,
    Graph,
    If,
    Node,
    ProgramLimitError,
    ProgramLimits,
    Repeat,
    child_blocks,
    walk,
)


def check_limits(graph: Graph, limits: ProgramLimits, default_max_new_tokens: int) -> None:
    """Raise ProgramLimitError (named after the limit field) at the first limit exceeded."""
    num_nodes = len(walk(graph.nodes))
    if num_nodes > limits.max_nodes:
        raise ProgramLimitError("max_nodes", num_nodes, f"the graph has more than "
                                f"{limits.max_nodes} nodes")
    for node in walk(graph.nodes):
        if isinstance(node, Fork) and node.size > limits.max_fork_size:
            raise ProgramLimitError("max_fork_size", node.size, f"fork %{node.id} is larger "
                                    f"than {limits.max_fork_size}")
    repeats = _max_iterations(graph.nodes)
    if repeats > limits.max_repeat:
        raise ProgramLimitError("max_repeat", repeats, f"a loop body may run more than "
                                f"{limits.max_repeat} times (nested repeats multiply)")
    total = _total_tokens(graph.nodes, default_max_new_tokens)
    if total > limits.max_total_tokens:
        raise ProgramLimitError("max_total_tokens", total, f"the gens may generate more than "
                                f"{limits.max_total_tokens} tokens in all")


def _total_tokens(nodes: list[Node], default: int) -> int:
    """Upper bound on generated tokens (fork branches are listed one by one already)."""
    total = 0
    for node in nodes:
        if isinstance(node, Gen):
            total += int(node.sampling.get("max_new_tokens", default))
        elif isinstance(node, Repeat):
            total += node.count * _total_tokens(node.body, default)
        elif isinstance(node, If):
            total += max(_total_tokens(node.then, default), _total_tokens(node.orelse, default))
        else:
            total += sum(_total_tokens(block, default) for block in child_blocks(node))
    return total


def _max_iterations(nodes: list[Node]) -> int:
    """How many times the most repeated node may run (the product of its enclosing counts)."""
    most = 1
    for node in nodes:
        factor = node.count if isinstance(node, Repeat) else 1
        for block in child_blocks(node):
            most = max(most, factor * _max_iterations(block))
    return most
