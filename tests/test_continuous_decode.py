"""num_continuous_decode_steps (SGLang's flag): decode steps run back to back, their tokens applied
after the last. The outputs must be those of one step at a time, a request that finishes within
a run must leave no KV behind, and the scheduler must fall back to single steps wherever a token
depends on the one before outside the model, or a request waits."""

from __future__ import annotations

import pytest

from forklm.runtime.config import EngineConfig
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.scheduling.request import FinishReason
from tests.conftest import assert_idle_and_clean, chat_prompt
from tests.test_scheduler import fake_step, make_req, make_scheduler

STEPS = 4


def _params() -> list[dict]:
    """Lengths that are not multiples of STEPS, a stop string and a stop token met within a run,
    and a seeded sampled request."""
    return [
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": 23},
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": 30, "stop": [" the"]},
        {"temperature": 0, "max_new_tokens": 40},  # stops on EOS (the chat template's end)
        {"temperature": 0.8, "seed": 11, "ignore_eos": True, "max_new_tokens": 26},
        {"temperature": 0, "ignore_eos": True, "max_new_tokens": 9},
    ]


def _summary(result: dict) -> tuple:
    meta = result["meta_info"]
    return result["text"], result["output_ids"], meta["finish_reason"]


def _logprobs(result: dict) -> list[tuple[float, int]]:
    """The chosen tokens' logprobs and each position's top 3, flat, as (logprob, token id)."""
    meta = result["meta_info"]
    tops = [entry for top in meta["output_top_logprobs"] for entry in top]
    return [(lp, t) for lp, t, *_ in meta["output_token_logprobs"] + tops]


def _assert_same_logprobs(a: dict, b: dict) -> None:
    # The same tokens; the logprobs to fp32 rounding (the two engines' radix caches differ, so a
    # prompt's KV may come from another chunking: ~1e-4 apart)
    (lps_a, ids_a), (lps_b, ids_b) = (zip(*_logprobs(r)) for r in (a, b))
    assert ids_a == ids_b
    assert lps_a == pytest.approx(lps_b, abs=1e-3)


def test_continuous_steps_give_the_tokens_of_single_steps(make_engine, tokenizer, caplog):
    prompts = [chat_prompt(tokenizer, q) for q in (
        "Describe a lighthouse at night.", "Name the planets of the solar system.",
        "What is 2+2?", "Write a short poem about rain.", "Count from one to five.")]
    logprobs = {"return_logprob": True, "top_logprobs_num": 3}
    single = make_engine().generate(prompts, _params(), **logprobs)
    engine = make_engine(num_continuous_decode_steps=STEPS)
    before = engine.stats()
    with caplog.at_level("ERROR"):
        continuous = engine.generate(prompts, _params(), **logprobs)
    assert [_summary(r) for r in continuous] == [_summary(r) for r in single]
    for a, b in zip(continuous, single):
        _assert_same_logprobs(a, b)
    assert not caplog.records  # e.g. a finished request given the tokens after its end
    # the tokens sampled after a request's end are dropped, not appended unseen
    assert engine.stats()["generated_tokens"] - before["generated_tokens"] == sum(
        r["meta_info"]["completion_tokens"] for r in single)
    assert single[1]["meta_info"]["finish_reason"]["type"] == "stop"  # the stop string is met
    assert single[2]["meta_info"]["finish_reason"]["type"] == "stop"
    # The 5 requests were prefilled together; at most 40 decode tokens need ~40 / STEPS runs,
    # plus the runs cut short where a request's length ends one (single steps: 39 or more).
    decode_steps = engine.stats()["steps"] - before["steps"] - 1
    assert decode_steps <= 40 // STEPS + 5, decode_steps
    assert_idle_and_clean(engine)  # no KV computed past a finished request is left behind


def test_tokens_depending_on_the_last_outside_the_model_take_single_steps(make_engine, tokenizer):
    prompt = chat_prompt(tokenizer, "Tell me about penguins.")
    params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12,
              "frequency_penalty": 0.5}
    single = make_engine().generate(prompt, params)
    engine = make_engine(num_continuous_decode_steps=STEPS)
    steps_before = engine.stats()["steps"]
    assert engine.generate(prompt, params)["output_ids"] == single["output_ids"]
    assert engine.stats()["steps"] - steps_before == 12  # the prefill and 11 decode steps
    assert_idle_and_clean(engine)


def _run_steps(sched, batch) -> None:
    """The engine's part of a run: every request takes a token from each step until it has
    max_new_tokens (the scheduler frees the slots of the steps after that)."""
    for req in batch.reqs:
        req.output_ids.extend([7] * min(batch.steps, req.remaining_new_tokens()))
        if req.remaining_new_tokens() == 0:
            req.finish_reason = FinishReason("length", length=len(req.output_ids))
    sched.after_step(batch)
    sched.kv.check_invariants(sched.active_reqs())


def test_scheduler_runs_single_steps_while_a_request_waits():
    sched = make_scheduler(num_continuous_decode_steps=STEPS, max_running_requests=1)
    first = make_req(list(range(20)), max_new_tokens=30)
    sched.waiting.append(first)
    fake_step(sched, sched.schedule())  # its prefill and first token
    batch = sched.schedule()
    assert (batch.phase, batch.steps) == ("decode", STEPS)
    assert first.num_computed == 21 + STEPS - 1  # a slot for each step's token
    _run_steps(sched, batch)
    sched.waiting.append(make_req(list(range(100, 140))))  # waits: one request may run
    batch = sched.schedule()
    assert (batch.phase, batch.steps) == ("decode", 1)
    _run_steps(sched, batch)


def test_a_run_takes_no_more_steps_than_a_request_may_take():
    sched = make_scheduler(num_continuous_decode_steps=STEPS)
    sched.waiting.extend([make_req(list(range(i * 100, i * 100 + 20)), max_new_tokens=n)
                          for i, n in enumerate((30, 3))])
    fake_step(sched, sched.schedule())
    batch = sched.schedule()
    assert batch.steps == 2  # the second request has 2 tokens left after its first
    _run_steps(sched, batch)
    assert sched.schedule().steps == STEPS  # it finished; the first runs alone
    penalized = make_req(list(range(500, 520)), max_new_tokens=30)
    penalized.sampling_params = SamplingParams(max_new_tokens=30, presence_penalty=0.3)
    sched = make_scheduler(num_continuous_decode_steps=STEPS)
    sched.waiting.append(penalized)
    fake_step(sched, sched.schedule())
    assert sched.schedule().steps == 1


@pytest.mark.parametrize("steps", [0, 65])
def test_num_continuous_decode_steps_is_bounded(steps):
    with pytest.raises(InvalidArgumentError, match="num_continuous_decode_steps"):
        EngineConfig(num_continuous_decode_steps=steps)
