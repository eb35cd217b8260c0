"""Tracing Python programs, executing graphs (== running the program), run_batch's prefix hint and
server-batch hook: on a scripted fake backend, and (slow) on the default model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_dsl_fake_backend import FakeBackend

import forklm as sgl
from forklm.frontend_dsl import GraphProgram, TraceError, ir
from forklm.frontend_dsl.program import constant_prefix
from forklm.frontend_dsl.program_file import load_program_file
from forklm.frontend_dsl.textual import parse_program
from forklm.runtime.errors import InvalidArgumentError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LOGPROBS = {"a": [-1.0], "b": [-0.5, -0.1], "yes": [-0.2], "no": [-0.3],
            **{t: [-float(i)] for i, t in enumerate(["sleep", "exercise", "nutrition", "focus",
                                                       "stress"])}}


def fake(**kw) -> FakeBackend:
    # each gen's text depends on the whole prompt, so equal texts mean equal prompts
    return FakeBackend(reply=lambda p, sp: f"<{len(p)}:{p[-3:]}>", logprobs=LOGPROBS, **kw)


class CachingFake(FakeBackend):
    def __init__(self, states=None):
        super().__init__(reply=lambda p, sp: f"<{len(p)}>", logprobs=LOGPROBS)
        self.cached: list[str] = []
        self.batches: list[tuple] = []
        self.states = states

    def cache_prefix(self, prompt):
        self.cached.append(prompt)

    def run_program_batch(self, graph, batch_arguments, defaults):
        self.batches.append((graph, batch_arguments, defaults))
        return self.states


@sgl.function
def few_shot(s, question):
    s += "Q: 1+1?\nA: 2\n\n" + f"Q: {question}?\nA:" + sgl.gen("answer", 6, stop="\n")


@sgl.function
def chat_scope_set(s, question, style="short"):
    s += sgl.system(f"Answer in a {style} way.")
    with s.user():
        s += question
    with s.assistant(), s.var_scope("reply"):
        s += "Sure: " + sgl.gen("answer", 5)
    s["asked"] = question
    s["fixed"] = [1, "x"]
    s += sgl.user("Again:" + s["answer"])
    s += sgl.assistant(sgl.select("ok", ["yes", "no"]))


@sgl.function
def fork_join(s, topic):
    s += f"Tips on {topic}:"
    forks = s.fork(3)
    forks += lambda i: f"\n{i}." + sgl.gen("tip", 4 + i)
    forks[2] += sgl.select("pick", ["a", "b"], choices_method=sgl.greedy_token_selection)
    forks.join()
    s += "\nBest: " + forks[1]["tip"]
    more = s.fork(2)
    more += sgl.gen("extra", 3)
    more.join(mode="concate_and_append")
    s["first_extra"] = more[0]["extra"]
    with s.copy() as c:
        c += sgl.gen("aside", 2)
    s += sgl.gen("end", 7)


PROGRAMS = [(few_shot, {"question": "2+2"}), (chat_scope_set, {"question": "Why?"}),
            (chat_scope_set, {"question": "Why?", "style": "long"}),
            (fork_join, {"topic": "sleep"})]


def _result(state):
    state.sync()
    return state.text(), state.variables(), state.messages()


@pytest.mark.parametrize("program,args", PROGRAMS)
def test_executing_the_trace_equals_running_the_program(program, args):
    graph = program.trace()
    assert _result(GraphProgram(graph).run(backend=fake(), **args)) == _result(
        program.run(backend=fake(), **args))
    again = GraphProgram(ir.Graph.from_json(graph.to_json()))  # through the wire form too
    assert _result(again.run(backend=fake(), **args)) == _result(
        program.run(backend=fake(), **args))


def test_trace_with_given_arguments_bakes_them_in():
    graph = few_shot.trace(question="3+3")
    assert graph.args == [] and '"Q: 1+1?\\nA: 2\\n\\nQ: 3+3?\\nA:"' in graph.to_text()
    with pytest.raises(InvalidArgumentError, match="colour"):
        few_shot.trace(colour=1)


def test_formatting_a_generated_value_raises_type_error_saying_why():
    tips = load_program_file(EXAMPLES / "tips_fork.py", "tips_fork")
    with pytest.raises(TypeError, match=r"the value of 'topic' is generated at run time; "
                                        r"append s\['topic'\] instead"):
        tips.trace()

    @sgl.function
    def with_str(s):
        s += sgl.gen("x", 3)
        s += "got " + str(s["x"])

    with pytest.raises(TraceError, match="'x' is generated at run time"):
        with_str.trace()


@pytest.mark.parametrize("body", [
    lambda s: s["x"] == "yes",
    lambda s: bool(s["x"]),
    lambda s: "y" in s["x"],
    lambda s: s["x"][0],
    lambda s: s["x"].strip(),
    lambda s: int(s["x"]),
])
def test_control_flow_on_a_generated_value_cannot_be_traced(body):
    @sgl.function
    def prog(s):
        s += sgl.gen("x", 3)
        body(s)

    with pytest.raises(TraceError, match="control flow depends on it, so it cannot be traced"):
        prog.trace()


def test_other_untraceable_uses():
    @sgl.function
    def branches_on_arg(s, flag):
        if flag:
            s += "x"

    @sgl.function
    def custom_method(s):
        s += sgl.select("c", ["a", "b"], choices_method=lambda **kw: None)

    @sgl.function
    def reads_text(s):
        s += "hi" + sgl.gen("g", 2)
        s += s.text()

    @sgl.function
    def append_after_join(s):
        forks = s.fork(2)
        forks.join()
        forks[0] += "late"

    for prog, match in [(branches_on_arg, "argument 'flag'"), (custom_method, "custom choices"),
                        (reads_text, r"s.text\(\) exists only at run time"),
                        (append_after_join, "after its join")]:
        with pytest.raises(TraceError, match=match):
            prog.trace()


def test_known_literal_variables_are_readable_while_tracing():
    @sgl.function
    def prog(s):
        s["n"] = 2
        for i in range(s["n"]):
            s += f"line {i}\n"

    assert [n.op for n in prog.trace().nodes] == ["set", "text"]

    @sgl.function
    def shadowed_by_a_branch(s):
        s["x"] = "lit"
        forks = s.fork(2)
        forks += sgl.gen("x", 2)
        forks.join()
        s += s["x"]  # a list at run time, not "lit": must not be traced as a constant

    assert shadowed_by_a_branch.trace().nodes[-1] == ir.Read("x", id=5)


def test_graph_program_trace_bakes_bound_and_given_arguments():
    program = GraphProgram(chat_scope_set.trace())
    assert program.trace() == chat_scope_set.trace()
    assert program.trace(style="long") == chat_scope_set.trace(style="long")
    bound = program.bind(question="Why?")
    assert bound.trace() == chat_scope_set.bind(question="Why?").trace()
    assert bound.trace().args == ["style"]
    assert _result(bound.run(backend=fake())) == _result(chat_scope_set.run("Why?", backend=fake()))
    with pytest.raises(InvalidArgumentError, match="colour"):
        program.trace(colour="red")


def test_graph_program_checks_arguments_and_runs_every_way():
    program = GraphProgram(chat_scope_set.trace())
    with pytest.raises(InvalidArgumentError, match="question.*missing"):
        program.run(backend=fake())
    with pytest.raises(InvalidArgumentError, match="colour"):
        program.run(question="q", colour="red", backend=fake())
    with pytest.raises(InvalidArgumentError, match="colour"):
        program.run_batch([{"question": "q", "colour": 1}], backend=fake())
    expected = _result(chat_scope_set.run("Why?", backend=fake(), max_new_tokens=9))
    assert _result(program.run("Why?", backend=fake(), max_new_tokens=9)) == expected
    assert _result(program.run(question="Why?", backend=fake(), stream=True,
                               max_new_tokens=9)) == expected
    assert _result(asyncio.run(program.run_async(question="Why?", backend=fake(),
                                                 max_new_tokens=9))) == expected
    states = program.run_batch([{"question": "Why?"}] * 3, backend=fake(), max_new_tokens=9)
    assert [_result(st) for st in states] == [expected] * 3


def test_run_batch_hints_the_constant_prefix_once():
    backend = CachingFake()
    states = chat_scope_set.run_batch([{"question": q} for q in "abc"], backend=backend)
    prefix = "<system>Answer in a "  # up to the first argument
    assert backend.cached == [prefix]
    assert all(prompt.startswith(prefix) for prompt, _ in backend.calls)
    assert [st["asked"] for st in states] == ["a", "b", "c"]
    assert len(backend.batches) == 1  # the hook was asked first and declined (None)
    graph = parse_program('program p(q)\nuser { "Hi" }\n"Q: {q}"\ngen a')
    hinted = "<system>default</system><user>Hi</user>Q: "  # through the role's template
    assert constant_prefix(backend, graph) == hinted
    states = GraphProgram(graph).run_batch([{"q": "x"}, {"q": "y"}], backend=backend)
    assert backend.cached[-1] == hinted
    assert [st.text() for st in states] == [f"{hinted}{q}<{len(hinted) + 1}>" for q in "xy"]


def test_run_batch_skips_the_hint_for_one_item_or_an_untraceable_program():
    backend = CachingFake()
    few_shot.run_batch([{"question": "x"}], backend=backend)
    tips = load_program_file(EXAMPLES / "tips_fork.py", "tips_fork")
    states = tips.run_batch([{"goal": "sleep"}] * 2, backend=backend, max_new_tokens=2)
    assert backend.cached == [] and backend.batches == []
    assert all(len(st["tip"]) == 5 for st in states)


def test_run_batch_uses_the_backends_program_batch_when_it_returns_states():
    local = fake()
    ready = [few_shot.run(question=q, backend=local) for q in "xy"]
    backend = CachingFake(states=ready)
    out = few_shot.run_batch([{"question": "x"}, {"question": "y"}], backend=backend,
                             temperature=0.0)
    assert out == ready and backend.calls == [] and backend.cached == []
    graph, items, defaults = backend.batches[0]
    assert graph == few_shot.trace() and items == [{"question": "x"}, {"question": "y"}]
    assert defaults == {"temperature": 0.0}
    gen = few_shot.run_batch([{"question": "x"}, {"question": "y"}], backend=backend,
                             generator_style=True)
    assert list(gen) == ready


# -- the default model -----------------------------------------------------------------------
@pytest.mark.slow
def test_trace_execution_equals_the_program_on_the_model(make_engine):
    backend = sgl.EngineBackend(make_engine())
    for program, args in [(few_shot, {"question": "What is 3+4"}),
                          (fork_join, {"topic": "tea"}),
                          (chat_scope_set, {"question": "Is the sky blue?"})]:
        direct = _result(program.run(backend=backend, temperature=0.0, **args))
        traced = _result(GraphProgram(program.trace()).run(backend=backend, temperature=0.0,
                                                           **args))
        assert traced == direct, program.func.__name__


@pytest.mark.slow
def test_run_batch_prefix_hint_makes_every_item_hit_the_cache(make_engine):
    class RecordingBackend(sgl.EngineBackend):
        hinted: list[str] = []

        def cache_prefix(self, prompt):
            self.hinted.append(prompt)
            super().cache_prefix(prompt)

    backend = RecordingBackend(make_engine())
    capital_qa = load_program_file(EXAMPLES / "few_shot_qa.py", "capital_qa")
    prefix = constant_prefix(backend, capital_qa.trace())
    prefix_len = len(backend.tokenizer.encode(prefix, add_special_tokens=False))
    assert prefix_len > 40
    states = capital_qa.run_batch([{"country": c} for c in ["Peru", "Chad", "Fiji", "Oman"]],
                                  backend=backend, temperature=0.0, max_new_tokens=4)
    assert backend.hinted == [prefix]
    for st in states:  # the prefix's last token (" ") merges with the country's in the items
        assert st.get_meta_info("answer")["cached_tokens"] >= prefix_len - 1
