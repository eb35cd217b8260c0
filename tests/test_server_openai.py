"""The OpenAI-compatible API through the official `openai` client against a real server:
completions, chat, streaming, n=2, logprobs, response_format json_schema, tool calls."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from conftest import wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string"}}, "required": ["timezone"]}}}


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def test_models(client, live_server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_completion_equals_engine(client, live_server):
    out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                    max_tokens=8, temperature=0)
    expected = live_server.engine.generate("The capital of France is",
                                           {"max_new_tokens": 8, "temperature": 0})
    assert out.choices[0].text == expected["text"]
    assert out.choices[0].finish_reason == "length" and out.object == "text_completion"
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 8


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                    temperature=0, logprobs=2, echo=True)
    choice = out.choices[0]
    assert choice.text.startswith("Once upon a time")
    lp = choice.logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == choice.text[len("Once upon a time"):]
    assert all(len(top) >= 1 for top in lp.top_logprobs)  # 2 unless two tokens decode alike
    assert all(max(top.values()) == pytest.approx(v) for top, v in
               zip(lp.top_logprobs, lp.token_logprobs))  # greedy picks the top token
    assert lp.text_offset[0] == len("Once upon a time")


def test_chat_matches_engine_on_template(client, live_server, tokenizer):
    from conftest import chat_prompt

    out = client.chat.completions.create(model=MODEL, messages=ask("What is 2+2?"),
                                         max_tokens=10, temperature=0)
    expected = live_server.engine.generate(chat_prompt(tokenizer, "What is 2+2?"),
                                           {"max_new_tokens": 10, "temperature": 0})
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == expected["text"]
    assert out.usage.completion_tokens == len(expected["output_ids"])


def test_chat_n2_seeded_sampling_and_logprobs(client):
    kwargs = dict(model=MODEL, messages=ask("Name a fruit."), max_tokens=6, temperature=1.0,
                  seed=7, n=2, logprobs=True, top_logprobs=2)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    for choice in a.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)


def test_chat_stream_with_usage(client):
    kwargs = dict(model=MODEL, messages=ask("Say hello."), max_tokens=8, temperature=0)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, n=2,
                                            stream_options={"include_usage": True})
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [full.choices[0].message.content] * 2
    assert reasons == [full.choices[0].finish_reason] * 2
    assert usage.completion_tokens == 2 * full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def _events(lines: Iterator[str], num: int) -> list[dict]:
    """The next `num` SSE events (JSON) from a held `response.iter_lines()` iterator."""
    events: list[dict] = []
    for line in lines:
        if line:
            assert line.startswith("data: ") and line != "data: [DONE]", line
            events.append(json.loads(line[len("data: "):]))
            if len(events) == num:
                break
    return events


def test_chat_n2_stream_stays_alive_while_the_client_holds_it(live_server):
    """Both samples of a streamed n=2 chat keep generating while the client holds the stream
    (a garbage collection included) and both end, their KV freed, once it leaves.
    Regression: the n=2 disconnect test read its first events through a temporary
    `r.iter_lines()`. Dropping that iterator closes it, and httpcore closes the response, i.e.
    the connection, on that GeneratorExit: the client had really left, and the server's (right)
    abort of both samples raced the test's check that they were still alive."""
    engine = live_server.engine
    wait_until(lambda: engine.stats()["running"] + engine.stats()["waiting"] == 0)
    body = {"model": MODEL, "n": 2, "stream": True, "ignore_eos": True, "max_tokens": 1000,
            "messages": ask("Write an essay.")}
    with (httpx.Client(base_url=live_server.base_url, timeout=60) as c,
          c.stream("POST", "/v1/chat/completions", json=body) as r):
        lines = r.iter_lines()  # held until the end of the block (see the docstring)
        assert len(_events(lines, 6)) == 6
        gc.collect()
        time.sleep(0.5)  # plenty for the server to act on a disconnect, were there one
        stats = engine.stats()
        assert stats["running"] + stats["waiting"] == 2, stats
        later = [e["choices"][0] for e in _events(lines, 12)]
        assert {ch["index"] for ch in later} == {0, 1}
        assert all(ch["finish_reason"] is None for ch in later)
    # the client has left now: both samples are aborted and their KV returns to the pool
    wait_until(lambda: engine.stats()["running"] + engine.stats()["waiting"] == 0
                and engine.stats()["kv_used"] == 0)
    wait_until(lambda: live_server.app.state.service.admission.admitted == 0)


def test_completion_stream(client):
    stream = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6,
                                       temperature=0, stream=True)
    chunks = list(stream)
    full = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_cached_tokens_in_usage(client):
    system = "You are a terse assistant. Reply with a single word, no punctuation. " * 4
    msgs = [{"role": "system", "content": system}]
    client.chat.completions.create(model=MODEL, messages=msgs + ask("Sky?"), max_tokens=2,
                                   temperature=0)
    out = client.chat.completions.create(model=MODEL, messages=msgs + ask("Sea?"), max_tokens=2,
                                         temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens > 40


def test_response_format_json_schema(client):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, messages=ask("Invent a person; reply in JSON."), max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_call_arguments_validate(client, choice):
    tool_choice = ("required" if choice == "required"
                   else {"type": "function", "function": {"name": "get_weather"}})
    out = client.chat.completions.create(
        model=MODEL, messages=ask("What's the weather in Paris, in Celsius?"), max_tokens=60,
        temperature=0, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice)
    choice0 = out.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None
    (call,) = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    if choice == "named":
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_tool_call_stream_and_auto(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Weather in Rome?"), max_tokens=60, temperature=0,
        tools=[WEATHER_TOOL], tool_choice="required", stream=True)
    pieces = [tc for chunk in stream if chunk.choices
              for tc in chunk.choices[0].delta.tool_calls or ()]
    assert len(pieces) > 1  # the call streams as it is generated: its name, then arguments
    assert {p.index for p in pieces} == {0} and [p.function.name for p in pieces if p.id] == [
        "get_weather"]
    jsonschema.validate(json.loads("".join(p.function.arguments for p in pieces)),
                        WEATHER_TOOL["function"]["parameters"])
    # auto: a plain answer or a tool call, but always a well-formed one
    out = client.chat.completions.create(model=MODEL, messages=ask("Hi there!"), max_tokens=30,
                                         temperature=0, tools=[WEATHER_TOOL], tool_choice="auto")
    msg = out.choices[0].message
    if msg.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"
        json.loads(msg.tool_calls[0].function.arguments)
    else:
        assert isinstance(msg.content, str) and out.choices[0].finish_reason in ("stop", "length")
