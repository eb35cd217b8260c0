"""Request graphs: golden dumps of traced programs, JSON round trips, DOT, validation, limits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import forklm as sgl
from forklm.frontend_dsl import ir
from forklm.frontend_dsl.ir import Graph, ProgramLimitError, ProgramLimits
from forklm.frontend_dsl.program_file import load_program_file
from forklm.frontend_dsl.textual import parse_program
from forklm.runtime.errors import InvalidArgumentError

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).with_name("golden")
# (example file, program name) for the traceable Python examples.
PY_EXAMPLES = [("few_shot_qa", "capital_qa"), ("select_truth", "judge"),
               ("typed_gen", "typed_answers"), ("multi_turn_chat", "two_turn_chat")]
TEXTUAL_ONLY = ["react", "parallel_tips"]  # examples/programs/*.fl with if/repeat or no twin here


@sgl.function
def everything(s, question, style="short"):
    """One of every traceable construct."""
    s += sgl.system("Be " + style + ".")
    with s.user():
        s += f"Q: {question}"
    s += sgl.assistant(sgl.gen("answer", 16, stop=["\n"], temperature=0.0, return_logprob=True))
    s["copy"] = question
    s["note"] = {"k": [1, 2]}
    s += "\nSo: " + s["answer"]
    with s.var_scope("scoped"):
        s += sgl.gen("n", dtype=int) + sgl.gen("f", regex=r"\d+\.\d", json_schema=None)
    s += sgl.gen("obj", 20, 2, stop_token_ids=[2], top_p=0.9, top_k=5, min_p=0.1,
                 frequency_penalty=0.5, presence_penalty=0.25, ignore_eos=False,
                 logprob_start_len=0, top_logprobs_num=2, json_schema='{"type": "object"}')
    s += sgl.gen_string("quoted", max_tokens=6) + sgl.gen_int("count")
    forks = s.fork(2)
    forks += lambda i: f"Tip {i}:" + sgl.gen("tip", max_tokens=8)
    forks[1] += sgl.select("pick", ["a", "b"], choices_method=sgl.greedy_token_selection)
    forks.join(mode="concate_and_append")
    s += forks[0]["tip"]
    s["echo"] = forks[1]["pick"]
    with s.copy() as c:
        c += sgl.gen("side", ebnf='root ::= "x"', max_tokens=2)
    s += sgl.gen(choices=["yes", "no"], name="final",
                 choices_method=sgl.unconditional_likelihood_normalized)


def _traced() -> dict[str, Graph]:
    graphs = {name: load_program_file(ROOT / "examples" / f"{ex}.py", name).trace()
              for ex, name in PY_EXAMPLES}
    graphs["everything"] = everything.trace()
    for name in TEXTUAL_ONLY:
        graphs[name] = parse_program((ROOT / "examples" / "programs" / f"{name}.fl").read_text())
    return graphs


@pytest.mark.parametrize("name", [n for _, n in PY_EXAMPLES] + ["everything", *TEXTUAL_ONLY])
def test_golden_text_dump(name):
    text = _traced()[name].to_text()
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("FORKLM_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name}: rerun with FORKLM_UPDATE_GOLDEN=1 if intended"


def _all_nodes() -> Graph:
    """A graph with every node kind (textual control flow included)."""
    graph = everything.trace()
    loop = ir.Repeat(3, [ir.Text("x"), ir.If("pick", "a", [ir.Break()], [ir.Read("n")])])
    graph.nodes.append(loop)
    return graph.normalized()


def test_json_round_trip_covers_every_node_kind():
    graph = _all_nodes()
    assert {n.op for n in ir.walk(graph.nodes)} == set(ir.NODE_TYPES)
    data = graph.to_json()
    again = Graph.from_json(data)
    assert again == graph and again.to_json() == data and again.to_text() == graph.to_text()
    assert Graph.from_json(json.loads(data)) == graph


def test_dot_output_has_every_node_and_edge():
    graph = _all_nodes()
    dot = graph.to_dot()
    assert dot.startswith('digraph "everything" {') and dot.rstrip().endswith("}")
    nodes = ir.walk(graph.nodes)
    for node in nodes:
        assert f"  n{node.id} [label=" in dot
    fork = next(n for n in nodes if isinstance(n, ir.Fork) and n.size == 2)
    join = next(n for n in nodes if isinstance(n, ir.Join) and n.fork == fork.id)
    for branch in fork.branches:  # fork -> each branch start, each branch end -> join
        assert f"n{fork.id} -> n{branch[0].id};" in dot
        assert f"n{branch[-1].id} -> n{join.id} [style=dashed];" in dot
    assert dot.count(" -> ") >= len(nodes) - 1


def _bad(mutate, match):
    data = json.loads(everything.trace().to_json())
    mutate(data)
    with pytest.raises(InvalidArgumentError, match=match):
        Graph.from_json(data)


def test_from_json_rejects_malformed_graphs_naming_the_field():
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        Graph.from_json("{nope")
    _bad(lambda d: d["nodes"][0].update(op="exec"), r"nodes\[0\]\.op.*unknown node op")
    _bad(lambda d: d["nodes"][0].update(code="1"), r"nodes\[0\]\.code.*not a field")
    _bad(lambda d: d["nodes"][0].pop("role"), r"nodes\[0\]\.role.*missing")
    gen = next(i for i, n in enumerate(json.loads(everything.trace().to_json())["nodes"])
               if n["op"] == "gen")
    _bad(lambda d: d["nodes"][gen]["sampling"].update(max_new_tokens=-3),
         rf"nodes\[{gen}\]\.sampling.*max_new_tokens")
    _bad(lambda d: d["nodes"][gen]["sampling"].update(evil=1), "unknown sampling parameter")
    _bad(lambda d: d["nodes"][gen].update(dtype="complex"), r"\.dtype")
    fork = next(i for i, n in enumerate(json.loads(everything.trace().to_json())["nodes"])
                if n["op"] == "fork")
    _bad(lambda d: d["nodes"][fork]["branches"][1][1].update(choices_method="os.system"),
         rf"nodes\[{fork}\]\.branches\[1\]\[1\]\.choices_method")
    _bad(lambda d: d["nodes"][fork].update(size=3), "needs 3 branches")
    _bad(lambda d: d["nodes"].append({"op": "join", "fork": 999, "id": 500}),
         "no fork node has this id")
    _bad(lambda d: d["nodes"].append({"op": "arg", "name": "nobody", "id": 500}), "not an argument")
    _bad(lambda d: d["nodes"].append({"op": "break", "id": 500}), "break outside a repeat")
    _bad(lambda d: d.update(args=["ok", "not valid"]), "args")
    _bad(lambda d: d.update(extra=1), "extra")


def test_limits_name_the_exceeded_field():
    graph = _all_nodes()
    graph.check_limits()  # the defaults allow a normal program
    cases = [(ProgramLimits(max_nodes=5), "max_nodes"),
             (ProgramLimits(max_fork_size=1), "max_fork_size"),
             (ProgramLimits(max_repeat=2), "max_repeat"),
             (ProgramLimits(max_total_tokens=100), "max_total_tokens")]
    for limits, name in cases:
        with pytest.raises(ProgramLimitError, match=name) as info:
            graph.check_limits(limits)
        assert info.value.name == name and isinstance(info.value, InvalidArgumentError)
    with pytest.raises(InvalidArgumentError, match="max_repeat"):
        ProgramLimits(max_repeat=0)


def test_total_tokens_counts_forks_repeats_and_default_max_tokens():
    graph = parse_program('program p()\ngen a max_tokens=10\nfork 3 { gen b max_tokens=5 } join\n'
                              'repeat 4 { gen c max_tokens=2 }\ngen d')
    graph.check_limits(ProgramLimits(max_total_tokens=10 + 15 + 8 + 128))
    with pytest.raises(ProgramLimitError, match="max_total_tokens"):
        graph.check_limits(ProgramLimits(max_total_tokens=10 + 15 + 8 + 127))


def test_nested_repeats_multiply_and_deep_or_unnumbered_graphs_are_refused():
    graph = parse_program("program p()\nrepeat 10 { repeat 10 { \"x\" } }")
    graph.check_limits(ProgramLimits(max_repeat=100))
    with pytest.raises(ProgramLimitError, match="max_repeat"):
        graph.check_limits(ProgramLimits(max_repeat=99))
    deep: dict = {"op": "repeat", "count": 1, "body": []}
    node = deep
    for _ in range(100):
        node["body"] = [{"op": "repeat", "count": 1, "body": []}]
        node = node["body"][0]
    with pytest.raises(InvalidArgumentError, match="nested deeper"):
        Graph.from_json({"name": "p", "args": [], "nodes": [deep]})
    with pytest.raises(InvalidArgumentError, match="ids must be unique"):
        Graph.from_json({"name": "p", "args": [], "nodes": [{"op": "text", "text": "a"},
                                                            {"op": "text", "text": "b"}]})
    with pytest.raises(InvalidArgumentError, match="not valid JSON"):
        Graph.from_json("[" * 100_000)
