"""Every field of SGLang's SamplingParams is accepted: stop_regex, no_stop_trim, logit_bias,
spaces_between_special_tokens, structural_tag, stream_interval and custom_params, end to end on
the default model and through /generate and /v1/completions; min_new_tokens bans EOS also with
ignore_eos, as transformers does."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import DEFAULT_MODEL, assert_idle_and_clean, chat_prompt

from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling import stop_regex
from forklm.runtime.sampling.params import SamplingParams

GREEDY = {"temperature": 0.0}
# What SGLang's frontend (sglang.RuntimeEndpoint, SglSamplingParams.to_srt_kwargs) sends with a
# plain gen(): every field, at its default.
SGLANG_FRONTEND_DEFAULTS = {
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8,
    "min_new_tokens": 0, "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": [],
    "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "regex": None, "json_schema": None}
# SGLang's server-side SamplingParams (python/sglang/srt/sampling/sampling_params.py), defaults.
SGLANG_SERVER_DEFAULTS = {
    "max_new_tokens": 128, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1,
    "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, "ignore_eos": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False,
    "custom_params": None, "stream_interval": None, "logit_bias": None, "sampling_seed": None}


# ---- SamplingParams ----

@pytest.mark.parametrize("fields", [SGLANG_FRONTEND_DEFAULTS, SGLANG_SERVER_DEFAULTS],
                         ids=["frontend", "server"])
def test_every_sglang_field_is_accepted_at_its_default(fields):
    params = SamplingParams.from_dict(fields)
    assert params.stop_regex is None and params.logit_bias is None and params.constraint is None


def test_extras_are_normalized():
    params = SamplingParams(stop_regex=r"\d+", logit_bias={"5": 1, 7: -2.5},
                            custom_params={"k": [1, "a"]}, stream_interval=4)
    assert params.stop_regex == [r"\d+"] and params.logit_bias == {5: 1.0, 7: -2.5}
    assert params.custom_params == {"k": [1, "a"]} and params.stream_interval == 4


@pytest.mark.parametrize(("name", "value", "why"), [
    ("stop_regex", "(", "not a valid regex"),
    ("stop_regex", "a*", "must not match the empty string"),
    ("stop_regex", ["a"] * (stop_regex.MAX_STOP_REGEXES + 1), "at most"),
    ("stop_regex", "a" * (stop_regex.MAX_STOP_REGEX_LEN + 1), "characters"),
    ("stop_regex", [1], "a str or a list of str"),
    ("stream_interval", 0, "int >= 1"),
    ("custom_params", [1], "an object"),
])
def test_bad_extras_name_the_field(name, value, why):
    with pytest.raises(InvalidArgumentError, match=why) as info:
        SamplingParams(**{name: value})
    assert info.value.name == name


# ---- the engine ----

@pytest.fixture(scope="module")
def engine(make_engine):
    engine = make_engine()
    yield engine
    assert_idle_and_clean(engine)


@pytest.fixture(scope="module")
def france(tokenizer) -> str:
    return chat_prompt(tokenizer, "What is the capital of France?")


def test_stop_regex_finishes_with_the_pattern_and_trims(engine, france):
    free = engine.generate(france, {**GREEDY, "max_new_tokens": 16})["text"]
    word = free.split()[2]  # a word a few tokens in
    pattern = rf"\b{word[:2]}\w*"
    cut, kept = engine.generate([france] * 2, [
        {**GREEDY, "max_new_tokens": 16, "stop_regex": [r"\d{5}", pattern]},
        {**GREEDY, "max_new_tokens": 16, "stop_regex": pattern, "no_stop_trim": True}])
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    start = free.index(" " + word[:2]) + 1
    assert cut["text"] == free[:start]
    assert kept["text"].startswith(free[:start] + word[:2]) and len(kept["text"]) < len(free)
    streamed = list(engine.generate(france, {**GREEDY, "max_new_tokens": 16,
                                             "stop_regex": pattern}, stream=True))
    assert "".join(c["text"] for c in streamed) == cut["text"]


def test_no_stop_trim_keeps_stop_strings_and_stop_tokens(engine, tokenizer, france):
    free = engine.generate(france, {**GREEDY, "max_new_tokens": 12})
    stop = free["text"].split()[2]
    token = free["output_ids"][3]
    trim, keep, tok_trim, tok_keep = engine.generate([france] * 4, [
        {**GREEDY, "max_new_tokens": 12, "stop": stop},
        {**GREEDY, "max_new_tokens": 12, "stop": stop, "no_stop_trim": True},
        {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [token]},
        {**GREEDY, "max_new_tokens": 12, "stop_token_ids": [token], "no_stop_trim": True}])
    assert keep["text"] == trim["text"] + stop
    assert tok_trim["text"] == tokenizer.decode(free["output_ids"][:3])
    assert tok_keep["text"] == tokenizer.decode(free["output_ids"][:4])


def test_logit_bias_forces_and_bans_tokens(engine, tokenizer, france):
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    free = engine.generate(france, {**GREEDY, "max_new_tokens": 4})
    first = free["output_ids"][0]
    forced, banned = engine.generate([france] * 2, [
        {**GREEDY, "max_new_tokens": 4, "logit_bias": {str(forced_id): 100}},
        {**GREEDY, "max_new_tokens": 4, "logit_bias": {first: -100}}])
    assert forced["output_ids"] == [forced_id] * 4
    assert banned["output_ids"][0] != first and first not in banned["output_ids"]
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        engine.generate(france, {"logit_bias": {engine.model_info.vocab_size: 1.0}})


@torch.inference_mode()
def test_min_new_tokens_with_ignore_eos_matches_transformers(engine, hf_model, tokenizer,
                                                             france):
    """A +100 bias on EOS makes it the argmax everywhere; min_new_tokens must still ban it for the
    first tokens, with and without ignore_eos, exactly as transformers' generate does."""
    eos = tokenizer.eos_token_id
    assert eos in engine.parts.intake.eos_token_ids
    bias, min_new = {eos: 100.0}, 5
    ids = tokenizer.encode(france, add_special_tokens=False)
    hf = hf_model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=min_new + 3,
                           min_new_tokens=min_new, sequence_bias={(eos,): 100.0},
                           eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    assert len(hf) == min_new + 1 and hf[-1] == eos and eos not in hf[:-1]
    common = {**GREEDY, "max_new_tokens": min_new + 3, "min_new_tokens": min_new,
              "logit_bias": bias}
    ignoring, stopping = engine.generate([france] * 2, [{**common, "ignore_eos": True}, common])
    assert stopping["output_ids"] == hf
    assert ignoring["output_ids"] == hf + [eos] * 2  # past min_new_tokens EOS may come, and does


