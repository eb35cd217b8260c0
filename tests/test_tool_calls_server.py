"""Tool calls and reasoning through a real server on a tiny random model whose tokenizer has a
hermes-style chat template (benchmarks/auto_tool_calls.py's) and `<tool_call>` tokens: forced and auto calls in the
model's own format, streamed deltas that reassemble to the non-streamed reply, a forced call cut
off by max_tokens (finish_reason "length"), parallel_tool_calls, reasoning_content."""

from __future__ import annotations

import json
import pathlib
import sys

import httpx
import jsonschema
import pytest
from conftest import serve_in_thread

from forklm.parsers.tool_calls import HermesParser
from forklm.runtime.engine.engine import Engine
from forklm.server.protocol import ChatCompletionRequest
from forklm.server.tools import ToolPlan

# benchmarks/ is a folder of the repository, not part of the installed package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.auto_tool_calls import TOOLS, build_hermes_model  # noqa: E402

pytestmark = pytest.mark.slow  # a live server, like test_server_openai
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """(server, reasoning server, the <tool_call> token id): two servers on one engine, both
    with the hermes parser detected from the template, the second with deepseek-r1 reasoning."""
    folder = tmp_path_factory.mktemp("tiny_hermes")
    tool_call_id = build_hermes_model(folder, tokenizer)
    engine = Engine(model_path=str(folder), dtype="float32", max_total_tokens=4096)
    servers = serve_in_thread(engine), serve_in_thread(engine, reasoning_parser="deepseek-r1")
    yield *servers, tool_call_id
    for server in servers:
        server.stop()
    engine.shutdown()


def chat(server, **body) -> dict:
    body = {"model": "default", "messages": ASK, "temperature": 0, "max_tokens": 48, **body}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def chat_stream(server, **body) -> tuple[dict, str]:
    """The streamed reply reassembled as a non-streamed message, and its finish_reason."""
    body = {"model": "default", "messages": ASK, "temperature": 0, "max_tokens": 48,
            "stream": True, **body}
    message: dict = {"role": "assistant", "content": "", "reasoning_content": ""}
    calls: dict[int, dict] = {}
    reason = None
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[6:])["choices"]
            delta, reason = choice["delta"], choice["finish_reason"] or reason
            message["content"] += delta.get("content") or ""
            message["reasoning_content"] += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls", ()):
                call = calls.setdefault(piece["index"], {"function": {"arguments": ""}})
                if "id" in piece:  # a call's first piece: its id and name, once
                    assert "name" not in call["function"]
                    call.update(id=piece["id"], type=piece["type"])
                    call["function"]["name"] = piece["function"]["name"]
                call["function"]["arguments"] += piece["function"]["arguments"]
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, reason


def same_reply(streamed: dict, whole: dict) -> None:
    """Equal but for the calls' ids (each reply has its own)."""
    strip = [{**c, "id": None} for c in whole.get("tool_calls", ())]
    assert [{**c, "id": None} for c in streamed.get("tool_calls", ())] == strip
    assert (streamed["content"] or None) == whole["content"]
    assert (streamed["reasoning_content"] or None) == whole.get("reasoning_content")


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_call_streams_as_it_is_whole(tiny, choice):
    _, server, _ = tiny  # the reasoning server: a forced call is never read as reasoning
    out = chat(server, tools=TOOLS, tool_choice=choice)
    (c,) = out["choices"]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        SCHEMAS[call["function"]["name"]])
    streamed, reason = chat_stream(server, tools=TOOLS, tool_choice=choice)
    assert reason == "tool_calls"
    same_reply(streamed, c["message"])


def test_forced_call_cut_off_is_a_tool_call_with_length(tiny):
    server, _, _ = tiny
    named = {"type": "function", "function": {"name": "get_weather"}}
    full = chat(server, tools=TOOLS, tool_choice=named)["choices"][0]["message"]
    out = chat(server, tools=TOOLS, tool_choice=named, max_tokens=4)["choices"][0]
    assert out["finish_reason"] == "length" and out["message"]["content"] is None
    (call,) = out["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = call["function"]["arguments"]
    assert args and full["tool_calls"][0]["function"]["arguments"].startswith(args)
    streamed, reason = chat_stream(server, tools=TOOLS, tool_choice=named, max_tokens=4)
    assert reason == "length"
    same_reply(streamed, out["message"])


def test_auto_calls_in_the_model_format_are_constrained(tiny):
    """A bias on <tool_call> makes the random model open calls; the structural tag makes each
    one a valid call (several: parallel calls) until max_tokens."""
    server, _, tool_call_id = tiny
    bias = {"logit_bias": {str(tool_call_id): 100}, "max_tokens": 80}
    out = chat(server, tools=TOOLS, **bias)["choices"][0]
    calls = out["message"]["tool_calls"]
    assert len(calls) >= 2 and out["message"]["content"] is None
    for call in calls:
        if call is not calls[-1] or out["finish_reason"] != "length":
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                SCHEMAS[call["function"]["name"]])
    streamed, _ = chat_stream(server, tools=TOOLS, **bias)
    same_reply(streamed, out["message"])
    (first,) = chat(server, tools=TOOLS, parallel_tool_calls=False,
                    **bias)["choices"][0]["message"]["tool_calls"]
    assert {**first, "id": None} == {**calls[0], "id": None}


def test_auto_plain_reply_and_reasoning(tiny):
    """Without a call, auto is plain text; the deepseek-r1 parser reads the reply as reasoning
    (its template opens <think> in the prompt), unless separate_reasoning is false."""
    plain, server, _ = tiny
    out = chat(plain, tools=TOOLS, max_tokens=12)["choices"][0]
    text = out["message"]["content"]
    assert "tool_calls" not in out["message"] and out["finish_reason"] == "length"
    assert text and "reasoning_content" not in out["message"]
    assert "</think>" not in text and "<tool_call>" not in text
    out = chat(server, tools=TOOLS, max_tokens=12)["choices"][0]
    assert out["message"]["reasoning_content"] == text.strip()
    assert out["message"]["content"] is None and out["finish_reason"] == "length"
    streamed, _ = chat_stream(server, tools=TOOLS, max_tokens=12)
    same_reply(streamed, out["message"])
    raw = chat(server, tools=TOOLS, max_tokens=12, separate_reasoning=False)["choices"][0]
    assert raw["message"] == {"role": "assistant", "content": text}


def test_auto_tool_calls_benchmark_counts(tiny):
    """benchmarks/auto_tool_calls.py's measure: constrained, every closed call validates."""
    from benchmarks.auto_tool_calls import measure

    server, _, tool_call_id = tiny
    plan = ToolPlan("auto", tuple(ChatCompletionRequest(model="m", messages=ASK,
                                                        tools=TOOLS).tools or ()),
                    parser=HermesParser())
    r = measure(server.engine, plan, True, {tool_call_id: 100.0}, 3)
    assert r["replies"] == r["opened"] == r["called"] == 3
    assert r["validated"] == r["parsed"] == r["calls"] - r["cut"] > 0
