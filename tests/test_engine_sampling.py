"""Sampling parameters through the engine on the default model: seeds, stop strings and ids,
min/max new tokens, penalties, and prompt/output logprobs against transformers (fp32)."""

from __future__ import annotations

import pytest
import torch

from forklm.runtime.engine.engine import Engine
from tests.conftest import assert_idle_and_clean, chat_prompt

GREEDY = {"temperature": 0}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def engine(make_engine) -> Engine:
    return make_engine()


@pytest.fixture(autouse=True)
def engine_stays_clean(engine):
    yield
    assert_idle_and_clean(engine)


@pytest.fixture(scope="module")
def story_prompt(tokenizer) -> str:
    return chat_prompt(tokenizer, "Tell me a short story about a brave little fox.")


@pytest.fixture(scope="module")
def france_prompt(tokenizer) -> str:
    return chat_prompt(tokenizer, "What is the capital of France?")


@pytest.fixture(scope="module")
def story_greedy(engine, story_prompt) -> dict:
    """The story prompt's greedy continuation: 40 tokens of prose without an EOS."""
    result = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40})
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    return result


@torch.inference_mode()
def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of transformers' logits: row t predicts token t + 1."""
    return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


# -- seeds and greedy ------------------------------------------------------------------------
def test_top_k_one_is_greedy(engine, story_prompt, story_greedy):
    top1 = engine.generate(story_prompt, {"temperature": 1.0, "top_k": 1, "max_new_tokens": 40})
    assert top1["output_ids"] == story_greedy["output_ids"]


def test_seed_makes_sampling_reproducible(engine, story_prompt):
    params = {"temperature": 1.0, "max_new_tokens": 32, "ignore_eos": True}
    first = engine.generate(story_prompt, {**params, "seed": 1234})
    other = engine.generate(story_prompt, {**params, "seed": 4321})
    assert other["text"] != first["text"]

    # The same seed again, now beside other requests (another seed with top-p, a greedy one on
    # another prompt): neighbours do not shift a row's random stream.
    batch = engine.generate(
        [story_prompt, story_prompt, "The weather today is"],
        [{**params, "seed": 99, "top_p": 0.9}, {**params, "seed": 1234}, GREEDY])
    assert batch[1]["text"] == first["text"]
    assert batch[0]["text"] != first["text"]


def test_n_samples_share_one_id_base_and_use_seed_plus_k(engine, story_prompt):
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True, "seed": 7}
    samples = engine.generate(story_prompt, {**params, "n": 3})
    assert len(samples) == 3
    ids = [s["meta_info"]["id"] for s in samples]
    base = ids[0].rsplit("-", 1)[0]
    assert ids == [f"{base}-0", f"{base}-1", f"{base}-2"]
    for k in (0, 2):  # sample k is the single request seeded with seed + k
        single = engine.generate(story_prompt, {**params, "seed": 7 + k})
        assert samples[k]["text"] == single["text"]
    named = engine.generate(story_prompt, {**params, "n": 2}, rid="mine")
    assert [s["meta_info"]["id"] for s in named] == ["mine-0", "mine-1"]


# -- stop conditions -------------------------------------------------------------------------
def test_stop_string_trims_output(engine, tokenizer, story_prompt, story_greedy):
    text, ids = story_greedy["text"], story_greedy["output_ids"]
    # A whole word from the second half whose first occurrence is past the first third.
    stop = next(" " + w for w in text[len(text) // 2 :].split()[1:]
                if text.index(" " + w) > len(text) // 3)
    cut = text.index(stop)

    result = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40, "stop": [stop]})
    assert result["text"] == text[:cut]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert result["output_ids"] == ids[: len(result["output_ids"])]
    assert len(result["output_ids"]) < len(ids)

    kept = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40, "stop": stop,
                                          "no_stop_trim": True})
    assert kept["text"] == text[: cut + len(stop)]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_stop_string_spanning_tokens(engine, tokenizer, story_prompt, story_greedy):
    text, ids = story_greedy["text"], story_greedy["output_ids"]
    # From the middle on, the first token boundary such that the 4 characters around it (2 from
    # each token) occur there first: that stop string can only match across the two tokens.
    for k in range(len(ids) // 2, len(ids) - 1):
        boundary = len(tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False))
        stop = text[boundary - 2 : boundary + 2]
        if (len(tokenizer.decode(ids[k - 1 : k])) >= 2 and len(tokenizer.decode(ids[k : k + 1])) >= 2
                and text.index(stop) == boundary - 2):
            break
    else:
        pytest.fail("no suitable token boundary in the greedy output")
    assert text.startswith(tokenizer.decode(ids[:k], clean_up_tokenization_spaces=False))
    cut = boundary - 2

    result = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40, "stop": stop})
    assert result["text"] == text[:cut]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # Another stop string that never occurs changes nothing.
    both = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40,
                                          "stop": ["zebra-never", stop]})
    assert both["text"] == text[:cut]


