"""Constrained decoding on the default model: regex, JSON schema, EBNF and choices hold for sampled
and greedy outputs, alongside unconstrained requests, across retraction, chunked prefill, streaming,
stop/length limits and logprobs; bad constraints fail at submission with xgrammar's reason."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import threading
from collections.abc import Callable

import jsonschema
import pytest

from forklm.runtime.engine.engine import Engine
from forklm.runtime.sampling.params import SamplingParams
from tests.conftest import assert_idle_and_clean, chat_prompt

GREEDY = {"temperature": 0}
NUM_SAMPLES = 20

IPV4 = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
# Strings and arrays are bounded so that a sample at temperature 1.0 always closes in time.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
# Sums of products of numbers or parenthesized binary operations (bounded, so samples end).
ARITHMETIC_EBNF = r"""
root ::= sum
sum ::= product (" " [-+] " " product){0,2}
product ::= atom (" " [*/] " " atom){0,1}
atom ::= number | "(" number " " [-+*/] " " number ")"
number ::= [1-9] [0-9]{0,1}
"""
# The same language as a Python regex, written independently of the grammar.
_NUM = r"[1-9][0-9]?"
_ATOM = rf"(?:{_NUM}|\({_NUM} [-+*/] {_NUM}\))"
_PRODUCT = rf"{_ATOM}(?: [*/] {_ATOM})?"
ARITHMETIC_RE = rf"{_PRODUCT}(?: [-+] {_PRODUCT}){{0,2}}"
LABELS = ["positive", "negative", "neutral", "mixed"]


def is_person(text: str) -> bool:
    jsonschema.validate(json.loads(text), PERSON_SCHEMA)  # raises with the reason
    return True


# name -> (question, constraint, max_new_tokens, check of the output text)
CASES: dict[str, tuple[str, dict, int, Callable[[str], bool]]] = {
    "ipv4": ("What is the IP address of the Google DNS server?", {"regex": IPV4}, 24,
             lambda t: re.fullmatch(IPV4, t) is not None),
    "date": ("On what date did Apollo 11 land on the moon? Answer as YYYY-MM-DD.",
             {"regex": DATE}, 16, lambda t: re.fullmatch(DATE, t) is not None),
    "json": ("Describe a user of a web shop as JSON with name, age, role, address and tags.",
             {"json_schema": PERSON_SCHEMA}, 96, is_person),
    "ebnf": ("Write a short arithmetic expression.", {"ebnf": ARITHMETIC_EBNF}, 48,
             lambda t: re.fullmatch(ARITHMETIC_RE, t) is not None),
    "choices": ("Is this review positive, negative, neutral or mixed? 'Great food, rude staff.'",
                {"choices": LABELS}, 8, lambda t: t in LABELS),
}


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture(autouse=True)
def engine_stays_clean(engine):
    yield
    assert_idle_and_clean(engine)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, str]:
    return {name: chat_prompt(tokenizer, case[0]) for name, case in CASES.items()}


def ended_by_grammar(result: dict) -> bool:
    """Finished by an end-of-generation token that a completed grammar allows (SmolLM2's
    <|im_end|>, id 2, or <|endoftext|>, id 0)."""
    reason = result["meta_info"]["finish_reason"]
    return reason["type"] == "stop" and reason.get("matched") in (2, 0)


def params_for(name: str, **extra) -> dict:
    _, constraint, max_new_tokens, _ = CASES[name]
    return {"max_new_tokens": max_new_tokens, **constraint, **extra}


@pytest.fixture(scope="module")
def runs(engine, prompts) -> dict[str, tuple[list[dict], dict]]:
    """Per case: NUM_SAMPLES samples at temperature 1.0 (n > 1: one seed each) and a greedy
    output, all from a single generate call so that the whole lot decodes as one batch."""
    names = list(CASES)
    results = engine.generate(
        [prompts[n] for n in names] * 2,
        [params_for(n, temperature=1.0, n=NUM_SAMPLES, seed=1000) for n in names]
        + [params_for(n, **GREEDY) for n in names])
    samples = results[: len(names) * NUM_SAMPLES]
    greedy = results[len(names) * NUM_SAMPLES :]
    return {n: (samples[i * NUM_SAMPLES : (i + 1) * NUM_SAMPLES], greedy[i])
            for i, n in enumerate(names)}


# -- every kind of constraint holds ----------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_samples_satisfy_the_constraint(runs, name):
    samples, _ = runs[name]
    check = CASES[name][3]
    texts = [s["text"] for s in samples]
    for s in samples:
        assert ended_by_grammar(s), s
        assert check(s["text"]), s["text"]
    assert len(set(texts)) > 1, f"seeds made no difference: {texts}"


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_is_deterministic(engine, prompts, runs, name):
    _, greedy = runs[name]
    assert CASES[name][3](greedy["text"]), greedy["text"]
    again = engine.generate(prompts[name], params_for(name, **GREEDY))  # now a radix-cache hit
    assert again["meta_info"]["cached_tokens"] > 0
    assert again["output_ids"] == greedy["output_ids"]


def test_unconstrained_neighbours_are_untouched(engine, tokenizer, prompts):
    free = [chat_prompt(tokenizer, "Tell me a short story about a brave little fox."),
            "The weather today is"]
    free_params = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    solo = [engine.generate(p, free_params)["output_ids"] for p in free]
    mixed = engine.generate(
        [prompts["json"], free[0], prompts["choices"], free[1], prompts["ipv4"]],
        [params_for("json", **GREEDY), free_params, params_for("choices", temperature=1.0),
         free_params, params_for("ipv4", temperature=1.0, seed=7)])
    assert [mixed[1]["output_ids"], mixed[3]["output_ids"]] == solo
    assert all(CASES[n][3](r["text"]) for n, r in zip(["json", "choices", "ipv4"],
                                                       [mixed[0], mixed[2], mixed[4]]))


def test_jump_forward_stays_valid_in_fewer_steps(make_engine, prompts):
    # Off by default because it can change greedy outputs: forced text is tokenized canonically
    # (` {"` here), where the model, sampling under the mask, may pick another split (` {`, `"`).
    engine = make_engine(enable_jump_forward=True)
    names = list(CASES)
    steps = engine.stats()["steps"]
    results = engine.generate([prompts[n] for n in names] + [prompts["json"]],
                              [params_for(n, **GREEDY) for n in names]
                              + [params_for("json", temperature=1.0, n=4, seed=5)])
    for name, result in zip(names + ["json"] * 4, results):
        assert ended_by_grammar(result), result
        assert CASES[name][3](result["text"]), result["text"]
    num_steps = engine.stats()["steps"] - steps
    longest = max(len(r["output_ids"]) for r in results)  # plain decoding: a step per token
    assert num_steps < 0.8 * longest, (num_steps, longest)


# -- the rest of the engine still applies ----------------------------------------------------
def test_retraction_mid_json_keeps_the_output(make_engine, prompts, runs, caplog):
    # 6 samples of ~65 JSON tokens after a shared ~40-token prompt need ~430 KV slots; 280 with
    # a low reserve for future tokens admit all 6, and their growth forces retraction during
    # decode, i.e. of requests part-way through their JSON. They re-prefill and continue with
    # the same matcher and random stream, so the outputs equal those of the roomy run. (An engine
    # of its own: retraction changes the scheduler's admission ratio for later tests.)
    tight = make_engine(max_total_tokens=280, schedule_conservativeness=0.3)
    with caplog.at_level(logging.INFO, logger="forklm.runtime.scheduling.scheduler"):
        results = tight.generate(prompts["json"],
                                 params_for("json", temperature=1.0, n=6, seed=1000))
    assert any("retracted" in r.getMessage() for r in caplog.records), "no retraction happened"
    roomy, _ = runs["json"]  # seeds 1000, 1001, ... as here
    assert [r["output_ids"] for r in results] == [r["output_ids"] for r in roomy[:6]]
    assert all(is_person(r["text"]) for r in results)
    assert tight.last_error is None
    tight.check_invariants()


def test_chunked_prefill(make_engine, prompts, runs):
    chunked = make_engine(chunked_prefill_size=16, disable_radix_cache=True)
    result = chunked.generate(prompts["json"], params_for("json", **GREEDY))
    assert result["output_ids"] == runs["json"][1]["output_ids"]


def test_streaming_yields_the_same_text(engine, prompts, runs):
    chunks = list(engine.generate(prompts["json"], params_for("json", **GREEDY), stream=True))
    assert "".join(c["text"] for c in chunks) == runs["json"][1]["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "stop"


def test_async_generate(engine, prompts):
    result = asyncio.run(engine.async_generate(prompts["choices"], params_for("choices", seed=3)))
    assert result["text"] in LABELS


def test_stop_string_and_max_new_tokens_cut_the_output(engine, prompts, runs):
    greedy = runs["json"][1]
    cut = engine.generate(prompts["json"], params_for("json", **GREEDY, stop='"role"'))
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": '"role"'}
    assert cut["text"] == greedy["text"][: greedy["text"].index('"role"')]
    short = engine.generate(prompts["json"], params_for("json", **GREEDY, max_new_tokens=5))
    assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert short["output_ids"] == greedy["output_ids"][:5]


@pytest.mark.parametrize("eos_rule", [{"min_new_tokens": 6}, {"ignore_eos": True}])
def test_completed_grammar_ends_despite_eos_rules(engine, prompts, eos_rule):
    # No label takes 6 tokens, and nothing may follow a label: holding EOS back would leave no
    # allowed token.
    result = engine.generate(prompts["choices"], params_for("choices", **GREEDY, **eos_rule))
    assert result["text"] in LABELS
    assert ended_by_grammar(result)


def test_logprobs_are_of_the_masked_distribution(engine, prompts):
    result = engine.generate(prompts["choices"], params_for("choices", **GREEDY),
                             return_logprob=True, top_logprobs_num=5)
    meta = result["meta_info"]
    assert all(math.isfinite(lp) and lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    first = [(lp, text) for lp, _, text in meta["output_top_logprobs"][0]]
    allowed = [text for lp, text in first if lp > -math.inf]
    assert allowed and all(any(label.startswith(t) for label in LABELS) for t in allowed), first
    # Masked tokens carry no probability: the allowed ones' mass is (about) all of it.
    assert sum(math.exp(lp) for lp, _ in first) == pytest.approx(1.0, abs=0.05)


# -- errors ----------------------------------------------------------------------------------
BAD_CONSTRAINTS = [
    ({"regex": "((25[0-5]"}, "regex", "parenthesis is not closed"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "foo"}}}}, "json_schema",
     'Unsupported type "foo"'),
    ({"json_schema": '{"type": "object"'}, "json_schema", "xgrammar cannot compile it"),
    ({"ebnf": "root ::= expr"}, "ebnf", 'Rule "expr" is not defined'),
]


@pytest.mark.parametrize(("constraint", "name", "reason"), BAD_CONSTRAINTS,
                         ids=["regex", "schema", "schema-text", "ebnf"])
def test_bad_constraint_is_a_value_error_with_the_reason(engine, prompts, constraint, name,
                                                         reason):
    generated = engine.stats()["generated_tokens"]
    with pytest.raises(ValueError, match=re.escape(reason)) as info:
        # With a good request in the same call: nothing of the call is submitted.
        engine.generate([prompts["ipv4"]] * 2,
                        [params_for("ipv4"), {"max_new_tokens": 8, **constraint}])
    assert str(info.value).startswith(f"{name}=")
    with pytest.raises(ValueError, match=re.escape(reason)):
        asyncio.run(engine.async_generate(prompts["ipv4"], {"max_new_tokens": 8, **constraint}))
    assert engine.stats()["generated_tokens"] == generated
    result = engine.generate(prompts["ipv4"], params_for("ipv4", **GREEDY))
    assert re.fullmatch(IPV4, result["text"])


def test_compiled_once_off_the_engine_thread(engine, prompts, monkeypatch):
    backend = engine.parts.grammar
    compiled_on: list[str] = []
    compile_one = backend._compile

    def recording(constraint):
        compiled_on.append(threading.current_thread().name)
        return compile_one(constraint)

    monkeypatch.setattr(backend, "_compile", recording)
    params = {**GREEDY, "max_new_tokens": 8, "regex": r"(yes|no|maybe)!"}  # new to the cache
    first = engine.generate([prompts["choices"]] * 3, params)  # one compile for 3 requests
    again = engine.generate(prompts["choices"], params)
    assert [r["text"] for r in first] == [again["text"]] * 3
    assert again["text"] in ("yes!", "no!", "maybe!")
    assert len(compiled_on) == 1 and compiled_on[0].startswith("forklm-grammar"), compiled_on


def test_at_most_one_constraint():
    with pytest.raises(ValueError, match="only one of regex, json_schema, ebnf, choices"):
        SamplingParams(regex="a+", choices=["a"])
    with pytest.raises(ValueError, match="choices"):
        SamplingParams(choices=[])
    with pytest.raises(ValueError, match="json_schema"):
        SamplingParams(json_schema=42)


# -- structural tags (tool calls constrained after their trigger) --------------------------------
WEATHER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                  "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 9}}}
WEATHER_TAG = {"type": "structural_tag", "triggers": ["<tool_call>"], "structures": [
    {"begin": "<tool_call>", "schema": WEATHER_SCHEMA, "end": "</tool_call>"}]}
# Few-shot: the model copies the call format, but picks cities the schema does not allow.
TOOL_PROMPT = ('Q: weather in Paris for 2 days?\nA: <tool_call>{"city": "Paris", "days": 2}'
               '</tool_call>\nQ: weather in Oslo tomorrow?\nA: <tool_call>{"city": "Oslo", '
               '"days": 1}</tool_call>\nQ: weather in Rome this week?\nA:')


def tool_calls(text: str) -> list[str]:
    return re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)


def valid_call(body: str) -> bool:
    try:
        jsonschema.validate(json.loads(body), WEATHER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_structural_tag_constrains_the_json_after_its_trigger(engine):
    free, tagged = engine.generate(
        [TOOL_PROMPT] * 2, [{**GREEDY, "max_new_tokens": 40},
                            {**GREEDY, "max_new_tokens": 40,
                             "structural_tag": json.dumps(WEATHER_TAG)}])
    assert tool_calls(free["text"]) and not all(map(valid_call, tool_calls(free["text"])))
    calls = tool_calls(tagged["text"])
    assert calls and all(map(valid_call, calls)), tagged["text"]
    # Free text before the trigger (the space the model writes first); the end tag closes it.
    assert tagged["text"].startswith(" <tool_call>{") and "</tool_call>" in tagged["text"]


def test_structural_tag_shapes_are_checked():
    with pytest.raises(ValueError, match="structural_tag=.*needs \"structures\""):
        SamplingParams(structural_tag={"type": "structural_tag", "structures": []})
    with pytest.raises(ValueError, match="begin must start with a trigger"):
        SamplingParams(structural_tag={**WEATHER_TAG, "triggers": ["<call>"]})
    with pytest.raises(ValueError, match="only one of"):
        SamplingParams(structural_tag=WEATHER_TAG, regex="a")
    with pytest.raises(ValueError, match="structural_tag=.*not valid JSON"):
        SamplingParams(structural_tag="[" * 100_000)
    spec = SamplingParams(structural_tag=WEATHER_TAG).constraint
    assert spec is not None and spec.kind == "structural_tag"
    assert json.loads(spec.spec) == WEATHER_TAG


def test_structural_tag_bad_schema_fails_with_xgrammar_reason(engine):
    bad = {**WEATHER_TAG, "structures": [{"begin": "<tool_call>", "schema": {"type": 5},
                                          "end": "</tool_call>"}]}
    with pytest.raises(ValueError, match="structural_tag=.*xgrammar cannot compile it"):
        engine.generate(TOOL_PROMPT, {"max_new_tokens": 4, "structural_tag": bad})
