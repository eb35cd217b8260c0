"""POST /v1/messages and /v1/messages/count_tokens through the official `anthropic` client against
a real server on the default model: replies equal the chat endpoint's for the same conversation,
streamed events come in Anthropic's order and validate against the package's own types, the
tool loop, thinking blocks with a reasoning parser, token counts, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from conftest import assert_idle_and_clean, serve_in_thread, wait_until
from pydantic import TypeAdapter

from forklm.parsers.reasoning import get_reasoning_parser
from forklm.parsers.tool_calls import get_tool_call_parser
from forklm.server.anthropic_output import BlockBuilder
from forklm.server.protocol import FunctionDef, Tool
from forklm.server.tools import ToolPlan

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# This client version has no sampling arguments; the body field is still Anthropic's.
GREEDY = {"temperature": 0}
SYSTEM = "Answer briefly."
CONVERSATION = [{"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "Apple."},
                {"role": "user", "content": "Name another one."}]
CITY = {"type": "string", "enum": ["Paris", "Tokyo"]}  # short, so a forced call ends quickly
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": CITY},
                            "required": ["city"], "additionalProperties": False}}
TOOL_RESULT = "sunny and 31 degrees, reading R-4417"  # a marker to find in the next prompt
_EVENTS: TypeAdapter = TypeAdapter(RawMessageStreamEvent)


@pytest.fixture(scope="module")
def client(live_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server.base_url, api_key="x", max_retries=0)


def chat(live_server, messages: list, **body) -> dict:
    r = httpx.post(live_server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def create(client: anthropic.Anthropic, max_tokens: int = 12, extra: dict | None = None,
           **kwargs) -> Message:
    """A greedy message, validated strictly as the package's Message (the client only
    constructs it)."""
    http = client.messages.with_raw_response.create(
        model=MODEL, max_tokens=max_tokens, extra_body={**GREEDY, **(extra or {})}, **kwargs)
    return Message.model_validate(http.http_response.json())


def raw_events(live_server, **body) -> list:
    """A streamed message's frames, each validated as a RawMessageStreamEvent."""
    events, names = [], []
    with httpx.stream("POST", live_server.base_url + "/v1/messages", timeout=60, json={
            "model": MODEL, "stream": True, **GREEDY, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                events.append(_EVENTS.validate_python(json.loads(line.removeprefix("data: "))))
    assert names == [e.type for e in events]
    return events


def check_order(events: list) -> None:
    """message_start; the blocks' events (check_block_order); message_delta; message_stop."""
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    check_block_order(events[1:-2])


def check_block_order(events: list) -> None:
    """Each block's start, deltas and stop, one block at a time, indices in order."""
    open_index, next_index = None, 0
    for e in events:
        if e.type == "content_block_start":
            assert open_index is None and e.index == next_index
            open_index, next_index = e.index, next_index + 1
        elif e.type == "content_block_delta":
            assert e.index == open_index
        else:
            assert e.type == "content_block_stop" and e.index == open_index
            open_index = None
    assert open_index is None and next_index >= 1


def streamed_text(events: list, delta_type: str = "text_delta", field: str = "text") -> str:
    return "".join(getattr(e.delta, field) for e in events
                   if e.type == "content_block_delta" and e.delta.type == delta_type)


def test_message_is_the_chat_completion(client, live_server):
    message = create(client, system=SYSTEM, messages=CONVERSATION)
    reply = chat(live_server, [{"role": "system", "content": SYSTEM}, *CONVERSATION],
                 max_tokens=12)
    [block] = message.content
    assert block.type == "text" and block.text == reply["choices"][0]["message"]["content"]
    assert block.text.strip()
    assert message.id.startswith("msg_") and message.model == MODEL
    finish = reply["choices"][0]["finish_reason"]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    assert message.stop_sequence is None
    # The same prompt again: both endpoints are served the same cached prefix.
    again = create(client, system=SYSTEM, messages=CONVERSATION)
    usage, chat_usage = again.usage, reply["usage"]
    assert usage.output_tokens == chat_usage["completion_tokens"] > 0
    assert usage.cache_read_input_tokens == chat_usage["prompt_tokens_details"]["cached_tokens"]
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == chat_usage["prompt_tokens"]


def test_count_tokens_is_the_prompt(client):
    count = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=CONVERSATION,
                                         tools=[WEATHER])
    # A fresh cache namespace: nothing is read from the cache, all of the prompt is input.
    salted = create(client, system=SYSTEM, messages=CONVERSATION, tools=[WEATHER],
                    extra={"cache_salt": uuid.uuid4().hex}, max_tokens=2)
    assert salted.usage.cache_read_input_tokens == 0
    assert count.input_tokens == salted.usage.input_tokens
    plain = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=CONVERSATION)
    assert plain.input_tokens < count.input_tokens  # the tool prompt is counted


