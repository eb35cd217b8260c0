"""Tool use: the model writes an arithmetic expression (constrained by a regex), a calculator
evaluates it (an AST walk over numbers, + - * / and parentheses; never `eval`), and the model
continues with the result.

Run: `python examples/tool_use.py` (greedy, on the default model).
"""

from __future__ import annotations

import ast
from fractions import Fraction
from typing import Any

import forklm as sgl

# Two to four whole numbers joined by operators with spaces, e.g. "12 * 3 + 5".
EXPRESSION_REGEX = r"[0-9]{1,4}( [-+*/] [0-9]{1,4}){1,3}"
QUESTION = ("A pen costs 3 dollars and a notebook costs 5 dollars. How much do 4 pens and 2 "
            "notebooks cost?")

_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
              ast.Div: Fraction.__truediv__}


def calculate(expression: str) -> Fraction:
    """The exact value of `expression`: numbers, unary +/-, + - * / and parentheses only.
    Raises ValueError naming what is not allowed (names, calls, powers, ...) and
    ZeroDivisionError for a division by zero."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({e.msg})") from e
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not allowed in a calculation: {ast.dump(node)[:60]}")


def format_number(value: Fraction) -> str:
    """An integer as itself, anything else as a decimal rounded to 6 places."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


@sgl.function
def calculator_agent(s, question):
    # one worked example shows the format the regex allows
    s += sgl.user("Write the calculation that answers: A box holds 6 eggs. How many eggs are in "
                  "7 boxes?")
    s += sgl.assistant("Calculation: 7 * 6")
    s += sgl.user(f"Write the calculation that answers: {question}")
    s += sgl.assistant("Calculation: " + sgl.gen("expression", max_tokens=24,
                                                  regex=EXPRESSION_REGEX))
    try:
        s["result"] = format_number(calculate(s["expression"]))  # waits for the expression
    except ZeroDivisionError:
        s["result"] = "undefined (division by zero)"
    s += sgl.user(f"The calculator says {s['expression']} = {s['result']}. "
                  "Now answer the question in one sentence.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=32))


def run(backend: Any = None) -> sgl.ProgramState:
    """The demo's run, greedy."""
    return calculator_agent.run(QUESTION, backend=backend, temperature=0.0)


def main() -> None:
    with sgl.Engine() as engine:  # the default model; stopped cleanly at the end
        state = run(engine)
        print(f"question:   {QUESTION}")
        print(f"expression: {state['expression']}")
        print(f"result:     {state['result']}")
        print(f"answer:     {state['answer'].strip()}")


if __name__ == "__main__":
    main()
