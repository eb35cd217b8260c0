r"""Textual programs: a small syntax parsed (grammar: program.lark) into the same request graph a
traced Python program gives. Nothing in a textual program runs Python.

    program qa(question, style="short")     # header: name and arguments (optional defaults)
    # a comment
    "Q: {question}\nA:"                      # text; {name} = an argument or a generated variable
    '''multi-line text''' written with three double quotes ({{ and }} are literal braces)
    gen answer max_tokens=16 stop="\n"       # gen NAME key=value... (gen()'s keywords)
    gen n regex="[0-9]+"                     # values: "str", 12, 0.5, true/false/none, [..], words
    select verdict choices=["yes", "no"]     # select NAME choices=[...] [choices_method=...]
    system { "Be brief." }                   # role blocks: system / user / assistant
    fork 3 { "Tip {i}:" gen tip } join       # branch i runs the body; {i} is its index;
                                             # `join concate_and_append` appends branch texts
    if verdict == "yes" { ... } else { ... } # on a variable's value (read at run time)
    repeat 5 { ... break ... }               # at most 5 times; break ends the loop
    scope name { ... }                       # var_scope: the block's text becomes variable name
    set name = "value"                       # s[name] = value

Examples: examples/programs/*.fl.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lark import Lark, Token, Tree, UnexpectedCharacters, UnexpectedEOF, UnexpectedInput

from forklm.frontend_dsl import api, ir
from forklm.frontend_dsl.ir import MAX_VALUE_DEPTH
from forklm.frontend_dsl.ir_codec import check_references
from forklm.frontend_dsl.limits import MAX_INT_DIGITS, BuildBudget
from forklm.runtime.errors import ForkLMError, InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams

_GRAMMAR = Path(__file__).with_name("program.lark")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}
_INTERPOLATION = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}|[{}]")
_WORDS = {"true": True, "false": False, "none": None}
_PARSER: Lark | None = None


class ProgramSyntaxError(ForkLMError, ValueError):
    """A textual program does not parse; `.line` and `.column` (1-based) locate it and
    `.expected` lists what could have come there."""

    def __init__(self, why: str, line: int, column: int, expected: list[str] | None = None):
        self.line, self.column, self.expected = line, column, sorted(expected or [])
        hint = f"; expected one of: {', '.join(self.expected)}" if self.expected else ""
        super().__init__(f"line {line}, column {column}: {why}{hint}")


def _parser() -> Lark:
    global _PARSER
    if _PARSER is None:
        calls = " | ".join(f'"{name}"' for name in api.TEXT_CALLS)
        _PARSER = Lark(f"{_GRAMMAR.read_text()}\nCALL.2: {calls}\n", parser="lalr",
                       propagate_positions=True)
    return _PARSER


def parse_program(source: str, limits: ir.ProgramLimits | None = None) -> ir.Graph:
    """Parse a textual program into a (normalized) request graph. The graph is counted against
    `limits` while it is built (ProgramLimitError as soon as one is passed: a fork's branches
    are copies, so `fork 300000 { "x" } join` stops at its size, before any branch exists)."""
    try:
        tree = _parser().parse(source)
    except UnexpectedInput as e:
        raise _syntax_error(e, source) from None
    except RecursionError:  # the depth limit below refuses it with a clearer message if it parses
        raise ProgramSyntaxError("the program is nested too deeply to parse", 1, 1) from None
    return _Builder(BuildBudget(limits)).program(tree)


def _syntax_error(e: UnexpectedInput, source: str) -> ProgramSyntaxError:
    parser = _parser()

    def show(name: str) -> list[str]:
        if name == "CALL":
            return [f'"{call}"' for call in api.TEXT_CALLS]
        try:
            pattern = parser.get_terminal(name).pattern
        except KeyError:
            return [name]
        return [f'"{pattern.value}"' if pattern.type == "str" else name]

    line, column = getattr(e, "line", -1), getattr(e, "column", -1)
    token = getattr(e, "token", None)
    if isinstance(e, UnexpectedCharacters):
        char = source[e.pos_in_stream or 0]
        got = "unterminated string" if char == '"' else f"unexpected character {char!r}"
        expected = e.allowed or set()
    elif isinstance(e, UnexpectedEOF) or token is None or token.type == "$END":
        got = "unexpected end of program"
        expected = set(getattr(e, "expected", None) or ())
        end = source.rstrip()  # point just past the last character
        line, column = end.count("\n") + 1, len(end) - end.rfind("\n")
    else:
        got = f"unexpected {str(token)!r}"
        expected = set(getattr(e, "expected", None) or getattr(e, "accepts", None) or ())
    return ProgramSyntaxError(got, line, column, [shown for n in expected for shown in show(n)])


def _error_at(item: Tree | Token, why: str, expected: list[str] | None = None
              ) -> ProgramSyntaxError:
    meta = item if isinstance(item, Token) else item.meta
    return ProgramSyntaxError(why, getattr(meta, "line", 0), getattr(meta, "column", 0), expected)


def decode_string(token: Any) -> str:
    """A string literal's text: quotes removed, \\n \\t \\r \\" \\\\ decoded; any other backslash
    is kept as written (so regexes read naturally: "\\d+")."""
    body = token[3:-3] if token.startswith('"""') else token[1:-1]
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), body, flags=re.S)


