"""Hostile input (issue 16): values that reach torch are bounded when a request enters, stop strings
are matched in linear time, and a request whose own step fails is aborted alone while the other
requests of its batch finish as they would have without it."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
import torch
from conftest import assert_idle_and_clean
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.runtime.engine import output_processor
from forklm.runtime.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from forklm.runtime.engine.intake import MAX_TOP_LOGPROBS_NUM
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling import params as sampling_params
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.sampling.sampler import sample

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = ["The capital of France is", "Once upon a time,", "def add(a, b):"]


# -- bounds at the edge: SamplingParams and the intake ----------------------------------------
def nested(depth: int) -> dict:
    """A dict nested `depth` deep: json.dumps runs out of stack on it."""
    value: dict = {}
    for _ in range(depth):
        value = {"x": value}
    return value


HOSTILE_PARAMS = [
    ("top_k", {"top_k": 10**400}),
    ("top_k", {"top_k": sampling_params.MAX_TOP_K + 1}),
    ("temperature", {"temperature": 10**400}),  # an int too large for a float
    ("temperature", {"temperature": 1e39}),  # inf in float32
    ("top_p", {"top_p": 10**400}),
    ("repetition_penalty", {"repetition_penalty": 1e-40}),  # 0 in float32
    ("n", {"n": sampling_params.MAX_N + 1}),
    ("stop", {"stop": ["x"] * (sampling_params.MAX_STOP_STRINGS + 1)}),
    ("stop", {"stop": "x" * (sampling_params.MAX_STOP_LEN + 1)}),
    ("stop", {"stop": "ab" * 20_000}),
    ("stop_token_ids", {"stop_token_ids": list(range(sampling_params.MAX_STOP_TOKEN_IDS + 1))}),
    ("logit_bias", {"logit_bias": {"5": 10**400}}),
    ("json_schema", {"json_schema": nested(100_000)}),
    ("seed", {"seed": 2**64}),
]


@pytest.mark.parametrize(("name", "params"), HOSTILE_PARAMS,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(HOSTILE_PARAMS)])
def test_hostile_sampling_values_are_invalid_arguments(name, params):
    with pytest.raises(InvalidArgumentError) as err:
        SamplingParams.from_dict(params)
    assert err.value.name == name
    assert len(str(err.value)) < 1000  # a 40,000-character value is not echoed back


def test_limits_themselves_are_accepted():
    SamplingParams(top_k=sampling_params.MAX_TOP_K, n=sampling_params.MAX_N, seed=2**64 - 1,
                   temperature=sampling_params.MAX_TEMPERATURE,
                   repetition_penalty=sampling_params.MIN_REPETITION_PENALTY,
                   stop=["x" * sampling_params.MAX_STOP_LEN] * sampling_params.MAX_STOP_STRINGS)


def test_huge_top_k_and_tiny_top_p_sample_like_their_meaning():
    """top_k above the vocabulary keeps every token; a top_p that is 0 in float32 still keeps the
    top token (so it is greedy)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)

    class Row:
        def __init__(self, params: SamplingParams, seed: int):
            self.sampling_params, self.generator = params, torch.Generator().manual_seed(seed)
            self.origin_input_ids, self.output_ids = [1, 2], []
            self.min_tokens_stop_ids, self.top_logprobs_num = [], 3

    huge = [Row(SamplingParams(top_k=sampling_params.MAX_TOP_K), s) for s in (1, 2)]
    plain = [Row(SamplingParams(top_k=50), s) for s in (1, 2)]  # the whole vocabulary
    assert sample(logits[:2].clone(), huge).token_ids == sample(logits[:2].clone(),
                                                               plain).token_ids
    tiny = [Row(SamplingParams(top_p=1e-300, top_k=40), s) for s in (3, 4)]
    assert sample(logits[2:].clone(), tiny).token_ids == logits[2:].argmax(-1).tolist()


