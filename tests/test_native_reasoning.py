"""separate_reasoning in the native API: /generate's `reasoning_text` beside the content `text`
(whole and streamed) and SGLang's /separate_reasoning endpoint."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import assert_idle_and_clean, serve_in_thread

pytestmark = pytest.mark.slow

# A reply that reasons, then answers: the regex makes the default model write both parts.
THINKING = r"<think>[a-z]{1,3}( [a-z]{1,3}){0,3}</think>[a-z]{1,3}( [a-z]{1,3}){0,2}"
BODY = {"text": "Think, then answer: what is 2+2?",
        "sampling_params": {"max_new_tokens": 48, "temperature": 0, "regex": THINKING}}


@pytest.fixture(scope="module")
def servers(make_engine):
    engine = make_engine()
    with_parser, without = serve_in_thread(engine, reasoning_parser="qwen3"), serve_in_thread(engine)
    yield with_parser, without
    with_parser.stop()
    without.stop()
    assert_idle_and_clean(engine)


def _split(text: str) -> tuple[str, str]:
    reasoning, _, content = text.removeprefix("<think>").partition("</think>")
    return reasoning, content


def test_generate_separates_reasoning_whole_and_streamed(servers):
    with_parser, _ = servers
    plain = httpx.post(with_parser.base_url + "/generate", json=BODY, timeout=60).json()
    reasoning, content = _split(plain["text"])
    assert reasoning and content and "reasoning_text" not in plain
    split = httpx.post(with_parser.base_url + "/generate",
                       json={**BODY, "separate_reasoning": True}, timeout=60).json()
    assert (split["reasoning_text"], split["text"]) == (reasoning, content)
    assert split["output_ids"] == plain["output_ids"]
    with httpx.stream("POST", with_parser.base_url + "/generate", timeout=60,
                      json={**BODY, "separate_reasoning": True, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert len(events) > 2
    for before, after in zip(events, events[1:]):  # both parts only grow
        assert after["reasoning_text"].startswith(before["reasoning_text"])
        assert after["text"].startswith(before["text"])
    assert "<" not in "".join(e["text"] + e["reasoning_text"] for e in events)
    assert (events[-1]["reasoning_text"], events[-1]["text"]) == (reasoning, content)


def test_separate_reasoning_endpoint(servers):
    with_parser, without = servers
    r = httpx.post(with_parser.base_url + "/separate_reasoning",
                   json={"text": "<think>add them</think>four"})
    assert r.json() == {"text": "four", "reasoning_text": "add them"}
    r = httpx.post(without.base_url + "/separate_reasoning",
                   json={"text": "all reasoning", "reasoning_parser": "deepseek-r1"})
    assert r.json() == {"text": "", "reasoning_text": "all reasoning"}


@pytest.mark.parametrize("url, body, param", [
    ("/generate", {**BODY, "separate_reasoning": True}, "separate_reasoning"),
    ("/separate_reasoning", {"text": "x"}, "reasoning_parser"),
    ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}, "reasoning_parser"),
])
def test_without_a_parser_is_a_400_naming_the_field(servers, url, body, param):
    _, without = servers
    r = httpx.post(without.base_url + url, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