def test_stop_token_ids(engine, story_prompt, story_greedy):
    ids = story_greedy["output_ids"]
    # The first token from the middle on that did not occur before it.
    m = next(i for i in range(len(ids) // 2, len(ids)) if ids[i] not in ids[:i])
    result = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40,
                                            "stop_token_ids": [ids[m]]})
    assert result["output_ids"] == ids[: m + 1]
    assert result["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[m]}
    # The matched stop token's text is left out, unless no_stop_trim.
    assert result["text"] == engine.tokenizer.decode(ids[:m])
    kept = engine.generate(story_prompt, {**GREEDY, "max_new_tokens": 40, "no_stop_trim": True,
                                          "stop_token_ids": [ids[m]]})
    assert kept["text"] == engine.tokenizer.decode(ids[: m + 1])


def test_eos_and_ignore_eos(engine, france_prompt):
    eos = engine.generate(france_prompt, {**GREEDY, "max_new_tokens": 32})
    assert eos["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert eos["output_ids"][-1] == 2
    assert "Paris" in eos["text"]
    num = len(eos["output_ids"])

    ignored = engine.generate(france_prompt, {**GREEDY, "max_new_tokens": num + 4,
                                              "ignore_eos": True})
    assert ignored["meta_info"]["completion_tokens"] == num + 4
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": num + 4}
    assert ignored["output_ids"][:num] == eos["output_ids"]


def test_min_new_tokens(engine, france_prompt):
    short = engine.generate(france_prompt, {**GREEDY, "max_new_tokens": 32})
    assert short["meta_info"]["finish_reason"]["type"] == "stop"
    min_new = len(short["output_ids"]) + 8

    longer = engine.generate(france_prompt, {**GREEDY, "max_new_tokens": 32,
                                             "min_new_tokens": min_new})
    assert longer["meta_info"]["completion_tokens"] >= min_new
    assert 2 not in longer["output_ids"][:min_new]


def test_max_new_tokens_exact(engine, france_prompt):
    for n in (1, 3):
        result = engine.generate(france_prompt, {**GREEDY, "max_new_tokens": n,
                                                 "ignore_eos": True})
        assert result["meta_info"]["completion_tokens"] == len(result["output_ids"]) == n
        assert result["meta_info"]["finish_reason"] == {"type": "length", "length": n}


# -- penalties -------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [{"repetition_penalty": 1.5}, {"frequency_penalty": 1.0}])
def test_penalty_breaks_repetition(engine, tokenizer, penalty):
    prompt = "Repeat after me: the the the the"
    params = {**GREEDY, "max_new_tokens": 16, "ignore_eos": True}
    the = tokenizer.encode(" the", add_special_tokens=False)
    assert len(the) == 1
    plain = engine.generate(prompt, params)["output_ids"]
    assert plain.count(the[0]) >= 12  # unpenalized greedy repeats " the"

    penalized = engine.generate(prompt, {**params, **penalty})["output_ids"]
    assert penalized != plain
    assert penalized.count(the[0]) <= plain.count(the[0]) // 2


# -- logprobs --------------------------------------------------------------------------------
def test_prompt_logprobs_match_transformers(engine, hf_model, tokenizer, france_prompt):
    ids = tokenizer.encode(france_prompt, add_special_tokens=False)
    ref = hf_logprobs(hf_model, ids)
    expected = [float(ref[t - 1, ids[t]]) for t in range(1, len(ids))]

    result = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                             return_logprob=True, logprob_start_len=0)
    assert result["output_ids"] == []
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    entries = result["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids
    assert entries[0][0] is None
    assert entries[0][2] == tokenizer.decode([ids[0]])
    assert torch.allclose(torch.tensor([e[0] for e in entries[1:]]), torch.tensor(expected),
                          atol=LOGPROB_TOL, rtol=0)

    from5 = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                            return_logprob=True, logprob_start_len=5)
    tail = from5["meta_info"]["input_token_logprobs"]
    assert len(tail) == len(ids) - 5
    assert [e[1] for e in tail] == ids[5:]
    assert torch.allclose(torch.tensor([e[0] for e in tail]), torch.tensor(expected[4:]),
                          atol=LOGPROB_TOL, rtol=0)


def test_output_logprobs_match_transformers(engine, hf_model, tokenizer, story_prompt):
    ids = tokenizer.encode(story_prompt, add_special_tokens=False)
    result = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12},
                             return_logprob=True, top_logprobs_num=3)
    out = result["output_ids"]
    meta = result["meta_info"]
    assert meta["input_token_logprobs"] == []  # logprob_start_len None: output logprobs only
    ref = hf_logprobs(hf_model, ids + out)
    expected = [float(ref[len(ids) - 1 + j, t]) for j, t in enumerate(out)]
    entries = meta["output_token_logprobs"]
    assert [e[1] for e in entries] == out
    assert torch.allclose(torch.tensor([e[0] for e in entries]), torch.tensor(expected),
                          atol=LOGPROB_TOL, rtol=0)

    tops = meta["output_top_logprobs"]
    assert len(tops) == len(out)
    for top, chosen in zip(tops, entries, strict=True):
        assert len(top) == 3
        values = [lp for lp, _, _ in top]
        assert values == sorted(values, reverse=True)
        assert top[0][1] == chosen[1]  # greedy picks the most likely token
        assert top[0][0] == pytest.approx(chosen[0], abs=1e-6)


