"""The request graph's renderings: the stable one-line-per-node text dump and Graphviz DOT."""

from __future__ import annotations

import json
from typing import Any

from forklm.frontend_dsl import ir


def _q(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, sort_keys=True)


def _state_text(state: list[int] | None) -> str:
    if state is None:
        return ""
    return ", of=root" if not state else f", of=%{state[0]}[{state[1]}]"


def node_label(node: ir.Node) -> str:
    """One node as `op(args)`, without id or children (used by the text dump and DOT)."""
    if isinstance(node, (ir.Text, ir.ScopeBegin, ir.ScopeEnd)):
        return f"{node.op}({_q(getattr(node, 'text', getattr(node, 'name', '')))})"
    if isinstance(node, (ir.Arg, ir.RoleBegin, ir.RoleEnd)):
        return f"{node.op}({getattr(node, 'name', getattr(node, 'role', ''))})"
    if isinstance(node, ir.Gen):
        opts = {**node.sampling, **node.logprob_options.to_dict()}
        parts = [_q(node.name)] + [f"{k}={_q(opts[k])}" for k in sorted(opts)]
        if node.dtype:
            parts.append(f"dtype={node.dtype}")
        if node.separate_reasoning:
            parts.append(f"separate_reasoning={node.separate_reasoning}")
        return f"gen({', '.join(parts)})"
    if isinstance(node, ir.Select):
        method = ("" if node.choices_method == "token_length_normalized"
                  else f", method={node.choices_method}")  # a custom method object: its repr
        return f"select({_q(node.name)}, choices={_q(node.choices)}{method})"
    if isinstance(node, ir.Read):
        return f"read({_q(node.name)}{_state_text(node.state)})"
    if isinstance(node, ir.SetVar):
        src = "" if node.source == "literal" else f"{node.source}="
        return f"set({_q(node.name)}, {src}{_q(node.value)}{_state_text(node.state)})"
    if isinstance(node, ir.Fork):
        return f"fork({node.size})"
    if isinstance(node, ir.Join):
        mode = "" if node.mode == "gather_variable" else f", mode={_q(node.mode)}"
        return f"join(%{node.fork}{mode})"
    if isinstance(node, ir.If):
        return f"if({node.var} == {_q(node.equals)})"
    if isinstance(node, ir.Repeat):
        return f"repeat({node.count})"
    return node.op


def _text_lines(nodes: list[ir.Node], indent: str) -> list[str]:
    lines = []
    for node in nodes:
        lines.append(f"{indent}%{node.id} = {node_label(node)}")
        if isinstance(node, ir.Fork):
            for i, branch in enumerate(node.branches):
                lines.append(f"{indent}  branch {i}:")
                lines.extend(_text_lines(branch, indent + "    "))
        elif isinstance(node, ir.If):
            lines.append(f"{indent}  then:")
            lines.extend(_text_lines(node.then, indent + "    "))
            if node.orelse:
                lines.append(f"{indent}  else:")
                lines.extend(_text_lines(node.orelse, indent + "    "))
        elif isinstance(node, ir.Repeat):
            lines.extend(_text_lines(node.body, indent + "  "))
    return lines


def graph_to_text(graph: ir.Graph) -> str:
    args = [f"{a}={_q(graph.arg_defaults[a])}" if a in graph.arg_defaults else a
            for a in graph.args]
    return "\n".join([f"program {graph.name}({', '.join(args)})",
                      *_text_lines(graph.nodes, "")]) + "\n"


def _dot_block(nodes: list[ir.Node], prev: str | None, out: list[str]) -> str | None:
    """Emit nodes chained after `prev`; returns the block's last node name."""
    for node in nodes:
        me = f"n{node.id}"
        out.append(f"  {me} [label={_q(f'%{node.id} = {node_label(node)}')}];")
        if prev is not None:
            out.append(f"  {prev} -> {me};")
        for block in ir.child_blocks(node):
            _dot_block(block, me, out)
        prev = me
    return prev


def graph_to_dot(graph: ir.Graph) -> str:
    out = [f"digraph {_q(graph.name)} {{", "  node [shape=box, fontname=monospace];"]
    _dot_block(graph.nodes, None, out)
    # a join waits for the end of each of its fork's branches: draw that dependency
    forks = {n.id: n for n in ir.walk(graph.nodes) if isinstance(n, ir.Fork)}
    for node in ir.walk(graph.nodes):
        if isinstance(node, ir.Join) and node.fork in forks:
            tails = [b[-1].id if b else node.fork for b in forks[node.fork].branches]
            out.extend(f"  n{t} -> n{node.id} [style=dashed];" for t in dict.fromkeys(tails))
    out.append("}")
    return "\n".join(out) + "\n"
