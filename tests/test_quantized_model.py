"""The default model with its GGUF blocks kept quantized (quantization="gguf") against the exact
dequantized float32 path: top-1 agreement over teacher-forced positions, memory, and greedy
decoding through the engine."""

from __future__ import annotations

import pytest
import torch

from forklm.runtime.engine.engine import Engine
from forklm.runtime.quant.linear import QuantizedLinear
from tests.conftest import EVAL_QUESTIONS, chat_prompt, hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = [*EVAL_QUESTIONS, "Name three rivers in Africa.", "Why is the sky blue?"]
NUM_NEW = 48
# Measured on an AVX-512 CPU (session 4): 696/711 = 97.9% top-1 agreement; every miss is a
# near-tie of the fp32 logits (top-2 margin below QUANT_TIE_MARGIN).
MIN_AGREEMENT = 0.95
QUANT_TIE_MARGIN = 0.5


@pytest.fixture(scope="module")
def engine():
    """The module's own engine (not make_engine's shared ones): freed when the module ends."""
    with Engine(dtype="float32", quantization="gguf", max_total_tokens=2048,
                debug_check_invariants=True) as quantized:
        yield quantized


@pytest.fixture(scope="module")
def sequences(tokenizer, hf_model) -> list[list[int]]:
    """Prompts followed by transformers' fp32 greedy continuation (the exact path's tokens)."""
    prompts = [tokenizer.encode(chat_prompt(tokenizer, q) if i % 2 == 0 else q,
                                add_special_tokens=False) for i, q in enumerate(QUESTIONS)]
    return [p + hf_greedy(hf_model, p, NUM_NEW) for p in prompts]


def test_quantized_top1_agrees_with_fp32(engine, hf_model, sequences):
    agree = total = clear_miss = 0
    for ids in sequences:
        res = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        ours = torch.tensor([top[0][1] for top in res["meta_info"]["input_top_logprobs"][1:]])
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
        same = ours == logits.argmax(-1)
        top2 = logits.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > QUANT_TIE_MARGIN
        agree, total = agree + int(same.sum()), total + len(same)
        clear_miss += int((~same & clear).sum())
    assert total >= 500
    assert agree / total >= MIN_AGREEMENT, f"top-1 agreement {agree}/{total}"
    assert clear_miss <= total // 100, f"{clear_miss} misses where fp32 has a clear winner"


def test_quantized_weights_stay_near_the_gguf_size(engine):
    model = engine.parts.runner.model
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(quantized) == 30 * 4 + 1  # qkv, o, gate_up, down per layer + tied embedding/head
    assert model.model.embed_tokens in quantized
    total = sum(m.nbytes for m in quantized) + sum(
        p.numel() * p.element_size() for p in model.parameters())
    assert total < 110 * 2**20, f"{total / 2**20:.0f} MB"  # GGUF: 98 MB; fp32: 540 MB


def test_quantized_greedy_is_the_same_alone_and_batched(engine, sequences):
    prompts = [ids[:-NUM_NEW] for ids in sequences[:4]]
    greedy = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    alone = [engine.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in prompts]
    together = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=greedy)]
    assert together == alone
    assert engine.last_error is None


def test_int8_activations_keep_decode_top1_near_fp32(make_engine, hf_model, sequences):
    """dtype auto (the GGUF kept quantized, bf16): decode-sized calls multiply with int8
    activations where the CPU has AVX512-VNNI. Teacher-forced through 1-token extends (the
    prefix cached), so every position is computed by the decode kernels, 16 rows at a time;
    against fp32, with the same near-tie allowance as above. Measured (session 13, over 1136
    positions of README text against the dense bf16 model): int8 95.5%, bf16 dots 96.7%."""
    engine = make_engine(dtype="auto")
    agree = total = clear_miss = 0
    for ids in sequences[:4]:
        positions = list(range(len(ids) - NUM_NEW, len(ids)))
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})  # cache it
        ours = []
        for start in range(0, len(positions), 16):
            prefixes = [ids[:p] for p in positions[start:start + 16]]
            out = engine.generate(input_ids=prefixes,
                                  sampling_params={"max_new_tokens": 1, "temperature": 0})
            ours += [o["output_ids"][0] for o in out]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0].float()
        reference = logits[[p - 1 for p in positions]]
        same = torch.tensor(ours) == reference.argmax(-1)
        top2 = reference.topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > QUANT_TIE_MARGIN
        agree, total = agree + int(same.sum()), total + len(same)
        clear_miss += int((~same & clear).sum())
    assert agree / total >= MIN_AGREEMENT - 0.03, f"top-1 agreement {agree}/{total}"
    assert clear_miss <= max(2, total // 50), f"{clear_miss} misses where fp32 has a clear winner"