def test_logprob_text_only_when_asked(engine, story_prompt):
    call = {"sampling_params": {**GREEDY, "max_new_tokens": 4}, "return_logprob": True,
            "top_logprobs_num": 2}
    with_text = engine.generate(story_prompt, **call)
    bare = engine.generate(story_prompt, **call, return_text_in_logprobs=False)
    entries, bare_entries = (r["meta_info"]["output_token_logprobs"] for r in (with_text, bare))
    tops, bare_tops = (r["meta_info"]["output_top_logprobs"] for r in (with_text, bare))
    assert "".join(e[2] for e in entries) == with_text["text"]
    assert all(isinstance(e[2], str) for top in tops for e in top)
    assert [e[1] for e in bare_entries] == [e[1] for e in entries]  # (logprobs: to rounding)
    assert all(e[2] is None for e in bare_entries)
    assert all(e[2] is None for top in bare_tops for e in top)


def test_prompt_logprobs_with_cached_prefix(engine, tokenizer, story_prompt):
    ids = tokenizer.encode(story_prompt, add_special_tokens=False)
    engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # caches the prompt
    plain = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert plain["meta_info"]["cached_tokens"] >= len(ids) - 1

    def prompt_logprobs(start: int) -> list[list]:
        result = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                                 return_logprob=True, logprob_start_len=start)
        return result["meta_info"]["input_token_logprobs"]

    first, second = prompt_logprobs(0), prompt_logprobs(0)
    assert len(first) == len(second) == len(ids)
    assert [e[1] for e in second] == ids
    assert second[0][0] is None
    assert torch.allclose(torch.tensor([e[0] for e in first[1:]]),
                          torch.tensor([e[0] for e in second[1:]]), atol=LOGPROB_TOL, rtol=0)
    # A later start may reuse the cache before it, and still gives the same values.
    later = prompt_logprobs(10)
    assert [e[1] for e in later] == ids[10:]
    assert torch.allclose(torch.tensor([e[0] for e in later]),
                          torch.tensor([e[0] for e in first[10:]]), atol=LOGPROB_TOL, rtol=0)
