"""NGRAM speculative decoding: the draft lookup (property tests), config validation, and engine
outputs identical to plain decoding (greedy and seeded sampling), with the KV accounting checked
after every step and nothing left allocated."""

from __future__ import annotations

import argparse
import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forklm.cli import add_engine_flags, engine_kwargs
from forklm.runtime.config import EngineConfig
from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.ngram_draft import MAX_CANDIDATES, NgramIndex
from tests.conftest import assert_idle_and_clean, chat_prompt
from tests.tiny_models import ARCHITECTURES, build_tiny_model

GREEDY = {"temperature": 0}
SPEC = {"speculative_algorithm": "NGRAM", "dtype": "float32", "max_total_tokens": 8192,
        "debug_check_invariants": True}
FRUITS = "apple, banana, cherry, date, elderberry, fig, grape"
# Prompts whose answers copy the prompt (drafts get accepted) and ones that do not.
QUESTIONS = [
    f"Repeat this list exactly, twice: {FRUITS}.",
    'Rewrite this JSON with "age" set to 31: {"name": "Ada", "age": 30, "city": "London", '
    '"languages": ["English", "French"]}',
    "What is the capital of France?",
    "Write a haiku about the sea.",
]


# -- the lookup ------------------------------------------------------------------------------
def index_of(tokens: list[int], min_n: int = 1, max_n: int = 4) -> NgramIndex:
    index = NgramIndex(min_n, max_n)
    index.extend(tokens)
    return index


def longest_earlier_match(tokens: list[int], max_n: int) -> int:
    """Brute force: the longest suffix (<= max_n) that also ends at an earlier position."""
    last = len(tokens) - 1
    best = 0
    for p in range(last):
        n = 0
        while n < max_n and p - n >= 0 and tokens[p - n] == tokens[last - n]:
            n += 1
        best = max(best, n)
    return best


def test_draft_copies_what_followed_the_suffix():
    assert index_of([1, 2, 3, 4, 5, 9, 2, 3]).propose(3) == [4, 5, 9]
    assert index_of([1, 2, 3, 4, 5, 9, 2, 3]).propose(1) == [4]
    # The longer match (7 8 2 3) wins over the later, shorter one (2 3).
    assert index_of([7, 8, 2, 3, 10, 2, 3, 11, 7, 8, 2, 3]).propose(2) == [10, 2]
    assert index_of([1, 2, 3]).propose(4) == []  # nothing repeats
    assert index_of([5, 6, 5], min_n=2).propose(4) == []  # a 1-token match is too short
    assert index_of([5]).propose(4) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 3),
       st.integers(0, 3), st.integers(1, 6), st.integers(1, 5))
