"""Programs on the default model through the in-process Engine backend (greedy), checked for
structure and against the same gens sent one at a time to the engine."""

from __future__ import annotations

import dataclasses
import re

import pytest

import forklm as sgl
from forklm.frontend_dsl import REGEX_INT
from forklm.runtime.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def engine(make_engine):
    return make_engine()


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.EngineBackend(engine)


def direct(engine, prompt: str, max_new_tokens: int, stop=None) -> str:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, stop=stop)
    return engine.generate(prompt=prompt, sampling_params=params)["text"]


@sgl.function
def capital_qa(s, country):
    s += "The capital of France is Paris.\nThe capital of Japan is Tokyo.\n"
    s += f"The capital of {country} is" + sgl.gen("answer", 6, stop="\n")


def test_few_shot_capital_qa(engine, backend):
    state = capital_qa.run(country="Italy", backend=backend, **GREEDY)
    prefix = "The capital of France is Paris.\nThe capital of Japan is Tokyo.\nThe capital of Italy is"
    assert isinstance(state["answer"], str) and "\n" not in state["answer"]
    assert state["answer"] == direct(engine, prefix, 6, stop="\n")
    assert state.text() == prefix + state["answer"]
    assert state.get_meta_info("answer")["completion_tokens"] <= 6


def test_batch_equals_one_by_one(engine, backend):
    countries = ["Italy", "Germany", "Spain", "Egypt"]
    states = capital_qa.run_batch([{"country": c} for c in countries], backend=backend, **GREEDY)
    singles = [capital_qa.run(country=c, backend=backend, **GREEDY)["answer"] for c in countries]
    assert [s["answer"] for s in states] == singles


def test_select_true_false_unknown_scores_each_choice_as_separate_calls_would(engine, backend):
    @sgl.function
    def judge(s, statement):
        s += f"Statement: {statement}\nIs the statement True, False or Unknown?\nAnswer:"
        s += sgl.select("verdict", [" True", " False", " Unknown"])

    state = judge.run("The sun is a star.", backend=backend)
    assert state["verdict"] in (" True", " False", " Unknown")
    meta = state.get_meta_info("verdict")
    prompt = "Statement: The sun is a star.\nIs the statement True, False or Unknown?\nAnswer:"
    tok = engine.tokenizer
    prefix_ids = tok.encode(prompt, add_special_tokens=False)
    for choice, mean in zip([" True", " False", " Unknown"], meta["normalized_prompt_logprobs"]):
        ids = tok.encode(prompt + choice, add_special_tokens=False)
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=len(prefix_ids))
        lps = [e[0] for e in out["meta_info"]["input_token_logprobs"]]
        assert mean == pytest.approx(sum(lps) / len(lps), abs=1e-4)
    best = max(range(3), key=lambda i: meta["normalized_prompt_logprobs"][i])
    assert state["verdict"] == [" True", " False", " Unknown"][best]
    assert state.text() == prompt + state["verdict"]
    # a choice that merges with the prompt's trailing space is scored on the merged token
    @sgl.function
    def spaced(s):
        s += "Is water wet? Answer: " + sgl.select("v", ["True", "False"])

    merged = spaced.run(backend=backend).get_meta_info("v")["input_token_logprobs"]
    assert [[e[2] for e in entries] for entries in merged] == [[" True"], [" False"]]
    uncond = judge.run("Cats bark.", backend=backend)  # the other methods run on the engine too
    for method in (sgl.greedy_token_selection, sgl.unconditional_likelihood_normalized):
        @sgl.function
        def judge2(s, m=method):
            s += "Cats bark. True or False? Answer:" + sgl.select("v", [" True", " False"],
                                                                    choices_method=m)
        assert judge2.run(backend=backend)["v"] in (" True", " False")
    assert uncond["verdict"] in (" True", " False", " Unknown")


@pytest.mark.skipif("regex" not in {f.name for f in dataclasses.fields(SamplingParams)},
                    reason="the engine has no regex-constrained decoding yet")
def test_gen_int(backend):
    @sgl.function
    def count(s):
        s += "Q: How many legs does a spider have?\nA (a number):" + sgl.gen_int("n", 4)

    state = count.run(backend=backend, **GREEDY)
    assert re.fullmatch(REGEX_INT, state["n"].lstrip()) and int(state["n"]) >= 0


def test_fork_expands_tips_then_summarizes(engine, backend):
    @sgl.function
    def tips(s, topic):
        s += sgl.user(f"Give three short tips about {topic}.")
        s += sgl.assistant("1. Sleep well\n2. Eat well\n3. Move daily")
        forks = s.fork(3)
        forks += lambda i: sgl.user(f"Expand tip {i + 1} in one sentence.")
        forks += sgl.assistant(sgl.gen("detail", 12, stop="\n"))
        forks.join()
        s += sgl.user("Summarize: " + " ".join(s["detail"]))
        s += sgl.assistant(sgl.gen("summary", 12))

    state = tips.run("health", backend=backend, **GREEDY)
    details = state["detail"]
    assert isinstance(details, list) and len(details) == 3 and all(isinstance(d, str) for d in details)
    assert isinstance(state["summary"], str) and state["summary"]
    text = state.text()
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert text.count("<|im_start|>user\n") == 2  # branches' turns are not in the parent
    # the template's default system prompt is in the text, so messages() lists it too
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user",
                                                     "assistant"]
    assert state.messages()[0]["content"].startswith("You are a helpful AI assistant named SmolLM")
    assert state.messages()[-1]["content"] == state["summary"].strip()
    # each branch equals its prompt run alone through the engine
    base = text[: text.index("<|im_start|>user\nSummarize")]
    for i, detail in enumerate(details):
        prompt = (base + f"<|im_start|>user\nExpand tip {i + 1} in one sentence.<|im_end|>\n"
                  "<|im_start|>assistant\n")
        assert detail == direct(engine, prompt, 12, stop="\n")