# ---- the HTTP server ----

@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        yield c


def test_native_generate_takes_the_sglang_frontend_body(client, live_server):
    body = {"text": "The capital of France is", "sampling_params": SGLANG_FRONTEND_DEFAULTS}
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    expected = live_server.engine.generate(body["text"], {**GREEDY, "max_new_tokens": 8})
    assert r.json()["output_ids"] == expected["output_ids"]
    nulls = {**SGLANG_SERVER_DEFAULTS, "max_new_tokens": 8, "temperature": 0.0}
    r = client.post("/generate", json={**body, "sampling_params": nulls,
                                       "custom_logit_processor": None, "lora_path": None})
    assert r.status_code == 200 and r.json()["output_ids"] == expected["output_ids"], r.text


@pytest.mark.parametrize(("field", "value", "says"), [
    ("custom_logit_processor", "<pickled>", "not supported"),
    ("return_hidden_states", True, "not supported"),
    ("lora_path", ["a"], "serves no LoRA adapters"),  # this server loaded none
    ("image_data", "x.png", "reads no images")])  # a text model
def test_native_fields_this_server_cannot_honour_are_a_400_when_set(client, field, value, says):
    r = client.post("/generate", json={"text": "Hi", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and says in error["message"]


def test_native_stream_interval_batches_events(client):
    def events(interval):
        body = {"text": "Count: 1, 2, 3,", "stream": True,
                "sampling_params": {**GREEDY, "max_new_tokens": 10, "ignore_eos": True,
                                    "stream_interval": interval}}
        with client.stream("POST", "/generate", json=body) as r:
            lines = [ln for ln in r.iter_lines() if ln and ln != "data: [DONE]"]
        return [json.loads(ln[len("data: "):]) for ln in lines]

    every, batched = events(1), events(4)
    assert len(every) == 10 and [len(e["output_ids"]) for e in batched] == [4, 8, 10]
    assert batched[-1]["text"] == every[-1]["text"]
    assert batched[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}


def test_openai_logit_bias_and_stop_regex(client, tokenizer):
    forced_id = tokenizer.encode(" banana", add_special_tokens=False)[0]
    body = {"model": DEFAULT_MODEL, "prompt": "The capital of France is", "max_tokens": 3,
            "temperature": 0}
    r = client.post("/v1/completions", json={**body, "logit_bias": {str(forced_id): 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " banana" * 3
    r = client.post("/v1/completions", json={**body, "max_tokens": 8, "stop_regex": "[Pp]aris"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "aris" not in choice["text"]
    r = client.post("/v1/completions", json={**body, "logit_bias": {"1": 150}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = client.post("/v1/completions", json={**body, "custom_logit_processor": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "custom_logit_processor"


def test_openai_fields_map_onto_sampling_params():
    from forklm.server.openai_convert import sampling_dict
    from forklm.server.protocol import CompletionRequest

    body = CompletionRequest(model=DEFAULT_MODEL, prompt="x", logit_bias={"3": -1.5},
                             stop_regex=["a+b"], spaces_between_special_tokens=False,
                             custom_params={"k": 1}, no_stop_trim=True)
    params = SamplingParams.from_dict(sampling_dict(body, 8))
    assert (params.logit_bias, params.stop_regex, params.custom_params) == (
        {3: -1.5}, ["a+b"], {"k": 1})
    assert params.spaces_between_special_tokens is False and params.no_stop_trim is True
