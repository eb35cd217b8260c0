"""POST /v1/responses through the official `openai` client and the OpenAI Agents SDK (both its
Chat Completions and its Responses model classes) against a real server on the default model:
plain and streamed responses, the tool round trip (previous_response_id and explicit items),
text.format json_schema, the 400s; every raw event and response is checked against the `openai`
package's own pydantic types, strictly."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from conftest import assert_idle_and_clean, serve_in_thread, wait_until
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, ConfigDict, TypeAdapter

from forklm.runtime.engine.engine import Engine
from forklm.server.responses_store import ResponseStore

slow = pytest.mark.slow  # the tests on the live server (the units run in test-fast too)
MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "string", "enum": ["Paris", "Tokyo"]}  # short, so a forced call ends quickly
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": CITY},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
TOOL_RESULT = "sunny and 31 degrees, reading R-4417"  # a marker to find in the next prompt
_EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)



def post(live_server, **body) -> httpx.Response:
    return httpx.post(live_server.base_url + "/v1/responses", json={"model": MODEL, **body},
                      timeout=60)


def strict(raw: dict) -> Response:
    """The response as the openai package's own model, validated (the client only constructs)."""
    return Response.model_validate(raw)


def raw_events(live_server, **body) -> list:
    """A streamed response's frames, each validated as a ResponseStreamEvent."""
    events, names = [], []
    with httpx.stream("POST", live_server.base_url + "/v1/responses", timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                events.append(_EVENTS.validate_python(json.loads(line.removeprefix("data: "))))
    assert names == [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


@slow
def test_plain_response_is_the_chat_completion(client, live_server):
    kwargs = dict(model=MODEL, max_output_tokens=8, temperature=0)
    http = client.responses.with_raw_response.create(
        input="Name a fruit.", instructions="Answer briefly.", **kwargs)
    raw = http.parse()
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, messages=[
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Name a fruit."}])
    assert raw.output_text == chat.choices[0].message.content
    assert raw.usage.input_tokens == chat.usage.prompt_tokens
    assert raw.usage.output_tokens == chat.usage.completion_tokens == 8
    assert raw.status == "incomplete" and raw.incomplete_details.reason == "max_output_tokens"
    assert strict(http.http_response.json()).output_text == raw.output_text


@slow
def test_streamed_response_events(client, live_server):
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6,
                                    temperature=0)
    events = raw_events(live_server, input="Say hello.", max_output_tokens=6, temperature=0)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 6


@slow
def test_tool_round_trip(client, live_server, engine_prompts):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                    tools=[WEATHER], tool_choice="required", temperature=0,
                                    max_output_tokens=40)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id,
                                      input=[result], tools=[WEATHER], temperature=0,
                                      max_output_tokens=6, tool_choice="none")
    explicit = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=6, tool_choice="none", tools=[WEATHER],
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               call.model_dump(exclude_none=True), result])
    assert engine_prompts[1] == engine_prompts[2]  # the stored conversation is the explicit one
    assert TOOL_RESULT in engine_prompts[1] and call.arguments.replace(" ", "") in \
        engine_prompts[1].replace(" ", "")
    assert chained.output_text == explicit.output_text
    assert chained.previous_response_id == first.id


@slow
def test_streamed_tool_call_events(live_server):
    events = raw_events(live_server, input="Weather in Tokyo?", tools=[WEATHER],
                        tool_choice={"type": "function", "name": "get_weather"},
                        temperature=0, max_output_tokens=30)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments
    assert json.loads(done.arguments) in ({"city": "Paris"}, {"city": "Tokyo"})
    [item] = events[-1].response.output
    assert item.type == "function_call" and item.arguments == done.arguments
    assert events[-1].type == "response.completed" and item.status == "completed"


class Pick(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo"]
    sunny: bool


@slow
def test_json_schema_text_format(client):
    """The SDK's stream helper with a pydantic text_format: it sends text.format json_schema,
    and parses the final text into the model."""
    with client.responses.stream(model=MODEL, input="Pick a city.", temperature=0,
                                 max_output_tokens=40, text_format=Pick) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Pick) and final.output_text == text
    assert final.status == "completed" and final.text.format.type == "json_schema"
    assert final.text.format.schema_["required"] == ["city", "sunny"]


