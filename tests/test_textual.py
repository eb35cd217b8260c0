"""Textual programs: the examples parse to their Python twins' graphs, run-time if/repeat/break,
parse errors that locate the problem, and program files."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_dsl_fake_backend import FakeBackend

import forklm as sgl
from forklm.frontend_dsl import GraphProgram, ProgramSyntaxError, parse_program
from forklm.frontend_dsl.program_file import load_program_file, run_program_file
from forklm.runtime.errors import InvalidArgumentError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TWINS = [("few_shot_qa", "capital_qa"), ("select_truth", "judge"),
         ("typed_gen", "typed_answers"), ("multi_turn_chat", "two_turn_chat")]


@sgl.function
def parallel_tips(s, topic="sleep"):
    """The Python twin of examples/programs/parallel_tips.fl."""
    s += sgl.system("You give short, practical advice.")
    forks = s.fork(5)
    forks += lambda i: sgl.user(f"Give tip number {i} of 5 about {topic}, in one sentence.")
    forks += sgl.assistant(sgl.gen("tip", max_tokens=32, stop="\n"))
    forks.join()
    s += sgl.user(f"Which single habit matters most for better {topic}?")
    s += sgl.assistant(sgl.gen("summary", max_tokens=32, stop="\n"))


def fake(logprobs=None) -> FakeBackend:
    return FakeBackend(reply=lambda p, sp: f"<{len(p)}>", logprobs=logprobs or {})


@pytest.mark.parametrize("example,name", TWINS)
def test_each_example_parses_to_its_python_twins_graph(example, name):
    textual = load_program_file(EXAMPLES / "programs" / f"{example}.fl")
    python = load_program_file(EXAMPLES / f"{example}.py", name)
    assert isinstance(textual, GraphProgram)
    assert textual.graph.to_json() == python.trace().to_json()


def test_fork_example_matches_its_twin_and_runs_the_same():
    textual = load_program_file(EXAMPLES / "programs" / "parallel_tips.fl")
    assert textual.graph.to_text() == parallel_tips.trace().to_text()
    a = textual.run(topic="tea", backend=fake())
    b = parallel_tips.run(topic="tea", backend=fake())
    assert a.text() == b.text() and a.variables() == b.variables()
    assert len(a["tip"]) == 5 and textual.run(backend=fake())["tip"][0].startswith("<")


def _react(first_choice: str) -> sgl.ProgramState:
    logprobs = {"search": [-1.0], "calculate": [-2.0], "finish": [-3.0]}
    logprobs[first_choice] = [-0.1]
    program = load_program_file(EXAMPLES / "programs" / "react.fl")
    state = program.run(question="What is 6*7?", backend=fake(logprobs))
    state.sync()
    return state


def test_react_loop_breaks_on_finish_and_is_bounded_otherwise():
    done = _react("finish")
    assert done.text().count("Thought: ") == 1 and "answer" in done.variables()
    assert "action_input" not in done.variables()
    looping = _react("search")
    assert looping.text().count("Thought: ") == 4  # repeat 4, never finished
    assert looping.text().count("Observation: the search tool") == 4
    assert "answer" not in looping.variables()
    assert [m["role"] for m in looping.messages()] == ["system", "user", "assistant"]


def test_if_else_reads_the_select_result_at_run_time():
    source = '''program route(q)
    select kind choices=["math", "chat"]
    if kind == "math" { "|calc" gen work max_tokens=3 } else { "|talk" }
    "|{kind}|{q}"
    '''
    graph = parse_program(source)
    math = GraphProgram(graph).run(q="x", backend=fake({"math": [-0.1], "chat": [-1.0]}))
    chat = GraphProgram(graph).run(q="x", backend=fake({"math": [-2.0], "chat": [-1.0]}))
    assert math.text() == "math|calc<9>|math|x" and math["work"] == "<9>"
    assert chat.text() == "chat|talk|chat|x" and "work" not in chat.variables()


@pytest.mark.parametrize("source,line,column,expected", [
    ('program p(\n"a"', 2, 1, ['")"', "NAME"]),
    ('program p()\n"a"\ngen', 3, 4, ["NAME"]),
    ('program p()\nfork 2 { "a" }', 2, 15, ['"join"']),
    ('program p()\n  @', 2, 3, ['"gen"', '"select"', "STRING"]),
    ('program p()\nif x = "a" { }', 2, 6, ['"=="']),
    ('program p()\nfork 2 { } join\nuser { "a" }\nx', 4, 1, ["ROLE"]),
    ('"no header"', 1, 1, ['"program"']),
])
def test_parse_errors_name_line_column_and_expected(source, line, column, expected):
    with pytest.raises(ProgramSyntaxError) as info:
        parse_program(source)
    err = info.value
    assert (err.line, err.column) == (line, column), str(err)
    assert set(expected) <= set(err.expected), err.expected
    assert str(err).startswith(f"line {line}, column {column}: ") and "expected one of" in str(err)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("source,match", [
    ('program p()\ngen a max_tokens=3 colour="red"',
     r"line 2, column 20: unknown keyword 'colour' for gen; expected one of: .*max_tokens"),
    ('program p()\nselect a choices=[]', "choices"),
    ('program p()\nselect a choices=["x"] choices_method=mine', "unknown choices_method 'mine'"),
    ('program p()\ngen a regex="("', "not a valid regular expression"),
    ('program p()\ngen a max_tokens=-2', "max_new_tokens"),
    ('program p()\nbreak', "line 2, column 1: break outside a repeat"),
    ('program p()\nrepeat 2 { fork 2 { break } join }', "break outside a repeat"),
    ('program p()\nrepeat 0 { }', "repeat count must be >= 1"),
    ('program p()\nfork 2 { } join sideways', "column 17: unexpected 'sideways'"),
    ('program p()\n"a { b"', "a lone '{' in text"),
    ('program p(a, a)', "declared twice"),
    ('program p(a)\nif a == "x" { }', "line 2, column 4: if tests a generated variable"),
    ('program p()\n"x" __import__("os")', "line 2, column 5"),
])
def test_semantic_errors_are_syntax_errors_too(source, match):
    with pytest.raises(ProgramSyntaxError, match=match):
        parse_program(source)


def test_text_escapes_interpolation_and_values():
    graph = parse_program('program p(a, b="B")\n"""x{{y}}\n{a}{b}{gen1}\\t\\"q\\" \\d"""\n'
                          'gen gen1 stop=["\\n", "."] temperature=0.5 ignore_eos=true top_k=3\n'
                          'set v = [1, -2.5, none, false, "s", word]')
    assert graph.to_text().splitlines()[1:] == [
        '%0 = text("x{y}\\n")', "%1 = arg(a)", "%2 = arg(b)", '%3 = read("gen1")',
        '%4 = text("\\t\\"q\\" \\\\d")',
        '%5 = gen("gen1", ignore_eos=true, stop=["\\n", "."], temperature=0.5, top_k=3)',
        '%6 = set("v", [1, -2.5, null, false, "s", "word"])']
    assert graph.arg_defaults == {"b": "B"}


def test_program_files(tmp_path):
    state = run_program_file(EXAMPLES / "programs" / "few_shot_qa.fl", {"country": "Peru"},
                             backend=fake(), max_new_tokens=3)
    python = run_program_file(EXAMPLES / "few_shot_qa.py", {"country": "Peru"}, backend=fake(),
                              max_new_tokens=3)
    assert state.text() == python.text() and state["answer"] == python["answer"]
    with pytest.raises(InvalidArgumentError, match="colour"):
        run_program_file(EXAMPLES / "programs" / "few_shot_qa.fl", {"colour": "x"}, backend=fake())
    with pytest.raises(InvalidArgumentError, match="country"):
        run_program_file(EXAMPLES / "programs" / "few_shot_qa.fl", {}, backend=fake())
    two = tmp_path / "two.py"
    two.write_text("import forklm as sgl\n"
                   "from test_textual import parallel_tips  # imported: not one of its programs\n"
                   "\n@sgl.function\ndef a(s):\n    s += 'A'\n"
                   "\n@sgl.function\ndef b(s):\n    s += 'B'\n")
    with pytest.raises(InvalidArgumentError, match=r"defines 2 programs \['a', 'b'\]"):
        load_program_file(two)
    assert run_program_file(two, {}, backend=fake(), name="b").text() == "B"
    with pytest.raises(InvalidArgumentError, match="no such program file"):
        load_program_file(tmp_path / "missing.fl")
    bad = tmp_path / "bad.fl"
    bad.write_text("program p()\ngen\n")
    with pytest.raises(ProgramSyntaxError, match="line 2, column 4: unexpected end of program"):
        load_program_file(bad)
