"""The request graph's renderings: the stable one-line-per-node text dump and Graphviz DOT (each
node's label and titled blocks come from its class, see ir.Node.label)."""

from __future__ import annotations

from forklm.frontend_dsl import ir
from forklm.frontend_dsl.ir import quote


def _text_lines(nodes: list[ir.Node], indent: str) -> list[str]:
    lines = []
    for node in nodes:
        lines.append(f"{indent}%{node.id} = {node.label()}")
        for title, block in node.titled_blocks():
            if title:
                lines.append(f"{indent}  {title}")
            lines.extend(_text_lines(block, indent + ("    " if title else "  ")))
    return lines


def graph_to_text(graph: ir.Graph) -> str:
    args = [f"{a}={quote(graph.arg_defaults[a])}" if a in graph.arg_defaults else a
            for a in graph.args]
    return "\n".join([f"program {graph.name}({', '.join(args)})",
                      *_text_lines(graph.nodes, "")]) + "\n"


def _dot_block(nodes: list[ir.Node], prev: str | None, out: list[str]) -> str | None:
    """Emit nodes chained after `prev`; returns the block's last node name."""
    for node in nodes:
        me = f"n{node.id}"
        out.append(f"  {me} [label={quote(f'%{node.id} = {node.label()}')}];")
        if prev is not None:
            out.append(f"  {prev} -> {me};")
        for block in node.blocks():
            _dot_block(block, me, out)
        prev = me
    return prev


def graph_to_dot(graph: ir.Graph) -> str:
    out = [f"digraph {quote(graph.name)} {{", "  node [shape=box, fontname=monospace];"]
    _dot_block(graph.nodes, None, out)
    # a join waits for the end of each of its fork's branches: draw that dependency
    forks = {n.id: n for n in ir.walk(graph.nodes) if isinstance(n, ir.Fork)}
    for node in ir.walk(graph.nodes):
        if isinstance(node, ir.Join) and node.fork in forks:
            tails = [b[-1].id if b else node.fork for b in forks[node.fork].branches]
            out.extend(f"  n{t} -> n{node.id} [style=dashed];" for t in dict.fromkeys(tails))
    out.append("}")
    return "\n".join(out) + "\n"
