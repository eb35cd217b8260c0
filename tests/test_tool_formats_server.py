"""Qwen3-Coder's and GLM-4.5's XML call formats through a real server, on the tiny random model
of test_tool_calls_server (its tokenizer has a `<tool_call>` token) with each format's test
template (tool_format_templates.py), the parser detected from it: a forced call comes back as a
tool_calls entry whose arguments validate, and "auto" calls (a bias on `<tool_call>` makes the
model open them) are constrained by the XML-styled structural tag into valid calls, streamed as
they are whole."""

from __future__ import annotations

import json
import pathlib
import sys

import jsonschema
import pytest
from conftest import serve_in_thread
from test_tool_calls_server import chat, chat_stream, same_reply
from tool_format_templates import TEMPLATES

from forklm.runtime.engine.engine import Engine

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks.auto_tool_calls import TOOLS, build_hermes_model  # noqa: E402

pytestmark = pytest.mark.slow  # live servers, like test_tool_calls_server
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
FORMATS = ("qwen3_coder", "glm45")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    """({format: server}, the <tool_call> token id): one server per format on one engine."""
    folder = tmp_path_factory.mktemp("tiny_xml_calls")
    tool_call_id = build_hermes_model(folder, tokenizer)
    engine = Engine(model_path=str(folder), dtype="float32", max_total_tokens=4096)
    servers = {name: serve_in_thread(engine, chat_template=TEMPLATES[name]) for name in FORMATS}
    yield servers, tool_call_id
    for server in servers.values():
        server.stop()
    engine.shutdown()


def unpadded(args: dict) -> dict:
    """xgrammar's XML styles let whitespace pad a value and do not count it (maxLength); the
    parser keeps a string's whitespace (less the template's newlines: code edits need it)."""
    return {k: v.strip() if isinstance(v, str) else v for k, v in args.items()}


@pytest.mark.parametrize("name", FORMATS)
def test_forced_named_call_is_a_valid_tool_call(tiny, name):
    servers, _ = tiny
    named = {"type": "function", "function": {"name": "get_weather"}}
    (c,) = chat(servers[name], tools=TOOLS, tool_choice=named)["choices"]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["get_weather"])
    streamed, reason = chat_stream(servers[name], tools=TOOLS, tool_choice=named)
    assert reason == "tool_calls"
    same_reply(streamed, c["message"])


@pytest.mark.parametrize("name", FORMATS)
def test_auto_xml_calls_are_constrained_to_valid_arguments(tiny, name):
    servers, tool_call_id = tiny
    bias = {"logit_bias": {str(tool_call_id): 100}, "max_tokens": 96}
    out = chat(servers[name], tools=TOOLS, **bias)["choices"][0]
    calls = out["message"].get("tool_calls") or []
    closed = calls if out["finish_reason"] != "length" else calls[:-1]
    assert closed, out  # at least one call closed before max_tokens
    for call in closed:
        jsonschema.validate(unpadded(json.loads(call["function"]["arguments"])),
                            SCHEMAS[call["function"]["name"]])
    streamed, _ = chat_stream(servers[name], tools=TOOLS, **bias)
    same_reply(streamed, out["message"])
