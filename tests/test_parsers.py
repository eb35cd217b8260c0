"""Tool-call and reasoning parsers on text: each format whole and split across stream chunks at
every position (the pieces reassemble to the whole parse, and no partial tag leaks as content),
parallel calls, calls cut off, reasoning before content, and the registries."""

from __future__ import annotations

import json

import pytest

from forklm.parsers.reasoning import get_reasoning_parser
from forklm.parsers.tool_calls import (
    StreamDelta,
    assemble,
    detect_tool_call_parser,
    get_tool_call_parser,
)
from forklm.runtime.errors import InvalidArgumentError
from forklm.server.config import ServerConfig
from forklm.server.protocol import ChatCompletionRequest
from forklm.server.tools import plan_tools, whole_calls

WEATHER = ('{"name": "get_weather", "arguments": {"city": "Paris \\"16e\\"", '
           '"unit": "C", "days": [1, {"x": "}"}]}}')
HERMES = ("Let me look that up.\n<tool_call>\n" + WEATHER + "\n</tool_call>\n<tool_call>\n"
          '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
WEATHER_ARGS = '{"city": "Paris \\"16e\\"", "unit": "C", "days": [1, {"x": "}"}]}'
CASES = {  # parser -> (text, content, [(name, arguments)])
    "hermes": (HERMES, "Let me look that up.", [("get_weather", WEATHER_ARGS),
                                                ("get_time", '{"tz": "Europe/Paris"}')]),
    "llama3": ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
               '{"name": "g", "parameters": {}}', "", [("f", '{"x": 1}'), ("g", "{}")]),
    "mistral": ('[TOOL_CALLS] [{"name": "f", "arguments": {"x": [1, 2]}}, '
                '{"name": "g", "arguments": {"y": "]"}}]', "",
                [("f", '{"x": [1, 2]}'), ("g", '{"y": "]"}')]),
    "json": ('{"name": "f", "arguments": {"a": "b"}}', "", [("f", '{"a": "b"}')]),
}


def calls_of(reply) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in reply.calls]


def stream_chunks(parser, chunks: list[str]):
    stream = parser.stream()
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    return deltas, assemble(deltas, stream.complete)


@pytest.mark.parametrize("name", CASES)
def test_whole_reply(name):
    text, content, calls = CASES[name]
    reply = get_tool_call_parser(name).parse(text)
    assert reply.content == content and calls_of(reply) == calls
    assert all(c.complete and c.id.startswith("call_") for c in reply.calls)
    assert len({c.id for c in reply.calls}) == len(calls)
    for _, args in calls:
        json.loads(args)


@pytest.mark.parametrize("name", CASES)
def test_split_at_every_position(name):
    text, content, calls = CASES[name]
    parser = get_tool_call_parser(name)
    for cut in range(len(text) + 1):
        _, reply = stream_chunks(parser, [text[:cut], text[cut:]])
        assert (reply.content, calls_of(reply)) == (content, calls), cut


@pytest.mark.parametrize("name", CASES)
def test_char_by_char_streams_pieces_early_and_no_partial_tag(name):
    text, content, calls = CASES[name]
    deltas, reply = stream_chunks(get_tool_call_parser(name), list(text))
    assert (reply.content, calls_of(reply)) == (content, calls)
    emitted = "".join(d.content for d in deltas)
    assert "<" not in emitted and "[" not in emitted and "{" not in emitted
    pieces = [p for d in deltas for p in d.calls]
    heads = [p for p in pieces if p.id is not None]
    assert [p.name for p in heads] == [n for n, _ in calls]
    assert len(pieces) > 2 * len(calls)  # arguments arrive in many pieces, not at the end
    assert deltas[-1] == StreamDelta("", [])  # everything was out before the stream ended


def test_cut_off_call_keeps_partial_arguments():
    text = HERMES[:HERMES.index('"unit"') + 3]
    reply = get_tool_call_parser("hermes").parse(text)
    (call,) = reply.calls
    assert call.name == "get_weather" and not call.complete
    assert call.arguments == '{"city": "Paris \\"16e\\"", "un'


@pytest.mark.parametrize("text", ["Hello <tool", "a < b and [TOOL", "x\n\n", '{"answer": 4} yes',
                                  "Hi {not json"])
def test_text_without_calls_is_content(text):
    for name in ("hermes", "llama3", "mistral"):
        reply = get_tool_call_parser(name).parse(text)
        assert reply == (text, [])  # held text (a possible tag, whitespace) comes out at the end


def test_llama3_bare_call_and_keys_in_any_order():
    parser = get_tool_call_parser("llama3")
    assert calls_of(parser.parse(' {"name": "f", "parameters": {"a": 1}}')) == [("f", '{"a": 1}')]
    assert calls_of(parser.parse('{"parameters": {"a": 1}, "name": "f"}')) == [("f", '{"a": 1}')]
    assert parser.parse('The answer: {"name": "f", "parameters": {}}').calls == []  # mid-text