@slow
@pytest.mark.parametrize(("body", "param", "says"), [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0", "only function tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]},
     "input.0.message.content", "input_image"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "messages", "reads no images"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "input.0", "not supported"),
    ({"input": [4.5, "hi"]}, "input", "tag"),  # no items at all (the schema fuzzer's case)
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": []}]},
     "input", "--reasoning-parser"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "nothing to answer"),
    ({"input": "hi", "background": True}, "background", "not supported"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include", "not supported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "hi", "max_output_tokenz": 3}, "max_output_tokenz", "Extra inputs"),
    ({"input": [{"role": "user", "content": "x"}] * 1025}, "input", "at most 1024"),
    ({"input": "hi", "tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"input": []}, "input", "at least one item"),
    ({"input": "hi", "model": "gpt-4o"}, "model", "does not exist"),
])
def test_unsupported_is_a_clear_400(live_server, body, param, says):
    r = post(live_server, **body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"].startswith(param), error
    assert says in error["message"], error


@slow
def test_previous_response_not_found(live_server):
    unstored = post(live_server, input="hi", store=False, max_output_tokens=1).json()
    for missing in ("resp_nope", unstored["id"]):
        r = post(live_server, input="hi", previous_response_id=missing)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "previous_response_not_found"
        assert missing in r.json()["error"]["message"]


def test_store_is_bounded_lru():
    from forklm.server.responses_protocol import MessageItem

    def talk(text: str) -> tuple:
        return (MessageItem(role="user", content=text),)

    store = ResponseStore(max_responses=2, max_chars=10)
    store.put("a", talk("1234"))
    store.put("b", talk("5678"))
    assert store.get("a") is not None  # now the most recently used
    store.put("c", talk("9"))
    assert store.get("b") is None and len(store) == 2  # count bound: b was least recent
    store.put("d", talk("abcdefg"))  # 4 + 1 + 7 chars > 10: the oldest go
    assert store.get("a") is None and store.get("c") is not None and store.num_chars == 8
    store.put("huge", talk("x" * 11))  # over the whole budget: not stored, nothing evicted
    assert store.get("huge") is None and len(store) == 2


@pytest.fixture(scope="module")
def hermes_server(tmp_path_factory, tokenizer):
    """A server on a tiny random Qwen2 whose template renders tools and tool turns in the hermes
    format (benchmarks/auto_tool_calls.py's), with the deepseek-r1 reasoning parser."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    from benchmarks.auto_tool_calls import build_hermes_model

    folder = tmp_path_factory.mktemp("tiny_hermes_responses")
    build_hermes_model(folder, tokenizer)
    engine = Engine(model_path=str(folder), dtype="float32", max_total_tokens=2048)
    server = serve_in_thread(engine, reasoning_parser="deepseek-r1")
    yield server
    server.stop()
    engine.shutdown()


@slow
def test_native_template_tool_turns_and_reasoning_items(hermes_server, monkeypatch):
    """The tool round trip through the model's own template (calls and results in its hermes
    shape), a reply read as a reasoning item (streamed), and reasoning items carried over."""
    engine, seen = hermes_server.engine, []
    prepare = engine.prepare
    monkeypatch.setattr(engine, "prepare", lambda request, **kw: seen.append(request.prompt)
                        or prepare(request, **kw))
    first = strict(post(hermes_server, model="default", input="Weather?", tools=[WEATHER],
                        tool_choice={"type": "function", "name": "get_weather"},
                        temperature=0, max_output_tokens=48).json())
    [call] = first.output
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = raw_events(hermes_server, model="default", previous_response_id=first.id,
                        tools=[WEATHER],
                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                "output": TOOL_RESULT}], temperature=0, max_output_tokens=8)
    assert f"<tool_response>\n{TOOL_RESULT}\n</tool_response>" in seen[1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": ' in seen[1]
    reply = events[-1].response
    assert reply.output[0].type == "reasoning" and reply.output[0].content[0].text
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reply.output[0].content[0].text
    follow = post(hermes_server, model="default", previous_response_id=reply.id, input="Ok.",
                  max_output_tokens=1)  # the stored reasoning item is taken back
    assert follow.status_code == 200, follow.text


# -- units: the output builder on model-native replies, items -> messages --------------------------
HERMES_REPLY = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Tokyo"}}\n</tool_call>')


def built(plan, text: str, piece_len: int, reason: str = "stop"):
    """`text` read in pieces of `piece_len` chars; the events (validated) and the output."""
    from forklm.runtime.engine.results import GenerateOutput
    from forklm.runtime.scheduling.request import FinishReason
    from forklm.server.responses_output import OutputBuilder, Sequencer

    builder = OutputBuilder(plan.reader(), Sequencer())
    events = [e for i in range(0, len(text), piece_len) for e in builder.feed(text[i:i + piece_len])]
    final = GenerateOutput("r", 0, "", [], FinishReason(reason), 3, 5, 0)
    events += builder.finish(final)
    return [_EVENTS.validate_python(e) for e in events], builder.output


def weather_plan(**kw):
    from forklm.parsers.tool_calls import get_tool_call_parser
    from forklm.server.protocol import FunctionDef, Tool
    from forklm.server.tools import ToolPlan

    tool = Tool(function=FunctionDef(name="get_weather", parameters=WEATHER["parameters"]))
    return ToolPlan("auto", (tool,), parser=get_tool_call_parser("hermes"), **kw)


@pytest.mark.parametrize("piece_len", [1, 7, 1000])  # a tag split across pieces, or whole
def test_builder_streams_parallel_hermes_calls(piece_len):
    events, output = built(weather_plan(), HERMES_REPLY, piece_len)
    assert [o["type"] for o in output] == ["message", "function_call", "function_call"]
    assert output[0]["content"][0]["text"] == "Let me check."
    assert [json.loads(o["arguments"]) for o in output[1:]] == [{"city": "Paris"},
                                                                {"city": "Tokyo"}]
    for index in (1, 2):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        assert "".join(pieces) == output[index]["arguments"]
        assert output[index]["status"] == "completed" and output[index]["call_id"]
    if piece_len == 1:  # arguments stream as generated, not at the end
        assert sum(e.type == "response.function_call_arguments.delta" for e in events) > 4
    Response.model_validate({"id": "r", "object": "response", "created_at": 0, "model": MODEL,
                             "output": output, "parallel_tool_calls": True,
                             "tool_choice": "auto", "tools": []})


def test_builder_single_call_reasoning_and_cut_replies():
    from forklm.parsers.reasoning import get_reasoning_parser

    _, output = built(weather_plan(parallel=False), HERMES_REPLY, 5)
    assert [o["type"] for o in output] == ["message", "function_call"]
    plan = weather_plan(reasoning=get_reasoning_parser("qwen3"))
    _, output = built(plan, "<think>It is a weather question.</think>\n\n" + HERMES_REPLY[14:],
                      3)
    assert [o["type"] for o in output] == ["reasoning", "function_call", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text",
                                     "text": "It is a weather question."}]
    events, output = built(weather_plan(), HERMES_REPLY[:80], 4, reason="length")
    assert output[-1]["type"] == "function_call" and output[-1]["status"] == "incomplete"
    _, output = built(weather_plan(), "", 1)  # an empty reply is still one (empty) message
    assert output == [{**output[0], "content": [{"type": "output_text", "text": "",
                                                 "annotations": [], "logprobs": []}]}]


def test_items_become_chat_messages():
    from forklm.server.responses_convert import to_messages
    from forklm.server.responses_protocol import ResponsesRequest

    body = ResponsesRequest(model=MODEL, input=[
        {"role": "developer", "content": [{"type": "input_text", "text": "Be "},
                                          {"type": "input_text", "text": "brief."}]},
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant", "id": "m", "status": "completed", "content": [
            {"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
        {"type": "reasoning", "id": "rs", "summary": [], "content": [{"type": "reasoning_text",
                                                                       "text": "hm"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [
            {"type": "input_text", "text": "rain"}]}])
    messages = [m.model_dump(exclude_none=True) for m in to_messages("Sys.", tuple(body.input))]
    assert [(m["role"], m.get("content")) for m in messages] == [
        ("system", "Sys."), ("developer", "Be brief."), ("user", "Weather?"),
        ("assistant", "Checking."), ("tool", "sunny"), ("tool", "rain")]
    assert [c["id"] for c in messages[3]["tool_calls"]] == ["c1", "c2"]
    assert [m.get("tool_call_id") for m in messages[4:]] == ["c1", "c2"]


def test_request_becomes_chat_request():
    from forklm.server.responses_convert import input_items, to_chat_request
    from forklm.server.responses_protocol import ResponsesRequest

    def chat(**body):
        request = ResponsesRequest(model=MODEL, input="hi", **body)
        return to_chat_request(request, input_items(request))

    out = chat(text={"format": {"type": "json_object"}}, max_output_tokens=5, top_p=0.5,
               tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               parallel_tool_calls=False)
    assert out.response_format is None  # a forced call is no text reply: no text format
    assert out.tool_choice.function.name == "get_weather" and out.tools[0].function.strict
    assert (out.max_completion_tokens, out.top_p, out.parallel_tool_calls) == (5, 0.5, False)
    assert chat(text={"format": {"type": "json_object"}}).response_format.type == "json_object"
    fmt = chat(text={"format": {"type": "json_schema", "name": "x", "schema": CITY}})
    assert fmt.response_format.json_schema.schema_ == CITY


# -- the OpenAI Agents SDK -----------------------------------------------------------------------
class Report(BaseModel):
    city: Literal["Paris", "Tokyo"]
    sunny: bool


@slow
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_runs_a_tool(live_server, engine_prompts, monkeypatch, api):
    """An Agent with a function tool, run to its end: the first turn is forced to call the tool
    (a tiny model would not choose to); the SDK runs it, resets tool_choice and sends the
    result back. The Responses model runs streamed (the SDK reads the typed events), chained by
    previous_response_id (the second request sends only the tool result), with a structured
    output_type, so its last turn ends by itself (the SDK fails an incomplete one)."""
    import agents  # a dev dependency; imported here as it takes ~2 s

    agents.set_tracing_disabled(True)
    ran: list[str] = []
    looked_up: list[str] = []  # the previous_response_ids the server resolved
    get = ResponseStore.get
    monkeypatch.setattr(ResponseStore, "get", lambda store, key: looked_up.append(key)
                        or get(store, key))

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
        """Weather in a city."""
        ran.append(city)
        return TOOL_RESULT

    client = openai.AsyncOpenAI(base_url=live_server.base_url + "/v1", api_key="unused",
                                max_retries=0)
    model_class = (agents.OpenAIChatCompletionsModel if api == "chat_completions"
                   else agents.OpenAIResponsesModel)
    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather],
        model=model_class(model=MODEL, openai_client=client),
        output_type=Report if api == "responses" else None,
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                            max_tokens=12 if api == "chat_completions" else 40))

    async def run():
        if api == "chat_completions":
            return await agents.Runner.run(agent, "Weather in Paris?", max_turns=2)
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?", max_turns=2,
                                              auto_previous_response_id=True)
        kinds = {e.type async for e in streamed.stream_events()}
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return streamed

    result = asyncio.run(run())
    assert ran and ran[0] in ("Paris", "Tokyo")
    first, second = engine_prompts
    assert TOOL_RESULT not in first and TOOL_RESULT in second
    assert "Weather in Paris?" in second  # from the stored conversation, when chained
    assert len(looked_up) == (1 if api == "responses" else 0)
    assert isinstance(result.final_output, Report if api == "responses" else str)


@slow
def test_engines_left_clean(live_server, hermes_server):
    """After every response above (streamed, cut, forced, failed): no request left running."""
    for engine in (live_server.engine, hermes_server.engine):
        wait_until(lambda engine=engine: engine.stats()["running"] == 0)
        assert_idle_and_clean(engine)
