"""EngineRequest and GenerateOutput at forklm's edges: SGLang's keyword call becomes a request,
a request becomes a /generate body, and a result's JSON reads back as the result it was."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from forklm.runtime.engine.engine_request import EngineRequest, LogprobOptions
from forklm.runtime.engine.results import GenerateOutput, TokenLogprobs
from forklm.runtime.errors import InvalidArgumentError
from forklm.runtime.sampling.params import SamplingParams
from forklm.runtime.scheduling.request import FinishReason


class _DigitTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_from_call_types_the_keyword_call():
    request = EngineRequest.from_call(
        prompt=["a", "b"], sampling_params=[{"max_new_tokens": 3}, None], return_logprob=True,
        top_logprobs_num=2, rid=["x", "y"], session_params={"id": "s1", "offset": None})
    assert request.sampling_params == (SamplingParams(max_new_tokens=3), SamplingParams())
    assert request.logprobs == LogprobOptions(True, None, 2, True)
    assert request.session_id == "s1" and request.rid == ["x", "y"]


@pytest.mark.parametrize("session_params, name", [
    ("s1", "session_params"), ({"id": ""}, "session_params.id"),
    ({"id": "s", "replace": True}, "session_params.replace")])
def test_from_call_refuses_what_sessions_cannot_do(session_params, name):
    with pytest.raises(InvalidArgumentError) as caught:
        EngineRequest.from_call(prompt="hi", session_params=session_params)
    assert caught.value.name == name


def test_from_call_names_a_bad_sampling_parameter():
    with pytest.raises(InvalidArgumentError) as caught:
        EngineRequest.from_call(prompt="hi", sampling_params={"temprature": 0.5})
    assert caught.value.name == "temprature"


def test_to_json_sends_only_what_differs_from_the_defaults():
    request = EngineRequest.from_call(
        input_ids=[(1, 2), (3,)], sampling_params={"temperature": 0.0, "stop": ["\n"]},
        return_logprob=True, logprob_start_len=0, return_text_in_logprobs=False, rid="r",
        session_params={"id": "s"})
    assert request.to_json() == {
        "input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0.0, "stop": ["\n"]},
        "return_logprob": True, "return_text_in_logprobs": False, "logprob_start_len": 0,
        "rid": "r", "session_params": {"id": "s"}}
    assert EngineRequest("hi").to_json() == {"text": "hi", "sampling_params": {}}


_pairs = st.lists(st.tuples(st.floats(max_value=0.0, allow_nan=False), st.integers(0, 99)),
                  max_size=4)
_reasons = st.one_of(
    st.none(), st.builds(FinishReason, st.just("length"), st.none(), st.integers(0, 9)),
    st.builds(FinishReason, st.just("stop"), st.one_of(st.integers(0, 9), st.text(max_size=3))),
    st.builds(FinishReason, st.just("abort"), message=st.text(max_size=5)))


@st.composite
def _logprobs(draw) -> TokenLogprobs | None:
    if not draw(st.booleans()):
        return None
    first = [(None, draw(st.integers(0, 99)))] if draw(st.booleans()) else []
    tops = draw(st.booleans())
    return TokenLogprobs(first + draw(_pairs), draw(_pairs),
                         draw(st.lists(_pairs, max_size=3)) if tops else None,
                         draw(st.lists(_pairs, max_size=3)) if tops else None)


@given(st.builds(GenerateOutput, rid=st.text(min_size=1, max_size=4), index=st.integers(0, 5),
                 text=st.text(max_size=8), output_ids=st.lists(st.integers(0, 99), max_size=4),
                 finish_reason=_reasons, prompt_tokens=st.integers(1, 50),
                 completion_tokens=st.integers(0, 50), cached_tokens=st.integers(0, 50),
                 logprobs=_logprobs()),
       st.booleans())
def test_a_result_reads_back_from_its_json(out, with_tokenizer):
    tokenizer = _DigitTokenizer() if with_tokenizer else None
    assert GenerateOutput.from_json(out.to_dict(tokenizer, with_index=True)) == out
    assert GenerateOutput.from_json(out.to_dict(tokenizer), index=out.index) == out
