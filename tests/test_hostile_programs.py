"""Hostile programs (issue 16): a cheap request may not stall, starve or poison the server.
Limits are enforced while a graph is built (not after), every engine request a run may have in
flight is admitted, a refused stream gives its admission back, and input that used to raise deep
inside Python (huge numbers, deep nesting) is a 400 naming the problem."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import assert_idle_and_clean, serve_in_thread

from forklm.frontend_dsl import Graph, ProgramLimitError, ProgramLimits, ProgramSyntaxError
from forklm.frontend_dsl.limits import BuildBudget, max_in_flight
from forklm.frontend_dsl.textual import parse_program
from forklm.runtime.errors import InvalidArgumentError

OK_GEN = {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
OK_PROGRAM = {"program_text": 'program p()\n"Hi" gen x max_tokens=2\n',
              "sampling_params": {"temperature": 0}}
HUGE = "9" * 5000  # Python's int() refuses more than 4300 digits
NESTED_FORKS = 'program p()\nfork 64 { fork 64 { fork 64 { "x" } join } join } join\n'


def _deep_list(depth: int) -> str:
    return "[" * depth + '"x"' + "]" * depth


def _deep_set_graph(depth: int) -> str:
    """A graph JSON (as text: json.dumps would recurse) whose one set node holds a value nested
    `depth` lists deep."""
    node = '{"op": "set", "id": 0, "name": "v", "value": ' + _deep_list(depth) + "}"
    return '{"name": "p", "args": [], "nodes": [' + node + "]}"


# -- the DSL: limits while building ------------------------------------------------------------
def test_a_huge_fork_is_refused_before_any_branch_is_built():
    start = time.perf_counter()
    with pytest.raises(ProgramLimitError, match="max_fork_size") as info:
        parse_program('program p()\nfork 300000 { "x" } join')
    assert info.value.name == "max_fork_size" and info.value.value == 300000
    assert time.perf_counter() - start < 0.5  # was 6.8 s of building 300,000 branches


def test_nested_forks_stop_at_the_node_limit_while_expanding():
    budget_limits = ProgramLimits(max_nodes=2000)
    start = time.perf_counter()
    with pytest.raises(ProgramLimitError, match="max_nodes") as info:
        parse_program(NESTED_FORKS, budget_limits)  # 64**3 branches if fully built
    assert info.value.value == 2001  # counted one by one: stopped at the first node too many
    assert time.perf_counter() - start < 0.5
    with pytest.raises(ProgramLimitError, match="max_nodes"):
        Graph.from_json(_nested_fork_json(64, 3), budget_limits)


def _nested_fork_json(size: int, levels: int) -> dict:
    body: list = [{"op": "text", "text": "x"}]
    for _ in range(levels):
        body = [{"op": "fork", "size": size, "branches": [body] * size}]
    return {"name": "p", "args": [], "nodes": body}


def test_budget_counts_text_copies_and_choices():
    with pytest.raises(ProgramLimitError, match="max_text_chars"):
        parse_program('program p()\nfork 8 { "' + "a" * 1000 + '" } join',
                      ProgramLimits(max_text_chars=5000))
    choices = ", ".join(f'"c{i}"' for i in range(2000))
    with pytest.raises(ProgramLimitError, match="max_choices") as info:
        parse_program(f"program p()\nselect v choices=[{choices}]")
    assert info.value.value == 2000
    budget = BuildBudget(ProgramLimits(max_fork_size=4))
    with pytest.raises(ProgramLimitError, match="max_fork_size"):
        budget.check_fork(5)


@pytest.mark.parametrize("source,says", [
    (f'program p()\nrepeat {HUGE} {{ "x" }}', "repeat count"),
    (f'program p()\nfork {HUGE} {{ "x" }} join', "fork size"),
    (f"program p()\ngen x max_tokens={HUGE}", "max_tokens"),
    (f"program p()\nset v = [1, -{HUGE}]", "set v"),
])
def test_huge_numbers_are_syntax_errors_naming_the_field(source, says):
    with pytest.raises(ProgramSyntaxError, match="5000 digits") as info:
        parse_program(source)
    assert says in str(info.value) and info.value.line == 2


def test_deep_nesting_is_refused_not_a_recursion_error():
    blocks = "program p()\n" + "scope a { " * 2000 + "}" * 2000
    with pytest.raises(ProgramLimitError, match="max_depth"):
        parse_program(blocks)
    parse_program("program p()\n" + "scope a { " * 32 + "}" * 32)  # the limit itself is fine
    with pytest.raises(ProgramSyntaxError, match="nested deeper than 64"):
        parse_program(f"program p()\nset v = {_deep_list(2000)}")
    with pytest.raises(InvalidArgumentError, match="nested deeper than 64"):
        Graph.from_json(_deep_set_graph(900))
    Graph.from_json(_deep_set_graph(60))


def test_requests_count_n_choices_forks_and_repeats():
    graph = parse_program('program p()\n"a" gen x max_tokens=1\n')
    graph.check_limits(default_n=64)
    with pytest.raises(ProgramLimitError, match="max_requests"):
        graph.check_limits(default_n=20000)
    with pytest.raises(ProgramLimitError, match="max_total_tokens"):  # max_tokens x n
        parse_program("program p()\ngen x").check_limits(ProgramLimits(max_total_tokens=8000),
                                                          default_n=64)
    repeated = parse_program('program p()\nrepeat 200 { select v choices=["a", "b"] }')
    with pytest.raises(ProgramLimitError, match="max_requests"):
        repeated.check_limits(ProgramLimits(max_requests=399))
    repeated.check_limits(ProgramLimits(max_requests=400))


def test_in_flight_peak_adds_fork_branches_until_their_join():
    fork = 'fork 3 { select v choices=["a", "b"] } join'
    assert max_in_flight(parse_program(f"program p()\n{fork}\ngen y"), default_n=4) == 6
    assert max_in_flight(parse_program(f"program p()\n{fork}\ngen y"), default_n=7) == 7
    assert max_in_flight(parse_program("program p()\ngen y"), default_n=5) == 5
    assert max_in_flight(parse_program('program p()\n"no gens"')) == 1
    # unjoined branches keep running beside the parent and across loop iterations
    tips = parse_program('program p()\n"T" gen t max_tokens=1')
    unjoined = Graph.from_json({"name": "p", "args": [], "nodes": [
        {"op": "repeat", "id": 0, "count": 3, "body": [
            {"op": "fork", "id": 1, "size": 2, "branches": [
                [{"op": "gen", "id": 2, "name": "a"}], [{"op": "gen", "id": 3, "name": "b"}]]}]},
        {"op": "gen", "id": 4, "name": "c"}]})
    assert max_in_flight(unjoined) == 3 * 2 + 1
    assert max_in_flight(tips) == 1
    with pytest.raises(ProgramLimitError, match="max_parallel_requests"):
        parse_program(f"program p()\n{fork}").check_limits(
            ProgramLimits(max_parallel_requests=5))


# -- a live server --------------------------------------------------------------------------------
def _post(server, body, timeout=60.0):
    return httpx.post(f"{server.base_url}/v1/programs/run", json=body, timeout=timeout)


def _assert_400(reply: httpx.Response, *fragments: str) -> dict:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


def _beside(server, hostile: dict) -> tuple[httpx.Response, float, httpx.Response, float]:
    """Send `hostile` and, while it is in the server, an ordinary /generate request; each reply
    with its seconds."""
    out: dict[str, tuple[httpx.Response, float]] = {}

    def send_hostile() -> None:
        start = time.perf_counter()
        reply = _post(server, hostile)
        out["hostile"] = (reply, time.perf_counter() - start)

    thread = threading.Thread(target=send_hostile)
    thread.start()
    start = time.perf_counter()
    ordinary = httpx.post(f"{server.base_url}/generate", json=OK_GEN, timeout=60)
    ordinary_s = time.perf_counter() - start
    thread.join(timeout=60)
    return (*out["hostile"], ordinary, ordinary_s)


@pytest.mark.slow
@pytest.mark.parametrize("source,limit", [
    ('program p()\nfork 300000 { "x" } join', "max_fork_size"),
    (NESTED_FORKS, "max_nodes"),
])
def test_huge_forks_are_refused_at_once_beside_an_ordinary_request(live_server, source, limit):
    reply, seconds, ordinary, ordinary_s = _beside(live_server, {"program_text": source})
    assert _assert_400(reply, limit)["param"] == limit
    assert seconds < 2.0  # refused while building (6.8 s of building before)
    assert ordinary.status_code == 200 and len(ordinary.json()["output_ids"]) == 2
    assert ordinary_s < 10.0


@pytest.mark.slow
def test_n_and_choices_count_against_the_limits_and_the_queue(live_server):
    limit = live_server.app.state.service.admission.limit  # 64 running + 256 queued
    twenty_k = {**OK_PROGRAM, "sampling_params": {"n": 20000, "temperature": 0}}
    reply, seconds, ordinary, _ = _beside(live_server, twenty_k)
    assert _assert_400(reply)["param"] in ("n", "max_requests")  # SamplingParams' bound or ours
    assert seconds < 2.0 and ordinary.status_code == 200
    n64 = {"n": 64, "temperature": 0}
    many = {"program_text": "program p()\nfork 2 { repeat 256 { gen x max_tokens=1 } } join",
            "sampling_params": n64}
    assert _assert_400(_post(live_server, many), "n samples")["param"] == "max_requests"
    wide = {"program_text": "program p()\nfork 8 { gen x max_tokens=1 } join",  # 512 at once
            "sampling_params": n64}
    error = _assert_400(_post(live_server, wide), f"admits at most {limit}")
    assert error["param"] == "max_parallel_requests"
    choices = ", ".join(f'"c{i}"' for i in range(2000))
    reply, _, ordinary, _ = _beside(live_server, {
        "program_text": f'program p()\n"Pick:" select v choices=[{choices}]'})
    assert _assert_400(reply, "more than 256 choices")["param"] == "max_choices"
    assert ordinary.status_code == 200
    batch = {"program_text": 'program p(x)\n"{x}" gen y max_tokens=1',
             "sampling_params": {"n": 2, "temperature": 0},
             "arguments": [{"x": str(i)} for i in range(limit // 2 + 1)]}
    assert _assert_400(_post(live_server, batch), "item(s) x 2")["param"] == \
        "max_parallel_requests"
    # run defaults travel in sampling_params, where they are counted, never in the arguments
    _assert_400(_post(live_server, {**OK_PROGRAM, "arguments": {"n": 64}}), "sampling_params")
    assert live_server.app.state.service.admission.admitted == 0


@pytest.mark.slow
def test_a_run_holds_a_slot_per_request_in_flight(live_server):
    """A 3-way fork of 2-choice selects holds 6 slots while it runs, none after."""
    service = live_server.app.state.service
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(service.admission.admitted)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        body = {"program_text": 'program p()\n"Q:" fork 3 { "{i}" gen a max_tokens=8 '
                                'select v choices=["yes", "no"] } join',
                "sampling_params": {"temperature": 0, "ignore_eos": True}}
        reply = _post(live_server, body)
    finally:
        done.set()
        watcher.join()
    assert reply.status_code == 200, reply.text
    assert max(seen) == 6 and service.admission.admitted == 0


@pytest.mark.slow
def test_refused_streams_give_their_admission_back(live_server):
    server = serve_in_thread(live_server.engine, max_queued_requests=0)  # admits 64 at once
    try:
        service = server.app.state.service
        bad = {"program_text": 'program p(topic)\n"{topic}" gen x max_tokens=1', "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            for arguments in ({"subject": "tea"}, {}) * 150:  # 300 > 64
                reply = client.post("/v1/programs/run", json={**bad, "arguments": arguments})
                assert reply.status_code == 400, reply.text
            assert service.admission.admitted == 0
            ordinary = client.post("/generate", json=OK_GEN)
            assert ordinary.status_code == 200, ordinary.text
            with client.stream("POST", "/v1/programs/run", json={
                    **bad, "arguments": {"topic": "tea"}}) as reply:
                lines = [line for line in reply.iter_lines() if line]
            assert reply.status_code == 200 and lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][len("data: "):])["type"] == "result"
        assert service.admission.admitted == 0
        assert_idle_and_clean(live_server.engine)
    finally:
        server.stop()


@pytest.mark.slow
def test_a_stream_whose_client_leaves_gives_its_admission_back(live_server):
    service = live_server.app.state.service
    body = {"program_text": 'program p()\n"Count:" gen n max_tokens=2000 ignore_eos=true',
            "stream": True, "sampling_params": {"temperature": 0}}
    with httpx.stream("POST", f"{live_server.base_url}/v1/programs/run", json=body,
                      timeout=60) as reply:
        assert reply.status_code == 200
        assert service.admission.admitted == 1
    deadline = time.monotonic() + 20
    while service.admission.admitted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.admission.admitted == 0


@pytest.mark.slow
def test_bad_input_that_raised_deep_in_python_is_a_400(live_server):
    for source, says in ((f'program p()\nrepeat {HUGE} {{ "x" }}', "repeat count"),
                         (f"program p()\ngen x max_tokens={HUGE}", "max_tokens")):
        error = _assert_400(_post(live_server, {"program_text": source}), says, "5000 digits")
        assert error["param"] == "program_text"
    blocks = "program p()\n" + "scope a { " * 2000 + "}" * 2000
    assert _assert_400(_post(live_server, {"program_text": blocks}),
                       "nested deeper than 32")["param"] == "max_depth"
    content = '{"program": ' + _deep_set_graph(900) + "}"
    reply = httpx.post(f"{live_server.base_url}/v1/programs/run", content=content,
                       headers={"content-type": "application/json"}, timeout=60)
    assert _assert_400(reply, "nested deeper than 64")["param"] == "nodes[0].value"
    deep_argument = ('{"program_text": "program p(a)\\n\\"{a}\\"", "arguments": {"a": '
                     + _deep_list(900) + "}}")
    reply = httpx.post(f"{live_server.base_url}/v1/programs/run", content=deep_argument,
                       headers={"content-type": "application/json"}, timeout=60)
    assert _assert_400(reply, "nested deeper than 64")["param"] == "arguments"
    assert _post(live_server, OK_PROGRAM).status_code == 200
