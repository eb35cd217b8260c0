"""What real OpenAI clients send, against a real server: the model name "default", the keys the
SDK echoes back in messages, the request options OpenAI accepts; the official client's tutorial
tool loop, stream and parse helpers; chat templates that render tools; --chat-template."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import serve_in_thread
from pydantic import BaseModel

from forklm.runtime.errors import InvalidArgumentError
from forklm.server.chat_template import render_chat, renders_tools
from forklm.server.config import ServerConfig

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
# A Qwen2.5/Hermes-style template, written for these tests: tools as JSON in <tools>, calls as
# <tool_call> objects (arguments through tojson, so they must be objects), results as
# <tool_response>; reads enable_thinking and reasoning_effort.
HERMES_TEMPLATE = (
    "{%- if tools or reasoning_effort is defined %}"
    "{{- '<|im_start|>system' }}"
    "{%- if reasoning_effort is defined %}{{- '\nReasoning: ' + reasoning_effort }}{%- endif %}"
    "{%- if tools %}{{- '\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>' }}{%- endif %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content }}"
    "{{- '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message.tool_calls %}{{- '<|im_start|>assistant' }}"
    "{%- for call in message.tool_calls %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{- call.function.arguments | tojson }}{{- '}\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}")
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hermes_server(make_engine, tmp_path_factory):
    """The default engine served with HERMES_TEMPLATE given as a --chat-template file."""
    path = tmp_path_factory.mktemp("template") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE)
    server = serve_in_thread(make_engine(), chat_template=str(path))
    yield server
    server.stop()


def assert_400(r: httpx.Response, param: str, says: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err


# -- A1: model names ---------------------------------------------------------------------------
def test_default_and_path_model_names(http, live_server):
    for name in ("default", MODEL, live_server.engine.config.model_path):
        assert http.post("/v1/chat/completions", json={**CHAT, "model": name}).status_code == 200
    assert http.post("/v1/completions", json={"model": "default", "prompt": "Hi",
                                              "max_tokens": 1}).status_code == 200
    r = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert r.status_code == 404 and MODEL in r.json()["error"]["message"], r.text


# -- A3: keys inside messages ------------------------------------------------------------------
def test_sdk_message_keys_are_ignored(http):
    assistant = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
                 "audio": None, "function_call": None, "parsed": None, "tool_calls": [{
                     "id": "call_1", "index": 0, "type": "function", "function": {
                         "name": "get_weather", "arguments": '{"city": "Paris"}',
                         "parsed_arguments": {"city": "Paris"}}}]}
    user = {"role": "user", "content": [{"type": "text", "text": "Hi",
                                         "cache_control": {"type": "ephemeral"}}]}
    messages = [user, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": messages})
    assert r.status_code == 200, r.text


def test_non_text_parts_and_request_typos_stay_400(http):
    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    # a text model (vision-language models read them: tests/test_vision.py)
    assert_400(http.post("/v1/chat/completions", json={**CHAT, "messages": [image]}),
               "messages", "reads no images")
    audio = {"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "wav"}}]}
    assert_400(http.post("/v1/chat/completions", json={**CHAT, "messages": [audio]}),
               "messages.0.content", "'input_audio'")
    assert_400(http.post("/v1/chat/completions", json={**CHAT, "temprature": 0}),
               "temprature", "Extra inputs")


# -- A4: request options -----------------------------------------------------------------------
OPENAI_OPTIONS = {
    "store": False, "metadata": {"team": "a"}, "service_tier": "auto", "reasoning_effort": "low",
    "prompt_cache_key": "k", "safety_identifier": "u1", "verbosity": "low",
    "modalities": ["text"], "user": "u1", "chat_template_kwargs": {"enable_thinking": False},
    "separate_reasoning": False}


def test_openai_and_sglang_options_are_accepted(http):
    r = http.post("/v1/chat/completions", json={**CHAT, **OPENAI_OPTIONS})
    assert r.status_code == 200, r.text
    with http.stream("POST", "/v1/chat/completions", json={
            **CHAT, "stream": True, "stream_options": {"include_usage": True,
                                                       "include_obfuscation": False}}) as r:
        assert r.status_code == 200 and '"usage"' in r.read().decode()


BAD_OPTIONS = [
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 keys"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512"),
    ({"modalities": ["text", "audio"]}, "modalities", "only ['text']"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "'tokenize'"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "chat_template_kwargs",
     "at most 32"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "Input should be"),
]


@pytest.mark.parametrize("extra,param,says", BAD_OPTIONS, ids=[b[2] for b in BAD_OPTIONS])
def test_option_bounds(http, extra, param, says):
    assert_400(http.post("/v1/chat/completions", json={**CHAT, **extra}), param, says)


# -- the official client -----------------------------------------------------------------------
def test_tutorial_tool_loop(client):
    """Call a tool, append the SDK's own message dump and the tool's result, ask again."""
    messages: list = [{"role": "user", "content": "What's the weather in Paris?"}]
    resp = client.chat.completions.create(model="default", messages=messages, max_tokens=24,
                                          temperature=0, tools=[WEATHER_TOOL],
                                          tool_choice="required")
    (call,) = resp.choices[0].message.tool_calls
    messages.append(resp.choices[0].message.model_dump())
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"city": json.loads(call.function.arguments)["city"],
                                            "celsius": 18})})
    final = client.chat.completions.create(model="default", messages=messages, max_tokens=4,
                                           temperature=0, tools=[WEATHER_TOOL])
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > resp.usage.prompt_tokens


class City(BaseModel):
    name: str
    population: int


def test_parse_and_stream_helpers(client):
    """The SDK's parse and stream helpers, and their messages (with `parsed`) sent back."""
    ask = [{"role": "user", "content": "Name a city; reply in JSON."}]
    parsed = client.chat.completions.parse(model="default", messages=ask, max_tokens=24,
                                           temperature=0, response_format=City)
    message = parsed.choices[0].message
    assert isinstance(message.parsed, City)  # its JSON was cut by max_tokens if this fails
    with client.chat.completions.stream(model="default", max_tokens=3, temperature=0,
                                        messages=[*ask, message.model_dump(warnings=False),
                                                  {"role": "user", "content": "Thanks"}]) as s:
        text = "".join(e.delta for e in s if e.type == "content.delta")
        snapshot = s.current_completion_snapshot  # get_final_completion raises on "length"
    assert text and snapshot.choices[0].message.content == text
    assert snapshot.choices[0].finish_reason == "length"