def test_registry_and_detection():
    with pytest.raises(InvalidArgumentError, match="hermes, llama3, mistral, json"):
        get_tool_call_parser("qwen25")
    with pytest.raises(InvalidArgumentError, match="qwen3, deepseek-r1, glm45, kimi, gpt-oss"):
        get_reasoning_parser("o1")
    assert detect_tool_call_parser("{{ '<tool_call>' }}{{ tools | tojson }}") == "hermes"
    assert detect_tool_call_parser("{{- '<|python_tag|>' }}") == "llama3"
    assert detect_tool_call_parser("{{ '[TOOL_CALLS] ' }}") == "mistral"
    assert detect_tool_call_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert detect_tool_call_parser(None) is None
    for field in ("tool_call_parser", "reasoning_parser"):
        with pytest.raises(InvalidArgumentError, match="expected one of") as e:
            ServerConfig(**{field: "nope"})
        assert e.value.name == field
    assert ServerConfig(tool_call_parser="mistral", reasoning_parser="qwen3").reasoning_parser


THINKING = "<think>\nFirst, the city.\nThen the unit.\n</think>\n\nIt is 20 C."


@pytest.mark.parametrize("name,text,opened,expected", [
    ("qwen3", THINKING, False, ("First, the city.\nThen the unit.", "It is 20 C.")),
    ("qwen3", "It is 20 C. <think>", False, ("", "It is 20 C. <think>")),
    ("qwen3", "\nFirst.\n</think>\nIt is.", True, ("First.", "It is.")),
    ("deepseek-r1", "Hmm.\n</think>\n\nIt is.", False, ("Hmm.", "It is.")),
    ("deepseek-r1", THINKING, False, ("First, the city.\nThen the unit.", "It is 20 C.")),
    ("deepseek-r1", "Hmm, still thinking", False, ("Hmm, still thinking", "")),
    ("glm45", THINKING, False, ("First, the city.\nThen the unit.", "It is 20 C.")),
    ("glm45", "\n<think></think>\nIt is.", False, ("", "It is.")),
    ("kimi", THINKING.replace("<think>", "◁think▷").replace("</think>", "◁/think▷"), False,
     ("First, the city.\nThen the unit.", "It is 20 C.")),
    ("kimi", "It is 20 C.", False, ("", "It is 20 C.")),
])
def test_reasoning_split_at_every_position(name, text, opened, expected):
    parser = get_reasoning_parser(name)
    assert tuple(parser.parse(text, opened)) == expected
    for cut in range(len(text) + 1):
        stream = parser.stream(opened)
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        got = ("".join(p.reasoning for p in parts), "".join(p.content for p in parts))
        assert got == expected, cut
        # no tag, not even part of one
        assert all("<" not in p.reasoning and "◁" not in p.reasoning for p in parts)


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]


class _Service:  # what plan_tools reads of a GenerationService
    def __init__(self, tool_call_parser=None, reasoning_parser=None):
        self.config = type("C", (), {"tool_call_parser": tool_call_parser,
                                     "reasoning_parser": reasoning_parser,
                                     "chat_template": None})()
        self.engine = type("E", (), {"tokenizer": type("T", (), {"chat_template": None})()})()


def plan(service=None, **kw):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)
    return plan_tools(body, service)


def test_reply_with_reasoning_and_parallel_calls_off():
    p = plan(_Service("hermes", "qwen3"), tools=TOOLS, parallel_tool_calls=False)
    reader = p.reader()
    text = "<think>The user wants weather.</think>\n" + HERMES
    parts = [reader.feed(ch) for ch in text] + [reader.finish()]
    assert "".join(d.reasoning for d in parts) == "The user wants weather."
    assert "".join(d.content for d in parts) == "Let me look that up."
    whole = parts[0]
    for d in parts[1:]:
        whole = whole.then(d)
    (call,) = whole_calls(whole, reader.complete)  # the second call is dropped
    assert (call.name, call.arguments) == ("get_weather", WEATHER_ARGS)