@dataclass
class _Scope:
    """What names mean where a statement stands."""

    fork_index: dict[str, int] = field(default_factory=dict)
    in_loop: bool = False
    depth: int = 0  # enclosing block statements

    def inner(self, fork_index: dict[str, int] | None = None, in_loop: bool | None = None
              ) -> _Scope:
        """The scope of a block nested in this one."""
        return _Scope(dict(self.fork_index if fork_index is None else fork_index),
                      self.in_loop if in_loop is None else in_loop, self.depth + 1)


class _Builder:
    def __init__(self, budget: BuildBudget) -> None:
        self.ids = itertools.count()
        self.args: list[str] = []
        self.budget = budget

    def node(self, node: ir.Node) -> ir.Node:
        node.id = next(self.ids)
        return self.budget.add(node)

    def program(self, tree: Tree) -> ir.Graph:
        header, *statements = tree.children
        name_tok, *params = header.children
        defaults: dict[str, Any] = {}
        for param in (p for p in params if p is not None):
            pname, pdefault = param.children
            if pname in self.args:
                raise _error_at(pname, f"argument {str(pname)!r} is declared twice")
            self.args.append(str(pname))
            if pdefault is not None:
                defaults[str(pname)] = decode_string(pdefault)
            elif defaults:
                raise _error_at(pname, f"argument {str(pname)!r} without a default follows one "
                                "with a default")
        nodes = self.block(statements, _Scope())
        graph = ir.Graph(str(name_tok), self.args, nodes, defaults).normalized()
        check_references(graph)
        return graph

    def block(self, statements: list[Any], scope: _Scope) -> list[ir.Node]:
        self.budget.check_depth(scope.depth)
        out: list[ir.Node] = []
        for st in statements:
            out.extend(self.statement(st, scope))
        return out

    def statement(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        build = _STATEMENTS.get(st.data)
        assert build is not None, f"unhandled statement {st.data}"
        return build(self, st, scope)

    # -- one builder per statement of program.lark (see _STATEMENTS) ---------------------------
    def text_statement(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        return self.text(st.children[0], scope)

    def call_statement(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        return [self.call(st, scope)]

    def role_block(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        role, body = str(st.children[0]), st.children[1]
        return [self.node(ir.RoleBegin(role)), *self.block(body.children, scope.inner()),
                self.node(ir.RoleEnd(role))]

    def scope_block(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        name, body = str(st.children[0]), st.children[1]
        return [self.node(ir.ScopeBegin(name)), *self.block(body.children, scope.inner()),
                self.node(ir.ScopeEnd(name))]

    def set_var(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        name, value = st.children
        return [self.node(ir.SetVar(str(name), self.value(value, f"set {name}")))]

    def break_(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        if not scope.in_loop:
            raise _error_at(st, "break outside a repeat block")
        return [self.node(ir.Break())]

    def if_block(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        var, equals, then, orelse = st.children
        if str(var) in self.args:
            raise _error_at(var, f"if tests a generated variable; {str(var)!r} is an argument "
                            "of the program")
        then_nodes = self.block(then.children, scope.inner())
        else_nodes = self.block(orelse.children, scope.inner()) if orelse is not None else []
        return [self.node(ir.If(str(var), decode_string(equals), then_nodes, else_nodes))]

    def repeat_block(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        count = self.positive(st.children[0], "repeat count")
        loop = scope.inner(in_loop=True)
        return [self.node(ir.Repeat(count, self.block(st.children[1].children, loop)))]

    def fork(self, st: Tree, scope: _Scope) -> list[ir.Node]:
        size_tok, body, mode_tok = st.children
        size = self.positive(size_tok, "fork size")
        self.budget.check_fork(size, f"the fork at line {st.meta.line}")
        mode = str(mode_tok) if mode_tok is not None else "gather_variable"
        fork = self.node(ir.Fork(size, []))
        assert isinstance(fork, ir.Fork)
        for i in range(size):  # each branch gets the body with {i} bound to its index
            inner = scope.inner({**scope.fork_index, "i": i}, in_loop=False)
            fork.branches.append(self.block(body.children, inner))
        return [fork, self.node(ir.Join(fork.id, mode))]

    def positive(self, tok: Any, what: str) -> int:
        value = _int(tok, what)
        if value < 1:
            raise _error_at(tok, f"{what} must be >= 1, got {tok}")
        return value

    def text(self, tok: Any, scope: _Scope) -> list[ir.Node]:
        """A string statement: literal text with {name} interpolation. Adjacent literal pieces
        make one Text node (as the normalized graph will hold), so the budget counts real nodes."""
        text, out, literal, pos = decode_string(tok), [], [], 0
        for m in _INTERPOLATION.finditer(text):
            literal.append(text[pos:m.start()])
            pos = m.end()
            piece, name = m.group(0), m.group(1)
            if piece in ("{{", "}}"):
                literal.append(piece[0])
            elif name is None:
                raise _error_at(tok, f"a lone {piece!r} in text; write {piece * 2} for a brace "
                                "or {name} to insert a value")
            elif name in scope.fork_index:
                literal.append(str(scope.fork_index[name]))
            else:
                out.extend(self.texts(literal))
                out.append(self.node(ir.Arg(name) if name in self.args else ir.Read(name)))
        literal.append(text[pos:])
        return out + self.texts(literal)

    def texts(self, pieces: list[str]) -> list[ir.Node]:
        """The literal pieces gathered so far as one Text node (none if empty); empties `pieces`."""
        text = "".join(pieces)
        pieces.clear()
        return [self.node(ir.Text(text))] if text else []

    def call(self, st: Tree, scope: _Scope) -> ir.Node:
        """`gen`/`select NAME key=value...` built with the Python API (same names, validation)."""
        call, name, *kwargs = st.children
        func = api.TEXT_CALLS[str(call)]
        options: dict[str, Any] = {}
        for kw in kwargs:
            key = str(kw.children[0])
            value = self.value(kw.children[1], f"{call} {str(name)!r}: {key}")
            if key in options:
                raise _error_at(kw, f"keyword {key!r} given twice")
            options[key] = value
        known = func.__code__.co_varnames[1:func.__code__.co_argcount]
        unknown = [k for k in options if k not in known]
        if unknown:
            bad = next(kw for kw in kwargs if str(kw.children[0]) == unknown[0])
            raise _error_at(bad, f"unknown keyword {unknown[0]!r} for {call}", list(known))
        method = options.get("choices_method")
        if method is not None and method not in ir.CHOICES_METHODS:
            raise _error_at(st, f"unknown choices_method {method!r}", list(ir.CHOICES_METHODS))
        try:
            node = func(str(name), **options)
            if isinstance(node, ir.Gen):
                SamplingParams.from_dict(node.sampling)
        except (InvalidArgumentError, TypeError, ValueError) as e:
            raise _error_at(st, f"{call} {str(name)!r}: {e}") from None
        return self.node(node)  # a limit it passes is a ProgramLimitError, named after the limit

    def value(self, tree: Any, what: str, depth: int = 0) -> Any:
        """A keyword's or set's value; `what` names it in errors."""
        if isinstance(tree, Token):
            return decode_string(tree)  # `?value` inlines a single STRING
        kind, ch = tree.data, tree.children
        if kind == "string":
            return decode_string(ch[0])
        if kind == "number":
            return float(ch[0]) if any(c in ch[0] for c in ".eE") else _int(ch[0], what)
        if kind == "word":
            return _WORDS.get(str(ch[0]), str(ch[0]))
        if depth >= MAX_VALUE_DEPTH:
            raise _error_at(tree, f"{what}: lists are nested deeper than {MAX_VALUE_DEPTH}")
        return [self.value(v, what, depth + 1) for v in ch if v is not None]


_STATEMENTS: dict[str, Callable[[_Builder, Tree, _Scope], list[ir.Node]]] = {
    "text": _Builder.text_statement, "call": _Builder.call_statement,
    "role_block": _Builder.role_block, "scope_block": _Builder.scope_block,
    "set_var": _Builder.set_var, "break_": _Builder.break_, "if_block": _Builder.if_block,
    "repeat_block": _Builder.repeat_block, "fork_block": _Builder.fork,
}


def _int(tok: Token, what: str) -> int:
    """An int literal, refused before int() when it is longer than any count or size (Python
    refuses > 4300 digits with a ValueError; far fewer are already nonsense here)."""
    digits = tok.lstrip("+-")
    if len(digits) > MAX_INT_DIGITS:
        raise _error_at(tok, f"{what}: a number of {len(digits)} digits is too large (at most "
                        f"{MAX_INT_DIGITS} digits)")
    return int(tok)
