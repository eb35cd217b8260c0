"""--enable-torch-compile (runtime/forward/torch_compile.py): the compiled forward gives eager's greedy
tokens and logprobs in float32, batches above torch_compile_max_bs run eagerly, and a compiler
failure falls back to eager without changing a token. One tiny Llama, one engine of each kind."""

from __future__ import annotations

import pytest
import torch

from forklm.runtime.engine.engine import Engine
from forklm.runtime.forward import torch_compile
from tests.conftest import assert_idle_and_clean
from tests.tiny_models import build_tiny_model

BASE = {"dtype": "float32", "max_total_tokens": 2048, "debug_check_invariants": True,
        # prefill chunks of 16 tokens after a cached context: prefill, decode and both at once
        "chunked_prefill_size": 16}
MAX_BS = 3
PROMPTS = ["What is a radix tree?", "Name three colours and say why each one matters to you.",
           "2 + 2 =", "Say hello.", "Count: one two three four five six seven eight nine ten",
           "Why is the sky blue?"]
# Different lengths, so the batch shrinks from 6 (above MAX_BS: eager) to 1 (compiled).
NEW_TOKENS = [3, 6, 10, 14, 18, 24]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny_llama_compile")
    hf_model = build_tiny_model("llama3", folder, tokenizer)
    return str(folder), hf_model


@pytest.fixture(scope="module")
def engines(tiny_llama):
    folder, _ = tiny_llama
    eager = Engine(folder, **BASE)
    compiled = Engine(folder, **BASE, enable_torch_compile=True, torch_compile_max_bs=MAX_BS)
    yield eager, compiled
    eager.shutdown()
    compiled.shutdown()


def _steps(engine: Engine) -> torch_compile.CompiledLayerSteps | None:
    return engine.parts.runner.model.compiled_steps


def _greedy(engine: Engine, prompts: list[str], new_tokens: list[int]) -> list[dict]:
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in new_tokens]
    return engine.generate(prompts, sampling_params=params, return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=3)


def _assert_same(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g["output_ids"] == w["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            ours = torch.tensor([lp for lp, _, _ in g["meta_info"][key][1:]])
            ref = torch.tensor([lp for lp, _, _ in w["meta_info"][key][1:]])
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)


def test_compiled_forward_equals_eager(engines):
    eager, compiled = engines
    steps = _steps(compiled)
    assert steps is not None and not steps.failed and _steps(eager) is None
    before = (steps.compiled_forwards, steps.eager_forwards)
    got = _greedy(compiled, PROMPTS, NEW_TOKENS)
    _assert_same(got, _greedy(eager, PROMPTS, NEW_TOKENS))
    assert not steps.failed
    # The 6-request prefill and first decodes ran eagerly, the last 3 requests' steps compiled.
    assert steps.eager_forwards > before[1] and steps.compiled_forwards > before[0]
    assert_idle_and_clean(compiled)


def test_one_request_at_a_time_equals_transformers(engines, tiny_llama, tokenizer):
    _, compiled = engines
    _, hf_model = tiny_llama
    for prompt in PROMPTS[:3]:
        ids = tokenizer.encode(prompt)
        out = compiled.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                    min_new_tokens=12)[0, len(ids):].tolist()
        assert out["output_ids"] == ref


def test_compiler_failure_falls_back_to_eager(engines, monkeypatch):
    eager, _ = engines
    model = eager.parts.runner.model

    def cannot_compile(fn, dynamic):
        def call(*args):
            raise RuntimeError("no compiler here")
        return call

    monkeypatch.setattr(torch_compile, "_compile", cannot_compile)
    want = _greedy(eager, PROMPTS[:2], NEW_TOKENS[:2])
    try:
        steps = torch_compile.enable_torch_compile(model, max_bs=MAX_BS, warm_up_tokens=(1,))
        assert steps.failed
        _assert_same(_greedy(eager, PROMPTS[:2], NEW_TOKENS[:2]), want)
        assert steps.compiled_forwards == 0 and steps.eager_forwards > 0
    finally:
        model.compiled_steps = None