def test_stream_has_anthropics_order_and_the_same_text(client, live_server):
    whole = create(client, system=SYSTEM, messages=CONVERSATION)
    events = raw_events(live_server, max_tokens=12, system=SYSTEM, messages=CONVERSATION)
    check_order(events)
    assert streamed_text(events) == whole.content[0].text
    start, delta = events[0], events[-2]
    assert start.message.content == [] and start.message.stop_reason is None
    assert delta.delta.stop_reason == whole.stop_reason
    assert delta.usage.output_tokens == whole.usage.output_tokens
    prompt_len = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert start.message.usage.input_tokens + start.message.usage.cache_read_input_tokens \
        == prompt_len
    with client.messages.stream(model=MODEL, max_tokens=12, system=SYSTEM,
                                messages=CONVERSATION, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    wait_until(lambda: live_server.engine.stats()["running"] == 0)
    assert_idle_and_clean(live_server.engine)


def test_stop_sequence_and_max_tokens(client):
    question = [{"role": "user", "content": "Describe the sea in one sentence."}]
    whole = create(client, messages=question, max_tokens=16)
    text = whole.content[0].text
    word = text.split()[2]  # a word inside the greedy reply
    stopped = create(client, messages=question, max_tokens=16, stop_sequences=["#@!", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]
    cut = create(client, messages=question, max_tokens=3)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_output_format_constrains_the_text(client):
    schema = WEATHER["input_schema"]
    message = create(client, max_tokens=20, messages=CONVERSATION,
                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_prefill_continues_the_final_assistant_message(client, live_server):
    messages = [{"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": "My favourite fruit is"}]
    message = create(client, messages=messages)
    reply = chat(live_server, messages, max_tokens=12, add_generation_prompt=False,
                 continue_final_message=True)
    assert message.content[0].text == reply["choices"][0]["message"]["content"]
    assert message.content[0].text.strip()


def test_tool_loop(client, live_server, engine_prompts):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = create(client, max_tokens=30, messages=question, tools=[WEATHER],
                    tool_choice={"type": "tool", "name": "get_weather"})
    [use] = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert called.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=30, messages=question, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body=GREEDY) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert kinds and set(kinds) == {"input_json_delta"}
    assert streamed.content[0].input == use.input and streamed.stop_reason == "tool_use"
    # The round trip: the client's own blocks back, then the tool's result.
    engine_prompts.clear()
    answer = create(client, max_tokens=12, tools=[WEATHER], tool_choice={"type": "none"},
                    messages=[*question, {"role": "assistant", "content": called.content},
                              {"role": "user", "content": [{
                                  "type": "tool_result", "tool_use_id": use.id,
                                  "content": [{"type": "text", "text": TOOL_RESULT}]}]}])
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text.strip()
    assert answer.stop_reason in ("end_turn", "max_tokens")
    [prompt] = engine_prompts
    assert TOOL_RESULT in prompt and json.dumps(use.input) in prompt


def test_thinking_blocks_with_a_reasoning_parser(make_engine):
    # deepseek-r1's replies reason from their first token: a reply that never closes </think>
    # is all thinking, so the default model's plain reply is one thinking block.
    server = serve_in_thread(make_engine(), reasoning_parser="deepseek-r1")
    try:
        client = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0)
        message = create(client, messages=CONVERSATION)
        reply = chat(server, CONVERSATION, max_tokens=12)["choices"][0]["message"]
        [block] = message.content
        assert block.type == "thinking" and block.thinking == reply["reasoning_content"]
        assert block.thinking.strip()
        events = raw_events(server, max_tokens=12, messages=CONVERSATION)
        check_order(events)
        assert streamed_text(events, "thinking_delta", "thinking") == block.thinking
        assert events[1].content_block.type == "thinking"
    finally:
        server.stop()


def test_streamed_blocks_are_the_whole_replys():
    # Reasoning, text and a call in one reply (Qwen3's shapes), fed a character at a time.
    tool = Tool(function=FunctionDef(name="get_weather", parameters=WEATHER["input_schema"]))
    plan = ToolPlan("auto", (tool,), parser=get_tool_call_parser("hermes"),
                    reasoning=get_reasoning_parser("qwen3"))
    reply = ("<think>It asks for weather.</think>\n\nLet me check.\n<tool_call>\n"
             '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    streamed, events = BlockBuilder(plan.reader()), []
    for ch in reply:
        events += streamed.feed(ch)
    events += streamed.finish()
    whole = BlockBuilder(plan.reader())
    whole.feed(reply)
    whole.finish()
    events = [_EVENTS.validate_python(e) for e in events]
    check_block_order(events)
    assert [e.content_block.type for e in events if e.type == "content_block_start"] \
        == ["thinking", "text", "tool_use"]
    assert streamed_text(events, "thinking_delta", "thinking") == "It asks for weather."
    assert streamed_text(events) == "Let me check."
    arguments = streamed_text(events, "input_json_delta", "partial_json")
    assert json.loads(arguments) == {"city": "Paris"} == streamed.blocks[2]["input"]
    assert streamed.called and whole.called
    unnamed = [{k: v for k, v in b.items() if k != "id"} for b in streamed.blocks]
    assert unnamed == [{k: v for k, v in b.items() if k != "id"} for b in whole.blocks]


def test_errors_in_anthropics_shape(client, live_server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "reads no images" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="names no tool"):
        client.messages.create(model=MODEL, max_tokens=4, messages=CONVERSATION,
                               tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=4, messages=CONVERSATION)
    assert e.value.body["error"]["type"] == "not_found_error"
    # max_tokens is required, as Anthropic's API has it
    r = httpx.post(live_server.base_url + "/v1/messages", json={
        "model": MODEL, "messages": CONVERSATION}, timeout=60)
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    r = httpx.post(live_server.base_url + "/v1/messages/count_tokens", json={
        "model": MODEL, "messages": CONVERSATION, "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    # other endpoints keep OpenAI's shape
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={
        "model": MODEL, "messages": []}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_api_key_as_x_api_key(make_engine):
    server = serve_in_thread(make_engine(), api_key="sekret")
    try:
        wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model=MODEL, max_tokens=2, messages=CONVERSATION)
        assert e.value.body["error"]["type"] == "authentication_error"
        right = anthropic.Anthropic(base_url=server.base_url, api_key="sekret", max_retries=0)
        assert right.messages.count_tokens(model=MODEL, messages=CONVERSATION).input_tokens > 0
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": CONVERSATION, "max_tokens": 1},
            headers={"x-api-key": "sekret"})
        assert r.status_code == 200
        r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": CONVERSATION, "max_tokens": 1})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401  # OpenAI's shape
    finally:
        server.stop()