def test_forced_named_call_streams_arguments_and_cut_off():
    p = plan(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    reader = p.reader()
    first, second = reader.feed('{"tz": '), reader.feed('"UT')
    assert first.calls[0].name == "get_time" and second.calls[0].arguments == '"UT'
    reader.finish()
    assert reader.complete == [False]
    reader = p.reader()
    (call,) = whole_calls(reader.read('{"tz": "UTC"}'), reader.complete)
    assert call.arguments == '{"tz": "UTC"}' and reader.complete == [True]


GENERIC_CALL = '{"name": "get_time", "arguments": {"tz": {"zone": "UTC"}} }'


def test_auto_without_parser_streams_the_generic_call_as_it_is_written():
    """The generic JSON prompt: once the reply's head names a tool, its arguments stream piece
    by piece (a closing brace held until more text shows it is not the object's end)."""
    reader = plan(tools=TOOLS).reader()
    assert reader.feed('{"name": "get_') == ("", "", [])  # could still be anything
    head, first = reader.feed('time", "arguments": {"tz"').calls
    assert (head.name, head.arguments, first.arguments) == ("get_time", "", '{"tz"')
    pieces = [reader.feed(c) for c in ': {"zone": "UTC"}} }']
    pieces.append(reader.finish())
    args = first.arguments + "".join(c.arguments for d in pieces for c in d.calls)
    assert args == '{"tz": {"zone": "UTC"}}' and reader.complete == [True]
    assert sum(bool(d.calls) for d in pieces) > 10  # streamed, not held to the end
    whole = plan(tools=TOOLS).reader()
    (call,) = whole_calls(whole.read(GENERIC_CALL), whole.complete)
    assert json.loads(call.arguments) == {"tz": {"zone": "UTC"}}


@pytest.mark.parametrize("text, content, calls", [
    ("The time is noon.", "The time is noon.", []),  # content from its first character
    ('{"name": "nope", "arguments": {}}', '{"name": "nope", "arguments": {}}', []),
    ('{"arguments": {}, "name": "get_time"}', "", [("get_time", "{}")]),  # held, read whole
    ('{"name": "get_time", "arguments": {"tz": "U', "", [("get_time", '{"tz": "U')]),
    ('```json\n{"name": "get_time", "arguments": {}}\n```', "", [("get_time", "{}")]),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),  # streams once known
])
def test_auto_without_parser_decides_from_the_head(text, content, calls):
    streamed = plan(tools=TOOLS).reader()
    deltas = [streamed.feed(c) for c in text] + [streamed.finish()]
    reply = assemble(deltas, streamed.complete)
    assert reply.content == content and [(c.name, c.arguments) for c in reply.calls] == calls
    if text[0] not in "{`":
        assert deltas[0].content == text[0]  # not held
    if text.startswith("```p"):
        assert sum(bool(d.content) for d in deltas) > 5
    whole = plan(tools=TOOLS).reader()
    assert whole.read(text).content == content


@pytest.mark.parametrize("name", ["hermes", "llama3", "mistral"])
def test_structural_tag_accepts_each_call_form_and_only_valid_arguments(name):
    """The auto constraint (xgrammar) accepts a call written in each of the format's forms with
    valid arguments, which the parser reads back, and rejects invalid arguments."""
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
    p = plan(_Service(name), tools=tools)
    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(p.structural_tag()))
    for t in p.parser.tags("get_time", {}):
        text = t["begin"] + '{"tz": "UTC"}' + t["end"]
        assert _is_grammar_accept_string(grammar, text), text
        assert not _is_grammar_accept_string(grammar, t["begin"] + '{"tz": 5}' + t["end"])
        assert calls_of(p.parser.parse(text)) == [("get_time", '{"tz": "UTC"}')]


def test_auto_constraint_params():
    """The sampling params the chat endpoint adds: a structural tag for auto in a model's
    format (one call only without parallel calls), the special-token opener kept in the text,
    nothing over the request's own constraint, a JSON schema for forced calls."""
    from forklm.server.openai_api import _add_tool_constraint

    params: dict = {}
    _add_tool_constraint(params, plan(_Service("mistral"), tools=TOOLS, parallel_tool_calls=False))
    assert params["skip_special_tokens"] is False
    assert params["structural_tag"]["format"]["stop_after_first"] is True
    params = {"skip_special_tokens": True, "json_schema": {"type": "object"}}
    _add_tool_constraint(params, plan(_Service("llama3"), tools=TOOLS))
    assert params == {"skip_special_tokens": True, "json_schema": {"type": "object"}}
    params = {}
    _add_tool_constraint(params, plan(_Service("hermes"), tools=TOOLS, tool_choice="required"))
    assert set(params) == {"json_schema"}  # forced: the generic JSON call, whatever the format


@pytest.mark.parametrize("text,name", [("", "get_time"), ('{"na', None), ('{"name": "get_t', "get_time"),
                                       ('{"name": "get_weather", "argu', "get_weather"),
                                       ('{"name": "get_', None)])
def test_required_call_cut_off_before_its_name(text, name):
    """A "required" reply cut off early is still a call when only one tool's name fits."""
    tools = TOOLS if name != "get_time" or text else TOOLS[1:]
    reader = plan(tools=tools, tool_choice="required").reader()
    reply = reader.read(text)
    calls = whole_calls(reply, reader.complete)
    if name is None:
        assert calls == [] and reply.content == text
    else:
        assert [(c.name, c.arguments, c.complete) for c in calls] == [(name, "", False)]
        assert reply.content == ""
