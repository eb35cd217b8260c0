"""Server pieces without a model: ServerConfig validation, tool-call planning and parsing, the
admission counter, and the engine requests a call counts (the intake, on a fake tokenizer)."""

from __future__ import annotations

import json

import pytest

from forklm.runtime.engine.engine_request import EngineRequest
from forklm.runtime.engine.intake import RequestGroup, RequestIntake
from forklm.runtime.errors import InvalidArgumentError
from forklm.server.config import ServerConfig
from forklm.server.errors import ApiError
from forklm.server.generation import Admission
from forklm.server.protocol import ChatCompletionRequest
from forklm.server.tools import plan_tools, whole_calls

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "noop"}}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **kw)


@pytest.mark.parametrize("field,value", [("port", 0), ("max_queued_requests", -1),
                                         ("max_request_body_bytes", 0), ("log_level", "loud"),
                                         ("api_key", ""), ("max_program_nodes", 0)])
def test_server_config_rejects(field, value):
    with pytest.raises(InvalidArgumentError) as e:
        ServerConfig(**{field: value})
    assert e.value.name == field


def test_server_config_defaults_are_safe():
    config = ServerConfig()
    assert config.host == "127.0.0.1" and config.api_key is None
    with pytest.raises(InvalidArgumentError, match="unknown server option"):
        ServerConfig.from_kwargs(prot=1)


def test_tool_plans():
    assert not plan_tools(chat()).active
    assert plan_tools(chat(tools=TOOLS)).mode == "auto"  # OpenAI's default with tools
    assert not plan_tools(chat(tools=TOOLS, tool_choice="none")).active
    named = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "add"}}))
    assert named.schema() == TOOLS[0]["function"]["parameters"]
    required = plan_tools(chat(tools=TOOLS, tool_choice="required")).schema()
    names = [b["properties"]["name"]["enum"] for b in required["anyOf"]]
    assert names == [["add"], ["noop"]]
    assert required["anyOf"][1]["properties"]["arguments"] == {"type": "object"}
    with pytest.raises(InvalidArgumentError, match="unique"):
        plan_tools(chat(tools=TOOLS + TOOLS[:1]))


def calls_of(plan, text: str) -> list[tuple[str, str, bool]]:
    reader = plan.reader()
    return [(c.name, c.arguments, c.complete)
            for c in whole_calls(reader.read(text), reader.complete)]


def test_tool_call_parsing():
    auto = plan_tools(chat(tools=TOOLS))
    assert calls_of(auto, '{"name": "add", "arguments": {"a": 1}}') == [("add", '{"a": 1}', True)]
    assert calls_of(auto, '```json\n{"name": "noop", "arguments": {}}\n```')
    for text in ("Hello!", '{"name": "other", "arguments": {}}', '{"name": "add"}', "[1]", "{"):
        assert calls_of(auto, text) == [], text
        assert auto.reader().read(text).content == text
    named = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function",
                                                      "function": {"name": "add"}}))
    ((name, args, complete),) = calls_of(named, '{"a": 2}')
    assert name == "add" and json.loads(args) == {"a": 2} and complete
    assert calls_of(named, '{"a": ') == [("add", '{"a": ', False)]  # cut off by max_tokens


def test_admission_counts_and_refuses():
    adm = Admission(limit=3, retry_after_s=5)
    adm.acquire(2)
    with pytest.raises(ApiError) as e:
        adm.acquire(2)
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "5"}
    assert adm.admitted == 2  # a refusal takes nothing
    adm.acquire(1)
    adm.release(3)
    assert adm.admitted == 0


class _CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]


class _BosTokenizer(_CharTokenizer):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1] * add_special_tokens + super().encode(text)


def test_a_raw_prompt_gets_the_tokenizers_bos_once_and_token_ids_stay_as_given():
    def first_ids(tokenizer, **call) -> list[int]:
        intake = RequestIntake(tokenizer, vocab_size=100, context_len=64, kv_capacity=256,
                               eos_token_ids=frozenset({0}), random_seed=0)
        return intake.build(EngineRequest.from_call(**call)).reqs[0].origin_input_ids

    assert first_ids(_BosTokenizer(), prompt="ab") == [1, 97, 98]
    assert first_ids(_BosTokenizer(), prompt="eb") == [1, 98]  # "e" is id 1: its text wrote it
    assert first_ids(_BosTokenizer(), input_ids=[5, 6]) == [5, 6]
    assert first_ids(_CharTokenizer(), prompt="ab") == [97, 98]  # a tokenizer that adds none


def test_intake_counts_prompts_times_n():
    intake = RequestIntake(_CharTokenizer(), vocab_size=100, context_len=64, kv_capacity=256,
                           eos_token_ids=frozenset({0}), random_seed=0)

    def build(**call) -> RequestGroup:
        return intake.build(EngineRequest.from_call(**call))

    def count(**call) -> int:
        return len(build(**call))

    assert count(prompt="x") == 1
    assert count(prompt=["a", "b"], sampling_params={"n": 3}) == 6
    assert count(input_ids=[[1], [2]], sampling_params=[{"n": 2}, {}]) == 3
    with pytest.raises(InvalidArgumentError, match="n"):  # refused before anything is admitted
        count(input_ids=[1, 2, 3], sampling_params={"n": "bad"})
    group = build(prompt="x", sampling_params={"n": 2, "seed": 5}, rid="r")
    assert group.rids == ["r-0", "r-1"] and not group.single
    assert [req.index for req in group.reqs] == [0, 1]
    assert build(prompt=["a", "b"], rid="r").rids == ["r-0", "r-1"]
    assert build(prompt=["a", [5, 6]]).prompt_index(1) == 1