def test_draft_follows_an_earlier_occurrence(tokens, min_n, extra_n, limit, num_chunks):
    max_n = min_n + extra_n
    index = NgramIndex(min_n, max_n)
    step = max(1, len(tokens) // num_chunks)
    for start in range(0, len(tokens), step):  # incremental extends must equal one extend
        index.extend(tokens[start : start + step])
    draft = index.propose(limit)
    assert len(draft) <= limit
    best = longest_earlier_match(tokens, max_n)
    if best < min_n:
        assert draft == []
        return
    assert draft, "a suffix of at least min_n tokens occurred earlier, so there is a draft"
    last = len(tokens) - 1
    # Some earlier end p shares the longest possible suffix, and the draft is what followed it.
    ends = [p for p in range(last)
            if tokens[max(p - best + 1, 0) : p + 1] == tokens[last - best + 1 :]
            and p - best + 1 >= 0]
    assert any(tokens[p + 1 : p + 1 + len(draft)] == draft for p in ends)


def test_lookup_work_is_bounded():
    """Only the MAX_CANDIDATES latest occurrences of the last bigram are tried: a longer match
    further back is found only while it is among them."""
    def tokens(repeats: int) -> list[int]:
        return [9, 1, 2, 7] + [1, 2] * repeats + [5, 9, 1, 2]

    assert index_of(tokens(MAX_CANDIDATES // 2)).propose(2) == [7, 1]  # 9 1 2 matched
    assert index_of(tokens(2 * MAX_CANDIDATES)).propose(2) == [5, 9]  # 1 2, the latest


# -- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [
    ("speculative_algorithm", "EAGLE"),
    ("speculative_algorithm", "ngram"),
    ("speculative_num_draft_tokens", 0),
    ("speculative_ngram_min_match_window_size", 0),
    ("speculative_ngram_max_match_window_size", 0),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        EngineConfig(**{field: value})


def test_cli_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens",
                              "6", "--speculative-ngram-max-match-window-size", "8"])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert (config.speculative_algorithm, config.speculative_num_draft_tokens) == ("NGRAM", 6)
    assert (config.speculative_ngram_min_match_window_size,
            config.speculative_ngram_max_match_window_size) == (1, 8)


# -- the engine ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain(make_engine) -> Engine:
    return make_engine()


@pytest.fixture(scope="module")
def spec() -> Engine:
    engine = Engine(**SPEC)
    yield engine
    engine.shutdown()


@pytest.fixture(autouse=False)
def clean(plain, spec):
    yield
    assert_idle_and_clean(spec)
    assert_idle_and_clean(plain)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[str]:
    return [chat_prompt(tokenizer, q) for q in QUESTIONS]


def accepted(engine: Engine) -> int:
    return engine.stats()["spec_accepted_tokens"]


def run_both(plain: Engine, spec: Engine, prompts, params) -> tuple[list[dict], list[dict]]:
    return plain.generate(prompts, params), spec.generate(prompts, params)


def ids(results: list[dict]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_greedy_output_is_identical(plain, spec, prompts, clean):
    before = accepted(spec)
    for prompt in prompts:  # batch 1
        a, b = run_both(plain, spec, [prompt], {**GREEDY, "max_new_tokens": 48})
        assert ids(a) == ids(b)
    assert accepted(spec) > before, "the repetitive prompts must get drafts accepted"


def test_greedy_batch_of_different_lengths(plain, spec, prompts, clean):
    params = [{**GREEDY, "max_new_tokens": n} for n in (40, 13, 29, 7)]
    before = accepted(spec)
    a, b = run_both(plain, spec, prompts, params)
    assert ids(a) == ids(b)
    assert [r["meta_info"]["finish_reason"] for r in a] == [
        r["meta_info"]["finish_reason"] for r in b]
    assert accepted(spec) > before


def test_max_new_tokens_inside_accepted_drafts(plain, spec, prompts, clean):
    """Every cut-off 1..24 of a prompt whose drafts are accepted: some land inside a draft."""
    params = [{**GREEDY, "max_new_tokens": n, "ignore_eos": True} for n in range(1, 25)]
    a, b = run_both(plain, spec, [prompts[0]] * len(params), params)
    assert ids(a) == ids(b)
    assert [len(x) for x in ids(b)] == list(range(1, 25))


def test_stop_strings_inside_accepted_drafts(plain, spec, prompts, clean):
    params = [{**GREEDY, "max_new_tokens": 60, "stop": [stop]}
              for stop in ("cherry", "fig, grape", "elderberry", ", d")]
    a, b = run_both(plain, spec, [prompts[0]] * len(params), params)
    assert [r["text"] for r in a] == [r["text"] for r in b]
    assert ids(a) == ids(b)
    assert all(r["meta_info"]["finish_reason"]["type"] == "stop" for r in b)


def test_seeded_sampling_is_identical(plain, spec, prompts, clean):
    """Each verify position samples with the request's own generator, rewound afterwards to
    where plain decoding would be, so a seed gives the same tokens."""
    params = [
        {"temperature": 0.8, "seed": 11, "max_new_tokens": 40},
        {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 5, "max_new_tokens": 40},
        {"temperature": 0.7, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "seed": 3,
         "max_new_tokens": 40, "min_new_tokens": 30},
        {"temperature": 0.6, "seed": 2, "max_new_tokens": 40},
    ]
    before = accepted(spec)
    a, b = run_both(plain, spec, prompts, params)
    assert ids(a) == ids(b)
    assert accepted(spec) > before, "sampled requests are drafted too"


def test_logprobs_match_plain_decoding(plain, spec, prompts, clean):
    params = {**GREEDY, "max_new_tokens": 30}
    a = plain.generate(prompts[0], params, return_logprob=True, top_logprobs_num=3)
    before = accepted(spec)
    b = spec.generate(prompts[0], params, return_logprob=True, top_logprobs_num=3)
    assert accepted(spec) > before, "requests with logprobs are drafted too"
    assert a["output_ids"] == b["output_ids"]
    la, lb = a["meta_info"]["output_token_logprobs"], b["meta_info"]["output_token_logprobs"]
    assert [x[1] for x in la] == [x[1] for x in lb]
    assert [x[0] for x in la] == pytest.approx([x[0] for x in lb], abs=1e-3)
    ta, tb = a["meta_info"]["output_top_logprobs"], b["meta_info"]["output_top_logprobs"]
    assert [[t[1] for t in row] for row in ta] == [[t[1] for t in row] for row in tb]


def test_constrained_requests_decode_normally(plain, spec, prompts, clean):
    params = [{**GREEDY, "max_new_tokens": 30, "regex": r"(apple|banana|cherry)(, (apple|banana"
               r"|cherry)){0,6}\."}, {**GREEDY, "max_new_tokens": 30}]
    a, b = run_both(plain, spec, prompts[:2], params)
    assert ids(a) == ids(b)


def test_kv_shortage_retracts_and_stays_identical(plain, tokenizer, caplog):
    """A pool too small for every request: drafts shrink or vanish, requests retract and
    re-prefill, and the outputs are still plain decoding's (no radix cache: the free path)."""
    engine = Engine(**{**SPEC, "max_total_tokens": 300, "schedule_conservativeness": 0.3,
                       "disable_radix_cache": True, "speculative_num_draft_tokens": 8})
    try:
        prompts = [chat_prompt(tokenizer, f"Repeat exactly: {FRUITS}, number {i}.")
                   for i in range(6)]
        params = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True}
        a = plain.generate(prompts, params)
        with caplog.at_level(logging.INFO, logger="forklm.runtime.scheduling.scheduler"):
            b = engine.generate(prompts, params)
        assert any("retracted" in r.getMessage() for r in caplog.records), "no retraction"
        assert ids(a) == ids(b)
        assert engine.stats()["spec_accepted_tokens"] > 0
        assert_idle_and_clean(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("arch", "backend"), [
    ("llama3", "torch"), ("llama3", "triton"), ("qwen2_sliding", "torch")])
def test_tiny_models_verify_drafts_on_every_attention_path(tmp_path, tokenizer, arch, backend):
    """Tiny random models: the verify forward through the Triton extend kernel (interpreted) and
    with sliding windows gives plain decoding's greedy tokens, drafts accepted or not."""
    build_tiny_model(arch, tmp_path, tokenizer)
    common = {**ARCHITECTURES[arch].engine_config, "model_path": str(tmp_path),
              "dtype": "float32", "max_total_tokens": 512, "debug_check_invariants": True}
    pattern = tokenizer.encode("one two three four five six seven")
    params = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    with Engine(**common) as engine:
        seeds = [pattern * 2, pattern[:4] * 3, pattern[2:]]
        # A prompt, its own continuation, the prompt again: the model is likely to repeat.
        prompts = [p + o + p for p, o in zip(seeds, ids(engine.generate(
            input_ids=seeds, sampling_params=params)))]
        want = ids(engine.generate(input_ids=prompts, sampling_params=params))
    with Engine(**common, speculative_algorithm="NGRAM", attention_backend=backend) as engine:
        got = ids(engine.generate(input_ids=prompts, sampling_params=params))
        stats = engine.stats()
        assert_idle_and_clean(engine)
    assert got == want
    assert stats["spec_draft_tokens"] > 0
    if arch == "llama3":  # (the random qwen2 never repeats itself, so its drafts all fail)
        assert stats["spec_accepted_tokens"] > 0