# -- stop strings: linear matching --------------------------------------------------------------
def first_stop(text: str, stops: list[str]) -> tuple[int, int, str] | None:
    """(end, start, stop) of the occurrence ending first, the longest on a tie: brute force."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    return min(found) if found else None


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab", max_size=40), stops=st.lists(st.text("ab", min_size=1, max_size=6),
                                                        min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=6))
def test_stop_matcher_equals_brute_force(text, stops, cuts):
    matcher = StopStringMatcher(stops)
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    expected, got = first_stop(text, stops), None
    for lo, hi in zip(bounds, bounds[1:]):
        found = matcher.feed(text[lo:hi])
        if found is not None:
            got = (found[0] + lo, found[1] + lo, found[2])
            break
        # What must be held back: the longest text suffix that a stop string starts with.
        fed = text[:hi]
        assert matcher.partial_len == max(
            (n for s in stops for n in range(1, min(len(s), len(fed) + 1))
             if fed.endswith(s[:n])), default=0)
    assert got == expected


class CharTokenizer:
    """One character per token id (ord), for text of any shape without a real vocabulary."""

    def decode(self, ids, **kwargs):
        return "".join(map(chr, ids))


def test_long_stop_string_is_cheap():
    """The old held-back check built every prefix of every stop string: 40,000 characters cost
    half a GB and a second. Building and feeding now grow linearly."""
    stop = "ab" * (sampling_params.MAX_STOP_LEN // 2 - 1) + "c"
    stops = [stop[: len(stop) - i] + "d" for i in range(sampling_params.MAX_STOP_STRINGS)]
    t0 = time.perf_counter()
    detok = IncrementalDetokenizer(CharTokenizer(), stop=stops)
    text = "ab" * 3000 + stop[-40:]
    for ch in text:
        assert detok.add([ord(ch)]).matched_stop is None
    elapsed = time.perf_counter() - t0
    detok.flush()
    assert detok.text == text
    # 64 stops of ~1,000 characters, each held back almost whole at every one of 6,000 steps:
    # the old check compared up to 1,000 prefixes per step.
    assert elapsed < 5, elapsed
    big = StopStringMatcher(["xy" * 20_000])  # beyond the request limit: the matcher is linear
    assert big.feed("xy" * 19_999 + "x") is None and big.partial_len == 39_999
    assert big.feed("y") == (1, 1 - 40_000, "xy" * 20_000)


# -- the intake: top_logprobs_num, seeds --------------------------------------------------------
def test_top_logprobs_num_is_bounded_at_intake(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidArgumentError) as err:
        engine.generate("Hi", GREEDY, return_logprob=True, top_logprobs_num=100_000)
    assert err.value.name == "top_logprobs_num"
    out = engine.generate("Hi", {**GREEDY, "max_new_tokens": 2}, return_logprob=True,
                          logprob_start_len=0, top_logprobs_num=MAX_TOP_LOGPROBS_NUM)
    assert all(len(top) == MAX_TOP_LOGPROBS_NUM
               for top in out["meta_info"]["output_top_logprobs"])
    assert_idle_and_clean(engine)


def test_largest_seed_with_n_wraps_instead_of_failing(make_engine):
    """Sample k draws from seed + k: from 2**64 - 1, sample 1 wraps to seed 0."""
    engine = make_engine()
    params = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
    wrapped = engine.generate("Tell me a story", {**params, "seed": 2**64 - 1, "n": 2})
    alone = engine.generate("Tell me a story", {**params, "seed": 0})
    assert wrapped[1]["output_ids"] == alone["output_ids"]
    assert_idle_and_clean(engine)


# -- a failing step aborts only the request that fails ------------------------------------------
def run_batch(engine, params: dict) -> list[dict]:
    """PROMPTS in one generate() call (one engine batch); the middle one has rid "bad"."""
    return engine.generate(PROMPTS, params, rid=["ok-a", "bad", "ok-b"])


def references(engine, params: dict) -> list[dict]:
    return [engine.generate(p, params) for p in PROMPTS]


def assert_only_bad_aborted(results: list[dict], refs: list[dict]) -> None:
    bad = results[1]["meta_info"]["finish_reason"]
    assert bad["type"] == "abort" and "injected" in bad["message"], bad
    for i in (0, 2):
        assert results[i]["output_ids"] == refs[i]["output_ids"]
        assert results[i]["text"] == refs[i]["text"]
        assert results[i]["meta_info"]["finish_reason"] == refs[i]["meta_info"]["finish_reason"]


def has_bad(rows) -> bool:
    return any(getattr(r, "rid", None) == "bad" for r in rows)


@pytest.mark.parametrize("params", [GREEDY, {"temperature": 0.9, "top_p": 0.9, "seed": 7,
                                             "max_new_tokens": 6, "ignore_eos": True}],
                         ids=["greedy", "seeded"])
def test_sampling_fault_aborts_only_its_request(make_engine, monkeypatch, params):
    """The batched sampler raising for a batch with the bad request: the batch is rerun in
    halves; the innocent requests' seeded generators were rewound, so even their sampled
    outputs equal their runs alone."""
    engine = make_engine()
    refs = references(engine, params)
    real_sample = output_processor.sample_on_device

    def faulty(logits, rows, *args):
        result = real_sample(logits, rows, *args)  # draws from every row's generator, then fails
        if has_bad(rows):
            raise RuntimeError("injected sampling fault")
        return result

    monkeypatch.setattr(output_processor, "sample_on_device", faulty)
    assert_only_bad_aborted(run_batch(engine, params), refs)
    assert_idle_and_clean(engine)


def test_update_fault_aborts_only_its_request(make_engine, monkeypatch):
    """A request whose own update fails (after the batch sampled) is aborted in place."""
    engine = make_engine()
    refs = references(engine, GREEDY)
    real_append = output_processor.append_token

    def faulty(req, *args):
        if req.rid == "bad" and len(req.output_ids) >= 2:
            raise RuntimeError("injected update fault")
        real_append(req, *args)

    monkeypatch.setattr(output_processor, "append_token", faulty)
    results = run_batch(engine, GREEDY)
    assert_only_bad_aborted(results, refs)
    assert results[1]["output_ids"] == refs[1]["output_ids"][:2]
    assert_idle_and_clean(engine)


def test_forward_fault_aborts_only_its_request_and_caches_no_unwritten_kv(make_engine,
                                                                          monkeypatch):
    """The forward failing mid-decode for batches holding the bad request: the others finish
    unchanged, and the KV the failed step never wrote stays out of the radix cache (a later
    request continuing the bad one's text computes the same as on an empty cache)."""
    engine = make_engine()
    refs = references(engine, GREEDY)
    assert engine.flush_cache()  # else the cache holds the bad request's text from refs already
    runner = engine.parts.runner
    real_forward = runner.forward

    def faulty(batch, input_ids=None):
        # The step computing the bad request's second output token (read from its KV position:
        # with the overlap scheduler, output_ids grows while the forward runs).
        if any(r.rid == "bad" and r.num_computed - len(r.origin_input_ids) >= 2
               for r in batch.reqs):
            raise RuntimeError("injected forward fault")
        return real_forward(batch, input_ids)

    monkeypatch.setattr(runner, "forward", faulty)
    results = run_batch(engine, GREEDY)
    monkeypatch.undo()
    assert_only_bad_aborted(results, refs)
    assert results[1]["output_ids"] == refs[1]["output_ids"][:2]
    assert_idle_and_clean(engine)

    tokenizer = engine.parts.tokenizer
    prompt_ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    follow = (prompt_ids + results[1]["output_ids"]
              + tokenizer.encode(" and so on", add_special_tokens=False))
    call = dict(input_ids=follow, sampling_params={**GREEDY, "max_new_tokens": 3},
                return_logprob=True, logprob_start_len=len(follow) - 1)
    after_fault = engine.generate(**call)
    assert after_fault["meta_info"]["cached_tokens"] > len(prompt_ids)  # the bad one's KV
    assert engine.flush_cache()
    clean = engine.generate(**call)
    assert clean["meta_info"]["cached_tokens"] == 0
    assert after_fault["output_ids"] == clean["output_ids"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        got = [entry[0] for entry in after_fault["meta_info"][key]]
        want = [entry[0] for entry in clean["meta_info"][key]]
        assert got == pytest.approx(want, abs=1e-3), key
    assert_idle_and_clean(engine)


def test_every_request_failing_aborts_all_and_the_engine_keeps_serving(make_engine, monkeypatch):
    engine = make_engine()
    runner = engine.parts.runner
    real_forward = runner.forward

    def broken(batch, input_ids=None):
        raise RuntimeError("injected fault for everyone")

    monkeypatch.setattr(runner, "forward", broken)
    results = run_batch(engine, GREEDY)
    assert all(r["meta_info"]["finish_reason"]["type"] == "abort" for r in results)
    monkeypatch.setattr(runner, "forward", real_forward)
    assert_idle_and_clean(engine)
    assert engine.generate(PROMPTS[0], GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


# -- over HTTP: a hostile request is a 400, and a request beside it is served -------------------
HOSTILE_BODIES = [
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": 10**400}}, "top_k"),
    ("/generate", {"text": "Hi", "sampling_params": {"stop": "ab" * 20_000}}, "stop"),
    ("/generate", {"text": "Hi", "sampling_params": {"seed": 2**64 - 1, "n": 2,
                                                     "max_new_tokens": 2}}, None),
    ("/v1/chat/completions", {"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "top_k": 10**400,
                              "messages": [{"role": "user", "content": "Hi"}]}, "top_k"),
    ("/v1/programs/run", {"program_text": 'program p()\n"Say hi:"\ngen x max_tokens=2\n',
                          "sampling_params": {"return_logprob": True,
                                              "top_logprobs_num": 100_000}},
     "top_logprobs_num"),
]


def assert_rejected(reply: httpx.Response, param: str) -> None:
    """A 400 naming `param`, or (a program that failed while running) its item's error."""
    if reply.status_code == 400:
        assert param in reply.json()["error"]["message"], reply.text
        return
    assert reply.status_code == 200, reply.text
    error = reply.json()["results"][0]["error"]
    assert error["type"] == "invalid_request_error" and param in error["message"], error


@pytest.mark.slow
def test_hostile_http_requests_fail_alone(live_server, make_engine):
    engine = make_engine()
    ok_body = {"text": PROMPTS[0], "sampling_params": {**GREEDY, "max_new_tokens": 24}}
    want = engine.generate(PROMPTS[0], ok_body["sampling_params"])["text"]
    replies: dict[int, httpx.Response] = {}

    def send(i: int, path: str, body: dict) -> None:
        replies[i] = httpx.post(live_server.base_url + path, json=body, timeout=120)

    rng = random.Random(0)
    for _ in range(2):
        threads = [threading.Thread(target=send, args=(i, path, body))
                   for i, (path, body, _) in enumerate(HOSTILE_BODIES)]
        threads.append(threading.Thread(target=send, args=(-1, "/generate", ok_body)))
        rng.shuffle(threads)
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.perf_counter() - t0 < 60
        assert replies[-1].status_code == 200 and replies[-1].json()["text"] == want
        for i, (_, _, param) in enumerate(HOSTILE_BODIES):
            if param is None:
                assert replies[i].status_code == 200, replies[i].text
                assert all(r["meta_info"]["finish_reason"]["type"] == "length"
                           for r in replies[i].json())
            else:
                assert_rejected(replies[i], param)
    assert_idle_and_clean(engine)
