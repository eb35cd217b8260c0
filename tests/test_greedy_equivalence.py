"""Greedy outputs and logits of forklm equal transformers' on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from forklm.runtime.engine.engine import Engine
from tests.conftest import EVAL_QUESTIONS, chat_prompt, hf_greedy

pytestmark = pytest.mark.slow

NUM_NEW = 48
QUESTIONS = EVAL_QUESTIONS
GREEDY = {"temperature": 0, "max_new_tokens": NUM_NEW, "ignore_eos": True}


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    # Half chat-formatted, half raw text, so prompt lengths vary from a few tokens to ~50.
    texts = [chat_prompt(tokenizer, q) if i % 2 == 0 else q for i, q in enumerate(QUESTIONS)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def reference(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, NUM_NEW) for ids in prompts]


def _outputs(results) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def test_one_at_a_time(make_engine, prompts, reference):
    engine = make_engine()
    assert [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"]
            for p in prompts] == reference


def test_all_together(make_engine, prompts, reference):
    engine = make_engine()
    engine.flush_cache()
    assert _outputs(engine.generate(input_ids=prompts, sampling_params=GREEDY)) == reference
    assert engine.last_error is None


def test_radix_cache_off(make_engine, prompts, reference):
    engine = make_engine(disable_radix_cache=True)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert _outputs(results) == reference
    assert all(r["meta_info"]["cached_tokens"] == 0 for r in results)


def test_chunked_prefill(make_engine, prompts, reference):
    engine = make_engine(chunked_prefill_size=16, disable_radix_cache=True)
    assert _outputs(engine.generate(input_ids=prompts, sampling_params=GREEDY)) == reference


def test_shared_prefix_already_cached(make_engine, prompts, reference):
    engine = make_engine()
    engine.flush_cache()
    # Cache the first half of every prompt (and more, for the longer ones), then run them all.
    engine.generate(input_ids=[p[: max(1, len(p) // 2)] for p in prompts],
                    sampling_params={"temperature": 0, "max_new_tokens": 1})
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert _outputs(results) == reference
    assert sum(r["meta_info"]["cached_tokens"] for r in results) >= sum(len(p) // 2 for p in prompts) - 8


def test_logits_match_transformers(make_engine, hf_model, prompts):
    """Prompt logprobs cover every position's full log-softmax ranking; compare the top ones and
    the chosen-token logprobs, which are the logits up to a per-row constant, within 1e-3."""
    engine = make_engine()
    for ids in prompts[:4]:
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=5)
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
        ours = [lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]]
        expect = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(torch.tensor(ours), expect, atol=1e-3)
        for t, top in enumerate(res["meta_info"]["input_top_logprobs"][1:]):
            values, indices = ref[t].topk(5)
            assert [tid for _, tid, _ in top] == indices.tolist()
            assert torch.allclose(torch.tensor([lp for lp, _, _ in top]), values, atol=1e-3)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_tiny_random_models(tmp_path, tokenizer, model_type):
    """A tiny random Llama / Qwen2 (q/k/v biases, untied head) saved as a HF folder: greedy tokens
    and logits equal transformers'."""
    torch.manual_seed(0)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if model_type == "llama":
        config = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # random init gives near-uniform logits; sharpen so argmax is stable
        for p in model.parameters():
            p.mul_(4.0)
    model.eval().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [tokenizer.encode(t) for t in ("hello world", "the quick brown fox jumps", "1 2 3")]
    expected = [hf_greedy(model, ids, 16) for ids in prompts]
    with Engine(model_path=str(tmp_path), dtype="float32", max_total_tokens=1024,
                debug_check_invariants=True) as engine:
        results = engine.generate(input_ids=prompts,
                                  sampling_params={**GREEDY, "max_new_tokens": 16})
        assert _outputs(results) == expected
        res = engine.generate(input_ids=prompts[1], sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0)
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompts[1]])).logits[0], dim=-1)
    ours = torch.tensor([lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
    expect = ref[torch.arange(len(prompts[1]) - 1), torch.tensor(prompts[1][1:])]
    assert torch.allclose(ours, expect, atol=1e-4)


def test_bfloat16_close_to_transformers_bfloat16(make_engine, hf_model, prompts, reference):
    """bf16 rounds differently per kernel, so exact equality is not expected. Over the prompts plus
    their fp32 greedy continuations (575 positions): log-probs agree within BF16_LOGPROB_ATOL, and
    the top-1 token agrees at >= 99% of the positions that are not bf16 near-ties (transformers'
    bf16 top-2 logit margin > BF16_TIE_MARGIN), >= 97.5% overall.
    Measured here: max |ours - transformers bf16| 0.34 (transformers bf16 vs its fp32: 0.35);
    overall top-1 agreement 568/575 with transformers bf16, while transformers bf16 agrees with
    its own fp32 at 562/575: the misses are rounding at near-ties, not a systematic difference.
    On an AVX-512 CPU without bf16 instructions (session 4) the overall figure is 563/575 with
    logits bit-identical to the previous loader's on that CPU: its bf16 kernels round differently."""
    engine = make_engine(dtype="bfloat16", quantization="none")  # the GGUF dequantized, in bf16
    hf_bf16 = transformers.LlamaForCausalLM(hf_model.config).to(torch.bfloat16).eval()
    hf_bf16.load_state_dict(hf_model.state_dict())
    agree = total = clear_agree = clear_total = 0
    diffs = []
    for prompt, continuation in zip(prompts, reference):
        ids = prompt + continuation
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        with torch.inference_mode():
            logits = hf_bf16(torch.tensor([ids])).logits[0, :-1].float()
        ref = torch.log_softmax(logits, dim=-1)
        ours = torch.tensor([lp for lp, _, _ in res["meta_info"]["input_token_logprobs"][1:]])
        diffs.append((ours - ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).abs().max())
        ours_top = torch.tensor([top[0][1] for top in res["meta_info"]["input_top_logprobs"][1:]])
        same = ours_top == logits.argmax(-1)
        top2 = logits.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > BF16_TIE_MARGIN
        agree, total = agree + int(same.sum()), total + len(same)
        clear_agree, clear_total = clear_agree + int(same[clear].sum()), clear_total + int(clear.sum())
    assert clear_agree / clear_total >= 0.99, f"top-1 agreement {clear_agree}/{clear_total}"
    assert agree / total >= 0.975, f"top-1 agreement {agree}/{total}"
    assert max(diffs) < BF16_LOGPROB_ATOL, f"max |logprob diff| {max(diffs):.3f}"


BF16_LOGPROB_ATOL = 0.5
BF16_TIE_MARGIN = 0.125  # bf16 keeps 8 significant bits: logits of ~10-30 are rounded to 1/16-1/8
