"""Bad requests and bad engine options fail at submission with typed errors naming the argument,
and leave the engine serving; a shut-down engine refuses new work."""

from __future__ import annotations

import asyncio
import threading

import pytest

from forklm.runtime.engine.engine import Engine
from forklm.runtime.errors import EngineShutdownError, InvalidArgumentError, ModelNotFoundError

VALID = {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}


def assert_still_serving(engine: Engine) -> None:
    """A valid request succeeds afterwards and nothing was left behind by the bad one."""
    result = engine.generate("Hello, my name is", VALID)
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    assert engine.last_error is None
    engine.check_invariants()
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["kv_used"]) == (0, 0, 0)


# (name expected in the message, generate() keyword arguments)
BAD_REQUESTS = [
    ("prompt", {"prompt": ""}),
    ("prompt", {"prompt": []}),
    ("prompt", {"prompt": ["fine", ""]}),  # one bad prompt in a list: nothing is submitted
    ("prompt", {}),  # neither prompt nor input_ids
    ("input_ids", {"input_ids": []}),
    ("input_ids", {"input_ids": [1, "two"]}),
    ("max_new_tokens", {"sampling_params": {"max_new_tokens": -1}}),
    ("max_new_tokens", {"sampling_params": {"max_new_tokens": 1.5}}),
    ("min_new_tokens", {"sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}}),
    ("temperature", {"sampling_params": {"temperature": -0.1}}),
    ("temperature", {"sampling_params": {"temperature": float("nan")}}),
    ("top_p", {"sampling_params": {"top_p": 0}}),
    ("top_p", {"sampling_params": {"top_p": 1.5}}),
    ("top_k", {"sampling_params": {"top_k": 0}}),
    ("n", {"sampling_params": {"n": 0}}),
    ("seed", {"sampling_params": {"seed": -1}}),
    ("stop", {"sampling_params": {"stop": [""]}}),
    ("frobnicate", {"sampling_params": {"frobnicate": 1}}),
    ("sampling_params", {"sampling_params": "greedy"}),
    ("logprob_start_len", {"return_logprob": True, "logprob_start_len": 100}),
    ("top_logprobs_num", {"return_logprob": True, "top_logprobs_num": -1}),
    ("stream", {"prompt": ["a", "b"], "stream": True}),
    ("rid", {"rid": ""}),
]


@pytest.mark.parametrize(("name", "kwargs"), BAD_REQUESTS,
                         ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_names_the_argument(make_engine, name, kwargs):
    engine = make_engine()
    if "prompt" not in kwargs and "input_ids" not in kwargs and kwargs:
        kwargs = {"prompt": "Hello", **kwargs}
    with pytest.raises(InvalidArgumentError) as err:
        engine.generate(**kwargs)
    assert name in str(err.value)
    assert isinstance(err.value, ValueError)
    assert_still_serving(engine)


def test_token_ids_outside_the_vocabulary(make_engine):
    engine = make_engine()
    vocab = engine.parts.vocab_size
    for ids in ([1, vocab], [-1, 5]):
        with pytest.raises(InvalidArgumentError, match="input_ids") as err:
            engine.generate(input_ids=ids, sampling_params=VALID)
        assert str(vocab) in str(err.value)
    with pytest.raises(InvalidArgumentError, match="stop_token_ids"):
        engine.generate("Hello", {**VALID, "stop_token_ids": [vocab + 5]})
    assert_still_serving(engine)


def test_async_generate_validates_at_submission(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidArgumentError, match="temperature"):
        asyncio.run(engine.async_generate("Hello", {"temperature": -1}))
    assert_still_serving(engine)


def test_prompt_longer_than_the_context(make_engine, tokenizer):
    engine = make_engine(context_length=64)
    prompt = " ".join(f"word{i}" for i in range(60))
    assert len(tokenizer.encode(prompt)) >= 100
    with pytest.raises(InvalidArgumentError, match="prompt") as err:
        engine.generate(prompt, VALID)
    assert "64" in str(err.value)
    # One short of the context still fits: it generates its single possible token.
    ids = tokenizer.encode(prompt)[:63]
    result = engine.generate(input_ids=ids, sampling_params={**VALID, "max_new_tokens": 8})
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    assert_still_serving(engine)


def test_bad_engine_options():
    with pytest.raises(ModelNotFoundError, match="nonexistent"):
        Engine(model_path="/nonexistent")
    with pytest.raises(InvalidArgumentError, match="foo"):
        Engine(foo=1)
    with pytest.raises(InvalidArgumentError, match="max_total_tokens"):
        Engine(max_total_tokens=4)


def test_shutdown_aborts_pending_and_refuses_new_requests():
    engine = Engine(dtype="float32", max_total_tokens=256)
    assert engine.generate("Hello", VALID)["meta_info"]["completion_tokens"] == 2

    chunks: list[dict] = []
    started = threading.Event()

    def consume() -> None:
        for chunk in engine.generate("Once upon a time", {**VALID, "max_new_tokens": 200},
                                     stream=True):
            chunks.append(chunk)
            started.set()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    assert started.wait(60)
    engine.shutdown()
    thread.join(30)
    assert not thread.is_alive()
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "abort",
                                                        "message": "engine shut down"}

    with pytest.raises(EngineShutdownError):
        engine.generate("Hello", VALID)
    with pytest.raises(EngineShutdownError):
        engine.stats()
    engine.shutdown()  # a second shutdown does nothing