# -- chat templates ----------------------------------------------------------------------------
def test_template_renders_tools_and_tool_turns(tokenizer):
    text = render_chat(tokenizer, TOOL_TURNS, [WEATHER_TOOL], {}, chat_template=HERMES_TEMPLATE,
                       tool_prompt="GENERIC TOOL PROMPT")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text
    assert "GENERIC" not in text and text.endswith("<|im_start|>assistant\n")


def test_plain_template_gets_the_generic_tool_prompt(tokenizer):
    assert not renders_tools(tokenizer) and renders_tools(tokenizer, HERMES_TEMPLATE)
    assert renders_tools(tokenizer, {"default": "{{ x }}", "tool_use": HERMES_TEMPLATE})
    text = render_chat(tokenizer, TOOL_TURNS, [WEATHER_TOOL], {}, tool_prompt="GENERIC")
    assert text.startswith("<|im_start|>system\nGENERIC<|im_end|>")
    assert '<|im_start|>assistant\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>tool\n18 C<|im_end|>" in text


def test_template_kwargs_reach_the_template(tokenizer):
    ask = TOOL_TURNS[:1]
    plain = render_chat(tokenizer, ask, None, {}, chat_template=HERMES_TEMPLATE)
    no_think = render_chat(tokenizer, ask, None, {"enable_thinking": False},
                           chat_template=HERMES_TEMPLATE)
    effort = render_chat(tokenizer, ask, None, {"reasoning_effort": "high"},
                         chat_template=HERMES_TEMPLATE)
    assert no_think == plain + "<think>\n\n</think>\n\n"
    assert effort.startswith("<|im_start|>system\nReasoning: high<|im_end|>")


def _prompt_len(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_chat_template_override_on_the_server(hermes_server, tokenizer):
    """--chat-template (a file) replaces the tokenizer's template, with tools, turns and kwargs."""
    url = hermes_server.base_url + "/v1/chat/completions"
    body = {**CHAT, "messages": TOOL_TURNS, "tools": [WEATHER_TOOL],
            "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"}
    r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == 200, r.text
    expected = render_chat(tokenizer, TOOL_TURNS, [WEATHER_TOOL],
                           {"enable_thinking": False, "reasoning_effort": "low"},
                           chat_template=HERMES_TEMPLATE)
    assert "<think>" in expected and "Reasoning: low" in expected
    assert r.json()["usage"]["prompt_tokens"] == _prompt_len(tokenizer, expected)


def test_chat_template_config_and_flag():
    assert ServerConfig(chat_template="{{ messages }}").chat_template == "{{ messages }}"
    with pytest.raises(InvalidArgumentError, match="chat_template"):
        ServerConfig(chat_template="no/such/template.jinja")
    from forklm.cli import build_parser, dataclass_kwargs

    args = build_parser().parse_args(["serve", "--chat-template", "{{ messages }}"])
    assert dataclass_kwargs(args, ServerConfig)["chat_template"] == "{{ messages }}"
