"""POST /v1/programs/run on a live server: graph JSON and textual programs, batches, streaming,
bad programs (400 naming the problem), run-time errors per item, and equality with the same
program run in process (greedy, fp32 on both sides)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

import forklm as sgl
from forklm.frontend_dsl.interpreter import GraphProgram
from forklm.frontend_dsl.ir import walk

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@sgl.function
def qa(s, question):
    s += sgl.system("Answer in a few words.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=8))
    s += "\nIs that answer correct? "
    s += sgl.select("verdict", ["yes", "no"])


@sgl.function
def tips(s, topic):
    s += f"Two tips about {topic}:\n"
    forks = s.fork(2)
    forks += lambda i: f"Tip {i + 1}:" + sgl.gen("tip", max_tokens=6, stop="\n")
    forks.join()


def _post(server, body, timeout=120.0):
    return httpx.post(f"{server.base_url}/v1/programs/run", json=body, timeout=timeout)


def _local(graph, engine, arguments):
    """The same graph run in process on an fp32 engine: the reference result."""
    states = GraphProgram(graph).run_batch(arguments, backend=engine, **GREEDY)
    return [{"variables": s.variables(), "text": s.text(), "messages": s.messages()}
            for s in states]


def _strip(results):
    return [{k: r[k] for k in ("variables", "text", "messages")} for r in results]


def test_graph_json_matches_in_process_run(live_server, make_engine):
    graph = qa.trace()
    body = {"program": json.loads(graph.to_json()),
            "arguments": {"question": "What is the capital of France?"},
            "sampling_params": GREEDY}
    reply = _post(live_server, body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["program"] == {"name": "qa", "num_nodes": len(walk(graph.nodes))}
    (result,) = data["results"]
    assert result["variables"]["verdict"] in ("yes", "no")
    assert [m["role"] for m in result["messages"]] == ["system", "user", "assistant"]
    meta = result["meta_info"]
    assert meta["prompt_tokens"] > 0 and 0 < meta["completion_tokens"] <= 8
    assert meta["variables"]["answer"]["completion_tokens"] == meta["completion_tokens"]
    assert "normalized_prompt_logprobs" in meta["variables"]["verdict"]
    assert _strip([result]) == _local(graph, make_engine(), [body["arguments"]])


def test_batch_of_eight_in_one_request(live_server, make_engine):
    graph = tips.trace()
    topics = ["sleep", "tea", "running", "chess", "python", "gardens", "rain", "music"]
    arguments = [{"topic": t} for t in topics]
    reply = _post(live_server, {"program": json.loads(graph.to_json()), "arguments": arguments,
                                "sampling_params": GREEDY})
    assert reply.status_code == 200, reply.text
    results = reply.json()["results"]
    assert len(results) == 8
    for topic, r in zip(topics, results):
        assert r["text"].startswith(f"Two tips about {topic}:\n")
        assert isinstance(r["variables"]["tip"], list) and len(r["variables"]["tip"]) == 2
    # the shared constant prefix is prefilled once, so later items hit the radix cache
    assert sum(r["meta_info"]["cached_tokens"] for r in results) > 0
    assert _strip(results) == _local(graph, make_engine(), arguments)


QA_TEXT = '''
program qa(question)
system { "Answer in a few words." }
user { "{question}" }
assistant { gen answer max_tokens=8 }
"\\nIs that answer correct? "
select verdict choices=["yes", "no"]
'''


def test_textual_program_equals_its_python_twin(live_server):
    arguments = {"question": "What is the capital of France?"}
    replies = [_post(live_server, {"program_text": QA_TEXT, "arguments": arguments,
                                   "sampling_params": GREEDY}),
               _post(live_server, {"program": json.loads(qa.trace().to_json()),
                                   "arguments": arguments, "sampling_params": GREEDY})]
    assert [r.status_code for r in replies] == [200, 200], replies[0].text
    text_result, graph_result = (r.json()["results"][0] for r in replies)
    assert _strip([text_result]) == _strip([graph_result])


def _assert_400(reply, *fragments):
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def test_bad_programs_get_400_naming_the_problem(live_server):
    graph = json.loads(tips.trace().to_json())
    ok = {"program": graph, "arguments": {"topic": "tea"}, "sampling_params": GREEDY}
    _assert_400(_post(live_server, {**ok, "program": {"name": "x", "nodes": 5}}), "nodes")
    error = _assert_400(_post(live_server, {"program_text": 'program p()\n"a" gen x }\n'}),
                        "line 2, column 11", "expected")
    assert error["param"] == "program_text"
    fork = 'program p()\nfork 65 { gen t max_tokens=1 } join\n'
    _assert_400(_post(live_server, {"program_text": fork}), "max_fork_size")
    repeat = 'program p()\nrepeat 100000 { gen x max_tokens=1 }\n'
    _assert_400(_post(live_server, {"program_text": repeat}), "max_repeat")
    # a run default max counts for every gen that sets none: 2 x 100000 > 131072
    two_gens = {"program_text": 'program p()\n"a" gen x "b" gen y\n',
                "sampling_params": {"max_new_tokens": 100000}}
    _assert_400(_post(live_server, two_gens), "max_total_tokens")
    _assert_400(_post(live_server, {**ok, "arguments": {"subject": "tea"}}), "subject")
    _assert_400(_post(live_server, {**ok, "arguments": {}}), "topic")
    _assert_400(_post(live_server, {**ok, "sampling_params": {"temprature": 0}}), "temprature")
    _assert_400(_post(live_server, {**ok, "sampling_params": {"top_p": 7}}), "top_p")
    _assert_400(_post(live_server, {**ok, "program_text": QA_TEXT}), "exactly one")
    _assert_400(_post(live_server, {**ok, "bogus": 1}), "bogus")
    _assert_400(_post(live_server, {**ok, "arguments": [{"topic": "a"}] * 2, "stream": True}),
                "stream")
    assert _post(live_server, ok).status_code == 200


def test_run_time_failure_is_the_items_error(live_server):
    """xgrammar rejects the lookahead only when the gen runs: the item reports it, HTTP 200."""
    graph = json.loads(tips.trace().to_json())
    body = {"program_text": 'program p()\n"Digits: " gen d regex="(?=1)[0-9]+" max_tokens=4\n'}
    reply = _post(live_server, body)
    assert reply.status_code == 200, reply.text
    (result,) = reply.json()["results"]
    assert set(result) == {"error"} and result["error"]["type"] == "invalid_request_error"
    assert _post(live_server, {"program": graph, "arguments": {"topic": "tea"},
                               "sampling_params": GREEDY}).status_code == 200


def _sse_payloads(lines):
    events = []
    for line in lines:
        if line.startswith("data: "):
            events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_stream_sends_text_and_variables_as_they_fill(live_server):
    body = {"program": json.loads(qa.trace().to_json()), "stream": True,
            "arguments": {"question": "Name a color."}, "sampling_params": GREEDY}
    with httpx.stream("POST", f"{live_server.base_url}/v1/programs/run", json=body,
                      timeout=120) as reply:
        assert reply.status_code == 200
        events = _sse_payloads(list(reply.iter_lines()))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "result" and "text" in kinds
    variables = {e["name"]: e["value"] for e in events if e["type"] == "variable"}
    result = events[-1]
    assert variables == result["variables"]
    assert "".join(e["text"] for e in events if e["type"] == "text") == result["text"]
    assert kinds.index("variable") < len(kinds) - 1  # a variable came before the end


def test_disconnect_aborts_the_program(live_server):
    body = {"program_text": 'program p()\n"Count: " gen n max_tokens=4000 ignore_eos=true\n',
            "stream": True, "sampling_params": {"temperature": 0.0}}
    start = time.monotonic()
    with httpx.stream("POST", f"{live_server.base_url}/v1/programs/run", json=body,
                      timeout=60) as reply:
        for line in reply.iter_lines():
            if '"text"' in line and "Count" not in line:
                break  # the gen is producing tokens: leave
    stats = _wait_idle(live_server.engine)
    assert (stats["running"], stats["waiting"], stats["kv_used"]) == (0, 0, 0)
    assert time.monotonic() - start < 30  # 4000 tokens would take minutes on the CPU


def _wait_idle(engine, seconds=20):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == stats["waiting"] == stats["kv_used"] == 0:
            return stats
        time.sleep(0.1)
    return stats


def test_disconnect_aborts_a_non_streamed_batch(live_server):
    body = {"program_text": 'program p(x)\n"Count: " gen n max_tokens=4000 ignore_eos=true\n',
            "arguments": [{"x": "a"}, {"x": "b"}], "sampling_params": {"temperature": 0.0}}
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        _post(live_server, body, timeout=2.0)
    stats = _wait_idle(live_server.engine)
    assert (stats["running"], stats["waiting"], stats["kv_used"]) == (0, 0, 0)
    assert time.monotonic() - start < 30


def test_react_loop_runs_server_side_as_in_process(live_server, make_engine):
    """repeat / if / break are decided on the server; same result as the in-process run."""
    from concurrent.futures import ThreadPoolExecutor

    from forklm.frontend_dsl.textual import parse_program

    source = (EXAMPLES / "programs" / "react.fl").read_text()
    source = source.replace("max_tokens=32", "max_tokens=6").replace("max_tokens=16", "max_tokens=4")
    arguments = {"question": "What is 12 times 12?"}
    body = {"program_text": source, "arguments": arguments, "sampling_params": GREEDY}
    with ThreadPoolExecutor(1) as pool:  # the server and the reference run in the same batches
        reply = pool.submit(_post, live_server, body)
        expected = _local(parse_program(source), make_engine(), [arguments])
        reply = reply.result()
    assert reply.status_code == 200, reply.text
    (result,) = reply.json()["results"]
    assert "error" not in result and "action" in result["variables"]
    assert _strip([result]) == expected
