"""What agents and SGLang's own clients call beyond generation: /tokenize and /detokenize (with
chat messages rendered as the chat endpoint renders them), a continued final assistant message,
the frontend's concate_and_append join, and logprobs streamed chunk by chunk."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import assert_idle_and_clean

from forklm.runtime.engine.engine_request import EngineRequest

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=120) as c:
        yield c


def _model(live_server) -> str:
    return live_server.engine.config.model_path


def test_tokenize_gives_the_ids_generate_runs(client, live_server):
    engine = live_server.engine
    text = "The quick brown fox"
    (req,) = engine.prepare(EngineRequest(text)).reqs
    for path in ("/tokenize", "/v1/tokenize"):
        body = client.post(path, json={"prompt": text}).json()
        assert body == {"tokens": req.origin_input_ids, "count": len(req.origin_input_ids),
                        "max_model_len": engine.model_info.context_len}
    plain = client.post("/tokenize", json={"prompt": [text, "a"], "add_special_tokens": False})
    ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in (text, "a")]
    assert plain.json()["tokens"] == ids and plain.json()["count"] == [len(i) for i in ids]
    generated = client.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": 1}}).json()
    assert generated["meta_info"]["prompt_tokens"] == len(req.origin_input_ids)


def test_tokenize_renders_messages_as_the_chat_endpoint_does(client, live_server):
    counted = client.post("/tokenize", json={"messages": QUESTION}).json()
    chat = client.post("/v1/chat/completions", json={
        "model": _model(live_server), "messages": QUESTION, "max_tokens": 1}).json()
    assert counted["count"] == chat["usage"]["prompt_tokens"] == len(counted["tokens"])
    assert counted["prompt"].endswith("<|im_start|>assistant\n")
    bare = client.post("/tokenize", json={"messages": QUESTION,
                                          "add_generation_prompt": False}).json()
    assert not bare["prompt"].endswith("assistant\n") and bare["count"] < counted["count"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with_tools = client.post("/tokenize", json={"messages": QUESTION, "tools": tools}).json()
    assert "get_weather" in with_tools["prompt"] and with_tools["count"] > counted["count"]
    for bad in ({}, {"prompt": "a", "messages": QUESTION}, {"prompt": "a", "junk": 1}):
        r = client.post("/tokenize", json=bad)
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_detokenize_inverts_tokenize(client, live_server):
    text = "Bonjour, le monde!"
    ids = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}
                      ).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"text": text}
    assert client.post("/v1/detokenize", json={"tokens": [ids, ids[:1]]}).json()["text"] == [
        text, live_server.engine.tokenizer.decode(ids[:1])]
    vocab = live_server.engine.model_info.vocab_size
    r = client.post("/detokenize", json={"tokens": [1, vocab]})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_a_final_assistant_message_is_continued(client, live_server):
    start = "The capital of France is"
    messages = [*QUESTION, {"role": "assistant", "content": start}]
    prompt = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()["prompt"]
    assert prompt.endswith(start)  # no end of turn after it, no new turn
    body = {"model": _model(live_server), "messages": messages, "max_tokens": 8,
            "temperature": 0, "add_generation_prompt": False, "continue_final_message": True}
    reply = client.post("/v1/chat/completions", json=body).json()
    expected = live_server.engine.generate(prompt, {"max_new_tokens": 8, "temperature": 0})
    assert reply["choices"][0]["message"]["content"] == expected["text"]
    for wrong, field in (({"add_generation_prompt": True}, "add_generation_prompt"),
                         ({"messages": QUESTION}, "assistant")):
        r = client.post("/v1/chat/completions", json={**body, **wrong})
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_sglang_frontends_concate_and_append_join_is_accepted(client):
    """SGLang's RuntimeEndpoint.concatenate_and_append posts exactly this, then sends the joined
    text in its next request (which the radix cache serves)."""
    r = client.post("/concate_and_append_request", json={"src_rids": ["f1", "f2"],
                                                         "dst_rid": "main"})
    assert r.status_code == 200 and r.json()["success"] is True
    assert client.post("/concate_and_append_request", json={"src_rids": "f1"}).status_code == 400


def _events(client, body) -> list[dict]:
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


@pytest.mark.parametrize("interval", [1, 3])
def test_generate_streams_each_chunks_logprobs(client, live_server, interval):
    body = {"text": "Count to ten: one, two,", "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0, "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True,
                                "stream_interval": interval}}
    whole = client.post("/generate", json=body).json()["meta_info"]
    events = _events(client, body)
    streamed, tops, sent = [], [], 0
    for event in events:
        meta = event["meta_info"]
        part = meta["output_token_logprobs"]
        sent += len(part)
        assert meta["output_token_logprobs_length"] == sent
        assert len(part) == len(meta["output_top_logprobs"])
        streamed += part
        tops += meta["output_top_logprobs"]
    assert streamed == whole["output_token_logprobs"] and tops == whole["output_top_logprobs"]
    assert events[0]["meta_info"]["input_token_logprobs"] == whole["input_token_logprobs"]
    assert all(not e["meta_info"]["input_token_logprobs"] for e in events[1:])
    assert len(events) == (10 + interval - 1) // interval
    assert_idle_and_clean(live_server.engine)


def test_openai_streams_carry_each_chunks_logprobs_once(client, live_server):
    body = {"model": _model(live_server), "messages": QUESTION, "max_tokens": 6,
            "temperature": 0, "logprobs": True, "top_logprobs": 1}
    whole = client.post("/v1/chat/completions", json=body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    streamed = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += (choice.get("logprobs") or {}).get("content") or []
    assert streamed == content and len(content) == whole["usage"]["completion_tokens"]


def test_openai_response_format_takes_sglangs_structural_tag(client, live_server):
    from test_constrained import TOOL_PROMPT, WEATHER_TAG

    fmt = {k: v for k, v in WEATHER_TAG.items()}
    params = {"max_new_tokens": 40, "temperature": 0}
    native = client.post("/generate", json={"text": TOOL_PROMPT, "sampling_params": {
        **params, "structural_tag": WEATHER_TAG}}).json()["text"]
    body = {"model": _model(live_server), "prompt": TOOL_PROMPT, "max_tokens": 40,
            "temperature": 0, "response_format": fmt}
    completion = client.post("/v1/completions", json=body).json()
    assert completion["choices"][0]["text"] == native and "<tool_call>{" in native
    clash = client.post("/v1/completions", json={**body, "regex": "a+"})
    assert clash.status_code == 400 and "structural_tag" in clash.json()["error"]["message"]


def test_a_reply_on_the_generic_tool_path_streams_as_it_is_generated(client, live_server):
    """The default model has no tool format of its own (the generic JSON tool prompt): a text
    reply streams token by token with tools as without (it was held to the end)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = {"model": _model(live_server), "max_tokens": 12, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Say hello to me in French."}]}

    def content_events(extra: dict) -> list[str]:
        pieces = []
        with client.stream("POST", "/v1/chat/completions", json={**body, **extra}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        if (choice.get("delta") or {}).get("content"):
                            pieces.append(choice["delta"]["content"])
        return pieces

    with_tools = content_events({"tools": tools, "tool_choice": "auto"})
    assert not "".join(with_tools).lstrip().startswith("{")  # a text reply, not a call
    assert len(with_tools) >= 6, with_tools
