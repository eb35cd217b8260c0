"""The tool-call formats of today's models on text (qwen3_coder, glm45, deepseekv3, deepseekv31,
kimi_k2, gpt-oss, pythonic): two parallel calls whole and split at every position (the pieces
reassemble to the whole parse, arguments arrive before a call ends), a malformed call as content,
a call cut off, each format's test template (tool_format_templates.py) detected and its rendered
calls read back, and the "auto" constraint accepting only valid arguments in each call form."""

from __future__ import annotations

import json
import re
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_format_templates import TEMPLATES
from transformers.utils.chat_template_utils import render_jinja_template

from forklm.parsers.calls import StreamDelta, assemble
from forklm.parsers.tool_calls import detect_tool_call_parser, get_tool_call_parser
from forklm.parsers.xml_calls import typed_value
from forklm.server.protocol import ChatCompletionRequest
from forklm.server.tools import plan_tools

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]


class Case(NamedTuple):
    reply: str  # "I'll check." (but pythonic) and CALLS
    malformed: str  # "Sure." and a call that does not read; `bad` is in its text
    bad: str


_DS_CALLS, _DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_KIMI_CALLS, _KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_CALL, _KIMI_ARGS, _KIMI_CALL_END = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>",
                                          "<|tool_call_end|>")
CASES = {
    "qwen3_coder": Case(
        "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
        "\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>",
        'Sure.\n<tool_call>\n{"name": "get_time"}\n</tool_call>', '{"name": "get_time"}'),
    "glm45": Case(
        "I'll check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>"
        "\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n"
        "<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n</tool_call>",
        'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', '"arguments": {}'),
    "deepseekv3": Case(
        f"I'll check.{_DS_CALLS}{_DS_CALL}function{_DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris", "days": 3}}\n```{_DS_CALL_END}\n{_DS_CALL}function{_DS_SEP}get_time'
        f'\n```json\n{{"tz": "UTC"}}\n```{_DS_CALL_END}{_DS_END}',
        f'Sure.{_DS_CALLS}{_DS_CALL}get_time\n{{"tz": "UTC"}}{_DS_CALL_END}{_DS_END}',
        'get_time\n{"tz": "UTC"}'),
    "deepseekv31": Case(
        f'I\'ll check.{_DS_CALLS}{_DS_CALL}get_weather{_DS_SEP}{{"city": "Paris", "days": 3}}'
        f'{_DS_CALL_END}{_DS_CALL}get_time{_DS_SEP}{{"tz": "UTC"}}{_DS_CALL_END}{_DS_END}',
        f'Sure.{_DS_CALLS}{_DS_CALL}get_time {{"tz": "UTC"}}{_DS_CALL_END}{_DS_END}',
        'get_time {"tz": "UTC"}'),
    "kimi_k2": Case(
        f"I'll check.{_KIMI_CALLS}{_KIMI_CALL}functions.get_weather:0{_KIMI_ARGS}"
        f'{{"city": "Paris", "days": 3}}{_KIMI_CALL_END}{_KIMI_CALL}functions.get_time:1'
        f'{_KIMI_ARGS}{{"tz": "UTC"}}{_KIMI_CALL_END}{_KIMI_END}',
        f'Sure.{_KIMI_CALLS}{_KIMI_CALL}get_time{_KIMI_ARGS}{{"tz": "UTC"}}{_KIMI_CALL_END}'
        f"{_KIMI_END}", "get_time"),
    "gpt-oss": Case(
        "<|channel|>commentary<|message|>I'll check.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
        '"days": 3}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json'
        '<|message|>{"tz": "UTC"}<|call|>',
        "<|channel|>final<|message|>Sure.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_time <|constrain|>json<|message|>tz=UTC<|call|>", "tz=UTC"),
    "pythonic": Case("[get_weather(city='Paris', days=3), get_time(tz=\"UTC\")]",
                     "Sure. [get_time(UTC)]", "[get_time(UTC)]"),
}
CONTENT = {name: "" if name == "pythonic" else "I'll check." for name in CASES}


def calls_of(reply) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.calls]


def stream_chunks(name: str, chunks: list[str]):
    stream = get_tool_call_parser(name).stream(SCHEMAS)
    deltas = [stream.feed(c) for c in chunks] + [stream.finish()]
    return deltas, assemble(deltas, stream.complete)


@pytest.mark.parametrize("name", CASES)
def test_whole_reply_with_parallel_calls(name):
    reply = get_tool_call_parser(name).parse(CASES[name].reply, SCHEMAS)
    assert reply.content == CONTENT[name] and calls_of(reply) == CALLS
    assert all(c.complete for c in reply.calls) and len({c.id for c in reply.calls}) == 2


@pytest.mark.parametrize("name", CASES)
def test_split_at_every_position_reassembles_to_the_whole(name):
    text = CASES[name].reply
    whole = get_tool_call_parser(name).parse(text, SCHEMAS)
    strip_ids = lambda r: (r.content, [c[1:] for c in r.calls])  # noqa: E731 - ids are random
    for cut in range(len(text) + 1):
        _, reply = stream_chunks(name, [text[:cut], text[cut:]])
        assert strip_ids(reply) == strip_ids(whole), cut


@pytest.mark.parametrize("name", CASES)
def test_char_by_char_streams_arguments_before_the_call_ends(name):
    text = CASES[name].reply
    deltas, reply = stream_chunks(name, list(text))
    assert reply.content == CONTENT[name] and calls_of(reply) == CALLS  # no partial tag leaked
    pieces = [p for d in deltas for p in d.calls]
    assert [p.name for p in pieces if p.id is not None] == ["get_weather", "get_time"]
    first_args = [i for i, p in enumerate(pieces) if p.index == 0 and p.arguments]
    second_head = next(i for i, p in enumerate(pieces) if p.index == 1)
    assert len(first_args) >= 2 and first_args[-1] < second_head  # a piece per parameter at least
    assert deltas[-1] == StreamDelta("", [])  # all was out before the stream ended


@pytest.mark.parametrize("name", CASES)
def test_malformed_call_is_content(name):
    case = CASES[name]
    reply = get_tool_call_parser(name).parse(case.malformed, SCHEMAS)
    assert reply.calls == [] and reply.content.startswith("Sure.") and case.bad in reply.content
    _, streamed = stream_chunks(name, list(case.malformed))
    assert streamed == reply


@pytest.mark.parametrize("name,call", [
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n"
                    "</function>\n</tool_call>"),
    ("glm45", "<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n"
              "</tool_call>"),
    ("gpt-oss", '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
                '{"tz": "UTC"}<|call|>'),
])
def test_call_after_a_malformed_one_still_reads(name, call):
    reply = get_tool_call_parser(name).parse(CASES[name].malformed + call, SCHEMAS)
    assert calls_of(reply) == [("get_time", {"tz": "UTC"})] and CASES[name].bad in reply.content


# Pieces of every format's replies, shuffled into text that is anything from calls to garbage.
PIECES = sorted({piece for case in CASES.values() for text in case[:2]
                 for piece in re.split(r"(<[^<>]*>|[\[\](){},=\n])", text) if piece})


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=40), cuts=st.tuples(
    st.integers(0, 2000), st.integers(0, 2000)))
@pytest.mark.parametrize("name", CASES)
def test_any_text_parses_without_error_and_streams_as_whole(name, pieces, cuts):
    text = "".join(pieces)
    a, b = sorted(min(c, len(text)) for c in cuts)
    whole = get_tool_call_parser(name).parse(text, SCHEMAS)
    _, streamed = stream_chunks(name, [text[:a], text[a:b], text[b:]])
    assert (streamed.content, [c[1:] for c in streamed.calls]) == (
        whole.content, [c[1:] for c in whole.calls])
    if name in ("qwen3_coder", "glm45", "pythonic"):  # arguments written by the parser
        for call in whole.calls:  # a call cut off has its complete parameters, or none yet
            json.loads(call.arguments + ("" if call.complete else "}") if call.arguments else "{}")


@pytest.mark.parametrize("name", CASES)
def test_call_cut_off_keeps_its_complete_parameters(name):
    text = CASES[name].reply
    full = get_tool_call_parser(name).parse(text, SCHEMAS).calls[0].arguments
    reply = get_tool_call_parser(name).parse(text[:text.index("days")], SCHEMAS)
    (call,) = reply.calls
    assert call.name == "get_weather" and not call.complete
    assert full.startswith(call.arguments) and '"Paris"' in call.arguments


@pytest.mark.parametrize("name", CASES)
def test_template_is_detected_and_its_calls_read_back(name):
    """The format is detected from the template's source, and the calls it renders in an
    assistant turn are what the parser reads (ids too, where the format writes them)."""
    template = TEMPLATES[name]
    assert detect_tool_call_parser(template) == name
    ask = [{"role": "user", "content": "Weather and time in Paris?"}]
    calls = [{"id": f"functions.{n}:{i}", "type": "function",
              "function": {"name": n, "arguments": args}} for i, (n, args) in enumerate(CALLS)]
    turn = {"role": "assistant", "content": "", "tool_calls": calls}
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"temp": 20}'} for c in calls]

    def render(messages, add_generation_prompt):
        (text,), _ = render_jinja_template([messages], tools=TOOLS, chat_template=template,
                                           add_generation_prompt=add_generation_prompt)
        return text

    prompt = render(ask, True)
    history = render(ask + [turn] + results, True)
    assert history.startswith(prompt) and history.count('{"temp": 20}') == 2
    assert all(t["function"]["name"] in prompt for t in TOOLS)
    reply = get_tool_call_parser(name).parse(render(ask + [turn], False)[len(prompt):], SCHEMAS)
    assert calls_of(reply) == CALLS and reply.content == ""
    if name == "kimi_k2":
        assert [c.id for c in reply.calls] == [c["id"] for c in calls]


class _Service:  # what plan_tools reads of a GenerationService
    def __init__(self, tool_call_parser=None, reasoning_parser=None):
        self.config = type("C", (), {"tool_call_parser": tool_call_parser,
                                     "reasoning_parser": reasoning_parser,
                                     "chat_template": None})()
        self.engine = type("E", (), {"tokenizer": type("T", (), {"chat_template": None})()})()


def plan(service, **kw):
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 tools=TOOLS, **kw)
    return plan_tools(body, service)


# One call of get_time in each format's arguments, valid, then invalid by the schema.
ARGUMENTS = {
    "qwen_xml": ("<parameter=tz>\nUTC\n</parameter>", "<parameter=zone>\nUTC\n</parameter>"),
    "glm_xml": ("<arg_key>tz</arg_key>\n<arg_value>UTC</arg_value>\n",
                "<arg_key>zone</arg_key>\n<arg_value>UTC</arg_value>\n"),
    "json": ('{"tz": "UTC"}', '{"tz": 5}'),
}


@pytest.mark.parametrize("name", [n for n in CASES if n != "pythonic"])
def test_auto_constraint_accepts_each_call_form_only_with_valid_arguments(name):
    import xgrammar
    from xgrammar.testing import _is_grammar_accept_string

    p = plan(_Service(name))
    grammar = xgrammar.Grammar.from_structural_tag(json.dumps(p.structural_tag()))
    good, bad = ARGUMENTS[p.parser.args_style]
    number = "7<|tool_call_argument_begin|>" if name == "kimi_k2" else ""  # Kimi's call index
    # Harmony writes text in a message, and a recipient after <|start|>assistant.
    before = ("<|channel|>final<|message|>Sure.<|end|><|start|>assistant" if name == "gpt-oss"
              else "Sure. ")
    forms = p.parser.tags("get_time", {})
    assert forms and all(t["begin"].startswith(p.parser.triggers) for t in forms)
    for form in forms:
        text = before + form["begin"] + number + good + form["end"]
        assert _is_grammar_accept_string(grammar, text), text
        assert not _is_grammar_accept_string(grammar, form["begin"] + number + bad + form["end"])
        assert calls_of(p.parser.parse(text, SCHEMAS)) == [("get_time", {"tz": "UTC"})]


def test_pythonic_is_not_constrained_but_taught():
    p = plan(_Service("pythonic"))
    assert p.structural_tag() is None
    assert "[<tool name>(<name>=<value>, ...), ...]" in p.system_prompt()


def test_special_tokens_kept_for_harmony_reasoning_and_special_token_formats():
    assert plan(_Service(None, "gpt-oss"), tool_choice="none").keeps_special_tokens
    assert plan(_Service("kimi_k2")).keeps_special_tokens
    assert not plan(_Service("qwen3_coder", "qwen3")).keeps_special_tokens
    assert not plan(_Service("kimi_k2"), tool_choice="required").keeps_special_tokens


@pytest.mark.parametrize("text,value", [("007", "007"), ("\nline 1\nline 2\n", "line 1\nline 2")])
def test_xml_string_parameter_keeps_its_text(text, value):
    reply = get_tool_call_parser("qwen3_coder").parse(
        f"<tool_call>\n<function=get_time>\n<parameter=tz>{text}</parameter>\n</function>",
        SCHEMAS)
    assert calls_of(reply) == [("get_time", {"tz": value})]


def test_xml_values_are_typed_by_schema_then_by_literal():
    reply = get_tool_call_parser("glm45").parse(
        "<tool_call>get_weather\n<arg_key>days</arg_key><arg_value>3</arg_value>"
        "<arg_key>city</arg_key><arg_value>12</arg_value><arg_key>extra</arg_key>"
        '<arg_value>{"a": [true, null]}</arg_value><arg_key>flag</arg_key>'
        "<arg_value>True</arg_value><arg_key>note</arg_key><arg_value>hi there</arg_value>"
        "</tool_call>", SCHEMAS)
    assert calls_of(reply) == [("get_weather", {"days": 3, "city": "12", "extra": {
        "a": [True, None]}, "flag": True, "note": "hi there"})]
    assert typed_value("\nC \n", {"enum": ["C", "F"]}) == "C"  # padding around a choice
    assert typed_value(" 4 ", {"type": "integer"}) == 4


@pytest.mark.parametrize("text", ["[1, 2, 3]", "[]", "[get_time(tz=now())]", "[get_time(tz='UTC'",
                                  "The list: [get_time(tz='UTC')]", "[see below]"])
def test_pythonic_text_that_is_no_call_list_is_content(text):
    reply = get_tool_call_parser("pythonic").parse(text)
    if text == "[get_time(tz='UTC'":  # cut off inside its arguments: a call, incomplete
        assert [(c.name, c.complete) for c in reply.calls] == [("get_time", False)]
    else:
        assert reply == (text, [])


def test_pythonic_llama4_tags_and_python_literals():
    reply = get_tool_call_parser("pythonic").parse(
        "<|python_start|>[get_time(tz=None, dst=True, at=(1, 2), f={'a': 1.5})]<|python_end|>")
    assert calls_of(reply) == [("get_time", {"tz": None, "dst": True, "at": [1, 2],
                                             "f": {"a": 1.5}})]


def test_harmony_reasoning_and_calls_through_the_reply_reader():
    """With the gpt-oss reasoning parser the analysis channel is reasoning, the final channel
    content, and calls pass on to the gpt-oss call parser, whole or char by char."""
    text = ("<|channel|>analysis<|message|>Need the weather.<|end|>" + CASES["gpt-oss"].reply)
    for chunks in ([text], list(text)):
        reader = plan(_Service("gpt-oss", "gpt-oss")).reader()
        whole = reader.feed("")
        for chunk in chunks:
            whole = whole.then(reader.feed(chunk))
        whole = whole.then(reader.finish())
        assert whole.reasoning == "Need the weather." and whole.content == "I'll check."
        assert [(c.name, json.loads(c.arguments)) for c in assemble(
            [StreamDelta("", whole.calls)], reader.complete).calls] == CALLS


@pytest.mark.parametrize("text,expected", [
    ("<|channel|>analysis<|message|>2+2 is 4.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.<|return|>", ("2+2 is 4.", "It is 4.")),
    ("<|channel|>analysis<|message|>Still thinking", ("Still thinking", "")),
    ("Plain text, no channels.", ("", "Plain text, no channels.")),
])
def test_harmony_reasoning_split_at_every_position(text, expected):
    from forklm.parsers.reasoning import get_reasoning_parser

    parser = get_reasoning_parser("gpt-oss")
    assert tuple(parser.parse(text)) == expected
    for cut in range(len(text) + 1):
        stream = parser.stream()
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        got = ("".join(p.reasoning for p in parts), "".join(p.content for p in parts))
        assert got == expected, cut
